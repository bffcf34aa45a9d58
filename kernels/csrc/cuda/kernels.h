// Launchers of the CUDA kernels (cuda/kernels.cu), callable from the g++-compiled ATen bindings
// (cuda/ops.cpp): raw pointers and a stream, no torch types, so nvcc never parses torch's headers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "../args.h"

namespace fasttrain::cuda {

// Elements per block and tile: 256 threads x 8 elements (Triton's GPU BLOCK is 2048 too, triton_shared.py).
constexpr int kThreads = 256;
constexpr int kPerThread = 8;
constexpr int64_t kTile = kThreads * kPerThread;

inline int64_t tiles_per_sample(int64_t D) { return (D + kTile - 1) / kTile; }

// The noise kernel: one launch.
void launch_noise(const NoiseArgs& a, cudaStream_t stream);

// The pyramid noise's std (kernels/noise_spec.py): the moments into `sums` (2 float64, zeroed by the
// caller), then std into `out` (float32), both on the device.
void launch_noise_std(const NoiseArgs& a, double* sums, float* out, cudaStream_t stream);

// The loss kernel: the elementwise pass writes the gradient and one fp32 partial sum of d^2 per tile
// (`partial`, B * tiles_per_sample(D) floats, fully overwritten: no zeroing, no state between
// calls); a one-block pass then reduces each sample's partials in a fixed order, writes raw, wl, per
// and the batch mean, and adds the finite samples to the bins with float64 atomics.
struct LossOutputs {
  float* partial;
  float* raw;
  float* wl;
  float* per;
  float* mean;
  double* bins;         // [5, T] or nullptr
  const double* pivots;  // [2, T]
};
void launch_loss(const LossArgs& a, const LossOutputs& out, cudaStream_t stream);

}  // namespace fasttrain::cuda
