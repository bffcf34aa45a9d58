// Helpers of the CPU bindings (cpu/ops.cpp, cpu/mixed_ops.cpp): arguments that are read on the host.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "../args.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace fasttrain::cpu {

// t as contiguous int64, checked against the table length (cheap on the CPU: no device sync).
inline at::Tensor checked_t(const at::Tensor& t, int64_t T) {
  at::Tensor t64 = t.to(at::kLong).contiguous();
  const int64_t* p = t64.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < t64.numel(); ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] < T, "fasttrain native ops: timestep ", p[b], " outside [0, ", T, ")");
  }
  return t64;
}

inline uint64_t offset_value(const at::Tensor& offset) {
  TORCH_CHECK(offset.numel() == 1 && offset.scalar_type() == at::kLong,
              "fasttrain native ops: offset must be a 0-d int64 tensor");
  return static_cast<uint64_t>(offset.item<int64_t>());  // a CPU tensor: a plain read
}

// What the CPU kernels read of a noise spec on the host: rows in [0, (K_XI or the range) / D), and not
// with an explicit eps (the Python ops refuse the combination too).
inline void check_spec(const NoiseSpecArgs& s, int64_t B, int64_t D, bool has_eps, bool need_std = true) {
  if (!s.active()) return;
  TORCH_CHECK(!has_eps, "fasttrain native ops: give either eps or a noise spec, not both");
  TORCH_CHECK(!need_std || !(s.flags & kSpecPyramid) || s.std != nullptr,
              "fasttrain native ops: pyramid noise needs its std (noise_std)");
  if (s.rows != nullptr && D > 0) {
    const int64_t R = static_cast<int64_t>(s.k_xi) / D;  // the base range holds R rows of D counters
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(s.rows[b] >= 0 && s.rows[b] < R, "fasttrain native ops: noise row ", s.rows[b], " outside [0, ", R,
                  ")");
    }
  }
}

// The per-timestep bins of V values (kernels/bins.py): data float64 [1 + 2V, T], pivots [V, T].
inline void check_bins(const at::Tensor& bins, const at::Tensor& pivots, int64_t V, int64_t T) {
  TORCH_CHECK(bins.scalar_type() == at::kDouble && bins.dim() == 2 && bins.size(0) == 1 + 2 * V && bins.size(1) == T,
              "fasttrain native ops: bins must be float64 [", 1 + 2 * V, ", ", T, "] (kernels/bins.py, ", V,
              " values)");
  TORCH_CHECK(pivots.scalar_type() == at::kDouble && pivots.dim() == 2 && pivots.size(0) == V && pivots.size(1) == T,
              "fasttrain native ops: pivots must be float64 [", V, ", ", T, "]");
}

// bins.py's layout: per sample b, count, then per value v: sum (x_v - c_v[t]), sum (x_v - c_v[t])^2,
// with x_v = value(v, b). Serial, in sample order; a sample with any non-finite value is left out
// (a bad step must not poison the statistics).
template <class Value>
void scatter_bins(at::Tensor& bins, const at::Tensor& pivots, const int64_t* t, int64_t B, int64_t V, Value&& value) {
  const at::Tensor piv = pivots.contiguous();
  const double* c = piv.const_data_ptr<double>();
  const int64_t T = piv.size(1);
  auto d = bins.accessor<double, 2>();
  std::vector<float> v(static_cast<size_t>(V));
  for (int64_t b = 0; b < B; ++b) {
    bool finite = true;
    for (int64_t j = 0; j < V; ++j) {
      v[j] = value(j, b);
      finite = finite && std::isfinite(v[j]);
    }
    if (!finite) continue;
    const int64_t tb = t[b];
    d[0][tb] += 1.0;
    for (int64_t j = 0; j < V; ++j) {
      const double x = static_cast<double>(v[j]) - c[j * T + tb];
      d[1 + 2 * j][tb] += x;
      d[2 + 2 * j][tb] += x * x;
    }
  }
}

}  // namespace fasttrain::cpu
