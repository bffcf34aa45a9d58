// Arguments of the native noise kernel, loss kernel and mixed loss as plain structs of raw
// pointers, shared by the C++ CPU kernels (cpu/kernels.cpp, cpu/mixed.cpp), the CUDA kernels
// (cuda/kernels.cu) and the ATen bindings that fill them (cpu/ops.cpp, cpu/mixed_ops.cpp,
// cuda/ops.cpp). Keeping torch out of the kernel sources keeps them quick to compile once per CPU
// instruction set and per GPU architecture.
//
// Contracts: kernels/torch_ref.py and kernels/torch_ref_mixed_loss.py (the oracles), kernels/triton_noise.py,
// kernels/triton_diffusion_loss.py and kernels/triton_mixed_loss.py (the Triton kernels).
#pragma once
#include <cstdint>

namespace fasttrain {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// The noise kernel: x_t = alpha[t_b]*x0 + sigma[t_b]*eps, eps = philox(seed, offset + b*D + i) unless given.
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

// The loss kernel: target = coef[0,t]*eps + coef[1,t]*x0, d = pred - target,
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

// The mixed-prediction loss (kernels/torch_ref_mixed_loss.py; CPU only, cpu/mixed.cpp): H heads of C
// channels over P pixels, out [B, CO, P] with head h in channels [h*C, (h+1)*C) and, for the pixel
// gate, CO = H*C + H (the logits in the last H channels); with a per-sample gate CO = H*C.
// eps = philox(seed, offset + x0 element index) unless given. The softmax weights are per pixel, or
// per sample where the gate is (mixed_gate_per_sample). Work is split into tasks of `block` pixels
// of one sample (pixel gate) or `block` elements of one sample (gate per sample); task k covers
// sample k / tasks_per_sample. Each task writes the gradient of its elements (for the pixel gate
// also of its pixels' logits) and mixed_sums(H) float64 partial sums.
struct MixedArgs {
  const void* out;
  DType out_type;
  const void* x0;
  DType x0_type;
  const void* eps;  // or nullptr
  DType eps_type;
  const void* gate;  // [B, H] per-sample logits (the timestep gate), or nullptr: pixel gate in `out`
  DType gate_type;
  const int64_t* t;
  const float* weight;  // [T]: the x0-space weight
  const float* iw;      // [B]
  const float* tab;     // [H, 6, T]: ce, cx, k1, fb, bias, aux (torch_ref_mixed_loss.ROWS)
  int64_t T;
  void* grad;  // out's dtype and shape, contiguous
  int64_t B, H, C, P;
  int64_t block, tasks_per_sample;
  uint64_t seed;
  uint64_t offset;
  float grad_scale;  // float32(2 / (B*C*P)), as torch_ref_mixed_loss.loss_and_grad rounds it
};

// The timestep gate, or the pixel gate of flat data (P = 1: the sample is one "pixel"): one
// softmax per sample, and a gate gradient summed over the whole sample.
inline bool mixed_gate_per_sample(const MixedArgs& a) { return a.gate != nullptr || a.P == 1; }

// Partial sums of one mixed task, float64: [0] sum E^2, [1 + h] sum d_h^2, [1 + H + h] sum e_h^2,
// [1 + 2H + h] sum of gate gradient terms (gate per sample only; the pixel gate's are written).
constexpr int64_t mixed_sums(int64_t H) { return 1 + 3 * H; }

}  // namespace fasttrain
