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

}  // namespace fasttrain
