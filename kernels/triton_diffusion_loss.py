"""The loss kernel in Triton: loss, gradient and statistics of one step's prediction (the op:
diffusion_loss.py; the contract: torch_ref_diffusion_loss.py).

`loss_kernel` regenerates the eps the noise kernel drew (triton_noise.py), forms the target
coef[0, t]·eps + coef[1, t]·x0 (every linear prediction type is two [T] tables), d = pred - target,
writes dL/dpred = 2·w[t_b]·iw_b·d/(B·D) (the gradient of the batch mean of ℓ_b = w[t_b]·iw_b·mean(d²))
in the forward pass, reduces Σd² per sample in fp32, and the program that finishes a sample scatters
its raw and weighted loss into the per-timestep bins (layout: bins.py).

Its accumulators (Σd² per sample and the batch sum, tile counters) live in a workspace
(backend.workspace) that the kernel itself leaves zeroed: the program that finishes a sample resets
that sample's slots, the program that finishes the batch resets the batch slots. So no memset launch
and no call-order protocol: the forward math of a step is two launches (noise, loss).

With noise options (SPEC != 0; noise_spec.py) eps is the options' ε (triton_noise_spec.spec_eps, the
same the noise kernel drew); with a loss shape (LOSS != 0; loss_shape.py) d² becomes ρ(d) and the
gradient's d becomes ψ(d), with the threshold c[t_b] read from a [T] table. LOSS = SPEC = 0 is the
plain kernel, unchanged.

Byte floor: read pred and x0, write the gradient (eps costs nothing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_shared as shared
from .backend import workspace
from .loss_shape import LOSSES
from .noise_spec import PYRAMID
from .triton_noise_spec import launch_args, spec_eps
from .triton_shared import block_size, div_of, rho_psi, scatter_value


# Only D is value-specialised (its alignment decides the vector width); B, T, NCH and the seed are not,
# so a batch of 1 or a seed of 1 compiles no kernel of its own.
@triton.jit(do_not_specialize=["B", "T", "NCH", "seed"])
def loss_kernel(pred_ptr, x0_ptr, eps_ptr, t_ptr, w_ptr, iw_ptr, coef_ptr, pivot_ptr, bins_ptr,
                grad_ptr, acc_ptr, cnt_ptr, raw_ptr, wl_ptr, ps_ptr, loss_ptr,
                D, B, T, NCH, seed, offset_ptr, grad_scale,
                rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L, K_XI, K_N, K_S, K_L, N, c_ptr,
                NEEDS_EPS: tl.constexpr, NEEDS_X0: tl.constexpr, HAS_EPS: tl.constexpr, BINS: tl.constexpr,
                 SPEC: tl.constexpr, LOSS: tl.constexpr, BLOCK: tl.constexpr, DIV: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    D = D // DIV * DIV  # == D: DIV-wide loads and stores (triton_shared.div_of)
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
        elif SPEC == 0:
            eps = tl.randn(seed, tl.load(offset_ptr) + gidx)  # the same eps the noise kernel used
        else:
            eps = spec_eps(seed, tl.load(offset_ptr), b.to(tl.int64), idx, mask, D, rows_ptr, tab_ptr, mean_ptr,
                           std_ptr, C, HW, H, W, L, K_N, K_S, K_L, N, SPEC=SPEC, NORM=True)
        target += tl.load(coef_ptr + tb) * eps
    if NEEDS_X0:
        x0 = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
        target += tl.load(coef_ptr + T + tb) * x0
    d = tl.where(mask, pred - target, 0.0)
    if LOSS == 0:
        r = d * d
        g = d
    else:
        cb = tl.load(c_ptr + tb)  # the threshold c(t_b) (a dummy table for l1)
        r, g = rho_psi(d, cb, LOSS)
    # dL/dpred of L = mean_b ℓ_b, written now: the loss is the last op, backward only rescales it.
    tl.store(grad_ptr + gidx, (g * (grad_scale * wb * ib)).to(grad_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(acc_ptr + b, tl.sum(r, axis=0))
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


def loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs_eps, needs_x0, spec, kind, c_table,
         interpret, block):
    """(mean, per-sample ℓ, raw, weighted, dL/dpred): one launch of a grid (B, ⌈D/BLOCK⌉)."""
    B, D, T = pred.shape[0], pred[0].numel(), weight.numel()
    x0c = x0.contiguous()
    args, flags = launch_args(spec if needs_eps else None, x0c)
    pyramid = bool(flags & PYRAMID)
    BLOCK = block_size(D, interpret, block, pyramid)
    nch = triton.cdiv(D, BLOCK)
    acc, cnt = workspace(B, pred.device)
    grad = torch.empty_like(pred, memory_format=torch.contiguous_format)
    f32 = dict(dtype=torch.float32, device=pred.device)
    raw, wl, per, mean = torch.empty(B, **f32), torch.empty(B, **f32), torch.empty(B, **f32), torch.empty((), **f32)
    loss_kernel[(B, nch)](pred.contiguous(), x0c, eps.contiguous() if eps is not None else x0c, t, weight, iw,
                          coef, pivots, bins, grad, acc, cnt, raw, wl, per, mean, D, B, T, nch, seed, offset,
                          2.0 / (B * D), *args, c_table if c_table is not None else weight,
                          NEEDS_EPS=needs_eps, NEEDS_X0=needs_x0, HAS_EPS=eps is not None,
                          BINS=bins.numel() > 0, SPEC=flags, LOSS=kind, BLOCK=BLOCK, DIV=div_of(D),
                          **shared.kernel_options(BLOCK, bool(flags), pyramid))
    return mean, per, raw, wl, grad


STREAMS = ("pred_ptr", "x0_ptr", "eps_ptr", "grad_ptr")  # rows of elements (aot_specs.Spec)


def specializations(aot):
    """Every compilation `loss` can launch on a GPU (aot_specs.Spec): each (data, model) dtype pair
    × eps drawn or given (fp32, as the probes pass it, or in x0's dtype) × the target's terms (eps, x0,
    both: the prediction types) × with and without bins, at a 3×32×32 row; each tile size and
    alignment class (aot.row_sizes) in each dtype with an int32 and an int64 seed, the other
    options rotating, some with an unaligned prediction; each loss shape (loss_shape.py) and each group
    of noise options (aot.NOISE_OPTIONS) in each dtype pair. A new launcher option extends
    this list."""
    T = 1000

    def spec(x_dt, p_dt, D=3072, eps_dt=None, needs=(True, True), bins=True, seed=aot.SEEDS[0], aligned=True,
             kind=0, options=None):
        def launch():
            shape = aot.IMAGE if options else (2, D)
            pred = torch.empty(shape, dtype=p_dt) if aligned else aot.unaligned(shape, p_dt)
            x0 = torch.zeros(shape, dtype=x_dt)
            f64 = dict(dtype=torch.float64)
            piv, data = (torch.zeros(2, T, **f64), torch.zeros(5, T, **f64)) if bins else (
                torch.zeros(0, 0, **f64), torch.zeros(0, 0, **f64))
            eps = None if eps_dt is None else torch.empty(2, D, dtype=eps_dt)
            return loss(pred, x0, torch.zeros(2, dtype=torch.int64), torch.zeros(T), torch.ones(2),
                        torch.zeros(2, T), piv, data, eps, seed, torch.zeros((), dtype=torch.int64), needs[0],
                        needs[1], aot.noise_spec(x0, options), kind, aot.loss_table(kind, T), False, 0)
        axes = dict(x0=aot.name(x_dt), pred=aot.name(p_dt), eps=aot.name(eps_dt),
                    target="+".join(n for n, u in zip(("eps", "x0"), needs) if u), bins=bins, D=D,
                    seed=aot.name(seed), aligned=aligned, loss=LOSSES[kind], noise=options or "plain")
        return aot.Spec(axes, launch, min(div_of(D), block_size(D, False)), STREAMS)

    targets = ((True, True), (True, False), (False, True))  # v and flow, eps, x0 prediction
    for x_dt, p_dt in aot.DTYPE_PAIRS:
        for eps_dt in dict.fromkeys((None, torch.float32, x_dt)):
            for needs in targets:
                for bins in (True, False):
                    yield spec(x_dt, p_dt, eps_dt=eps_dt, needs=needs, bins=bins)
    for i, D in enumerate(aot.row_sizes()):
        for j, dt in enumerate(aot.SAME_DTYPES):
            kw = dict(needs=targets[(i + j) % 3], bins=(i + j) % 2 == 0)
            for seed in aot.SEEDS:
                yield spec(dt, dt, D, seed=seed, **kw)
            if (i + j) % 3 == 0:
                yield spec(dt, dt, D, aligned=False, seed=aot.SEEDS[(i + j) % 2], **kw)
    for kind in range(1, len(LOSSES)):
        for j, (x_dt, p_dt) in enumerate(aot.DTYPE_PAIRS):
            yield spec(x_dt, p_dt, kind=kind, needs=targets[(kind + j) % 3], bins=(kind + j) % 2 == 0)
    for i, options in enumerate(aot.NOISE_OPTIONS):
        for j, (x_dt, p_dt) in enumerate(aot.DTYPE_PAIRS):
            yield spec(x_dt, p_dt, options=options, kind=(i + j) % len(LOSSES), needs=targets[(i + j) % 2],
                       bins=j % 2 == 0)
