// The noise options on the CPU (formulas and counter layout: kernels/noise_spec.py; the Triton version:
// kernels/triton_noise_spec.py): the eps that the noise kernel, the loss kernel and the mixed loss
// regenerate, the perturbation the noise kernel adds, and the pre-division noise of the pyramid's std.
// Included by the per-instruction-set kernel sources (cpu/kernels.cpp, cpu/mixed.cpp) after chunk.h.
//
// The per-batch draws (random strengths, the pyramid's r_l and level sizes) are made once per
// object (one per thread range). A pyramid level is the bilinear upsampling of a small normal field:
// the field of the current plane (sample and channel) is drawn once into a buffer (contiguous counters:
// the SIMD Philox) and interpolated from there with per-axis index/weight tables, in torch's arithmetic
// (UpSampleKernel.cpp, align_corners=False); level 0 (full size) is a contiguous run of the stream.
// The additions happen in the reference's order (base, offset, levels 0, 1, ...) and without FMA
// contraction (CMakeLists.txt).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "chunk.h"

namespace fasttrain::cpu::FT_CAP {

inline float uniform_at(uint64_t seed, uint64_t ctr) {  // tl.rand
  uint32_t w0, w1;
  philox_w01(static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32), static_cast<uint32_t>(seed),
             static_cast<uint32_t>(seed >> 32), w0, w1);
  return uniform01(w0);
}

inline float normal_at(uint64_t seed, uint64_t ctr) {  // tl.randn
  uint32_t w0, w1;
  philox_w01(static_cast<uint32_t>(ctr), static_cast<uint32_t>(ctr >> 32), static_cast<uint32_t>(seed),
             static_cast<uint32_t>(seed >> 32), w0, w1);
  return normal_from_words(w0, w1);
}

// normals for counters base .. base + n - 1, any n
inline void normals_run(uint64_t seed, uint64_t base, int64_t n, float* out) {
  for (int64_t s = 0; s < n; s += kChunk) {
    normals_chunk(seed, base + static_cast<uint64_t>(s), static_cast<int>(std::min<int64_t>(kChunk, n - s)), out + s);
  }
}

class SpecNoise {
 public:
  SpecNoise(const NoiseSpecArgs& s, uint64_t seed, uint64_t offset, int64_t D)
      : s_(s), seed_(seed), offset_(offset), D_(D), HW_(D / std::max<int64_t>(1, s.C)) {
    if (s.flags & (kSpecOffsetRandom | kSpecPerturbRandom | kSpecPyramid)) {
      u_off_ = (s.flags & kSpecOffsetRandom) ? uniform_at(seed, offset + s.k_s) : 1.0f;
      u_ip_ = (s.flags & kSpecPerturbRandom) ? uniform_at(seed, offset + s.k_s + 1) : 1.0f;
    }
    if (s.flags & kSpecPyramid) {
      for (int l = 0; l < s.levels; ++l) {
        const double r = 2.0 + 2.0 * static_cast<double>(uniform_at(seed, offset + s.k_s + 2 + l));
        double p = 1.0;
        for (int k = 0; k < l; ++k) p *= r;  // r^l by l-fold multiplication, as every backend
        Level lv;
        lv.h = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(s.H) / p));
        lv.w = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(s.W) / p));
        lv.weight = s.table[3 + l];
        lv.base = offset + s.k_l + static_cast<uint64_t>(l) * s.n;
        lv.identity = lv.h == s.H && lv.w == s.W;
        axis(lv.h, s.H, lv.y0, lv.y1, lv.ly);
        axis(lv.w, s.W, lv.x0, lv.x1, lv.lx);
        levels_.push_back(std::move(lv));
        if (levels_.back().h == 1 || levels_.back().w == 1) break;  // sd-scripts: after a side of 1
      }
      std_ = s.std;
    }
    grid_.resize(levels_.size());
    full_.resize(levels_.size());
    for (size_t l = 0; l < levels_.size(); ++l) {
      if (levels_[l].identity) full_[l].resize(kChunk);
    }
  }

  // The sample whose elements the next calls ask for.
  void begin(int64_t b) {
    b_ = b;
    plane_ = -1;
  }

  // eps of elements [j0, j0 + n) of the sample, n <= kChunk (`norm`: divided by the pyramid's std).
  void eps(int64_t j0, int n, float* __restrict out, bool norm = true) {
    const int64_t row = s_.rows != nullptr ? s_.rows[b_] : b_;
    normals_chunk(seed_, offset_ + static_cast<uint64_t>(row * D_ + j0), n, out);
    if (!(s_.flags & (kSpecOffset | kSpecPyramid))) return;
    for (size_t l = 0; l < levels_.size(); ++l) {
      if (!levels_[l].identity) continue;  // full size: a contiguous run of the stream
      normals_chunk(seed_, levels_[l].base + static_cast<uint64_t>(b_ * D_ + j0), n, full_[l].data());
    }
    for (int i = 0; i < n;) {  // runs of one plane (channel)
      const int64_t j = j0 + i, c = j / HW_;
      const int m = static_cast<int>(std::min<int64_t>(n - i, (c + 1) * HW_ - j));
      set_plane(b_ * s_.C + c);
      float* __restrict o = out + i;
      if (s_.flags & kSpecOffset) {
        for (int k = 0; k < m; ++k) o[k] = o[k] + shift_;
      }
      for (size_t l = 0; l < levels_.size(); ++l) {
        const Level& lv = levels_[l];
        if (lv.identity) {
          const float* __restrict zl = full_[l].data() + i;
          for (int k = 0; k < m; ++k) o[k] = o[k] + zl[k] * lv.weight;
          continue;
        }
        const float* __restrict g = grid_[l].data();
        for (int k = 0; k < m; ++k) {
          const int64_t pix = (j + k) % HW_, y = pix / s_.W, x = pix % s_.W;
          const float* r0 = g + lv.y0[y] * lv.w;
          const float* r1 = g + lv.y1[y] * lv.w;
          const float lx1 = lv.lx[x], lx0 = 1.0f - lx1, ly1 = lv.ly[y], ly0 = 1.0f - ly1;
          const float t0 = r0[lv.x0[x]] * lx0 + r0[lv.x1[x]] * lx1;
          const float t1 = r1[lv.x0[x]] * lx0 + r1[lv.x1[x]] * lx1;
          o[k] = o[k] + (t0 * ly0 + t1 * ly1) * lv.weight;
        }
      }
      i += m;
    }
    if (norm && (s_.flags & kSpecPyramid)) {
      const float sd = *std_;
      for (int i = 0; i < n; ++i) out[i] = out[i] / sd;
    }
  }

  // gamma*u*xi of elements [j0, j0 + n) of the sample: added to eps for x_t only.
  void perturbation(int64_t j0, int n, float* __restrict out) const {
    normals_chunk(seed_, offset_ + s_.k_xi + static_cast<uint64_t>(b_ * D_ + j0), n, out);
    const float g = s_.table[2] * u_ip_;
    for (int i = 0; i < n; ++i) out[i] = g * out[i];
  }

 private:
  struct Level {
    int64_t h = 1, w = 1;
    float weight = 0.0f;
    uint64_t base = 0;
    bool identity = false;
    std::vector<int64_t> y0, y1, x0, x1;
    std::vector<float> ly, lx;
  };

  // torch's bilinear source indices along one axis (compute_source_index_and_lambda, align_corners=False).
  static void axis(int64_t in, int64_t out, std::vector<int64_t>& i0, std::vector<int64_t>& i1,
                   std::vector<float>& lam) {
    i0.resize(out);
    i1.resize(out);
    lam.resize(out);
    const float scale = static_cast<float>(in) / static_cast<float>(out);
    for (int64_t o = 0; o < out; ++o) {
      if (in == out) {
        i0[o] = i1[o] = o;
        lam[o] = 0.0f;
        continue;
      }
      float src = scale * (static_cast<float>(o) + 0.5f) - 0.5f;
      src = src < 0.0f ? 0.0f : src;
      const int64_t a = std::min<int64_t>(static_cast<int64_t>(std::floor(src)), in - 1);
      i0[o] = a;
      i1[o] = a + (a < in - 1 ? 1 : 0);
      lam[o] = std::min(std::max(src - static_cast<float>(a), 0.0f), 1.0f);
    }
  }

  // The offset shift and the level fields of plane p = b*C + c.
  void set_plane(int64_t p) {
    if (p == plane_) return;
    plane_ = p;
    if (s_.flags & kSpecOffset) {
      float sc = s_.table[0] * u_off_;
      if (s_.flags & kSpecAdaptive) sc = std::max(sc + s_.table[1] * s_.mean[p], 0.0f);
      shift_ = sc * normal_at(seed_, offset_ + s_.k_n + static_cast<uint64_t>(p));
    }
    for (size_t l = 0; l < levels_.size(); ++l) {
      const Level& lv = levels_[l];
      if (lv.identity) continue;
      grid_[l].resize(static_cast<size_t>(lv.h * lv.w));
      normals_run(seed_, lv.base + static_cast<uint64_t>(p * lv.h * lv.w), lv.h * lv.w, grid_[l].data());
    }
  }

  NoiseSpecArgs s_;
  uint64_t seed_, offset_;
  int64_t D_, HW_;
  float u_off_ = 1.0f, u_ip_ = 1.0f;
  std::vector<Level> levels_;
  const float* std_ = nullptr;
  int64_t b_ = 0, plane_ = -1;
  float shift_ = 0.0f;
  std::vector<std::vector<float>> grid_, full_;
};

}  // namespace fasttrain::cpu::FT_CAP
