// The ATen entry points of the native ops, one pair per device (cpu/ops.cpp, cuda/ops.cpp), which
// register.cpp registers as the CPU and CUDA kernels of fasttrain_C::noise and fasttrain_C::loss, and
// the CPU kernel of fasttrain_C::mixed_loss.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

// The noise options travel as (spec, table, rows, mean, std) (kernels/noise_spec.py, common.h: spec_args),
// the loss shape as (loss kind, c table) (kernels/loss_shape.py).
#define FT_DECLARE_OPS                                                                                              \
  std::tuple<at::Tensor, at::Tensor> noise(const at::Tensor& x0, const at::Tensor& t, const at::Tensor& alpha,     \
                                           const at::Tensor& sigma, const OptT& eps, int64_t seed,                 \
                                           const at::Tensor& offset, at::ScalarType out_dtype, bool write_eps,     \
                                           at::IntArrayRef spec, const OptT& table, const OptT& rows,              \
                                           const OptT& spec_mean, const OptT& spec_std);                                     \
  at::Tensor noise_std(const at::Tensor& x0, int64_t seed, const at::Tensor& offset, at::IntArrayRef spec,         \
                       const OptT& table, const OptT& rows, const OptT& spec_mean);                                     \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> loss(                                     \
      const at::Tensor& pred, const at::Tensor& x0, const at::Tensor& t, const at::Tensor& weight,                 \
      const at::Tensor& iw, const at::Tensor& coef, const at::Tensor& pivots, at::Tensor& bins, const OptT& eps,   \
      int64_t seed, const at::Tensor& offset, int64_t needs, at::IntArrayRef spec, const OptT& table,              \
      const OptT& rows, const OptT& spec_mean, const OptT& spec_std, int64_t loss_kind, const OptT& huber_c,     \
      const OptT& mask);

namespace fasttrain {
using OptT = std::optional<at::Tensor>;
}
namespace fasttrain::cpu {
FT_DECLARE_OPS
// The mixed-prediction loss (cpu/mixed_ops.cpp); CPU only, the Triton kernel is the GPU path.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mixed_loss(
    const at::Tensor& out, const at::Tensor& x0, const at::Tensor& t, const at::Tensor& weight, const at::Tensor& iw,
    const at::Tensor& tab, const std::optional<at::Tensor>& gate, const at::Tensor& pivots, at::Tensor& bins,
    const std::optional<at::Tensor>& eps, int64_t seed, const at::Tensor& offset, at::IntArrayRef spec,
    const OptT& table, const OptT& rows, const OptT& spec_mean, const OptT& spec_std, int64_t loss_kind, const OptT& huber_c);
// Words 0 and 1 of Philox4x32-10 for counters offset .. offset + n - 1: int64 [2, n] (tests).
at::Tensor philox_words(int64_t seed, int64_t offset, int64_t n);
}
namespace fasttrain::cuda {
FT_DECLARE_OPS
}
#undef FT_DECLARE_OPS
