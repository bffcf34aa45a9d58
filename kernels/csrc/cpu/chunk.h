// Chunk-level helpers of the CPU kernels (cpu/kernels.cpp, cpu/mixed.cpp): dtype loads and stores through float32
// buffers of kChunk elements, the Philox normals of a run of counters, and the fixed-order sums of
// a chunk. Included only by the per-instruction-set
// kernel sources, so everything lands in that copy's namespace FT_CAP (CMakeLists.txt).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../args.h"
#include "../fastmath.h"
#include "convert.h"
#include "philox_simd.h"

#ifndef FT_CAP
#error "compile with -DFT_CAP=<namespace>"
#endif

namespace fasttrain::cpu::FT_CAP {

constexpr int kChunk = 512;  // elements per step: a few float buffers that stay in L1
constexpr int kLanes = 16;   // independent float32 accumulators of a chunk's sums

// The float32 view of elements [start, start + n): the data itself when it is float32, else `buf`
// filled by conversion (convert.h).
inline const float* load(const void* src, DType type, int64_t start, int n, float* __restrict buf) {
  switch (type) {
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + start;
      for (int i = 0; i < n; ++i) buf[i] = bf16_to_f32(s[i]);
      return buf;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + start;
      for (int i = 0; i < n; ++i) buf[i] = f16_to_f32(s[i]);
      return buf;
    }
    default:
      return static_cast<const float*>(src) + start;
  }
}

inline void store(void* dst, DType type, int64_t start, int n, const float* __restrict in) {
  switch (type) {
    case DType::kFloat32:
      std::memcpy(static_cast<float*>(dst) + start, in, sizeof(float) * n);
      break;
    case DType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + start;
      for (int i = 0; i < n; ++i) d[i] = f32_to_bf16(in[i]);
      break;
    }
    case DType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + start;
      for (int i = 0; i < n; ++i) d[i] = f32_to_f16(in[i]);
      break;
    }
  }
}

// eps for counters base .. base + n - 1 (mod 2^64): Philox words (philox_simd.h where there are x86
// intrinsics, else a loop gcc vectorises), then Box-Muller (fastmath.h) over the words.
inline void words_run(uint64_t seed, uint64_t base, int n, uint32_t* __restrict w0, uint32_t* __restrict w1) {
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(FT_PHILOX_SIMD)
  philox_words(base, k0, k1, n, w0, w1);
#else
  for (int i = 0; i < n; ++i) {
    const uint64_t c = base + static_cast<uint64_t>(i);
    philox_w01(static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), k0, k1, w0[i], w1[i]);
  }
#endif
}

inline void normals_chunk(uint64_t seed, uint64_t base, int n, float* __restrict out) {
  alignas(64) uint32_t w0[kChunk];
  alignas(64) uint32_t w1[kChunk];
  words_run(seed, base, n, w0, w1);
  for (int i = 0; i < n; ++i) out[i] = normal_from_words(w0[i], w1[i]);
}

// sum_i p[i]^2 over a chunk, in a fixed order: kLanes float32 partial sums (which gcc vectorises),
// then their total in float64. Pads p with zeros up to a multiple of kLanes (p holds kChunk floats).
inline double sum_squares(float* __restrict p, int n) {
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int i = n; i < padded; ++i) p[i] = 0.0f;
  float acc[kLanes] = {};
  for (int j = 0; j < padded; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += p[j + l] * p[j + l];
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// sum_i p[i] over a chunk, in the same fixed order (and with the same padding) as sum_squares.
inline double sum_plain(float* __restrict p, int n) {
  const int padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int i = n; i < padded; ++i) p[i] = 0.0f;
  float acc[kLanes] = {};
  for (int j = 0; j < padded; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += p[j + l];
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// A loss shape (kernels/loss_shape.py) over a chunk: r[i] = rho(d[i]), d[i] = psi(d[i]) (in place), in the
// reference's operations; the caller keeps l2 (r = d^2, psi = d) on its own path.
inline void rho_psi(int32_t kind, float c, float* __restrict d, float* __restrict r, int n) {
  switch (kind) {
    case kL1:
      for (int i = 0; i < n; ++i) {
        r[i] = std::fabs(d[i]);
        d[i] = d[i] > 0.0f ? 0.5f : (d[i] < 0.0f ? -0.5f : 0.0f);
      }
      break;
    case kHuber:
    case kSmoothL1:
    case kPseudoHuber: {
      const float k = kind == kHuber ? 2.0f * c : kind == kSmoothL1 ? 2.0f : 1.0f;  // rho = k*(sqrt(d^2+c^2) - c)
      const float m = kind == kHuber ? c : kind == kSmoothL1 ? 1.0f : 0.5f;         // psi = m*d/sqrt(d^2+c^2)
      for (int i = 0; i < n; ++i) {
        const float dd = d[i] * d[i];
        const float q = std::sqrt(dd + c * c);
        const float v = dd / (q + c);  // sqrt(d^2 + c^2) - c without cancellation
        r[i] = kind == kPseudoHuber ? v : k * v;
        d[i] = (m * d[i]) / q;
      }
      break;
    }
    default:
      for (int i = 0; i < n; ++i) r[i] = d[i] * d[i];
  }
}

}  // namespace fasttrain::cpu::FT_CAP
