// The CUDA implementations of fasttrain_C::noise and fasttrain_C::loss (schemas: register.cpp):
// checks that need no device values, outputs from torch's caching allocator, launches on the
// current stream (cuda/kernels.cu). Nothing here waits for the device: the noise offset is passed
// by pointer and timesteps are not range-checked (as in the Triton path, kernels/triton_noise.py and
// kernels/triton_diffusion_loss.py).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>

#include "../common.h"
#include "../ops.h"
#include "kernels.h"

namespace fasttrain::cuda {
namespace {

void check_device(const at::Tensor& x, const at::Tensor& like, const char* name) {
  TORCH_CHECK(x.device() == like.device(), "fasttrain native ops: ", name, " is on ", x.device(), ", expected ",
              like.device());
}

// The offset on the device (read there), or a CPU scalar (read here: no device sync either way).
void set_offset(const at::Tensor& offset, const at::Tensor& like, uint64_t& value, const int64_t*& ptr) {
  TORCH_CHECK(offset.numel() == 1 && offset.scalar_type() == at::kLong,
              "fasttrain native ops: offset must be a 0-d int64 tensor");
  if (offset.is_cuda()) {
    check_device(offset, like, "offset");
    ptr = offset.const_data_ptr<int64_t>();
    value = 0;
  } else {
    ptr = nullptr;
    value = static_cast<uint64_t>(offset.item<int64_t>());
  }
}

// What can be checked without reading device memory (the rows are not range-checked: as the timesteps).
void check_spec(const NoiseSpecArgs& s, bool has_eps, bool need_std) {
  if (s.flags == 0 && s.rows == nullptr) return;
  TORCH_CHECK(!has_eps, "fasttrain native ops: give either eps or a noise spec, not both");
  TORCH_CHECK(!need_std || !(s.flags & kSpecPyramid) || s.std != nullptr,
              "fasttrain native ops: pyramid noise needs its std (noise_std)");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> noise(const at::Tensor& x0_in, const at::Tensor& t, const at::Tensor& alpha,
                                         const at::Tensor& sigma, const std::optional<at::Tensor>& eps_in,
                                         int64_t seed, const at::Tensor& offset, at::ScalarType out_dtype,
                                         bool write_eps, at::IntArrayRef spec, const OptT& table, const OptT& rows,
                                         const OptT& spec_mean, const OptT& spec_std) {
  const c10::cuda::CUDAGuard guard(x0_in.device());
  const at::Tensor x0 = x0_in.contiguous();
  check_batch(x0, t, x0, "x0");
  check_device(t, x0, "t");
  check_device(alpha, x0, "alpha");
  check_device(sigma, x0, "sigma");
  const at::Tensor a = f32(alpha), s = f32(sigma), t64 = t.to(at::kLong).contiguous();
  at::Tensor eps;
  if (eps_in.has_value()) {
    check_batch(x0, t, *eps_in, "eps");
    eps = eps_in->contiguous();
  }
  at::Tensor xt = at::empty(x0.sizes(), x0.options().dtype(out_dtype));
  at::Tensor eps_out = at::empty(write_eps ? x0.sizes() : at::IntArrayRef{0}, x0.options().dtype(at::kFloat));
  NoiseArgs args = noise_args(x0, eps, xt, eps_out, write_eps, t64, a, s, seed);
  set_offset(offset, x0, args.offset, args.offset_ptr);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, spec_std, x0, keep);
  check_spec(args.spec, eps.defined(), true);
  launch_noise(args, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {xt, eps_out};
}

at::Tensor noise_std(const at::Tensor& x0_in, int64_t seed, const at::Tensor& offset, at::IntArrayRef spec,
                     const OptT& table, const OptT& rows, const OptT& spec_mean) {
  const c10::cuda::CUDAGuard guard(x0_in.device());
  const at::Tensor x0 = x0_in.contiguous();
  TORCH_CHECK(x0.dim() >= 1, "fasttrain native ops: inputs need a batch dimension");
  NoiseArgs args{};
  args.B = x0.size(0);
  args.D = per_sample(x0);
  args.seed = static_cast<uint64_t>(seed);
  set_offset(offset, x0, args.offset, args.offset_ptr);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, std::nullopt, x0, keep);
  TORCH_CHECK(args.spec.flags & kSpecPyramid, "fasttrain native ops: noise_std is the pyramid noise's std");
  at::Tensor sums = at::zeros({2}, x0.options().dtype(at::kDouble));
  at::Tensor out = at::empty({}, x0.options().dtype(at::kFloat));
  launch_noise_std(args, sums.data_ptr<double>(), out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss(
    const at::Tensor& pred_in, const at::Tensor& x0_in, const at::Tensor& t, const at::Tensor& weight,
    const at::Tensor& iw_in, const at::Tensor& coef_in, const at::Tensor& pivots_in, at::Tensor& bins,
    const std::optional<at::Tensor>& eps_in, int64_t seed, const at::Tensor& offset, int64_t needs,
    at::IntArrayRef spec, const OptT& table, const OptT& rows, const OptT& spec_mean, const OptT& spec_std, int64_t loss_kind,
    const OptT& huber_c, const OptT& mask) {
  const c10::cuda::CUDAGuard guard(pred_in.device());
  const at::Tensor pred = pred_in.contiguous(), x0 = x0_in.contiguous();
  check_batch(pred, t, x0, "x0");
  for (const auto* x : {&t, &weight, &iw_in, &coef_in}) check_device(*x, pred, "a table");
  const at::Tensor w = f32(weight), iw = f32(iw_in), coef = f32(coef_in), t64 = t.to(at::kLong).contiguous();
  const int64_t T = w.numel(), B = pred.size(0), D = per_sample(pred);
  TORCH_CHECK(coef.dim() == 2 && coef.size(0) == 2 && coef.size(1) == T, "fasttrain native ops: coef must be [2, ",
              T, "], got ", coef.sizes());
  TORCH_CHECK(iw.numel() == B, "fasttrain native ops: iw must have ", B, " elements");
  at::Tensor eps;
  if (eps_in.has_value()) {
    check_batch(pred, t, *eps_in, "eps");
    eps = eps_in->contiguous();
  }
  const bool with_bins = bins.numel() > 0;
  at::Tensor pivots;
  if (with_bins) {
    check_device(bins, pred, "bins");
    TORCH_CHECK(bins.scalar_type() == at::kDouble && bins.is_contiguous() && bins.dim() == 2 && bins.size(0) == 5 &&
                    bins.size(1) == T,
                "fasttrain native ops: bins must be contiguous float64 [5, ", T, "] (kernels/bins.py, 2 values)");
    TORCH_CHECK(pivots_in.scalar_type() == at::kDouble && pivots_in.dim() == 2 && pivots_in.size(0) == 2 &&
                    pivots_in.size(1) == T,
                "fasttrain native ops: pivots must be float64 [2, ", T, "]");
    pivots = pivots_in.contiguous();
  }
  at::Tensor grad = at::empty(pred.sizes(), pred.options());
  const auto f = pred.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({}, f), per = at::empty({B}, f), raw = at::empty({B}, f), wl = at::empty({B}, f);
  if (B == 0) return {mean.fill_(NAN), per, raw, wl, grad};
  at::Tensor partial = at::empty({B * tiles_per_sample(D)}, f);

  LossArgs args = loss_args(pred, x0, eps, t64, w, iw, coef, grad, T, seed, needs);
  set_offset(offset, pred, args.offset, args.offset_ptr);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, spec_std, x0, keep);
  check_spec(args.spec, eps.defined(), true);
  at::Tensor keep_c;
  args.loss_kind = static_cast<int32_t>(loss_kind);
  args.huber_c = huber_table(loss_kind, huber_c, T, pred, keep_c);
  at::Tensor keep_m;
  mask_args(mask, pred, args, keep_m);

  LossOutputs out{partial.data_ptr<float>(), raw.data_ptr<float>(), wl.data_ptr<float>(), per.data_ptr<float>(),
                  mean.data_ptr<float>(), with_bins ? bins.data_ptr<double>() : nullptr,
                  with_bins ? pivots.const_data_ptr<double>() : nullptr};
  launch_loss(args, out, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {mean, per, raw, wl, grad};
}

}  // namespace fasttrain::cuda
