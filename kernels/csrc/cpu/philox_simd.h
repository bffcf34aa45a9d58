// Philox4x32-10 words 0 and 1 (philox.h) for runs of consecutive counters, with x86 SIMD intrinsics.
//
// Each counter lives in a 64-bit lane: PMULUDQ multiplies the low 32 bits of every lane into a full
// 64-bit product (Salmon et al. 2011 chose the round function for exactly this instruction), so hi
// is one shift and lo is the product itself. The upper halves of c1/c3 (and so of c0/c2) then carry
// garbage, which is harmless: c0 and c2 only ever enter the next PMULUDQ, which ignores them, and only
// the low halves of c0 and c1 are stored. Per lane and round: 2 multiplies, 2 shifts, 2 three-way
// XORs (one VPTERNLOGQ each on AVX-512). The compiler flags of the copy being built (CMakeLists.txt)
// choose the width: AVX-512 (8 lanes), AVX2 (4) or the x86-64 baseline SSE2 (2).
#pragma once
#include <cstdint>

#include "../philox.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FT_PHILOX_SIMD 1

namespace fasttrain::cpu {

#if defined(__AVX512F__)
struct Lanes {
  using V = __m512i;
  static constexpr int N = 8;
  static V set1(uint64_t x) { return _mm512_set1_epi64(static_cast<long long>(x)); }
  static V iota(uint64_t base) { return _mm512_add_epi64(set1(base), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0)); }
  static V mul(V a, V b) { return _mm512_mul_epu32(a, b); }
  static V hi(V p) { return _mm512_srli_epi64(p, 32); }
  static V xor3(V a, V b, V c) { return _mm512_ternarylogic_epi64(a, b, c, 0x96); }
  static void store_lo(uint32_t* dst, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi64_epi32(v));
  }
};
#elif defined(__AVX2__)
struct Lanes {
  using V = __m256i;
  static constexpr int N = 4;
  static V set1(uint64_t x) { return _mm256_set1_epi64x(static_cast<long long>(x)); }
  static V iota(uint64_t base) { return _mm256_add_epi64(set1(base), _mm256_set_epi64x(3, 2, 1, 0)); }
  static V mul(V a, V b) { return _mm256_mul_epu32(a, b); }
  static V hi(V p) { return _mm256_srli_epi64(p, 32); }
  static V xor3(V a, V b, V c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static void store_lo(uint32_t* dst, V v) {
    const V lo = _mm256_permutevar8x32_epi32(v, _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(lo));
  }
};
#else
struct Lanes {
  using V = __m128i;
  static constexpr int N = 2;
  static V set1(uint64_t x) { return _mm_set1_epi64x(static_cast<long long>(x)); }
  static V iota(uint64_t base) { return _mm_add_epi64(set1(base), _mm_set_epi64x(1, 0)); }
  static V mul(V a, V b) { return _mm_mul_epu32(a, b); }
  static V hi(V p) { return _mm_srli_epi64(p, 32); }
  static V xor3(V a, V b, V c) { return _mm_xor_si128(_mm_xor_si128(a, b), c); }
  static void store_lo(uint32_t* dst, V v) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 1, 2, 0)));
  }
};
#endif

// w0[i], w1[i] for counter base + i, i < n (mod 2^64), key (k0, k1).
inline void philox_words(uint64_t base, uint32_t k0, uint32_t k1, int n, uint32_t* __restrict w0,
                         uint32_t* __restrict w1) {
  using V = Lanes::V;
  constexpr int U = 4;  // independent vectors in flight, to cover the multiply latency
  constexpr int step = U * Lanes::N;
  V key0[10], key1[10];
  for (int r = 0; r < 10; ++r) {
    key0[r] = Lanes::set1(static_cast<uint32_t>(k0 + static_cast<uint32_t>(r) * kPhiloxKeyA));
    key1[r] = Lanes::set1(static_cast<uint32_t>(k1 + static_cast<uint32_t>(r) * kPhiloxKeyB));
  }
  const V ma = Lanes::set1(kPhiloxA), mb = Lanes::set1(kPhiloxB);
  int i = 0;
  for (; i + step <= n; i += step) {
    V c0[U], c1[U], c2[U], c3[U];
    for (int u = 0; u < U; ++u) {
      c0[u] = Lanes::iota(base + static_cast<uint64_t>(i + u * Lanes::N));  // low word in the low half
      c1[u] = Lanes::hi(c0[u]);
      c2[u] = Lanes::set1(0);
      c3[u] = c2[u];
    }
    for (int r = 0; r < 10; ++r) {
      for (int u = 0; u < U; ++u) {
        const V pb = Lanes::mul(c2[u], mb), pa = Lanes::mul(c0[u], ma);
        c0[u] = Lanes::xor3(Lanes::hi(pb), c1[u], key0[r]);
        c2[u] = Lanes::xor3(Lanes::hi(pa), c3[u], key1[r]);
        c1[u] = pb;
        c3[u] = pa;
      }
    }
    for (int u = 0; u < U; ++u) {
      Lanes::store_lo(w0 + i + u * Lanes::N, c0[u]);
      Lanes::store_lo(w1 + i + u * Lanes::N, c1[u]);
    }
  }
  for (; i < n; ++i) {
    const uint64_t c = base + static_cast<uint64_t>(i);
    philox_w01(static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), k0, k1, w0[i], w1[i]);
  }
}

}  // namespace fasttrain::cpu
#endif
