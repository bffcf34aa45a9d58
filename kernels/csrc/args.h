// Arguments of the native kernels A (noise) and B (loss) as plain structs of raw pointers, shared by
// the C++ CPU kernels (cpu/kernels.cpp), the CUDA kernels (cuda/kernels.cu) and the ATen bindings
// that fill them (cpu/ops.cpp, cuda/ops.cpp). Keeping torch out of the kernel sources keeps them
// quick to compile once per CPU instruction set and per GPU architecture.
//
// Contracts: kernels/reference.py (the oracle) and kernels/triton_kernels.py (the Triton kernels).
#pragma once
#include <cstdint>

namespace fasttrain {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Kernel A: x_t = alpha[t_b]*x0 + sigma[t_b]*eps, eps = philox(seed, offset + b*D + i) unless given.
struct NoiseArgs {
  const void* x0;
  DType x0_type;
  const void* eps;  // explicit eps (tests, reproductions) or nullptr: draw from the stream
  DType eps_type;
  void* xt;
  DType xt_type;
  float* eps_out;  // the eps used, float32, or nullptr
  const int64_t* t;
  const float* alpha;
  const float* sigma;
  int64_t B, D;
  uint64_t seed;
  uint64_t offset;                // CPU: the value; CUDA reads `offset_ptr` on the device instead
  const int64_t* offset_ptr;      // CUDA only: the 0-d int64 offset tensor (no host sync)
};

// Kernel B: target = coef[0,t]*eps + coef[1,t]*x0, d = pred - target,
// grad = d * (grad_scale * w[t_b]*iw_b) in pred's dtype, per-sample sums of d^2 per tile.
struct LossArgs {
  const void* pred;
  DType pred_type;
  const void* x0;
  DType x0_type;
  const void* eps;
  DType eps_type;
  const int64_t* t;
  const float* weight;
  const float* iw;
  const float* coef;  // [2, T]
  int64_t T;
  void* grad;  // pred's dtype, contiguous
  int64_t B, D;
  uint64_t seed;
  uint64_t offset;
  const int64_t* offset_ptr;
  bool needs_eps, needs_x0;
  float grad_scale;  // float32(2 / (B*D)), as the reference rounds it
};

}  // namespace fasttrain
