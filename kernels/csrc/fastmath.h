// Branch-free float32 log and cos for the noise (Box-Muller), written so that gcc vectorises them on
// the CPU; the CUDA kernels use them too, which keeps their code small (CUDA's cosf carries a
// large-argument reduction that the domain here never needs) and their normals the CPU's. Also exp
// on x <= 0, for the CPU mixed loss's gate softmax (cpu/mixed.cpp).
//
// The libm versions do not vectorise (and the uniforms of philox.h need only a narrow domain):
//   log: x in [1e-7, 1), normal numbers only;  cos: x in [0, 2*pi].
// Both are the Cephes Mathematical Library single-precision algorithms (S. L. Moshier, logf.c and
// sinf.c/cosf.c): log(x) = e*ln2 + log1p(f) with f in [sqrt(1/2) - 1, sqrt(2) - 1] and a degree-9
// polynomial; cos by reduction to [-pi/4, pi/4] with pi/4 split in three (Cody & Waite) and the
// sine or cosine polynomial of the octant. Each is within about 1 ulp of the correctly rounded
// result on these domains, which is what "the same normals as Triton to rounding" needs (Triton's
// interpreter uses numpy's log/cos, the GPU libdevice's; neither is correctly rounded either).
#pragma once
#include <cstdint>
#include <cstring>

#include "philox.h"

namespace fasttrain {

FT_INLINE uint32_t f2u(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
FT_INLINE float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// a*b + c: one fused multiply-add where the target has it (the polynomials below are a third
// faster with it); elsewhere two roundings. Either is within the error bounds stated above, so the
// noise of the baseline x86-64 copy may differ from the AVX2/AVX-512 and CUDA ones in the last bit.
// (Everything outside these polynomials is compiled with -ffp-contract=off, CMakeLists.txt.)
FT_INLINE float madd(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#elif defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// Cephes logf for normal x > 0.
FT_INLINE float log_positive(float x) {
  const uint32_t bits = f2u(x);
  int32_t e = static_cast<int32_t>((bits >> 23) & 0xffu) - 126;  // x = m * 2^e, m in [0.5, 1)
  const float m = u2f((bits & 0x007fffffu) | 0x3f000000u);
  const bool low = m < 0.707106781186547524f;
  e -= low ? 1 : 0;
  const float f = low ? (m + m) - 1.0f : m - 1.0f;  // exact (Sterbenz)
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = madd(y, f, -1.1514610310e-1f);
  y = madd(y, f, 1.1676998740e-1f);
  y = madd(y, f, -1.2420140846e-1f);
  y = madd(y, f, 1.4249322787e-1f);
  y = madd(y, f, -1.6668057665e-1f);
  y = madd(y, f, 2.0000714765e-1f);
  y = madd(y, f, -2.4999993993e-1f);
  y = madd(y, f, 3.3333331174e-1f);
  y = y * f * z;
  const float ef = static_cast<float>(e);
  y += -2.12194440e-4f * ef;  // ln2 = 0.693359375 - 2.12194440e-4, the first part exact in 9 bits
  y += -0.5f * z;
  return (f + y) + 0.693359375f * ef;
}

// Cephes cosf for 0 <= x <= 2*pi (a few octants; no large-argument reduction needed).
FT_INLINE float cos_small(float x) {
  int32_t j = static_cast<int32_t>(x * 1.27323954473516f);  // 4/pi: the octant
  j += j & 1;                                                // to an even octant: |z| <= pi/4
  const float y = static_cast<float>(j);
  const float z = ((x - y * 0.78515625f) - y * 2.4187564849853515625e-4f) - y * 3.77489497744594108e-8f;
  const float zz = z * z;
  const float c = madd(madd(madd(2.443315711809948e-5f, zz, -1.388731625493765e-3f), zz, 4.166664568298827e-2f) * zz,
                       zz, -0.5f * zz) + 1.0f;
  const float s = madd(madd(madd(-1.9515295891e-4f, zz, 8.3321608736e-3f), zz, -1.6666654611e-1f) * zz, z, z);
  // cos(x) = cos(j*pi/4 + z) for j in {0, 2, 4, 6, 8}: cos z, -sin z, -cos z, sin z, cos z
  const int32_t q = (j >> 1) & 3;
  const float v = (q & 1) ? s : c;
  return (q == 1 || q == 2) ? -v : v;
}

// Cephes expf for x <= 0 (the softmax of the mixed loss's gate, cpu/mixed.cpp, takes exp(z - max z)):
// n = round(x / ln2), r = x - n*ln2 with ln2 split in two (Cody & Waite), a degree-5 polynomial for
// e^r on [-ln2/2, ln2/2], times 2^n built in the exponent bits; within 1.4 ulp of exp. n is rounded
// by adding 1.5*2^23 (its bits then hold n + 0x400000 in the mantissa), so there is no float-to-int
// conversion and no branch: gcc vectorises it, and a NaN stays NaN (a non-finite gate logit must
// still poison its sample). Below -88 (n = -127: the exponent field 0) the result is exactly 0,
// which is what a masked head's logit (bias -1e9) must give.
FT_INLINE float exp_nonpositive(float x) {
  const float xc = x < -88.0f ? -88.0f : x;  // keeps n >= -127; NaN passes
  const float t = xc * 1.44269504088896341f + 12582912.0f;
  const float fn = t - 12582912.0f;  // round(x / ln2), exact
  const float r = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
  const float rr = r * r;
  float y = 1.9875691500e-4f;
  y = madd(y, r, 1.3981999507e-3f);
  y = madd(y, r, 8.3334519073e-3f);
  y = madd(y, r, 4.1665795894e-2f);
  y = madd(y, r, 1.6666665459e-1f);
  y = madd(y, r, 5.0000001201e-1f);
  y = madd(y, rr, r) + 1.0f;
  return y * u2f((f2u(t) - 0x4B400000u + 127u) << 23);  // 2^n: n + 127 in the exponent field
}

// tl.randn's Box-Muller on the first two words (philox.h): the first normal of the pair.
FT_INLINE float normal_from_words(uint32_t w0, uint32_t w1) {
  float u0 = uniform01(w0);
  u0 = u0 < kMinUniform ? kMinUniform : u0;
  const float th = kTwoPi * uniform01(w1);
  #if defined(__CUDA_ARCH__)
  return sqrtf(-2.0f * log_positive(u0)) * cos_small(th);
#else
  return __builtin_sqrtf(-2.0f * log_positive(u0)) * cos_small(th);
#endif
}

}  // namespace fasttrain
