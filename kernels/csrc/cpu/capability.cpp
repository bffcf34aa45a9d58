// Run-time choice of the CPU kernel set (cpu/kernels.h): the widest instruction set that this
// processor and its OS support, unless FASTTRAIN_CPU_CAPABILITY (or cpu_capability(request), which
// the tests use to check every set) asks for a narrower one. Mirrors ATen's own DispatchStub
// (aten/src/ATen/native/DispatchStub.cpp), so the shipped .so needs no -march=native.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace fasttrain::cpu {
namespace {

int level_supported() {
#if defined(FT_X86_CAPS)
  __builtin_cpu_init();
  // __builtin_cpu_supports checks CPUID and that the OS saves the wider registers (XGETBV).
  if (__builtin_cpu_supports("x86-64-v4")) return 2;
  if (__builtin_cpu_supports("x86-64-v3")) return 1;
#endif
  return 0;
}

int level_of(const std::string& name) {
  if (name == "default") return 0;
  if (name == "avx2") return 1;
  if (name == "avx512") return 2;
  throw std::invalid_argument("unknown CPU capability '" + name + "'; choose default, avx2 or avx512");
}

KernelSet set_for(int level) {
#if defined(FT_X86_CAPS)
  if (level >= 2) return cap_avx512::kernel_set();
  if (level == 1) return cap_avx2::kernel_set();
#endif
  (void)level;
  return cap_default::kernel_set();
}

KernelSet initial() {
  int level = level_supported();
  if (const char* env = std::getenv("FASTTRAIN_CPU_CAPABILITY"); env != nullptr && *env != '\0') {
    level = std::min(level, level_of(env));
  }
  return set_for(level);
}

KernelSet& current() {
  static KernelSet set = initial();
  return set;
}

}  // namespace

const KernelSet& kernels() { return current(); }

std::string set_capability(const std::string& request) {
  if (!request.empty()) {
    const int want = level_of(request);
    if (want > level_supported()) {
      throw std::invalid_argument("this processor does not support the '" + request + "' kernels");
    }
    current() = set_for(want);
  }
  return current().name;
}

}  // namespace fasttrain::cpu
