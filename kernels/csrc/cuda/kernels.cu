// The noise kernel and the loss kernel in CUDA C++: a hand-written baseline with the contract of the
// Triton kernels (kernels/triton_noise.py, kernels/triton_diffusion_loss.py) and the same noise stream
// (philox.h), against which the kernel benchmarks set the Triton ones. No host synchronisation: the
// noise offset is read on the device.
//
// Products and sums that the reference rounds separately use the _rn intrinsics, which nvcc never
// contracts into FMAs, so x_t and the gradient match kernels/torch_ref.py as the CPU kernels do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../fastmath.h"
#include "kernels.h"

namespace fasttrain::cuda {
namespace {

template <class T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// x0 and an explicit eps may come in any of the three dtypes: one warp-uniform branch.
__device__ __forceinline__ float load_any(const void* p, DType type, int64_t i) {
  switch (type) {
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// tl.randn(seed, counter): Box-Muller on Philox words 0 and 1 (philox.h, fastmath.h).
__device__ __forceinline__ float normal(uint64_t seed, uint64_t counter) {
  uint32_t w0, w1;
  philox_w01(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), static_cast<uint32_t>(seed),
             static_cast<uint32_t>(seed >> 32), w0, w1);
  return normal_from_words(w0, w1);
}

__device__ __forceinline__ uint64_t offset_of(const int64_t* ptr, uint64_t value) {
  return ptr != nullptr ? static_cast<uint64_t>(*ptr) : value;
}

// tl.rand(seed, counter): the first Philox word as a uniform in [0, 1).
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t counter) {
  uint32_t w0, w1;
  philox_w01(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), static_cast<uint32_t>(seed),
             static_cast<uint32_t>(seed >> 32), w0, w1);
  return uniform01(w0);
}

// torch's bilinear source indices along one axis (UpSampleKernel.cpp, align_corners=False).
__device__ __forceinline__ void source(int64_t o, int64_t in, int64_t out, int64_t& i0, int64_t& i1, float& lam) {
  if (in == out) {
    i0 = i1 = o;
    lam = 0.0f;
    return;
  }
  const float scale = __fdiv_rn(static_cast<float>(in), static_cast<float>(out));
  float src = __fsub_rn(__fmul_rn(scale, __fadd_rn(static_cast<float>(o), 0.5f)), 0.5f);
  src = src < 0.0f ? 0.0f : src;
  i0 = min(static_cast<int64_t>(floorf(src)), in - 1);
  i1 = i0 + (i0 < in - 1 ? 1 : 0);
  lam = fminf(fmaxf(__fsub_rn(src, static_cast<float>(i0)), 0.0f), 1.0f);
}

// eps of sample b, element i under the noise options (kernels/noise_spec.py; the Triton version:
// kernels/triton_noise_spec.py): base draw of the sample's row, offset, pyramid levels, then (norm) / std.
// The per-batch draws (strengths, r_l) are a few scalar Philox evaluations per element.
__device__ float spec_eps(const NoiseSpecArgs& s, uint64_t seed, uint64_t off, int64_t b, int64_t i, int64_t D,
                          bool norm) {
  const int64_t row = s.rows != nullptr ? s.rows[b] : b;
  float e = normal(seed, off + static_cast<uint64_t>(row * D + i));
  const int64_t HW = D / s.C, p = b * s.C + i / HW;
  if (s.flags & kSpecOffset) {
    float sc = s.table[0];
    if (s.flags & kSpecOffsetRandom) sc = __fmul_rn(sc, uniform(seed, off + s.k_s));
    if (s.flags & kSpecAdaptive) sc = fmaxf(__fadd_rn(sc, __fmul_rn(s.table[1], s.mean[p])), 0.0f);
    e = __fadd_rn(e, __fmul_rn(sc, normal(seed, off + s.k_n + static_cast<uint64_t>(p))));
  }
  if (s.flags & kSpecPyramid) {
    const int64_t pix = i % HW, y = pix / s.W, x = pix % s.W;
    for (int l = 0; l < s.levels; ++l) {
      const double r = __dadd_rn(2.0, __dmul_rn(2.0, static_cast<double>(uniform(seed, off + s.k_s + 2 + l))));
      double pw = 1.0;
      for (int k = 0; k < l; ++k) pw = __dmul_rn(pw, r);  // r^l by l-fold multiplication, as every backend
      const int64_t h = max(int64_t{1}, static_cast<int64_t>(__ddiv_rn(static_cast<double>(s.H), pw)));
      const int64_t w = max(int64_t{1}, static_cast<int64_t>(__ddiv_rn(static_cast<double>(s.W), pw)));
      int64_t y0, y1, x0, x1;
      float ly, lx;
      source(y, h, s.H, y0, y1, ly);
      source(x, w, s.W, x0, x1, lx);
      const uint64_t base = off + s.k_l + static_cast<uint64_t>(l) * s.n;
      const uint64_t r0 = base + static_cast<uint64_t>((p * h + y0) * w), r1 = base + static_cast<uint64_t>((p * h + y1) * w);
      const float lx0 = __fsub_rn(1.0f, lx), ly0 = __fsub_rn(1.0f, ly);
      const float t0 = __fadd_rn(__fmul_rn(normal(seed, r0 + x0), lx0), __fmul_rn(normal(seed, r0 + x1), lx));
      const float t1 = __fadd_rn(__fmul_rn(normal(seed, r1 + x0), lx0), __fmul_rn(normal(seed, r1 + x1), lx));
      e = __fadd_rn(e, __fmul_rn(__fadd_rn(__fmul_rn(t0, ly0), __fmul_rn(t1, ly)), s.table[3 + l]));
      if (h == 1 || w == 1) break;  // sd-scripts: stop after a level with a side of 1
    }
    if (norm) e = __fdiv_rn(e, *s.std);
  }
  return e;
}

// gamma*u*xi: the perturbation added to eps for x_t only.
__device__ __forceinline__ float spec_perturbation(const NoiseSpecArgs& s, uint64_t seed, uint64_t off, int64_t g) {
  float gamma = s.table[2];
  if (s.flags & kSpecPerturbRandom) gamma = __fmul_rn(gamma, uniform(seed, off + s.k_s + 1));
  return __fmul_rn(gamma, normal(seed, off + s.k_xi + static_cast<uint64_t>(g)));
}

// (rho(d), psi(d)) of a loss shape (kernels/loss_shape.py), kind != kL2.
__device__ __forceinline__ float rho_psi(int32_t kind, float c, float d, float& psi) {
  if (kind == kL1) {
    psi = d > 0.0f ? 0.5f : (d < 0.0f ? -0.5f : 0.0f);
    return fabsf(d);
  }
  const float dd = __fmul_rn(d, d);
  const float q = __fsqrt_rn(__fadd_rn(dd, __fmul_rn(c, c)));
  const float v = __fdiv_rn(dd, __fadd_rn(q, c));  // sqrt(d^2 + c^2) - c without cancellation
  const float m = kind == kHuber ? c : kind == kSmoothL1 ? 1.0f : 0.5f;
  psi = __fdiv_rn(__fmul_rn(m, d), q);
  return kind == kHuber ? __fmul_rn(2.0f * c, v) : kind == kSmoothL1 ? __fmul_rn(2.0f, v) : v;
}

// Templated on the output dtype only; inputs of any dtype go through load_any (one warp-uniform
// branch), which keeps the number of instantiations, and so nvcc's time, small.
template <class TO, bool SPEC>
__global__ void __launch_bounds__(kThreads) noise_kernel(NoiseArgs a) {
  const uint64_t offset = offset_of(a.offset_ptr, a.offset);
  TO* xt = static_cast<TO*>(a.xt);
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const int64_t tb = a.t[b];
    const float al = a.alpha[tb], sg = a.sigma[tb];
    const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
#pragma unroll 2  // (a full unroll multiplies nvcc's time for little gain: the work is ALU-bound)
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < a.D) {
        const int64_t g = b * a.D + i;
        if constexpr (SPEC) {  // the noise options (eps given comes without them: kernels/noise.py)
          const float e = spec_eps(a.spec, a.seed, offset, b, i, a.D, true);
          const float ex = (a.spec.flags & kSpecPerturb) ? __fadd_rn(e, spec_perturbation(a.spec, a.seed, offset, g)) : e;
          xt[g] = from_f32<TO>(__fadd_rn(__fmul_rn(al, load_any(a.x0, a.x0_type, g)), __fmul_rn(sg, ex)));
          if (a.eps_out != nullptr) a.eps_out[g] = e;
        } else {
          const float e = a.eps != nullptr ? load_any(a.eps, a.eps_type, g) : normal(a.seed, offset + g);
          xt[g] = from_f32<TO>(__fadd_rn(__fmul_rn(al, load_any(a.x0, a.x0_type, g)), __fmul_rn(sg, e)));
          if (a.eps_out != nullptr) a.eps_out[g] = e;
        }
      }
    }
  }
}

__device__ __forceinline__ float block_sum(float v, float* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;  // valid in thread 0
}

template <class TP, bool EXT>
__global__ void __launch_bounds__(kThreads) loss_kernel(LossArgs a, float* partial) {
  __shared__ float shared[kThreads / 32];
  const uint64_t offset = offset_of(a.offset_ptr, a.offset);
  const TP* pred = static_cast<const TP*>(a.pred);
  TP* grad = static_cast<TP*>(a.grad);
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const int64_t tb = a.t[b];
    const float ce = a.coef[tb], cx = a.coef[a.T + tb];
    const float scale = __fmul_rn(a.grad_scale, __fmul_rn(a.weight[tb], a.iw[b]));  // reference.loss_and_grad
    const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
    float acc = 0.0f;
#pragma unroll 2  // (a full unroll multiplies nvcc's time for little gain: the work is ALU-bound)
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < a.D) {
        const int64_t g = b * a.D + i;
        float target = 0.0f;
        if (a.needs_eps) {
          float e;
          if constexpr (EXT) {  // noise options or a loss shape
            e = a.eps != nullptr       ? load_any(a.eps, a.eps_type, g)
                : a.spec.flags != 0 || a.spec.rows != nullptr ? spec_eps(a.spec, a.seed, offset, b, i, a.D, true)
                                       : normal(a.seed, offset + g);
          } else {
            e = a.eps != nullptr ? load_any(a.eps, a.eps_type, g) : normal(a.seed, offset + g);
          }
          target = __fmul_rn(ce, e);
        }
        if (a.needs_x0) {
          const float xv = __fmul_rn(cx, load_any(a.x0, a.x0_type, g));
          target = a.needs_eps ? __fadd_rn(target, xv) : xv;
        }
        const float d = __fsub_rn(to_f32(pred[g]), target);
        if constexpr (EXT) {
          if (a.mask != nullptr) {  // rho(d)*m and psi(d)*m (kernels/torch_ref_diffusion_loss.py: masked)
            const int64_t P = a.mask_period;
            const float m = load_any(a.mask, a.mask_type, b * P + (P == a.D ? i : i % P));
            float psi = d, r;
            if (a.loss_kind == kL2) {
              r = __fmul_rn(d, d);
            } else {
              r = rho_psi(a.loss_kind, a.huber_c != nullptr ? a.huber_c[tb] : 0.0f, d, psi);
            }
            acc += __fmul_rn(r, m);
            grad[g] = from_f32<TP>(__fmul_rn(__fmul_rn(psi, m), scale));
          } else if (a.loss_kind == kL2) {
            grad[g] = from_f32<TP>(__fmul_rn(d, scale));
            acc = fmaf(d, d, acc);
          } else {
            float psi;
            acc += rho_psi(a.loss_kind, a.huber_c != nullptr ? a.huber_c[tb] : 0.0f, d, psi);
            grad[g] = from_f32<TP>(__fmul_rn(psi, scale));
          }
        } else {
          grad[g] = from_f32<TP>(__fmul_rn(d, scale));  // dL/dpred, written in the forward pass
          acc = fmaf(d, d, acc);
        }
      }
    }
    const float s = block_sum(acc, shared);
    if (threadIdx.x == 0) partial[b * gridDim.x + blockIdx.x] = s;
  }
}

__device__ __forceinline__ bool finite(float v) { return v - v == 0.0f; }  // NaN for inf and NaN

// One block: per-sample reduction in a fixed order, outputs, bins, batch mean.
__global__ void __launch_bounds__(1024) finalize_kernel(LossArgs a, LossOutputs out, int64_t tiles) {
  __shared__ float shared[32];
  float total = 0.0f;
  for (int64_t b = threadIdx.x; b < a.B; b += blockDim.x) {
    double sum = 0.0;
    for (int64_t k = 0; k < tiles; ++k) sum += out.partial[b * tiles + k];
    const float r = static_cast<float>(sum / static_cast<double>(a.D));
    const int64_t tb = a.t[b];
    const float wb = a.weight[tb];
    const float wl = __fmul_rn(wb, r);
    const float per = __fmul_rn(__fmul_rn(wb, a.iw[b]), r);
    out.raw[b] = r;
    out.wl[b] = wl;
    out.per[b] = per;
    total += per;
    if (out.bins != nullptr && finite(r) && finite(wl)) {  // kernels/bins.py: skip non-finite samples
      atomicAdd(out.bins + tb, 1.0);
      const float v[2] = {r, wl};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const double x = static_cast<double>(v[j]) - out.pivots[j * a.T + tb];
        atomicAdd(out.bins + (1 + 2 * j) * a.T + tb, x);
        atomicAdd(out.bins + (2 + 2 * j) * a.T + tb, x * x);
      }
    }
  }
  const float s = block_sum(total, shared);
  if (threadIdx.x == 0) *out.mean = s / static_cast<float>(a.B);
}

// Sigma and Sigma^2 of the pyramid noise before its std division: a float sum per block, float64 atomics.
__global__ void __launch_bounds__(kThreads) moments_kernel(NoiseArgs a, double* sums) {
  __shared__ float shared[kThreads / 32];
  const uint64_t offset = offset_of(a.offset_ptr, a.offset);
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
    float s1 = 0.0f, s2 = 0.0f;
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < a.D) {
        const float e = spec_eps(a.spec, a.seed, offset, b, i, a.D, false);
        s1 += e;
        s2 = fmaf(e, e, s2);
      }
    }
    const float t1 = block_sum(s1, shared);
    const float t2 = block_sum(s2, shared);
    if (threadIdx.x == 0) {
      atomicAdd(sums, static_cast<double>(t1));
      atomicAdd(sums + 1, static_cast<double>(t2));
    }
  }
}

// std = sqrt((S2 - S1^2/n)/(n - 1)) on the device: no host sync.
__global__ void std_kernel(const double* sums, double n, float* out) {
  *out = static_cast<float>(sqrt((sums[1] - sums[0] * sums[0] / n) / (n - 1.0)));
}

dim3 grid_for(int64_t B, int64_t D) {
  return dim3(static_cast<unsigned>(tiles_per_sample(D)), static_cast<unsigned>(B < 65535 ? B : 65535));
}

template <class F>
void with_type(DType t, F&& f) {
  switch (t) {
    case DType::kBFloat16:
      f(__nv_bfloat16{});
      break;
    case DType::kFloat16:
      f(__half{});
      break;
    default:
      f(float{});
  }
}

}  // namespace

void launch_noise(const NoiseArgs& a, cudaStream_t stream) {
  if (a.B == 0 || a.D == 0) return;
  const bool spec = a.eps == nullptr && (a.spec.flags != 0 || a.spec.rows != nullptr);
  with_type(a.xt_type, [&](auto o) {
    if (spec) {
      noise_kernel<decltype(o), true><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a);
    } else {
      noise_kernel<decltype(o), false><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a);
    }
  });
}

void launch_noise_std(const NoiseArgs& a, double* sums, float* out, cudaStream_t stream) {
  if (a.B > 0 && a.D > 0) moments_kernel<<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a, sums);
  std_kernel<<<1, 1, 0, stream>>>(sums, static_cast<double>(a.B * a.D), out);
}

void launch_loss(const LossArgs& a, const LossOutputs& out, cudaStream_t stream) {
  if (a.B == 0) return;
  if (a.D > 0) {
    const bool ext = a.loss_kind != kL2 || a.mask != nullptr ||
                     (a.eps == nullptr && (a.spec.flags != 0 || a.spec.rows != nullptr));
    with_type(a.pred_type, [&](auto p) {
      if (ext) {
        loss_kernel<decltype(p), true><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a, out.partial);
      } else {
        loss_kernel<decltype(p), false><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a, out.partial);
      }
    });
  }
  finalize_kernel<<<1, 1024, 0, stream>>>(a, out, tiles_per_sample(a.D));
}

}  // namespace fasttrain::cuda
