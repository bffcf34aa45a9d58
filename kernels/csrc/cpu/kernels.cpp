// The noise kernel and the loss kernel on the CPU: loops over float32 buffers of kChunk elements, which
// gcc vectorises (the branch-free log/cos of fastmath.h, the dtype casts of convert.h), with Philox in SIMD
// intrinsics (philox_simd.h). Compiled once per instruction set, each copy in its own namespace
// FT_CAP (CMakeLists.txt); cpu/capability.cpp picks one at run time.
//
// The arithmetic is the reference's, operation for operation and without contraction into FMAs
// (-ffp-contract=off), so x_t and the gradient equal kernels/torch_ref.py bit for bit for the same
// eps; only the order of the d^2 sum differs (per chunk in float32 lanes, per tile in float64).
#include <algorithm>
#include <cstring>

#include "chunk.h"
#include "kernels.h"
#include "spec_noise.h"

namespace fasttrain::cpu::FT_CAP {
namespace {

void words(uint64_t seed, uint64_t base, int64_t n, uint32_t* w0, uint32_t* w1) {
  for (int64_t s = 0; s < n; s += kChunk) {
    words_run(seed, base + static_cast<uint64_t>(s), static_cast<int>(std::min<int64_t>(kChunk, n - s)), w0 + s,
              w1 + s);
  }
}

struct TileRange {
  int64_t b, start, end;
};

TileRange tile_range(int64_t k, int64_t D, int64_t tile) {
  const int64_t per_sample = (D + tile - 1) / tile;
  const int64_t b = k / per_sample, start = (k % per_sample) * tile;
  return {b, start, std::min(D, start + tile)};
}

// The noise kernel with noise options (cpu/spec_noise.h): eps of the options, x_t from eps + gamma*u*xi.
void noise_tiles_spec(const NoiseArgs& a, int64_t begin, int64_t end, int64_t tile) {
  alignas(64) float xbuf[kChunk];
  alignas(64) float ebuf[kChunk];
  alignas(64) float pbuf[kChunk];
  alignas(64) float y[kChunk];
  SpecNoise spec(a.spec, a.seed, a.offset, a.D);
  const bool perturb = (a.spec.flags & kSpecPerturb) != 0;
  for (int64_t k = begin; k < end; ++k) {
    const TileRange r = tile_range(k, a.D, tile);
    const int64_t tb = a.t[r.b];
    const float al = a.alpha[tb], sg = a.sigma[tb];
    spec.begin(r.b);
    for (int64_t s = r.start; s < r.end; s += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, r.end - s));
      const int64_t g = r.b * a.D + s;
      const float* __restrict x = load(a.x0, a.x0_type, g, n, xbuf);
      spec.eps(s, n, ebuf);
      const float* __restrict e = ebuf;
      if (perturb) {
        spec.perturbation(s, n, pbuf);
        for (int i = 0; i < n; ++i) pbuf[i] = ebuf[i] + pbuf[i];  // eps + gamma*u*xi
        e = pbuf;
      }
      float* __restrict out = a.xt_type == DType::kFloat32 ? static_cast<float*>(a.xt) + g : y;
      for (int i = 0; i < n; ++i) out[i] = al * x[i] + sg * e[i];  // reference.noise
      if (out == y) store(a.xt, a.xt_type, g, n, y);
      if (a.eps_out != nullptr) std::memcpy(a.eps_out + g, ebuf, sizeof(float) * n);
    }
  }
}

void noise_tiles(const NoiseArgs& a, int64_t begin, int64_t end, int64_t tile) {
  if (a.eps == nullptr && (a.spec.flags != 0 || a.spec.rows != nullptr)) {
    noise_tiles_spec(a, begin, end, tile);
    return;
  }
  alignas(64) float xbuf[kChunk];
  alignas(64) float ebuf[kChunk];
  alignas(64) float y[kChunk];
  for (int64_t k = begin; k < end; ++k) {
    const TileRange r = tile_range(k, a.D, tile);
    const int64_t tb = a.t[r.b];
    const float al = a.alpha[tb], sg = a.sigma[tb];
    for (int64_t s = r.start; s < r.end; s += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, r.end - s));
      const int64_t g = r.b * a.D + s;  // global element index: the Philox counter (minus offset)
      const float* __restrict x = load(a.x0, a.x0_type, g, n, xbuf);
      const float* __restrict e = ebuf;
      if (a.eps != nullptr) {
        e = load(a.eps, a.eps_type, g, n, ebuf);
      } else {
        normals_chunk(a.seed, a.offset + static_cast<uint64_t>(g), n, ebuf);
      }
      float* __restrict out = a.xt_type == DType::kFloat32 ? static_cast<float*>(a.xt) + g : y;
      for (int i = 0; i < n; ++i) out[i] = al * x[i] + sg * e[i];  // reference.noise
      if (out == y) store(a.xt, a.xt_type, g, n, y);
      if (a.eps_out != nullptr) std::memcpy(a.eps_out + g, e, sizeof(float) * n);
    }
  }
}

// Sigma eps and Sigma eps^2 (float64) of the pyramid noise before its std division, per tile (noise_std).
void moments_tiles(const NoiseArgs& a, double* partial, int64_t begin, int64_t end, int64_t tile) {
  alignas(64) float ebuf[kChunk];
  SpecNoise spec(a.spec, a.seed, a.offset, a.D);
  for (int64_t k = begin; k < end; ++k) {
    const TileRange r = tile_range(k, a.D, tile);
    spec.begin(r.b);
    double s1 = 0.0, s2 = 0.0;
    for (int64_t s = r.start; s < r.end; s += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, r.end - s));
      spec.eps(s, n, ebuf, /*norm=*/false);
      s2 += sum_squares(ebuf, n);
      s1 += sum_plain(ebuf, n);
    }
    partial[2 * k] = s1;
    partial[2 * k + 1] = s2;
  }
}

// The per-pixel weight of elements [s, s + n) of sample b as float32 (args.h: LossArgs::mask).
// Runs of consecutive pixels: the range wraps around the period (a channel's pixels) where it crosses one.
void mask_chunk(const LossArgs& a, int64_t b, int64_t s, int n, float* __restrict out) {
  const int64_t P = a.mask_period;
  int64_t j = s % P;
  for (int i = 0; i < n;) {
    const int len = static_cast<int>(std::min<int64_t>(n - i, P - j));
    const float* m = load(a.mask, a.mask_type, b * P + j, len, out + i);
    if (m != out + i) std::memcpy(out + i, m, sizeof(float) * len);
    i += len;
    j = 0;
  }
}

void loss_tiles(const LossArgs& a, double* partial, int64_t begin, int64_t end, int64_t tile) {
  alignas(64) float pbuf[kChunk];
  alignas(64) float ebuf[kChunk];
  alignas(64) float xbuf[kChunk];
  alignas(64) float p[kChunk];  // d = pred - target, then the gradient
  alignas(64) float rbuf[kChunk];  // rho(d) of a loss shape
  alignas(64) float mbuf[kChunk];  // the per-pixel weight
  const bool with_spec = a.eps == nullptr && (a.spec.flags != 0 || a.spec.rows != nullptr);
  SpecNoise spec(with_spec ? a.spec : NoiseSpecArgs{}, a.seed, a.offset, a.D);
  for (int64_t k = begin; k < end; ++k) {
    const TileRange r = tile_range(k, a.D, tile);
    const int64_t tb = a.t[r.b];
    const float ce = a.coef[tb], cx = a.coef[a.T + tb];
    const float scale = a.grad_scale * (a.weight[tb] * a.iw[r.b]);  // reference.loss_and_grad
    const float c = a.huber_c != nullptr ? a.huber_c[tb] : 0.0f;
    spec.begin(r.b);
    double total = 0.0;
    for (int64_t s = r.start; s < r.end; s += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, r.end - s));
      const int64_t g = r.b * a.D + s;
      const float* __restrict pv = load(a.pred, a.pred_type, g, n, pbuf);
      const float* __restrict e = ebuf;
      const float* __restrict x = xbuf;
      if (a.needs_eps) {
        if (a.eps != nullptr) {
          e = load(a.eps, a.eps_type, g, n, ebuf);
        } else if (with_spec) {
          spec.eps(s, n, ebuf);  // the noise kernel's eps of the options again
        } else {
          normals_chunk(a.seed, a.offset + static_cast<uint64_t>(g), n, ebuf);  // the noise kernel's eps again
        }
      }
      if (a.needs_x0) x = load(a.x0, a.x0_type, g, n, xbuf);
      // d = pred - target, target = ce*eps + cx*x0 (reference.target; a term the prediction type
      // does not use is skipped, as its coefficient is 0)
      if (a.needs_eps && a.needs_x0) {
        for (int i = 0; i < n; ++i) p[i] = pv[i] - (ce * e[i] + cx * x[i]);
      } else if (a.needs_eps) {
        for (int i = 0; i < n; ++i) p[i] = pv[i] - ce * e[i];
      } else if (a.needs_x0) {
        for (int i = 0; i < n; ++i) p[i] = pv[i] - cx * x[i];
      } else {
        std::memcpy(p, pv, sizeof(float) * n);
      }
      if (a.mask != nullptr) {  // rho(d)*m and psi(d)*m, in the reference's order (torch_ref_diffusion_loss.masked)
        mask_chunk(a, r.b, s, n, mbuf);
        if (a.loss_kind == kL2) {
          for (int i = 0; i < n; ++i) rbuf[i] = (p[i] * p[i]) * mbuf[i];
        } else {
          rho_psi(a.loss_kind, c, p, rbuf, n);
          for (int i = 0; i < n; ++i) rbuf[i] = rbuf[i] * mbuf[i];
        }
        for (int i = 0; i < n; ++i) p[i] = p[i] * mbuf[i];
        total += sum_plain(rbuf, n);
      } else if (a.loss_kind == kL2) {
        total += sum_squares(p, n);
      } else {
        rho_psi(a.loss_kind, c, p, rbuf, n);  // rbuf = rho(d), p = psi(d)
        total += sum_plain(rbuf, n);
      }
      for (int i = 0; i < n; ++i) p[i] = p[i] * scale;  // dL/dpred, written in the forward pass
      store(a.grad, a.pred_type, g, n, p);
    }
    partial[k] = total;
  }
}

}  // namespace

MixedTasksFn mixed_tasks_fn();  // cpu/mixed.cpp, the same instruction set

KernelSet kernel_set() { return {FT_CAP_NAME, &noise_tiles, &loss_tiles, mixed_tasks_fn(), &words, &moments_tiles}; }

}  // namespace fasttrain::cpu::FT_CAP
