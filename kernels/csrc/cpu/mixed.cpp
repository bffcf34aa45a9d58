// The mixed-prediction loss on the CPU (contract and equations: kernels/torch_ref_mixed_loss.py; the same
// math as the Triton kernel, kernels/triton_mixed_loss.py). Compiled once per instruction set like
// cpu/kernels.cpp, whose chunk helpers it shares (chunk.h); cpu/mixed_ops.cpp runs the tasks.
//
// One task covers one sample's pixels [p0, p1) over all channels (pixel gate), or a range of the
// sample's elements (a gate per sample, args.h). Per chunk of kChunk consecutive x0 elements it
//   * regenerates eps = Philox(seed, offset + x0 element index) (the stream the noise kernel drew),
//   * per head h: d_h = pred_h - (ce_h*eps + cx_h*x0), e_h = k1_h*d_h + fb_h*x0 (the x0 residual),
//   * E = sum_h pi_h*e_h with pi = softmax over heads of (gate + bias), per pixel or per sample,
//   * writes dL/dpred_h = (pi_h*k1_h)*(s*w*E) + (s*aux_h)*d_h (s = 2*iw_b/(B*D)) in the forward pass,
//   * adds the gate terms (pi_h*(e_h - E))*(s*w*E): per pixel over the channels (pixel gate, written
//     at the end of the task) or into the task's sums (gate per sample),
//   * adds the chunk's sums of E^2, d_h^2, e_h^2 (chunk.h: fixed order) to the task's float64 sums.
// The operations and their order are the reference's (torch_ref_mixed_loss.loss_and_grad), without FMA
// contraction (-ffp-contract=off), so for the same eps and softmax weights the gradient is the
// reference's bit for bit; the softmax's exp (fastmath.h) and the order of the sums are the only
// differences. Every result depends only on the shapes, never on the number of threads.
#include <algorithm>
#include <cstring>
#include <vector>

#include "chunk.h"
#include "kernels.h"
#include "spec_noise.h"

namespace fasttrain::cpu::FT_CAP {
namespace {

constexpr int kRows = 6;  // torch_ref_mixed_loss.NROWS: ce, cx, k1, fb, bias, aux
enum Row { kCe = 0, kCx, kK1, kFb, kBias, kAux };

// pi[h*stride + i] = softmax over h of z[h*stride + i] (in place), for i < n: exp(z - max) / sum,
// as torch.softmax; a masked head (bias -1e9) gets exactly 0, a NaN logit makes the pixel NaN.
void softmax_heads(float* __restrict z, int64_t H, int64_t stride, int n) {
  alignas(64) float m[kChunk];
  alignas(64) float sum[kChunk];
  for (int i = 0; i < n; ++i) m[i] = z[i];
  for (int64_t h = 1; h < H; ++h) {
    const float* zh = z + h * stride;
    for (int i = 0; i < n; ++i) m[i] = zh[i] > m[i] ? zh[i] : m[i];
  }
  for (int i = 0; i < n; ++i) sum[i] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    float* zh = z + h * stride;
    for (int i = 0; i < n; ++i) {
      zh[i] = exp_nonpositive(zh[i] - m[i]);
      sum[i] += zh[i];
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* zh = z + h * stride;
    for (int i = 0; i < n; ++i) zh[i] = zh[i] / sum[i];
  }
}

// The per-task state: the table rows at t_b, the scales, and the buffers (one set per thread range).
struct Task {
  const MixedArgs& a;
  int64_t H, C, P, D, CO;
  bool sample_gate;
  // per head: the rows at t_b and s*aux_h
  std::vector<float> row;  // [kRows][H]
  std::vector<float> sa;   // [H]
  // buffers: d_h and e_h of a chunk, pi_h of a chunk (pie), pi_h and the gate sums per pixel of the
  // task (pixel gate), the chunk's pointers to pi_h
  std::vector<float> d, e, pie, pi, gacc;
  std::vector<const float*> pw;
  int64_t b = 0;
  float sw = 0.0f;  // s*w[t_b]: dL/dE = sw*psi(E)
  float c = 0.0f;   // the loss shape's threshold c(t_b)
  double* acc = nullptr;
  bool with_spec;
  SpecNoise spec;  // the noise options' eps (cpu/spec_noise.h)

  explicit Task(const MixedArgs& args)
      : a(args), H(args.H), C(args.C), P(args.P), D(args.C * args.P), CO(args.H * args.C + (args.gate ? 0 : args.H)),
        sample_gate(mixed_gate_per_sample(args)), row(kRows * args.H), sa(args.H), d(args.H * kChunk),
        e(args.H * kChunk), pie(args.H * kChunk), pw(args.H),
        with_spec(args.eps == nullptr && (args.spec.flags != 0 || args.spec.rows != nullptr)),
        spec(with_spec ? args.spec : NoiseSpecArgs{}, args.seed, args.offset, args.C * args.P) {
    if (!sample_gate) {
      pi.resize(static_cast<size_t>(H * a.block));
      gacc.resize(static_cast<size_t>(H * a.block));
    }
  }

  float& r(int row_id, int64_t h) { return row[row_id * H + h]; }

  void begin(int64_t sample, double* sums) {
    b = sample;
    acc = sums;
    const int64_t tb = a.t[b];
    for (int64_t h = 0; h < H; ++h) {
      for (int k = 0; k < kRows; ++k) r(k, h) = a.tab[(h * kRows + k) * a.T + tb];
    }
    const float s = a.grad_scale * a.iw[b];  // reference: s = (2/(B*D))*iw, then w = weight[t]*s
    sw = a.weight[tb] * s;
    c = a.huber_c != nullptr ? a.huber_c[tb] : 0.0f;
    spec.begin(b);
    for (int64_t h = 0; h < H; ++h) sa[h] = r(kAux, h) * s;
    std::fill(acc, acc + mixed_sums(H), 0.0);
  }

  // pie[h][*] = the sample's softmax weights (gate per sample): logits from `gate` [B, H] or from
  // out's gate channels at the one pixel.
  void sample_weights() {
    alignas(64) float lbuf[kChunk];
    std::vector<float> z(static_cast<size_t>(H));
    for (int64_t h = 0; h < H; ++h) {
      const float* l = a.gate != nullptr ? load(a.gate, a.gate_type, b * H + h, 1, lbuf)
                                         : load(a.out, a.out_type, b * CO + H * C + h, 1, lbuf);
      z[h] = l[0] + r(kBias, h);
    }
    softmax_heads(z.data(), H, 1, 1);
    for (int64_t h = 0; h < H; ++h) std::fill(pie.begin() + h * kChunk, pie.begin() + (h + 1) * kChunk, z[h]);
  }

  // pi[h][q] for the task's pixels p0 + q, q < W (pixel gate).
  void pixel_weights(int64_t p0, int64_t W) {
    alignas(64) float lbuf[kChunk];
    for (int64_t q = 0; q < W; q += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, W - q));
      for (int64_t h = 0; h < H; ++h) {
        const float* l = load(a.out, a.out_type, (b * CO + H * C + h) * P + p0 + q, n, lbuf);
        float* z = pi.data() + h * a.block + q;
        const float bias = r(kBias, h);
        for (int i = 0; i < n; ++i) z[i] = l[i] + bias;
      }
      softmax_heads(pi.data() + q, H, a.block, n);
    }
  }

  // Elements [j, j + n) of the sample (j = c*P + p), with pw[h] pointing at pi_h of element j
  // onwards; each head's gate terms go to gate_sink(h, terms) (see run()).
  template <class GateSink>
  void chunk(int64_t j, int n, GateSink&& gate_sink) {
    alignas(64) float xbuf[kChunk];
    alignas(64) float ebuf[kChunk];
    alignas(64) float pbuf[kChunk];
    alignas(64) float E[kChunk];
    alignas(64) float gE[kChunk];
    alignas(64) float g[kChunk];
    alignas(64) float rbuf[kChunk];
    const int64_t gx = b * D + j;  // x0 element index: the Philox counter (minus offset)
    const float* __restrict x = load(a.x0, a.x0_type, gx, n, xbuf);
    const float* __restrict eps = ebuf;
    if (a.eps != nullptr) {
      eps = load(a.eps, a.eps_type, gx, n, ebuf);
    } else if (with_spec) {
      spec.eps(j, n, ebuf);  // the noise kernel's eps of the options again
    } else {
      normals_chunk(a.seed, a.offset + static_cast<uint64_t>(gx), n, ebuf);  // the noise kernel's eps again
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* __restrict pred = load(a.out, a.out_type, b * CO * P + h * D + j, n, pbuf);
      float* __restrict dh = d.data() + h * kChunk;
      float* __restrict eh = e.data() + h * kChunk;
      const float ce = r(kCe, h), cx = r(kCx, h), k1 = r(kK1, h), fb = r(kFb, h);
      for (int i = 0; i < n; ++i) {
        dh[i] = pred[i] - (ce * eps[i] + cx * x[i]);  // d = heads - (ce*eps + cx*x0)
        eh[i] = k1 * dh[i] + fb * x[i];                // e = k1*d + fb*x0
      }
      const float* __restrict ph = pw[h];
      if (h == 0) {
        for (int i = 0; i < n; ++i) E[i] = ph[i] * eh[i];  // E = sum_h pi_h*e_h, heads in order
      } else {
        for (int i = 0; i < n; ++i) E[i] += ph[i] * eh[i];
      }
    }
    const bool l2 = a.loss_kind == kL2;
    if (l2) {
      acc[0] += sum_squares(E, n);
      for (int i = 0; i < n; ++i) gE[i] = sw * E[i];  // dL/dE
    } else {  // a loss shape: rho(E) in the sums, psi(E) in the gradient (torch_ref_mixed_loss.py)
      std::memcpy(gE, E, sizeof(float) * n);
      rho_psi(a.loss_kind, c, gE, rbuf, n);
      acc[0] += sum_plain(rbuf, n);
      for (int i = 0; i < n; ++i) gE[i] = sw * gE[i];
    }
    for (int64_t h = 0; h < H; ++h) {
      acc[1 + H + h] += sum_squares(e.data() + h * kChunk, n);  // x0_error: always the x0-space MSE
      if (l2) {
        acc[1 + h] += sum_squares(d.data() + h * kChunk, n);
      } else {
        rho_psi(a.loss_kind, c, d.data() + h * kChunk, rbuf, n);  // d_h becomes psi(d_h): only the aux term reads it now
        acc[1 + h] += sum_plain(rbuf, n);
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* __restrict ph = pw[h];
      const float* __restrict dh = d.data() + h * kChunk;
      const float* __restrict eh = e.data() + h * kChunk;
      const float k1 = r(kK1, h), sah = sa[h];
      for (int i = 0; i < n; ++i) g[i] = (ph[i] * k1) * gE[i] + sah * dh[i];  // dL/dpred_h
      store(a.grad, a.out_type, b * CO * P + h * D + j, n, g);
      for (int i = 0; i < n; ++i) g[i] = (ph[i] * (eh[i] - E[i])) * gE[i];  // softmax Jacobian term
      gate_sink(h, g);
    }
  }

  // Elements [j0, j1) of the sample; the pixel gate's task covers pixels [p0, p0 + W).
  void run(int64_t j0, int64_t j1, int64_t p0, int64_t W) {
    for (int64_t j = j0; j < j1; j += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, j1 - j));
      if (sample_gate) {
        for (int64_t h = 0; h < H; ++h) pw[h] = pie.data() + h * kChunk;
        chunk(j, n, [&](int64_t h, float* g) { acc[1 + 2 * H + h] += sum_plain(g, n); });
        continue;
      }
      const int64_t q0 = j % P - p0;  // the chunk's first pixel in the task
      if (q0 + n <= W) {              // within one channel: the task's weights and gate sums in place
        for (int64_t h = 0; h < H; ++h) pw[h] = pi.data() + h * a.block + q0;
        chunk(j, n, [&](int64_t h, const float* g) {
          float* __restrict ga = gacc.data() + h * a.block + q0;
          for (int i = 0; i < n; ++i) ga[i] += g[i];  // per pixel, over the channels in order
        });
      } else {  // crosses a channel boundary (the task holds all P pixels): gather, then scatter back
        for (int64_t h = 0; h < H; ++h) {
          float* __restrict dst = pie.data() + h * kChunk;
          const float* __restrict src = pi.data() + h * a.block;
          for (int i = 0, q = static_cast<int>(q0); i < n; ++i, q = q + 1 == W ? 0 : q + 1) dst[i] = src[q];
          pw[h] = dst;
        }
        chunk(j, n, [&](int64_t h, const float* g) {
          float* __restrict ga = gacc.data() + h * a.block;
          for (int i = 0, q = static_cast<int>(q0); i < n; ++i, q = q + 1 == W ? 0 : q + 1) ga[q] += g[i];
        });
      }
    }
  }
};

void mixed_tasks(const MixedArgs& a, double* partial, int64_t begin, int64_t end) {
  Task task(a);
  const int64_t H = a.H, P = a.P, D = task.D, nacc = mixed_sums(H);
  for (int64_t k = begin; k < end; ++k) {
    const int64_t b = k / a.tasks_per_sample, part = k % a.tasks_per_sample;
    task.begin(b, partial + k * nacc);
    if (task.sample_gate) {
      task.sample_weights();
      const int64_t j0 = part * a.block;
      task.run(j0, std::min(D, j0 + a.block), 0, 0);
      continue;
    }
    const int64_t p0 = part * a.block, W = std::min(P, p0 + a.block) - p0;
    task.pixel_weights(p0, W);
    std::fill(task.gacc.begin(), task.gacc.end(), 0.0f);
    if (W == P) {
      task.run(0, D, 0, P);  // the whole sample: channels back to back, chunks may cross them
    } else {
      for (int64_t c = 0; c < a.C; ++c) task.run(c * P + p0, c * P + p0 + W, p0, W);
    }
    for (int64_t h = 0; h < H; ++h) {  // dL/dgate_h per pixel (torch_ref_mixed_loss: summed over channels)
      store(a.grad, a.out_type, (b * task.CO + H * a.C + h) * P + p0, static_cast<int>(W),
            task.gacc.data() + h * a.block);
    }
  }
}

}  // namespace

MixedTasksFn mixed_tasks_fn() { return &mixed_tasks; }

}  // namespace fasttrain::cpu::FT_CAP
