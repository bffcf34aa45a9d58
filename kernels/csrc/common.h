// ATen-side helpers shared by the CPU and CUDA bindings (cpu/ops.cpp, cuda/ops.cpp): argument
// checks and the translation of tensors into the raw-pointer structs of args.h.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

}  // namespace fasttrain
