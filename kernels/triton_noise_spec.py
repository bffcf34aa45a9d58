"""The noise options in Triton (contract and counter layout: noise_spec.py): the ε every kernel that
regenerates noise computes (the noise kernel, triton_noise.py; the loss kernels,
triton_diffusion_loss.py and triton_mixed_loss.py), the perturbation the noise kernel adds, and the
reduction of the pyramid's std before the noise kernel.

`SPEC` is a constexpr of flag bits (noise_spec: OFFSET ... PERTURB_RANDOM, ROWS); the kernels call
`spec_eps` only where SPEC != 0, so the plain kernels compile as before. Per-batch draws (the random
strengths, the pyramid's r_l) are scalars every program draws for itself from the stream: no extra
launch, the same values everywhere. A pyramid level's value at a pixel is torch's bilinear
interpolation (align_corners=False: source index scale·(dst + 0.5) − 0.5 clamped at 0, the next index
clamped at the edge; identity where the sizes agree) of four normals of the level's field, each drawn
at its own counter: nothing is stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import noise_spec as ns
from . import triton_shared as shared
from .triton_shared import block_size

# The flag bits, written as literals in the kernels (the interpreter cannot `&` an int with a constexpr):
assert (ns.OFFSET, ns.OFFSET_RANDOM, ns.ADAPTIVE, ns.PYRAMID, ns.PERTURB, ns.PERTURB_RANDOM, ns.ROWS) == (
    1, 2, 4, 8, 16, 32, 64)


@triton.jit
def _source(o, n_in, n_out_f, same):
    """torch's bilinear source indices and weight along one axis (UpSampleKernel.cpp,
    compute_source_index_and_lambda): output index o of n_out from an axis of n_in; identity if same."""
    scale = n_in.to(tl.float32) / n_out_f
    src = tl.maximum(scale * (o.to(tl.float32) + 0.5) - 0.5, 0.0)
    i0 = tl.minimum(src.to(tl.int64), n_in - 1)  # src >= 0: truncation is floor
    lam = tl.minimum(tl.maximum(src - i0.to(tl.float32), 0.0), 1.0)
    i1 = i0 + (i0 < n_in - 1).to(tl.int64)
    return tl.where(same, o, i0), tl.where(same, o, i1), tl.where(same, 0.0, lam)


@triton.jit
def _level(seed, base, plane, y, x, hl, wl, H, W):
    """One pyramid level's upsampled value at pixels (y, x) of planes b·C + c (int64 tensors)."""
    y0, y1, ly = _source(y, hl, H * 1.0, hl == H)
    x0, x1, lx = _source(x, wl, W * 1.0, wl == W)
    r0 = base + (plane * hl + y0) * wl
    r1 = base + (plane * hl + y1) * wl
    t0 = tl.randn(seed, r0 + x0) * (1.0 - lx) + tl.randn(seed, r0 + x1) * lx
    t1 = tl.randn(seed, r1 + x0) * (1.0 - lx) + tl.randn(seed, r1 + x1) * lx
    return t0 * (1.0 - ly) + t1 * ly


@triton.jit
def spec_eps(seed, off, b, j, mask, D, rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L, K_N, K_S, K_L, N,
             SPEC: tl.constexpr, NORM: tl.constexpr):
    """ε of sample b (int64 scalar) at element indices j (any shape) for the counter `off`: the base
    draw of the sample's row, the offset, the pyramid levels, then (NORM) the division by the std."""
    if SPEC & 64:  # ROWS
        row = tl.load(rows_ptr + b)
    else:
        row = b
    eps = tl.randn(seed, off + row * D + j)
    plane = b * C + j // HW  # b·C + channel, int64
    if SPEC & 1:  # OFFSET
        s = tl.load(tab_ptr)
        if SPEC & 2:  # OFFSET_RANDOM
            s = s * tl.rand(seed, off + K_S)
        if SPEC & 4:  # ADAPTIVE
            s = tl.maximum(s + tl.load(tab_ptr + 1) * tl.load(mean_ptr + plane, mask=mask, other=0.0), 0.0)
        eps = eps + s * tl.randn(seed, off + K_N + plane)
    if SPEC & 8:  # PYRAMID
        pix = j % HW
        y = pix // W
        x = pix % W
        alive = b >= 0
        for lv in range(0, L):
            r = 2.0 + 2.0 * tl.rand(seed, off + K_S + 2 + lv).to(tl.float64)
            p = r * 0.0 + 1.0
            for _ in range(0, lv):
                p = p * r  # r^l by l-fold multiplication (float64), as every backend
            hl = tl.maximum((H / p).to(tl.int64), 1)
            wl = tl.maximum((W / p).to(tl.int64), 1)
            if alive:
                base = off + K_L + lv * (N + b * 0)  # int64 even where N fits 32 bits
                eps = eps + _level(seed, base, plane, y, x, hl, wl, H, W) * tl.load(tab_ptr + 3 + lv)
            alive = alive & (hl > 1) & (wl > 1)  # sd-scripts: stop after a level with a side of 1
        if NORM:
            eps = tl.div_rn(eps, tl.load(std_ptr))
    return eps


@triton.jit
def spec_perturbation(seed, off, b, j, D, tab_ptr, K_XI, K_S, SPEC: tl.constexpr):
    """γ·u·ξ at elements j of sample b: added to ε for x_t only (the target keeps ε)."""
    g = tl.load(tab_ptr + 2)
    if SPEC & 32:  # PERTURB_RANDOM
        g = g * tl.rand(seed, off + K_S + 1)
    return g * tl.randn(seed, off + K_XI + b * D + j)


def launch_args(spec: ns.NoiseSpec | None, dummy: torch.Tensor) -> tuple[tuple, int]:
    """(the kernels' spec arguments: rows, table, mean, std pointers, C, HW, H, W, L, K_XI, K_N, K_S, K_L, N;
    SPEC), for data of `dummy`'s batch (dummy: any tensor of the device, for absent pointers)."""
    if spec is None:
        return (dummy, dummy, dummy, dummy, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0), 0
    f, L, C, H, W, kxi, kn, ks, kl = spec.ints
    B = dummy.shape[0] if dummy.ndim else 1
    D = dummy[0].numel() if dummy.ndim else 1
    flags = f | (ns.ROWS if spec.rows is not None else 0)
    ptr = [x if x is not None else dummy for x in (spec.rows, spec.table, spec.mean, spec.std)]
    HW = max(1, D // max(1, C))
    return (*ptr, C, HW, H, W, L, kxi, kn, ks, kl, B * D), flags


@triton.jit(do_not_specialize=["seed"])  # as the noise kernel's seed
def moments_kernel(sums_ptr, D, seed, offset_ptr, rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L, K_XI, K_N,
                   K_S, K_L, N, SPEC: tl.constexpr, BLOCK: tl.constexpr):
    """Σε and Σε² (float64) of the pre-division noise over the batch: one program per (sample, tile)."""
    b = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < D
    eps = spec_eps(seed, tl.load(offset_ptr), b, idx, mask, D, rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L,
                   K_N, K_S, K_L, N, SPEC=SPEC, NORM=False)
    eps = tl.where(mask, eps, 0.0)
    tl.atomic_add(sums_ptr, tl.sum(eps, axis=0).to(tl.float64))
    tl.atomic_add(sums_ptr + 1, tl.sum(eps * eps, axis=0).to(tl.float64))


def moments(x0, seed, offset, spec, interpret, block):
    """float64 [2]: Σ and Σ² of the pyramid noise before its division by the std (noise_std.py)."""
    B, D = x0.shape[0], x0[0].numel()
    sums = torch.zeros(2, dtype=torch.float64, device=x0.device)
    args, flags = launch_args(spec, x0)
    BLOCK = block_size(D, interpret, block, pyramid=True)
    moments_kernel[(B, triton.cdiv(D, BLOCK))](sums, D, seed, offset, *args, SPEC=flags, BLOCK=BLOCK,
                                               **shared.pyramid_options())
    return sums


STREAMS = ()  # reads no rows of elements: it regenerates the noise


def specializations(aot):
    """Every compilation `moments` can launch on a GPU (aot_specs.Spec): each group of noise options
    with pyramid noise (aot.NOISE_OPTIONS), with an int32 and an int64 seed."""
    def spec(options, seed):
        def launch():
            x0 = torch.zeros(aot.IMAGE)
            return moments(x0, seed, torch.zeros((), dtype=torch.int64), aot.noise_spec(x0, options), False, 0)
        return aot.Spec(dict(noise=options, seed=aot.name(seed)), launch, 1, STREAMS)

    for options, kw in aot.NOISE_OPTIONS.items():
        if kw.get("pyramid_iterations"):
            for seed in aot.SEEDS:
                yield spec(options, seed)
