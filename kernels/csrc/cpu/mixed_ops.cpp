// The CPU implementation of fasttrain_C::mixed_loss (schema: register.cpp; contract:
// kernels/torch_ref_mixed_loss.py): argument checks, outputs, at::parallel_for over the tasks of
// cpu/mixed.cpp (pixel blocks or element ranges of one sample), then the per-sample values, the batch
// mean, the per-sample gate gradient and the per-timestep bins, which are O(B*H) and run serially in
// a fixed order, so every result is independent of the number of threads.
//
// There is no CUDA version: on GPUs the Triton kernel (kernels/triton_mixed_loss.py) is the fused path,
// and kernels/mixed_loss.py never sends CUDA tensors here.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <vector>

#include "../common.h"
#include "../ops.h"
#include "host.h"
#include "kernels.h"

namespace fasttrain::cpu {
namespace {

constexpr int64_t kTaskElements = 16384;    // x0 elements per task (each with H head elements)
constexpr int64_t kMinTaskPixels = 256;     // a pixel block shorter than this makes short chunks
constexpr int64_t kMinPerThread = 65536;    // head elements below which a thread is not worth waking

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// (block, tasks per sample): `total` units (pixels or elements) in about equal blocks of at most
// `target` (one empty task for empty samples).
std::pair<int64_t, int64_t> split(int64_t total, int64_t target) {
  const int64_t tasks = std::max<int64_t>(1, cdiv(total, std::max<int64_t>(1, target)));
  return {std::max<int64_t>(1, cdiv(total, tasks)), tasks};
}

void check_mixed(const at::Tensor& out, const at::Tensor& x0, const at::Tensor& t, const at::Tensor& tab,
                 const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& eps) {
  TORCH_CHECK(x0.dim() >= 2 && x0.size(1) > 0, "fasttrain native mixed_loss: data must be [B, C >= 1, *S], got ",
              x0.sizes());
  TORCH_CHECK(tab.dim() == 3 && tab.size(0) >= 2 && tab.size(1) == 6,
              "fasttrain native mixed_loss: the head table must be [H >= 2, 6, T], got ", tab.sizes());
  const int64_t B = x0.size(0), H = tab.size(0), C = x0.size(1);
  const int64_t width = H * C + (gate.has_value() ? 0 : H);
  TORCH_CHECK(out.dim() == x0.dim() && out.size(0) == B && out.size(1) == width &&
                  out.sizes().slice(2) == x0.sizes().slice(2),
              "fasttrain native mixed_loss: out must be [B, ", width, ", *S] for ", H, " heads x ", C,
              " channels, got ", out.sizes(), " for data ", x0.sizes());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "fasttrain native mixed_loss: t must be [", B, "], got ", t.sizes());
  if (gate.has_value()) {
    TORCH_CHECK(gate->dim() == 2 && gate->size(0) == B && gate->size(1) == H,
                "fasttrain native mixed_loss: the per-sample gate must be [", B, ", ", H, "], got ", gate->sizes());
  }
  if (eps.has_value()) {
    TORCH_CHECK(eps->sizes() == x0.sizes(), "fasttrain native mixed_loss: eps must have shape ", x0.sizes(), ", got ",
                eps->sizes());
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mixed_loss(
    const at::Tensor& out_in, const at::Tensor& x0_in, const at::Tensor& t, const at::Tensor& weight_in,
    const at::Tensor& iw_in, const at::Tensor& tab_in, const std::optional<at::Tensor>& gate_in,
    const at::Tensor& pivots, at::Tensor& bins, const std::optional<at::Tensor>& eps_in, int64_t seed,
    const at::Tensor& offset, at::IntArrayRef spec, const OptT& table, const OptT& rows, const OptT& spec_mean,
    const OptT& spec_std, int64_t loss_kind, const OptT& huber_c) {
  check_mixed(out_in, x0_in, t, tab_in, gate_in, eps_in);
  const at::Tensor out = out_in.contiguous(), x0 = x0_in.contiguous();
  const at::Tensor w = f32(weight_in), iw = f32(iw_in), tab = f32(tab_in);
  const int64_t B = x0.size(0), C = x0.size(1), H = tab.size(0), T = tab.size(2);
  const int64_t P = per_sample(x0) / C, D = C * P, V = 2 + H;
  TORCH_CHECK(w.numel() == T, "fasttrain native mixed_loss: weight must have T = ", T, " elements (the table's)");
  TORCH_CHECK(iw.numel() == B, "fasttrain native mixed_loss: iw must have ", B, " elements");
  const at::Tensor t64 = checked_t(t, T);
  const at::Tensor gate = gate_in.has_value() ? gate_in->contiguous() : at::Tensor();
  const at::Tensor eps = eps_in.has_value() ? eps_in->contiguous() : at::Tensor();
  const bool with_bins = bins.numel() > 0;
  if (with_bins) check_bins(bins, pivots, V, T);

  at::Tensor grad = at::empty(out.sizes(), out.options());
  const auto f = out.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({}, f), per = at::empty({B}, f), raw = at::empty({B}, f), wl = at::empty({B}, f);
  at::Tensor x0e = at::empty({B, H}, f);

  MixedArgs args{};
  args.out = out.const_data_ptr();
  args.out_type = dtype_of(out.scalar_type(), "out");
  args.x0 = x0.const_data_ptr();
  args.x0_type = dtype_of(x0.scalar_type(), "x0");
  args.eps = eps.defined() ? eps.const_data_ptr() : nullptr;
  args.eps_type = eps.defined() ? dtype_of(eps.scalar_type(), "eps") : DType::kFloat32;
  args.gate = gate.defined() ? gate.const_data_ptr() : nullptr;
  args.gate_type = gate.defined() ? dtype_of(gate.scalar_type(), "gate") : DType::kFloat32;
  args.t = t64.const_data_ptr<int64_t>();
  args.weight = w.const_data_ptr<float>();
  args.iw = iw.const_data_ptr<float>();
  args.tab = tab.const_data_ptr<float>();
  args.T = T;
  args.grad = grad.data_ptr();
  args.B = B;
  args.H = H;
  args.C = C;
  args.P = P;
  args.seed = static_cast<uint64_t>(seed);
  args.offset = offset_value(offset);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, spec_std, x0, keep);
  check_spec(args.spec, B, D, eps.defined());
  at::Tensor keep_c;
  args.loss_kind = static_cast<int32_t>(loss_kind);
  args.huber_c = huber_table(loss_kind, huber_c, T, out, keep_c);
  // torch_ref_mixed_loss.loss_and_grad: s = (2/(B*D))*iw, the Python float rounded to float32 by torch
  args.grad_scale = B * D > 0 ? static_cast<float>(2.0 / static_cast<double>(B * D)) : 0.0f;
  const bool sample_gate = mixed_gate_per_sample(args);
  // Tasks of about kTaskElements x0 elements: element ranges where the gate is per sample, else
  // pixel blocks (every channel of a pixel in one task, so that its gate gradient is complete there),
  // whole samples when they are small enough, since then chunks run on across channels.
  const auto [block, tasks] = sample_gate ? split(D, kTaskElements)
                              : D <= kTaskElements ? std::pair<int64_t, int64_t>{P, 1}
                                                   : split(P, std::max(kTaskElements / C, std::min(P, kMinTaskPixels)));
  args.block = block;
  args.tasks_per_sample = tasks;

  const int64_t nacc = mixed_sums(H);
  std::vector<double> partial(static_cast<size_t>(B * tasks * nacc));
  if (B > 0 && D > 0) {  // (empty samples: the sums stay 0, so the means are NaN, as the reference's)
    const KernelSet& ks = kernels();
    const int64_t per_task = (sample_gate ? block : block * C) * H;
    const int64_t grain = std::max<int64_t>(1, kMinPerThread / per_task);
    at::parallel_for(0, B * tasks, grain, [&](int64_t begin, int64_t end) { ks.mixed(args, partial.data(), begin, end); });
  }

  // Per sample (torch_ref_mixed_loss.loss): raw = mean(E^2), own_h = mean(d_h^2), x0_error_h = mean(e_h^2),
  // weighted = w[t]*raw + sum_h aux_h*own_h, l = iw*weighted; float32 from the float64 sums.
  const float* tp = tab.const_data_ptr<float>();
  float* rawp = raw.data_ptr<float>();
  float* wlp = wl.data_ptr<float>();
  float* perp = per.data_ptr<float>();
  float* x0ep = x0e.data_ptr<float>();
  at::Tensor gsum = at::empty({B, H}, f);  // the gate gradient of a gate per sample, float32
  float* gp = gsum.data_ptr<float>();
  std::vector<double> s(static_cast<size_t>(nacc));
  double total = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    std::fill(s.begin(), s.end(), 0.0);
    for (int64_t k = 0; k < tasks; ++k) {
      const double* pk = partial.data() + (b * tasks + k) * nacc;
      for (int64_t i = 0; i < nacc; ++i) s[i] += pk[i];
    }
    const int64_t tb = args.t[b];
    const float r = static_cast<float>(s[0] / static_cast<double>(D));
    float aux_sum = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float own = static_cast<float>(s[1 + h] / static_cast<double>(D));
      aux_sum += tp[(h * 6 + 5) * T + tb] * own;  // row 5: aux
      x0ep[b * H + h] = static_cast<float>(s[1 + H + h] / static_cast<double>(D));
      gp[b * H + h] = static_cast<float>(s[1 + 2 * H + h]);
    }
    rawp[b] = r;
    wlp[b] = args.weight[tb] * r + aux_sum;
    perp[b] = args.iw[b] * wlp[b];
    total += perp[b];
  }
  *mean.data_ptr<float>() = B > 0 ? static_cast<float>(total / static_cast<double>(B)) : NAN;

  at::Tensor ggrad;
  if (gate.defined()) {
    ggrad = gsum.to(gate.scalar_type());  // torch_ref_mixed_loss: summed over channels and pixels, gate's dtype
  } else {
    ggrad = at::empty({0}, out.options());
    if (sample_gate && B > 0) {  // flat data: the pixel gate's one logit per head and sample
      grad.view({B, H * C + H}).narrow(1, H * C, H).copy_(gsum);
    }
  }
  if (with_bins) {  // V = 2 + H values: raw, weighted, each head's x0 error
    scatter_bins(bins, pivots, args.t, B, V, [&](int64_t v, int64_t b) {
      return v == 0 ? rawp[b] : v == 1 ? wlp[b] : x0ep[b * H + v - 2];
    });
  }
  return {mean, per, raw, wl, x0e, grad, ggrad};
}

}  // namespace fasttrain::cpu
