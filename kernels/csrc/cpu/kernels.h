// The CPU kernels' entry points, one set per instruction set (cpu/kernels.cpp is compiled once for
// each: the x86-64 baseline, AVX2+FMA (x86-64-v3) and AVX-512 (x86-64-v4)); cpu/capability.cpp
// picks the best set the processor supports at run time, so the shipped build runs on any x86-64.
//
// Work is split into tiles of at most `tile` elements of one sample; tile k covers sample
// k / ceil(D/tile). The ATen side (cpu/ops.cpp) runs ranges of tiles under at::parallel_for.
#pragma once
#include <cstdint>
#include <string>

#include "../args.h"

namespace fasttrain::cpu {

// The noise kernel on tiles [begin, end).
using NoiseTilesFn = void (*)(const NoiseArgs&, int64_t begin, int64_t end, int64_t tile);
// The loss kernel on tiles [begin, end): writes the gradient and partial[k] = sum of d^2 over tile k.
using LossTilesFn = void (*)(const LossArgs&, double* partial, int64_t begin, int64_t end, int64_t tile);

// The mixed loss on tasks [begin, end) (args.h: MixedArgs): writes the gradient and
// partial[k * mixed_sums(H) ...], the sums of task k.
using MixedTasksFn = void (*)(const MixedArgs&, double* partial, int64_t begin, int64_t end);

// Philox words 0 and 1 (philox.h) of counters base .. base + n - 1: the tests check them bit for bit.
using WordsFn = void (*)(uint64_t seed, uint64_t base, int64_t n, uint32_t* w0, uint32_t* w1);

// The pyramid noise's moments on tiles [begin, end): partial[2k], partial[2k + 1] = sum of eps, of eps^2
// (before the std division) over tile k (cpu/spec_noise.h).
using MomentsTilesFn = void (*)(const NoiseArgs&, double* partial, int64_t begin, int64_t end, int64_t tile);

struct KernelSet {
  const char* name;
  NoiseTilesFn noise;
  LossTilesFn loss;
  MixedTasksFn mixed;
  WordsFn words;
  MomentsTilesFn moments;
};

namespace cap_default { KernelSet kernel_set(); }
namespace cap_avx2 { KernelSet kernel_set(); }
namespace cap_avx512 { KernelSet kernel_set(); }

// The set in use; `request` ("", "default", "avx2", "avx512") changes it when the processor has it.
const KernelSet& kernels();
std::string set_capability(const std::string& request);

}  // namespace fasttrain::cpu
