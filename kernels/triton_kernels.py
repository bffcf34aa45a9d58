"""Fused Triton kernels for one training step's diffusion math (DESIGN.md, "One training step").

Kernel A  `noise_kernel`:  x_t = alpha[t_b]·x0 + sigma[t_b]·eps, eps ~ N(0, 1) from Philox keyed on
          (seed, offset + global element index): never written to memory (optional output for
          tests), identical for any block size or grid. Also zeroes kernel B's workspace, so the
          step needs no separate memset.
Kernel B  `loss_kernel`: regenerates the same eps, forms the target of the prediction type,
          d = pred - target, writes dL/dpred = 2·w[t_b]·iw_b·d/(B·D) (the gradient of the batch mean
          of ℓ_b = w[t_b]·iw_b·mean(d²)) in the forward pass, reduces Σd² per sample, and the last
          program of each sample scatters its raw and weighted losses into the per-timestep bins.
`scatter_kernel`: the bin scatter alone, for callers with their own losses.

Byte floor (performance notes §1.5): A reads x0 and writes x_t; B reads pred and x0 and writes the
gradient; eps costs nothing. Bins are shifted by a per-timestep pivot (TimestepStats.pivots) and kept
in fp64. Prediction codes: 0 eps, 1 x0, 2 v (a·eps - s·x0), 3 flow (eps - x0).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def noise_kernel(x0_ptr, t_ptr, alpha_ptr, sigma_ptr, eps_ptr, xt_ptr, eps_out_ptr, acc_ptr, cnt_ptr,
                 D, B, seed, offset,
                 HAS_EPS: tl.constexpr, WRITE_EPS: tl.constexpr, ZERO_WS: tl.constexpr, BLOCK: tl.constexpr):
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
        eps = tl.randn(seed, offset + gidx)
    tl.store(xt_ptr + gidx, (a * x0 + s * eps).to(xt_ptr.dtype.element_ty), mask=mask)
    if WRITE_EPS:
        tl.store(eps_out_ptr + gidx, eps, mask=mask)
    if ZERO_WS:
        if c == 0:
            tl.store(acc_ptr + b, 0.0)
            tl.store(cnt_ptr + b, 0)
            if b == 0:
                tl.store(acc_ptr + B, 0.0)
                tl.store(cnt_ptr + B, 0)


@triton.jit
def _scatter_one(bins_ptr, pivot_ptr, tb, raw, wl, T, mask):
    """Add one sample's (raw, weighted) loss to the fp64 bins of timestep tb, shifted by the pivots."""
    r = raw.to(tl.float64) - tl.load(pivot_ptr + tb, mask=mask, other=0.0)
    q = wl.to(tl.float64) - tl.load(pivot_ptr + T + tb, mask=mask, other=0.0)
    tl.atomic_add(bins_ptr + tb, r * 0.0 + 1.0, mask=mask)
    tl.atomic_add(bins_ptr + T + tb, r, mask=mask)
    tl.atomic_add(bins_ptr + 2 * T + tb, r * r, mask=mask)
    tl.atomic_add(bins_ptr + 3 * T + tb, q, mask=mask)
    tl.atomic_add(bins_ptr + 4 * T + tb, q * q, mask=mask)


@triton.jit
def loss_kernel(pred_ptr, x0_ptr, eps_ptr, t_ptr, alpha_ptr, sigma_ptr, w_ptr, iw_ptr, pivot_ptr,
                grad_ptr, acc_ptr, cnt_ptr, raw_ptr, wl_ptr, ps_ptr, loss_ptr, bins_ptr,
                D, B, T, NCH, seed, offset, grad_scale,
                PRED: tl.constexpr, HAS_EPS: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    mask = idx < D
    gidx = b.to(tl.int64) * D + idx
    tb = tl.load(t_ptr + b)
    a = tl.load(alpha_ptr + tb)
    s = tl.load(sigma_ptr + tb)
    wb = tl.load(w_ptr + tb)
    ib = tl.load(iw_ptr + b)
    pred = tl.load(pred_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    if PRED == 1:
        target = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    else:
        if HAS_EPS:
            eps = tl.load(eps_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
        else:
            eps = tl.randn(seed, offset + gidx)  # the same eps kernel A used
        if PRED == 0:
            target = eps
        else:
            x0 = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
            if PRED == 2:
                target = a * eps - s * x0
            else:
                target = eps - x0
    d = tl.where(mask, pred - target, 0.0)
    # dL/dpred of L = mean_b ℓ_b, written now: the loss is the last op, backward only rescales it.
    tl.store(grad_ptr + gidx, (d * (grad_scale * wb * ib)).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(acc_ptr + b, tl.sum(d * d, axis=0))
    # The program that finishes a sample (acq_rel atomics order its partial sum before the count)
    # reads the total and writes the per-sample outputs and the bins.
    last = tl.atomic_add(cnt_ptr + b, 1) == NCH - 1
    raw = tl.atomic_add(acc_ptr + b, 0.0, mask=last) / D
    wl = wb * raw
    tl.store(raw_ptr + b, raw, mask=last)
    tl.store(wl_ptr + b, wl, mask=last)
    tl.store(ps_ptr + b, wl * ib, mask=last)
    tl.atomic_add(acc_ptr + B, wl * ib / B, mask=last)
    if BINS:
        _scatter_one(bins_ptr, pivot_ptr, tb, raw, wl, T, last)
    # The last sample to finish publishes the batch mean (no memset, no extra launch for the output).
    final = last & (tl.atomic_add(cnt_ptr + B, 1, mask=last) == B - 1)
    tl.store(loss_ptr, tl.atomic_add(acc_ptr + B, 0.0, mask=final), mask=final)


@triton.jit
def scatter_kernel(t_ptr, raw_ptr, w_ptr, pivot_ptr, bins_ptr, B, T, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < B
    tb = tl.load(t_ptr + i, mask=mask, other=0)
    raw = tl.load(raw_ptr + i, mask=mask, other=0.0).to(tl.float64)
    wl = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float64)
    _scatter_one(bins_ptr, pivot_ptr, tb, raw, wl, T, mask)
