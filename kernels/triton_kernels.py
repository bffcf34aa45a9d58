"""Fused Triton kernels for one training step's diffusion math (docs/architecture.md, "One step").

Kernel A  `noise_kernel`: x_t = alpha[t_b]·x0 + sigma[t_b]·eps, eps ~ N(0, 1) from Philox keyed on
          (seed, offset + global element index); the offset is read from a device scalar, so a
          captured CUDA graph draws new noise on every replay (`philox.py` is the same stream in PyTorch): never
          written to memory (optional output for tests), identical for any block size or grid.
Kernel B  `loss_kernel`: regenerates the same eps, forms the target coef[0, t]·eps + coef[1, t]·x0
          (every linear prediction type is two [T] tables), d = pred - target, writes
          dL/dpred = 2·w[t_b]·iw_b·d/(B·D) (the gradient of the batch mean of ℓ_b = w[t_b]·iw_b·mean(d²))
          in the forward pass, reduces Σd² per sample in fp32, and the program that finishes a sample
          scatters its raw and weighted loss into the per-timestep bins (layout: bins.py).

Kernel B's accumulators (Σd² per sample and the batch sum, tile counters) live in a workspace that
the kernel itself leaves zeroed: the program that finishes a sample resets that sample's slots, the
program that finishes the batch resets the batch slots. So no memset launch and no call-order
protocol: the forward math is two launches.

Byte floor (A reads x0, writes x_t; B reads pred and x0, writes the gradient; eps costs nothing).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def noise_kernel(x0_ptr, t_ptr, alpha_ptr, sigma_ptr, eps_ptr, xt_ptr, eps_out_ptr, D, seed, offset_ptr,
                 HAS_EPS: tl.constexpr, WRITE_EPS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    mask = idx < D
    gidx = b.to(tl.int64) * D + idx  # global element index: the Philox counter
    tb = tl.load(t_ptr + b)
    a = tl.load(alpha_ptr + tb)
    s = tl.load(sigma_ptr + tb)
    x0 = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    if HAS_EPS:
        eps = tl.load(eps_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    else:
        eps = tl.randn(seed, tl.load(offset_ptr) + gidx)
    tl.store(xt_ptr + gidx, (a * x0 + s * eps).to(xt_ptr.dtype.element_ty), mask=mask)
    if WRITE_EPS:
        tl.store(eps_out_ptr + gidx, eps, mask=mask)


@triton.jit
def scatter_value(bins_ptr, pivot_ptr, v, row, tb, T, mask):
    """Add one value (row `row` of V) of one sample at timestep tb: Σ(x - c) and Σ(x - c)² (bins.py)."""
    d = v.to(tl.float64) - tl.load(pivot_ptr + row * T + tb, mask=mask, other=0.0)
    tl.atomic_add(bins_ptr + (1 + 2 * row) * T + tb, d, mask=mask)
    tl.atomic_add(bins_ptr + (2 + 2 * row) * T + tb, d * d, mask=mask)


@triton.jit
def loss_kernel(pred_ptr, x0_ptr, eps_ptr, t_ptr, w_ptr, iw_ptr, coef_ptr, pivot_ptr, bins_ptr,
                grad_ptr, acc_ptr, cnt_ptr, raw_ptr, wl_ptr, ps_ptr, loss_ptr,
                D, B, T, NCH, seed, offset_ptr, grad_scale,
                NEEDS_EPS: tl.constexpr, NEEDS_X0: tl.constexpr, HAS_EPS: tl.constexpr, BINS: tl.constexpr,
                BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    mask = idx < D
    gidx = b.to(tl.int64) * D + idx
    tb = tl.load(t_ptr + b)
    wb = tl.load(w_ptr + tb)
    ib = tl.load(iw_ptr + b)
    pred = tl.load(pred_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    target = tl.zeros([BLOCK], dtype=tl.float32)
    if NEEDS_EPS:
        if HAS_EPS:
            eps = tl.load(eps_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
        else:
            eps = tl.randn(seed, tl.load(offset_ptr) + gidx)  # the same eps kernel A used
        target += tl.load(coef_ptr + tb) * eps
    if NEEDS_X0:
        x0 = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
        target += tl.load(coef_ptr + T + tb) * x0
    d = tl.where(mask, pred - target, 0.0)
    # dL/dpred of L = mean_b ℓ_b, written now: the loss is the last op, backward only rescales it.
    tl.store(grad_ptr + gidx, (d * (grad_scale * wb * ib)).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(acc_ptr + b, tl.sum(d * d, axis=0))
    # The program that finishes a sample (acq_rel atomics order its partial sum before the count)
    # reads the total, writes the per-sample outputs and the bins, and resets the sample's slots.
    last = tl.atomic_add(cnt_ptr + b, 1) == NCH - 1
    raw = tl.atomic_add(acc_ptr + b, 0.0, mask=last) / D
    tl.store(acc_ptr + b, 0.0, mask=last)
    tl.store(cnt_ptr + b, 0, mask=last)
    wl = wb * raw
    tl.store(raw_ptr + b, raw, mask=last)
    tl.store(wl_ptr + b, wl, mask=last)
    tl.store(ps_ptr + b, wl * ib, mask=last)
    tl.atomic_add(acc_ptr + B, wl * ib / B, mask=last)
    if BINS:
        ok = last & (raw - raw == 0.0) & (wl - wl == 0.0)  # finite: x - x is NaN for inf and NaN
        tl.atomic_add(bins_ptr + tb, raw.to(tl.float64) * 0.0 + 1.0, mask=ok)
        scatter_value(bins_ptr, pivot_ptr, raw, 0, tb, T, ok)
        scatter_value(bins_ptr, pivot_ptr, wl, 1, tb, T, ok)
    # The last sample to finish publishes the batch mean and resets the batch slots.
    final = last & (tl.atomic_add(cnt_ptr + B, 1, mask=last) == B - 1)
    tl.store(loss_ptr, tl.atomic_add(acc_ptr + B, 0.0, mask=final), mask=final)
    tl.store(acc_ptr + B, 0.0, mask=final)
    tl.store(cnt_ptr + B, 0, mask=final)
