// ATen-side helpers shared by the CPU and CUDA bindings (cpu/ops.cpp, cuda/ops.cpp): argument
// checks and the translation of tensors into the raw-pointer structs of args.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "args.h"

namespace fasttrain {

inline DType dtype_of(at::ScalarType s, const char* what) {
  switch (s) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "fasttrain native ops: ", what, " must be float32, bfloat16 or float16, got ", s);
  }
}

// A [T] (or [2, T]) table as contiguous float32 on `like`'s device (a no-op for the usual inputs).
inline at::Tensor f32(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

inline void check_batch(const at::Tensor& x, const at::Tensor& t, const at::Tensor& other, const char* name) {
  TORCH_CHECK(x.dim() >= 1, "fasttrain native ops: inputs need a batch dimension");
  TORCH_CHECK(t.dim() == 1 && t.size(0) == x.size(0), "fasttrain native ops: t must be [B] with B = ",
              x.size(0), ", got ", t.sizes());
  TORCH_CHECK(other.sizes() == x.sizes(), "fasttrain native ops: ", name, " must have shape ", x.sizes(),
              ", got ", other.sizes());
  TORCH_CHECK(other.device() == x.device(), "fasttrain native ops: ", name, " is on ", other.device(),
              ", expected ", x.device());
}

inline int64_t per_sample(const at::Tensor& x) { return x.dim() == 0 || x.size(0) == 0 ? 0 : x.numel() / x.size(0); }

// The fields of the noise kernel's and the loss kernel's arguments that every backend fills alike, from
// contiguous tensors; the noise offset is the caller's (the CPU passes its value, CUDA a device pointer).
inline NoiseArgs noise_args(const at::Tensor& x0, const at::Tensor& eps, at::Tensor& xt, at::Tensor& eps_out,
                            bool write_eps, const at::Tensor& t64, const at::Tensor& alpha, const at::Tensor& sigma,
                            int64_t seed) {
  NoiseArgs args{};
  args.x0 = x0.const_data_ptr();
  args.x0_type = dtype_of(x0.scalar_type(), "x0");
  args.eps = eps.defined() ? eps.const_data_ptr() : nullptr;
  args.eps_type = eps.defined() ? dtype_of(eps.scalar_type(), "eps") : DType::kFloat32;
  args.xt = xt.data_ptr();
  args.xt_type = dtype_of(xt.scalar_type(), "out_dtype");
  args.eps_out = write_eps ? eps_out.data_ptr<float>() : nullptr;
  args.t = t64.const_data_ptr<int64_t>();
  args.alpha = alpha.const_data_ptr<float>();
  args.sigma = sigma.const_data_ptr<float>();
  args.B = x0.dim() == 0 ? 0 : x0.size(0);
  args.D = per_sample(x0);
  args.seed = static_cast<uint64_t>(seed);
  return args;
}

inline LossArgs loss_args(const at::Tensor& pred, const at::Tensor& x0, const at::Tensor& eps, const at::Tensor& t64,
                          const at::Tensor& weight, const at::Tensor& iw, const at::Tensor& coef, at::Tensor& grad,
                          int64_t T, int64_t seed, int64_t needs) {
  LossArgs args{};
  args.pred = pred.const_data_ptr();
  args.pred_type = dtype_of(pred.scalar_type(), "pred");
  args.x0 = x0.const_data_ptr();
  args.x0_type = dtype_of(x0.scalar_type(), "x0");
  args.eps = eps.defined() ? eps.const_data_ptr() : nullptr;
  args.eps_type = eps.defined() ? dtype_of(eps.scalar_type(), "eps") : DType::kFloat32;
  args.t = t64.const_data_ptr<int64_t>();
  args.weight = weight.const_data_ptr<float>();
  args.iw = iw.const_data_ptr<float>();
  args.coef = coef.const_data_ptr<float>();
  args.T = T;
  args.grad = grad.data_ptr();
  args.B = pred.dim() == 0 ? 0 : pred.size(0);
  args.D = per_sample(pred);
  args.seed = static_cast<uint64_t>(seed);
  args.needs_eps = (needs & 1) != 0;
  args.needs_x0 = (needs & 2) != 0;
  // reference.loss_and_grad rounds 2/(B*D) to float32 before scaling by w*iw
  args.grad_scale = args.B * args.D > 0
                        ? static_cast<float>(2.0 / static_cast<double>(args.D) / static_cast<double>(args.B))
                        : 0.0f;
  return args;
}

// The tensors behind a NoiseSpecArgs (contiguous copies where needed), kept alive for the kernel call.
struct SpecTensors {
  at::Tensor table, rows, mean, std;
};

// The noise options as the ops receive them (kernels/noise_spec.py: `spec` is empty for the plain stream,
// else flags, levels, C, H, W, K_XI, K_N, K_S, K_L) for data x0 [B, ...] on x0's device.
inline NoiseSpecArgs spec_args(at::IntArrayRef spec, const std::optional<at::Tensor>& table,
                               const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& mean,
                               const std::optional<at::Tensor>& std, const at::Tensor& x0, SpecTensors& keep) {
  NoiseSpecArgs s{};
  if (spec.empty()) return s;
  TORCH_CHECK(spec.size() == 9, "fasttrain native ops: a noise spec holds 9 integers, got ", spec.size());
  s.flags = static_cast<uint32_t>(spec[0]);
  s.levels = static_cast<int32_t>(spec[1]);
  s.C = spec[2];
  s.H = spec[3];
  s.W = spec[4];
  s.k_xi = static_cast<uint64_t>(spec[5]);
  s.k_n = static_cast<uint64_t>(spec[6]);
  s.k_s = static_cast<uint64_t>(spec[7]);
  s.k_l = static_cast<uint64_t>(spec[8]);
  const int64_t B = x0.dim() == 0 ? 0 : x0.size(0);
  const int64_t D = per_sample(x0);
  s.n = static_cast<uint64_t>(B * D);
  TORCH_CHECK(s.levels >= 0 && s.levels <= kMaxLevels, "fasttrain native ops: pyramid levels must lie in [0, ",
              kMaxLevels, "], got ", s.levels);
  TORCH_CHECK(s.C >= 1 && D % s.C == 0, "fasttrain native ops: the noise spec's channels (", s.C,
              ") do not divide a sample of ", D);
  TORCH_CHECK(!(s.flags & kSpecPyramid) || (x0.dim() == 4 && x0.size(2) == s.H && x0.size(3) == s.W),
              "fasttrain native ops: pyramid noise needs [B, C, H, W] data of the spec's H, W");
  auto on_device = [&](const at::Tensor& x, at::ScalarType type, const char* what) {
    TORCH_CHECK(x.device() == x0.device(), "fasttrain native ops: noise spec ", what, " is on ", x.device(),
                ", expected ", x0.device());
    TORCH_CHECK(x.scalar_type() == type, "fasttrain native ops: noise spec ", what, " must be ", type);
    return x.contiguous();
  };
  if (s.flags != 0) {
    TORCH_CHECK(table.has_value() && table->numel() >= 3 + s.levels, "fasttrain native ops: the noise spec needs a "
                "table of ", 3 + s.levels, " values");
    keep.table = on_device(*table, at::kFloat, "table");
    s.table = keep.table.const_data_ptr<float>();
  }
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == B, "fasttrain native ops: noise rows must be [", B, "]");
    keep.rows = on_device(*rows, at::kLong, "rows");
    s.rows = keep.rows.const_data_ptr<int64_t>();
  }
  if (s.flags & kSpecAdaptive) {
    TORCH_CHECK(mean.has_value() && mean->numel() == B * s.C, "fasttrain native ops: an adaptive offset needs "
                "|mean(x0)| [", B, ", ", s.C, "]");
    keep.mean = on_device(*mean, at::kFloat, "mean");
    s.mean = keep.mean.const_data_ptr<float>();
  }
  if (std.has_value()) {
    TORCH_CHECK(std->numel() == 1, "fasttrain native ops: the pyramid's std must be one value");
    keep.std = on_device(*std, at::kFloat, "std");
    s.std = keep.std.const_data_ptr<float>();
  }
  return s;
}

// The per-pixel weight of the loss (kernels/diffusion_loss.py: check_mask): [B, 1 or C, ...] on pred's
// device, any of the three float dtypes; its elements per sample divide pred's.
inline void mask_args(const std::optional<at::Tensor>& mask, const at::Tensor& pred, LossArgs& args,
                      at::Tensor& keep) {
  if (!mask.has_value()) return;
  TORCH_CHECK(mask->device() == pred.device(), "fasttrain native ops: mask is on ", mask->device(), ", expected ",
              pred.device());
  TORCH_CHECK(mask->dim() == pred.dim() && pred.dim() >= 2 && mask->size(0) == pred.size(0),
              "fasttrain native ops: mask must be [B, 1 or C, ...] of pred's ", pred.sizes(), ", got ", mask->sizes());
  keep = mask->contiguous();
  const int64_t per = per_sample(keep);
  TORCH_CHECK(per > 0 && args.D % per == 0, "fasttrain native ops: mask's ", per, " elements per sample do not "
              "divide pred's ", args.D);
  args.mask = keep.const_data_ptr();
  args.mask_type = dtype_of(keep.scalar_type(), "mask");
  args.mask_period = per;
}

// The loss shape's kind and threshold table ([T] float32, for the Huber family).
inline const float* huber_table(int64_t kind, const std::optional<at::Tensor>& c, int64_t T, const at::Tensor& like,
                                at::Tensor& keep) {
  TORCH_CHECK(kind >= kL2 && kind <= kPseudoHuber, "fasttrain native ops: unknown loss shape ", kind);
  if (kind < kHuber) return nullptr;
  TORCH_CHECK(c.has_value() && c->numel() == T && c->scalar_type() == at::kFloat && c->device() == like.device(),
              "fasttrain native ops: the loss shape needs its threshold table c(t), float32 [", T, "]");
  keep = c->contiguous();
  return keep.const_data_ptr<float>();
}

}  // namespace fasttrain
