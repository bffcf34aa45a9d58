// The CPU implementations of fasttrain_C::noise and fasttrain_C::loss (schemas: register.cpp):
// argument checks, outputs, at::parallel_for over samples x tiles, then the per-sample reduction,
// the batch mean and the per-timestep bins (kernels/bins.py), which are O(B) and run serially in a
// fixed order, so every result is independent of the number of threads.
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

constexpr int64_t kTile = 16384;        // elements per task: a few hundred microseconds of work
constexpr int64_t kMinPerThread = 65536;  // below this many elements a thread is not worth waking

int64_t tile_for(int64_t D) { return std::max<int64_t>(1, std::min(kTile, D)); }

template <class Fn>
void for_tiles(int64_t B, int64_t D, Fn&& fn) {
  const int64_t tile = tile_for(D);
  const int64_t tiles = B * ((D + tile - 1) / tile);
  const int64_t grain = std::max<int64_t>(1, kMinPerThread / tile);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) { fn(begin, end, tile); });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> noise(const at::Tensor& x0_in, const at::Tensor& t, const at::Tensor& alpha,
                                         const at::Tensor& sigma, const std::optional<at::Tensor>& eps_in,
                                         int64_t seed, const at::Tensor& offset, at::ScalarType out_dtype,
                                         bool write_eps, at::IntArrayRef spec, const OptT& table, const OptT& rows,
                                         const OptT& spec_mean, const OptT& spec_std) {
  const at::Tensor x0 = x0_in.contiguous();
  const at::Tensor a = f32(alpha), s = f32(sigma);
  TORCH_CHECK(a.numel() == s.numel(), "fasttrain native ops: alpha and sigma differ in length");
  const at::Tensor t64 = checked_t(t, a.numel());
  at::Tensor eps;
  if (eps_in.has_value()) {
    check_batch(x0, t, *eps_in, "eps");
    eps = eps_in->contiguous();
  } else {
    check_batch(x0, t, x0, "x0");
  }
  at::Tensor xt = at::empty(x0.sizes(), x0.options().dtype(out_dtype));
  at::Tensor eps_out = at::empty(write_eps ? x0.sizes() : at::IntArrayRef{0}, x0.options().dtype(at::kFloat));
  NoiseArgs args = noise_args(x0, eps, xt, eps_out, write_eps, t64, a, s, seed);
  args.offset = offset_value(offset);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, spec_std, x0, keep);
  check_spec(args.spec, args.B, args.D, eps.defined());
  if (args.B > 0 && args.D > 0) {
    const KernelSet& ks = kernels();
    for_tiles(args.B, args.D, [&](int64_t b, int64_t e, int64_t tile) { ks.noise(args, b, e, tile); });
  }
  return {xt, eps_out};
}

at::Tensor noise_std(const at::Tensor& x0_in, int64_t seed, const at::Tensor& offset, at::IntArrayRef spec,
                     const OptT& table, const OptT& rows, const OptT& spec_mean) {
  const at::Tensor x0 = x0_in.contiguous();
  TORCH_CHECK(x0.dim() >= 1, "fasttrain native ops: inputs need a batch dimension");
  NoiseArgs args{};
  args.B = x0.size(0);
  args.D = per_sample(x0);
  args.seed = static_cast<uint64_t>(seed);
  args.offset = offset_value(offset);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, std::nullopt, x0, keep);
  TORCH_CHECK(args.spec.flags & kSpecPyramid, "fasttrain native ops: noise_std is the pyramid noise's std");
  check_spec(args.spec, args.B, args.D, false, /*need_std=*/false);
  const int64_t tile = tile_for(args.D), per_b = args.D > 0 ? (args.D + tile - 1) / tile : 0;
  std::vector<double> partial(static_cast<size_t>(2 * args.B * per_b));
  if (args.B > 0 && args.D > 0) {
    const KernelSet& ks = kernels();
    for_tiles(args.B, args.D, [&](int64_t b, int64_t e, int64_t tl) { ks.moments(args, partial.data(), b, e, tl); });
  }
  double s1 = 0.0, s2 = 0.0;
  for (size_t k = 0; k < partial.size(); k += 2) {  // fixed order: independent of the thread count
    s1 += partial[k];
    s2 += partial[k + 1];
  }
  const double n = static_cast<double>(args.B * args.D);
  at::Tensor out = at::empty({}, x0.options().dtype(at::kFloat));
  *out.data_ptr<float>() = static_cast<float>(std::sqrt((s2 - s1 * s1 / n) / (n - 1.0)));  // unbiased, as Tensor.std
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss(
    const at::Tensor& pred_in, const at::Tensor& x0_in, const at::Tensor& t, const at::Tensor& weight,
    const at::Tensor& iw_in, const at::Tensor& coef_in, const at::Tensor& pivots_in, at::Tensor& bins,
    const std::optional<at::Tensor>& eps_in, int64_t seed, const at::Tensor& offset, int64_t needs,
    at::IntArrayRef spec, const OptT& table, const OptT& rows, const OptT& spec_mean, const OptT& spec_std, int64_t loss_kind,
    const OptT& huber_c, const OptT& mask) {
  const at::Tensor pred = pred_in.contiguous(), x0 = x0_in.contiguous();
  check_batch(pred, t, x0, "x0");
  const at::Tensor w = f32(weight), iw = f32(iw_in), coef = f32(coef_in);
  const int64_t T = w.numel(), B = pred.size(0), D = per_sample(pred);
  TORCH_CHECK(coef.dim() == 2 && coef.size(0) == 2 && coef.size(1) == T, "fasttrain native ops: coef must be [2, ",
              T, "], got ", coef.sizes());
  TORCH_CHECK(iw.numel() == B, "fasttrain native ops: iw must have ", B, " elements");
  const at::Tensor t64 = checked_t(t, T);
  at::Tensor eps;
  if (eps_in.has_value()) {
    check_batch(pred, t, *eps_in, "eps");
    eps = eps_in->contiguous();
  }
  const bool with_bins = bins.numel() > 0;
  if (with_bins) check_bins(bins, pivots_in, 2, T);

  at::Tensor grad = at::empty(pred.sizes(), pred.options());
  const auto f = pred.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({}, f), per = at::empty({B}, f), raw = at::empty({B}, f), wl = at::empty({B}, f);

  LossArgs args = loss_args(pred, x0, eps, t64, w, iw, coef, grad, T, seed, needs);
  args.offset = offset_value(offset);
  SpecTensors keep;
  args.spec = spec_args(spec, table, rows, spec_mean, spec_std, x0, keep);
  check_spec(args.spec, B, D, eps.defined());
  at::Tensor keep_c;
  args.loss_kind = static_cast<int32_t>(loss_kind);
  args.huber_c = huber_table(loss_kind, huber_c, T, pred, keep_c);
  at::Tensor keep_m;
  mask_args(mask, pred, args, keep_m);

  const int64_t tile = tile_for(D);
  const int64_t per_b = D > 0 ? (D + tile - 1) / tile : 0;
  std::vector<double> partial(static_cast<size_t>(B * per_b));
  if (B > 0 && D > 0) {
    const KernelSet& ks = kernels();
    for_tiles(B, D, [&](int64_t b, int64_t e, int64_t tl) { ks.loss(args, partial.data(), b, e, tl); });
  }

  // Per sample: raw = mean(d^2), wl = w[t]*raw, l = (w[t]*iw)*raw (reference.loss), in float32.
  const int64_t* tp = args.t;
  float* rawp = raw.data_ptr<float>();
  float* wlp = wl.data_ptr<float>();
  float* perp = per.data_ptr<float>();
  double total = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    double sum = 0.0;
    for (int64_t k = 0; k < per_b; ++k) sum += partial[b * per_b + k];
    const float r = static_cast<float>(sum / static_cast<double>(D));
    const float wb = args.weight[tp[b]];
    rawp[b] = r;
    wlp[b] = wb * r;
    perp[b] = (wb * args.iw[b]) * r;
    total += perp[b];
  }
  *mean.data_ptr<float>() = B > 0 ? static_cast<float>(total / static_cast<double>(B)) : NAN;

  if (with_bins) {
    const float* v[2] = {rawp, wlp};
    scatter_bins(bins, pivots_in, tp, B, 2, [&](int64_t j, int64_t b) { return v[j][b]; });
  }
  return {mean, per, raw, wl, grad};
}

at::Tensor philox_words(int64_t seed, int64_t offset, int64_t n) {
  TORCH_CHECK(n >= 0, "fasttrain native ops: n must be >= 0");
  std::vector<uint32_t> w(static_cast<size_t>(2 * n));
  kernels().words(static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), n, w.data(), w.data() + n);
  at::Tensor out = at::empty({2, n}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * n; ++i) o[i] = w[static_cast<size_t>(i)];  // uint32 values, as philox.py holds them
  return out;
}

}  // namespace fasttrain::cpu
