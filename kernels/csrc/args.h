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

// The noise options of one step (kernels/noise_spec.py: formulas and counter layout). flags == 0 and
// rows == nullptr: the plain stream, eps = philox(seed, offset + b*D + i). Otherwise eps of sample b,
// element i is philox(seed, offset + rows[b]*D + i), plus the noise offset s*n per (b, channel), plus
// the pyramid levels, divided by the pyramid's std; the noise kernel adds gamma*u*xi for x_t.
// Pointers are host memory for the CPU kernels and device memory for the CUDA ones.
enum SpecFlag : uint32_t {
  kSpecOffset = 1, kSpecOffsetRandom = 2, kSpecAdaptive = 4, kSpecPyramid = 8, kSpecPerturb = 16,
  kSpecPerturbRandom = 32
};
constexpr int kMaxLevels = 16;  // noise_spec.MAX_LEVELS
struct NoiseSpecArgs {
  uint32_t flags = 0;
  int32_t levels = 0;                      // pyramid iterations L
  int64_t C = 1, H = 1, W = 1;             // channels; the pyramid's spatial dims
  uint64_t k_xi = 0, k_n = 0, k_s = 0, k_l = 0;  // sub-range starts, relative to the offset
  uint64_t n = 0;                          // B*D: a pyramid level's counter range
  const int64_t* rows = nullptr;           // [B] base-noise rows, or nullptr (identity)
  const float* table = nullptr;            // [3 + L]: offset c, adaptive scale, gamma, level weights
  const float* mean = nullptr;             // [B, C]: |mean over pixels of x0| (adaptive offset)
  const float* std = nullptr;              // the pyramid's std (0-d)
  bool active() const { return flags != 0 || rows != nullptr; }
};

// Loss shapes (kernels/loss_shape.py): rho(d) per element, psi = rho'/2 in the gradient.
enum LossKind : int32_t { kL2 = 0, kL1 = 1, kHuber = 2, kSmoothL1 = 3, kPseudoHuber = 4 };

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
  NoiseSpecArgs spec;             // the noise options (plain by default)
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
  NoiseSpecArgs spec;
  int32_t loss_kind;     // LossKind (kL2: d^2)
  const float* huber_c;  // [T] threshold c(t) of the Huber family, or nullptr
  // The per-pixel weight m (kernels/torch_ref_diffusion_loss.py: rho(d)*m and psi(d)*m, sd-scripts' masked
  // loss), or nullptr: element i of sample b reads mask[b*mask_period + i % mask_period] (mask_period = D:
  // one weight per element; D/C: one per pixel, broadcast over the channels).
  const void* mask = nullptr;
  DType mask_type = DType::kFloat32;
  int64_t mask_period = 0;
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
  NoiseSpecArgs spec;
  int32_t loss_kind;     // LossKind: rho of the mixed x0-space term and of the aux terms
  const float* huber_c;  // [T] or nullptr
};

// The timestep gate, or the pixel gate of flat data (P = 1: the sample is one "pixel"): one
// softmax per sample, and a gate gradient summed over the whole sample.
inline bool mixed_gate_per_sample(const MixedArgs& a) { return a.gate != nullptr || a.P == 1; }

// Partial sums of one mixed task, float64: [0] sum E^2, [1 + h] sum d_h^2, [1 + H + h] sum e_h^2,
// [1 + 2H + h] sum of gate gradient terms (gate per sample only; the pixel gate's are written).
constexpr int64_t mixed_sums(int64_t H) { return 1 + 3 * H; }

}  // namespace fasttrain
