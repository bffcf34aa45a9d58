"""The mixed-prediction loss kernel in Triton: the loss kernel for H heads and a gate (the op:
mixed_loss.py; contract and formulas: torch_ref_mixed_loss.py).

One program per (sample b, block of BP pixels). It holds a [HP, CB, BP] tile (heads × channels ×
pixels; HP, CB powers of two, padded lanes masked) and loops over the channels in chunks of CB, so a
pixel's gate sees all channels of all heads in one program:
  * regenerates eps = Philox(seed, offset + element index) (the stream the noise kernel drew, philox.py),
  * per head: target = ce·eps + cx·x0, d = pred - target, e = k1·d + fb·x0 (the x0 residual),
  * π = softmax over heads of (gate + bias) per pixel, E = Σ π·e (the mixed x0 residual),
  * writes ∂L/∂pred and ∂L/∂gate (L = mean_b ℓ_b) in the forward pass: the loss is the last op,
  * adds its partial sums (Σ E², Σ d_i², Σ e_i², per-sample gate gradient) into a workspace row;
    the program that finishes a sample writes the per-sample outputs and scatters the V = 2 + H
    values (raw, weighted, each head's x0 error) into the per-timestep bins (bins.py), skipping a
    sample with any non-finite value, and resets the sample's workspace row; the program that
    finishes the batch publishes the mean and resets the batch slots (the self-cleaning workspace
    of the loss kernel, triton_diffusion_loss.py: no memset launch).

Noise options (SPEC != 0) regenerate the options' ε (triton_noise_spec.spec_eps); a loss shape
(LOSS != 0, loss_shape.py) turns E² and d_i² into ρ(E), ρ(d_i) and E, d_i in the gradients into ψ(E),
ψ(d_i) (torch_ref_mixed_loss.py); both 0: the plain kernel, unchanged.

Workspace row of sample b (NACC = 1 + 3·HP fp32 slots): [0] Σ E², [1 + h] Σ d_h², [1 + HP + h]
Σ e_h², [1 + 2·HP + h] the per-sample gate gradient (per-sample gate only). Row B: the batch sum.
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
from .triton_shared import div_of, rho_psi, scatter_value

# An explicit register ceiling (.maxnreg), the hardware's: without one ptxas squeezed the fp32 kernel
# (2 heads, pixel gate) into 128 registers on sm_80 and spilled 20 bytes; with it, it takes the 163 it
# needs, and no specialisation spills (kernels/aot.py). The kernel takes 36-229 registers.
MAXNREG = 255

# Logit of a padded head lane (exp underflows to exactly 0); constexpr, as compiled Triton only reads
# globals that are.
NEG = tl.constexpr(-1e30)


# P, H, C and CO are value-specialised (P's alignment decides the vector width); B, T, NCH, NACC and the
# seed are not, so a batch of 1 or a seed of 1 compiles no kernel of its own.
@triton.jit(do_not_specialize=["B", "T", "NCH", "NACC", "seed"])
def mixed_loss_kernel(out_ptr, x0_ptr, eps_ptr, t_ptr, w_ptr, iw_ptr, tab_ptr, gate_ptr, pivot_ptr, bins_ptr,
                      grad_ptr, ggrad_ptr, acc_ptr, cnt_ptr, raw_ptr, wl_ptr, ps_ptr, x0e_ptr, loss_ptr,
                      H, C, P, CO, B, T, NCH, NACC, seed, offset_ptr, grad_scale,
                      rows_ptr, spec_ptr, mean_ptr, std_ptr, SC, HW, SH, SW, L, K_XI, K_N, K_S, K_L, N, c_ptr,
                      PIXEL_GATE: tl.constexpr, HAS_EPS: tl.constexpr, BINS: tl.constexpr, NROWS: tl.constexpr,
                      SPEC: tl.constexpr, LOSS: tl.constexpr, HP: tl.constexpr, CB: tl.constexpr, BP: tl.constexpr,
                      DIV: tl.constexpr):
    b = tl.program_id(0)
    pblk = tl.program_id(1)
    P = P // DIV * DIV  # == P: DIV-wide loads and stores (triton_shared.div_of)
    hh = tl.arange(0, HP)
    hm = hh < H
    pp = pblk * BP + tl.arange(0, BP)
    pm = pp < P
    tb = tl.load(t_ptr + b)
    wb = tl.load(w_ptr + tb)
    ib = tl.load(iw_ptr + b)
    row = tab_ptr + hh * (NROWS * T) + tb  # [HP]: the table rows at t_b (layout: torch_ref_mixed_loss.ROWS)
    ce = tl.load(row, mask=hm, other=0.0)[:, None, None]
    cx = tl.load(row + T, mask=hm, other=0.0)[:, None, None]
    k1 = tl.load(row + 2 * T, mask=hm, other=0.0)[:, None, None]
    fb = tl.load(row + 3 * T, mask=hm, other=0.0)[:, None, None]
    bias = tl.load(row + 4 * T, mask=hm, other=0.0)
    aux = tl.load(row + 5 * T, mask=hm, other=0.0)
    obase = b.to(tl.int64) * CO * P
    xbase = b.to(tl.int64) * C * P
    # π: softmax over heads of gate + bias, per pixel ([HP, BP]) or per sample ([HP, 1])
    if PIXEL_GATE:
        goff = obase + (H * C + hh)[:, None] * P + pp[None, :]
        gm = hm[:, None] & pm[None, :]
        z = tl.load(out_ptr + goff, mask=gm, other=0.0).to(tl.float32) + bias[:, None]
    else:
        z = (tl.load(gate_ptr + b * H + hh, mask=hm, other=0.0).to(tl.float32) + bias)[:, None]
    z = tl.where(hm[:, None], z, NEG)
    ez = tl.exp(z - tl.max(z, axis=0)[None, :])
    pi = ez / tl.sum(ez, axis=0)[None, :]
    pi3 = pi[:, None, :]
    sb = grad_scale * ib  # 2·iw_b/(B·D)
    cb = 0.0
    if LOSS >= 2:
        cb = tl.load(c_ptr + tb)  # the loss shape's threshold c(t_b)
    sE2 = tl.zeros([BP], dtype=tl.float32)
    sd2 = tl.zeros([HP, BP], dtype=tl.float32)
    se2 = tl.zeros([HP, BP], dtype=tl.float32)
    gacc = tl.zeros([HP, BP], dtype=tl.float32)
    for c0 in range(0, C, CB):
        cc = c0 + tl.arange(0, CB)
        m2 = (cc < C)[:, None] & pm[None, :]
        xoff = xbase + cc[:, None] * P + pp[None, :]  # [CB, BP]: also the Philox counter
        x0 = tl.load(x0_ptr + xoff, mask=m2, other=0.0).to(tl.float32)
        if HAS_EPS:
            eps = tl.load(eps_ptr + xoff, mask=m2, other=0.0).to(tl.float32)
        elif SPEC == 0:
            eps = tl.where(m2, tl.randn(seed, tl.load(offset_ptr) + xoff), 0.0)  # the same eps the noise kernel used
        else:
            eps = spec_eps(seed, tl.load(offset_ptr), b.to(tl.int64), cc[:, None] * P + pp[None, :], m2, C * P,
                           rows_ptr, spec_ptr, mean_ptr, std_ptr, SC, HW, SH, SW, L, K_N, K_S, K_L, N, SPEC=SPEC,
                           NORM=True)
            eps = tl.where(m2, eps, 0.0)
        m3 = hm[:, None, None] & m2[None, :, :]
        ooff = obase + (hh[:, None, None] * C + cc[None, :, None]) * P + pp[None, None, :]
        pred = tl.load(out_ptr + ooff, mask=m3, other=0.0).to(tl.float32)
        d = pred - (ce * eps[None, :, :] + cx * x0[None, :, :])  # 0 on padded lanes: all loads are 0 there
        e = k1 * d + fb * x0[None, :, :]
        E = tl.sum(pi3 * e, axis=0)  # [CB, BP]
        if LOSS == 0:
            rE = E * E
            qE = E
            rd = d * d
            qd = d
        else:
            rE, qE = rho_psi(E, cb, LOSS)
            rd, qd = rho_psi(d, cb, LOSS)
        gE = (sb * wb) * qE
        g = pi3 * k1 * gE[None, :, :] + (sb * aux)[:, None, None] * qd
        tl.store(grad_ptr + ooff, g.to(grad_ptr.dtype.element_ty), mask=m3)
        gacc += tl.sum(pi3 * (e - E[None, :, :]) * gE[None, :, :], axis=1)
        sE2 += tl.sum(rE, axis=0)
        sd2 += tl.sum(rd, axis=1)
        se2 += tl.sum(e * e, axis=1)
    ws = acc_ptr + b * NACC
    if PIXEL_GATE:
        tl.store(grad_ptr + goff, gacc.to(grad_ptr.dtype.element_ty), mask=gm)
    else:
        tl.atomic_add(ws + 1 + 2 * HP + hh, tl.sum(gacc, axis=1), mask=hm)
    tl.atomic_add(ws, tl.sum(sE2, axis=0))
    tl.atomic_add(ws + 1 + hh, tl.sum(sd2, axis=1), mask=hm)
    tl.atomic_add(ws + 1 + HP + hh, tl.sum(se2, axis=1), mask=hm)
    # The program that finishes a sample (acq_rel atomics order its partial sums before the count)
    # reads the totals, writes the per-sample outputs and the bins, and resets the sample's slots.
    last = tl.atomic_add(cnt_ptr + b, 1) == NCH - 1
    lh = last & hm
    D = C * P
    zh = tl.zeros([HP], dtype=tl.float32)
    raw = tl.atomic_add(ws, 0.0, mask=last) / D
    own = tl.atomic_add(ws + 1 + hh, zh, mask=lh) / D
    x0e = tl.atomic_add(ws + 1 + HP + hh, zh, mask=lh) / D
    wl = wb * raw + tl.sum(tl.where(hm, aux * own, 0.0), axis=0)
    tl.store(raw_ptr + b, raw, mask=last)
    tl.store(wl_ptr + b, wl, mask=last)
    tl.store(ps_ptr + b, wl * ib, mask=last)
    tl.store(x0e_ptr + b * H + hh, x0e, mask=lh)
    if not PIXEL_GATE:
        gg = tl.atomic_add(ws + 1 + 2 * HP + hh, zh, mask=lh)
        tl.store(ggrad_ptr + b * H + hh, gg.to(ggrad_ptr.dtype.element_ty), mask=lh)
    slots = tl.arange(0, 4 * HP)
    tl.store(ws + slots, tl.zeros([4 * HP], dtype=tl.float32), mask=last & (slots < NACC))
    tl.store(cnt_ptr + b, 0, mask=last)
    tl.atomic_add(acc_ptr + B * NACC, wl * ib / B, mask=last)
    if BINS:
        # finite: x - x is NaN for inf and NaN; one non-finite value leaves the whole sample out
        fin_h = tl.sum(tl.where(hm, x0e - x0e, 0.0), axis=0) == 0.0
        ok = last & (raw - raw == 0.0) & (wl - wl == 0.0) & fin_h
        tl.atomic_add(bins_ptr + tb, raw.to(tl.float64) * 0.0 + 1.0, mask=ok)
        scatter_value(bins_ptr, pivot_ptr, raw, 0, tb, T, ok)
        scatter_value(bins_ptr, pivot_ptr, wl, 1, tb, T, ok)
        scatter_value(bins_ptr, pivot_ptr, x0e, 2 + hh, tb, T, ok & hm)
    # The last sample to finish publishes the batch mean and resets the batch slots.
    final = last & (tl.atomic_add(cnt_ptr + B, 1, mask=last) == B - 1)
    tl.store(loss_ptr, tl.atomic_add(acc_ptr + B * NACC, 0.0, mask=final), mask=final)
    tl.store(acc_ptr + B * NACC, 0.0, mask=final)
    tl.store(cnt_ptr + B, 0, mask=final)


def tile(H: int, C: int, P: int, budget: int) -> tuple[int, int, int]:
    """(HP, CB, BP): heads padded to a power of two; as many pixels as fit in `budget` elements with
    every channel in one chunk, else one pixel and the channels in chunks."""
    HP, CP, PP = (triton.next_power_of_2(v) for v in (H, C, P))
    budget = triton.next_power_of_2(max(int(budget), HP))
    BP = min(PP, max(1, budget // (HP * CP)))
    CB = min(CP, max(1, budget // (HP * BP)))
    return HP, CB, BP


def budget(interpret: bool, block: int = 0, pyramid: bool = False) -> int:
    """Elements per program tile (`block` overrides it: tests; pyramid noise: triton_shared.PYRAMID_BLOCK)."""
    # Interpreter: few large programs (each op costs Python time); GPU: 2048-element tiles, as the loss
    # kernel (the tile spans heads × channels × pixels; not yet tuned on a GPU). 16 tile elements per
    # thread keep x0 and the pixel gate 128 bits wide with 4 heads too (at 1024 they were 64).
    return block or (16384 if interpret else shared.PYRAMID_BLOCK if pyramid else 2048)


def mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, spec, kind, c_table, nrows,
               interpret, block):
    """(mean, per, raw, weighted, x0_error, ∂L/∂out, ∂L/∂gate): one launch of a grid (B, ⌈P/BP⌉)."""
    B, T = x0.shape[0], weight.numel()
    H, C = tab.shape[0], x0.shape[1]
    P = x0[0, 0].numel()
    x0c = x0.contiguous()
    args, flags = launch_args(spec, x0c)
    HP, CB, BP = tile(H, C, P, budget(interpret, block, bool(flags & PYRAMID)))
    nch = triton.cdiv(P, BP)
    nacc = 1 + 3 * HP
    acc, cnt = workspace(B, out.device, nacc)
    f32 = dict(dtype=torch.float32, device=out.device)
    grad = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    ggrad = torch.empty((B, H) if gate is not None else (0,), dtype=gate.dtype if gate is not None else out.dtype,
                        device=out.device)
    raw, wl, per, mean = torch.empty(B, **f32), torch.empty(B, **f32), torch.empty(B, **f32), torch.empty((), **f32)
    x0e = torch.empty(B, H, **f32)
    mixed_loss_kernel[(B, nch)](
        out.contiguous(), x0c, eps.contiguous() if eps is not None else x0c, t, weight, iw, tab.contiguous(),
        gate.contiguous() if gate is not None else iw, pivots, bins, grad, ggrad, acc, cnt, raw, wl, per, x0e,
        mean, H, C, P, out.shape[1], B, T, nch, nacc, seed, offset, 2.0 / (B * C * P),
        *args, c_table if c_table is not None else weight,
        PIXEL_GATE=gate is None, HAS_EPS=eps is not None, BINS=bins.numel() > 0, NROWS=nrows,
        SPEC=flags, LOSS=kind, HP=HP, CB=CB, BP=BP, DIV=div_of(P), maxnreg=MAXNREG)
    return mean, per, raw, wl, x0e, grad, ggrad


STREAMS = ("out_ptr", "x0_ptr", "eps_ptr", "grad_ptr")  # rows of elements (aot_specs.Spec)


def specializations(aot):
    """Every compilation `mixed_loss` can launch on a GPU (aot_specs.Spec): each (data, model) dtype
    pair × pixel or timestep gate × eps drawn or given (fp32, as the probes pass it, or in x0's dtype)
    × with and without bins × 2 or 3 heads (padded to 2 or 4), on 3×32×32 images; then every tile
    `tile` picks for 2-4 heads, 1, 3, 4 or 16 channels and 4×4 to 256×256 images (and 2-D points, P =
    1), and each alignment class of P, the dtypes and options rotating, some with unaligned outputs;
    each loss shape (loss_shape.py) and each group of noise options (aot.NOISE_OPTIONS) in
    each dtype pair. A new launcher option extends this list."""
    from .torch_ref_mixed_loss import NROWS

    T = 1000

    def spec(x_dt, o_dt, H=2, C=3, P=1024, gate=None, eps_dt=None, bins=True, seed=aot.SEEDS[0], aligned=True,
             kind=0, options=None):
        def launch():
            V = 2 + H
            shape = (2, H * C + (H if gate is None else 0), P)
            out = torch.empty(shape, dtype=o_dt) if aligned else aot.unaligned(shape, o_dt)
            f64 = dict(dtype=torch.float64)
            piv, data = (torch.zeros(V, T, **f64), torch.zeros(1 + 2 * V, T, **f64)) if bins else (
                torch.zeros(0, 0, **f64), torch.zeros(0, 0, **f64))
            eps = None if eps_dt is None else torch.empty(2, C, P, dtype=eps_dt)
            g = None if gate is None else torch.empty(2, H, dtype=gate)
            x0 = torch.zeros(2, C, P, dtype=x_dt)
            spec = aot.noise_spec(x0.view(aot.IMAGE), options) if options else None
            return mixed_loss(out, x0, torch.zeros(2, dtype=torch.int64), torch.zeros(T), torch.ones(2),
                              torch.zeros(H, NROWS, T), g, piv, data, eps, seed, torch.zeros((), dtype=torch.int64),
                              spec, kind, aot.loss_table(kind, T), NROWS, False, 0)
        axes = dict(x0=aot.name(x_dt), out=aot.name(o_dt),
                    gate="pixel" if gate is None else f"timestep {aot.name(gate)}", eps=aot.name(eps_dt),
                    bins=bins, H=H, C=C, P=P, seed=aot.name(seed), aligned=aligned, loss=LOSSES[kind],
                    noise=options or "plain")
        return aot.Spec(axes, launch, min(div_of(P), tile(H, C, P, budget(False))[2]), STREAMS)

    for x_dt, o_dt in aot.DTYPE_PAIRS:
        for gate in (None, o_dt):
            for eps_dt in dict.fromkeys((None, torch.float32, x_dt)):
                for bins in (True, False):
                    for H in (2, 3):
                        yield spec(x_dt, o_dt, H, gate=gate, eps_dt=eps_dt, bins=bins)
    yield spec(torch.float32, torch.bfloat16, gate=torch.float32)  # an fp32 timestep gate under a bf16 model
    shapes, tiles = [(2, 2, 1)], {tile(2, 2, 1, budget(False))}
    for H in (2, 3, 4):
        for C in (1, 3, 4, 16):
            for P in [16 << k for k in range(13)]:
                if tile(H, C, P, budget(False)) not in tiles:
                    tiles.add(tile(H, C, P, budget(False)))
                    shapes.append((H, C, P))
    shapes += [(2, 3, 1024 - 16 + d) for d in (8, 4, 2, 1)]  # the alignment classes of P (div_of)
    for i, (H, C, P) in enumerate(shapes):
        dt = aot.SAME_DTYPES[i % 3]
        kw = dict(gate=None if i % 2 else dt, bins=i % 4 < 2, seed=aot.SEEDS[i % 5 == 0], aligned=i % 3 != 1)
        yield spec(dt, dt, H, C, P, **kw)
    for kind in range(1, len(LOSSES)):
        for j, (x_dt, o_dt) in enumerate(aot.DTYPE_PAIRS):
            yield spec(x_dt, o_dt, 2 + (kind + j) % 2, gate=None if j % 2 else o_dt, kind=kind)
    for i, options in enumerate(aot.NOISE_OPTIONS):  # 3×32×32 images (aot.IMAGE)
        for j, (x_dt, o_dt) in enumerate(aot.DTYPE_PAIRS):
            yield spec(x_dt, o_dt, 2 + (i + j) % 2, gate=None if (i + j) % 2 else o_dt, bins=j % 2 == 0,
                       kind=(i + j) % len(LOSSES), options=options)
