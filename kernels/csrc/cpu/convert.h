// float32 <-> bfloat16 / float16 conversions for the CPU kernels, branch-free so that gcc vectorises
// the load and store loops (the libgcc/_Float16 routes do not vectorise below AVX512-FP16).
// Rounding is IEEE round-to-nearest-even, the same as torch's c10::BFloat16 / c10::Half, so that a
// cast here equals `.to(dtype)` in kernels/torch_ref.py. The float16 routines are F. Giesen's
// exhaustively checked "half_to_float" and "float_to_half_fast3_rtne" (public domain, 2012).
#pragma once
#include <cstdint>

#include "../fastmath.h"

namespace fasttrain {

FT_INLINE float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

FT_INLINE uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}

FT_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (static_cast<uint32_t>(h) & 0x7fffu) << 13;  // exponent and mantissa
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;  // rebias
  const uint32_t inf_nan = o + ((128u - 16u) << 23);
  const uint32_t denorm = f2u(u2f(o + (1u << 23)) - u2f(113u << 23));  // renormalise exactly
  o = exp == shifted_exp ? inf_nan : (exp == 0 ? denorm : o);
  return u2f(o | ((static_cast<uint32_t>(h) & 0x8000u) << 16));
}

FT_INLINE uint16_t f32_to_f16(float value) {
  uint32_t f = f2u(value);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  const uint32_t f32_infty = 255u << 23, f16_max = (127u + 16u) << 23;
  const uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t big = f > f32_infty ? 0x7e00u : 0x7c00u;                // NaN -> qNaN, overflow -> inf
  const uint32_t tiny = f2u(u2f(f) + u2f(denorm_magic)) - denorm_magic;  // the FPU rounds the subnormal
  const uint32_t normal = (f + ((15u - 127u) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
  const uint32_t o = f >= f16_max ? big : (f < (113u << 23) ? tiny : normal);
  return static_cast<uint16_t>(o | (sign >> 16));
}

}  // namespace fasttrain
