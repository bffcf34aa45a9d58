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

// Templated on the output dtype only; inputs of any dtype go through load_any (one warp-uniform
// branch), which keeps the number of instantiations, and so nvcc's time, small.
template <class TO>
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
        const float e = a.eps != nullptr ? load_any(a.eps, a.eps_type, g) : normal(a.seed, offset + g);
        xt[g] = from_f32<TO>(__fadd_rn(__fmul_rn(al, load_any(a.x0, a.x0_type, g)), __fmul_rn(sg, e)));
        if (a.eps_out != nullptr) a.eps_out[g] = e;
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

template <class TP>
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
          const float e = a.eps != nullptr ? load_any(a.eps, a.eps_type, g) : normal(a.seed, offset + g);
          target = __fmul_rn(ce, e);
        }
        if (a.needs_x0) {
          const float xv = __fmul_rn(cx, load_any(a.x0, a.x0_type, g));
          target = a.needs_eps ? __fadd_rn(target, xv) : xv;
        }
        const float d = __fsub_rn(to_f32(pred[g]), target);
        grad[g] = from_f32<TP>(__fmul_rn(d, scale));  // dL/dpred, written in the forward pass
        acc = fmaf(d, d, acc);
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
  with_type(a.xt_type,
            [&](auto o) { noise_kernel<decltype(o)><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a); });
}

void launch_loss(const LossArgs& a, const LossOutputs& out, cudaStream_t stream) {
  if (a.B == 0) return;
  if (a.D > 0) {
    with_type(a.pred_type, [&](auto p) {
      loss_kernel<decltype(p)><<<grid_for(a.B, a.D), kThreads, 0, stream>>>(a, out.partial);
    });
  }
  finalize_kernel<<<1, 1024, 0, stream>>>(a, out, tiles_per_sample(a.D));
}

}  // namespace fasttrain::cuda
