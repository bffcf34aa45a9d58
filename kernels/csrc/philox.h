// The project's one noise stream: eps for (seed, offset + element index), in C++ for the CPU and CUDA.
//
// Exactly kernels/philox.py, which is Triton's `tl.randn(seed, offset)` (triton/language/random.py):
//   counter (lo32(n), hi32(n), 0, 0) for n = offset + index, key (lo32(seed), hi32(seed));
//   Philox4x32-10 (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3",
//   SC'11, Fig. 2): ten rounds of
//       c0' = mulhi(B, c2) ^ c1 ^ k0,  c1' = mullo(B, c2),  c2' = mulhi(A, c0) ^ c3 ^ k1,  c3' = mullo(A, c0)
//   with the key bumped by the Weyl constants after every round;
//   uniform u = float(int32(w) complemented when negative) * 4.6566127342e-10f, in [0, 1);
//   normal  Box-Muller on the first two words: sqrt(-2 ln max(u0, 1e-7)) * cos(2*pi*u1).
// The words and the uniforms are bit-identical to Triton's; the normals differ only by the rounding
// of log and cos (fastmath.h, used by the CPU and CUDA kernels alike).
//
// Everything here is scalar, branch-free and inline so that the CPU loops over it vectorise
// (gcc turns the 32x32->64 products into vpmuludq) and CUDA compiles it per thread.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FT_INLINE __host__ __device__ __forceinline__
#else
#define FT_INLINE inline __attribute__((always_inline))
#endif

namespace fasttrain {

constexpr uint32_t kPhiloxA = 0xD2511F53u, kPhiloxB = 0xCD9E8D57u;    // round multipliers
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u, kPhiloxKeyB = 0xBB67AE85u;  // key schedule (Weyl)
constexpr float kUniformScale = 4.6566127342e-10f;  // largest s with (2^31 - 1)·s < 1 in float32
constexpr float kTwoPi = 6.283185307179586f;
constexpr float kMinUniform = 1.0e-7f;  // Triton clamps u0 before the log

FT_INLINE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// The first two of the four output words of Philox4x32-10 for counter (c0, c1, 0, 0) and key
// (k0, k1): all that one normal needs. The first round multiplies zeros (c2 = c3 = 0) and the last
// round's A-product feeds only words 2 and 3, so 18 of the 20 products remain.
FT_INLINE void philox_w01(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1, uint32_t& w0, uint32_t& w1) {
  uint32_t c2 = 0, c3 = 0;
#if defined(__CUDACC__)
#pragma unroll
#else
#pragma GCC unroll 10
#endif
  for (int r = 0; r < 10; ++r) {
    const uint32_t hb = mulhi32(kPhiloxB, c2), lb = kPhiloxB * c2;
    const uint32_t ha = mulhi32(kPhiloxA, c0), la = kPhiloxA * c0;
    const uint32_t n0 = hb ^ c1 ^ k0, n2 = ha ^ c3 ^ k1;
    c1 = lb;
    c3 = la;
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  w0 = c0;
  w1 = c1;
}

// Triton's uint_to_uniform_float for 32-bit words: bit-cast to int32, x < 0 -> -x - 1 (= ~x).
FT_INLINE float uniform01(uint32_t w) {
  const int32_t x = static_cast<int32_t>(w);
  return static_cast<float>(x ^ (x >> 31)) * kUniformScale;
}

}  // namespace fasttrain
