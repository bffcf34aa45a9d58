"""What the Triton kernels share: the default tile size of the noise and loss kernels, the alignment
class of a row length, the scatter of one per-sample value into the per-timestep bins (layout:
bins.py), the loss shapes (loss_shape.py), and the vocabulary of the launchers' `specializations()`
(every compilation a launcher can produce on a GPU, enumerated next to it; kernels/aot.py compiles
them for sm_80 and sm_90)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Tile of the kernels when pyramid noise is on (noise_spec.PYRAMID): each element draws 4 normals per
# level (bilinear upsampling of the level's field), and at 2048-element tiles ptxas spilled about 1 KB
# per thread in every kernel that regenerates it (kernels/aot.py).
PYRAMID_BLOCK = 256


def block_size(D: int, interpret: bool, block: int = 0, pyramid: bool = False) -> int:
    """Elements per program for samples of D elements (`block` overrides it: tests)."""
    if block:
        return block
    # Interpreter: few large programs (each costs ~0.5 ms of Python); GPU: 2048-element tiles.
    return min(16384 if interpret else PYRAMID_BLOCK if pyramid else 2048, max(16, triton.next_power_of_2(D)))


def launch_options(block: int) -> dict:
    """num_warps and the register budget of a noise or loss kernel program: at most 8 elements per
    thread (8 warps for 2048-element tiles, else Triton's 4) and at most 64 registers (`.maxnreg`: 4
    blocks of 8 warps per SM, 32 KB of each fp32 row stream in flight per SM). Found by kernels/aot.py:
    at 16 elements per thread ptxas held the one-element-wide paths (odd row lengths) to 80 registers
    on sm_90 and spilled 8-12 bytes; at 8 per thread with no budget it squeezed some variants to 32-40
    registers (for occupancy) and spilled 4; with a budget of 48 the loss kernel's odd-length half
    paths spilled 8-16; with 64 nothing spills."""
    return dict(num_warps=8 if block >= 2048 else 4, maxnreg=64)


def kernel_options(block: int, spec_flags: int) -> dict:
    """num_warps and register budget of a noise or loss kernel with the noise options `spec_flags`
    (noise_spec.py): launch_options without options; the pyramid's (pyramid_options) with pyramid noise;
    else a 96-register budget (the loss kernel with the adaptive offset spilled 8 bytes on sm_90 under
    64: kernels/aot.py, full set)."""
    from .noise_spec import PYRAMID

    if spec_flags & PYRAMID:
        return pyramid_options()
    return {**launch_options(block), "maxnreg": 96} if spec_flags else launch_options(block)


def pyramid_options() -> dict:
    """num_warps and register budget of a kernel regenerating pyramid noise (PYRAMID_BLOCK tiles)."""
    return dict(num_warps=4, maxnreg=PYRAMID_REGS)


PYRAMID_REGS = 128


def div_of(n: int) -> int:
    """DIV: the largest power of two dividing the row length n, at most 16. The kernels rebuild n as
    (n // DIV)·DIV, so the compiler knows n % DIV == 0: every row starts DIV-aligned and a row's mask is
    uniform over DIV lanes, and loads and stores go DIV elements wide (128-bit: 4 fp32 or 8 halves).
    Triton itself only specialises n % 16 == 0 (then DIV = 16 as well)."""
    return min(16, n & -n)


@triton.jit
def scatter_value(bins_ptr, pivot_ptr, v, row, tb, T, mask):
    """Add one value (row `row` of V) of one sample at timestep tb: Σ(x - c) and Σ(x - c)² (bins.py)."""
    d = v.to(tl.float64) - tl.load(pivot_ptr + row * T + tb, mask=mask, other=0.0)
    tl.atomic_add(bins_ptr + (1 + 2 * row) * T + tb, d, mask=mask)
    tl.atomic_add(bins_ptr + (2 + 2 * row) * T + tb, d * d, mask=mask)


@triton.jit
def rho_psi(d, c, LOSS: tl.constexpr):
    """(ρ(d), ψ(d) = ρ'(d)/2) of the loss shape LOSS (loss_shape.py: 0 l2, 1 l1, 2 huber, 3 smooth_l1,
    4 pseudo_huber) with threshold c; (0, 0) at d = 0, so padded lanes add nothing."""
    if LOSS == 0:
        r = d * d
        g = d
    elif LOSS == 1:
        r = tl.abs(d)
        g = tl.where(d > 0, 0.5, tl.where(d < 0, -0.5, 0.0))
    else:
        q = tl.sqrt_rn(d * d + c * c)
        r = tl.div_rn(d * d, q + c)  # √(d² + c²) − c without cancellation
        if LOSS == 2:
            r = (2.0 * c) * r
            g = tl.div_rn(c * d, q)
        elif LOSS == 3:
            r = 2.0 * r
            g = tl.div_rn(d, q)
        else:
            g = tl.div_rn(0.5 * d, q)
    return r, g


# -- the launchers' specialisations -----------------------------------------------------------------
class Spec(NamedTuple):
    """One launch a launcher can make on a GPU. `launch()` calls the launcher with CPU tensors of
    these dtypes and shapes (kernels/aot.py intercepts the kernel call: the launcher itself decides
    the tile, the constexprs and the arguments; Triton's binder then decides the signature, as at
    run time: only dtypes, data_ptr() % 16 and the ints' values matter). `streams`: the kernel's
    pointer arguments that hold rows of elements (a sample, a channel plane), read or written a tile
    at a time; `vec`: the contiguous aligned elements such a row offers, min(DIV, tile extent): the
    vector width the check expects of them (per-sample values and small gathers are only reported)."""
    axes: dict
    launch: Callable[[], object]
    vec: int
    streams: tuple


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (data, model) dtype pairs: x0 and eps in the data's dtype, the network's input and output in the
# model's (the noise kernel writes x_t in it, the loss kernels read predictions and write gradients in
# it). The trainer's data is fp32 and its compute dtype fp32, bf16 or fp16; the ops take half data too
# (then the model's dtype is the same). A bf16/fp16 mix, or half data under an fp32 model, is no
# configuration of the trainer.
DTYPE_PAIRS = ((F32, F32), (F32, BF16), (F32, F16), (BF16, BF16), (F16, F16))
SAME_DTYPES = (F32, BF16, F16)
SEEDS = (12345, 2**40 + 7)  # an int32 and an int64 seed (the seed is never value-specialised)


def name(v) -> str:
    """A Spec axis value: a dtype's short name ("drawn" for no tensor: eps from the stream), a seed's type."""
    if isinstance(v, int):
        return "i64" if v >= 2**31 else "i32"
    return {F32: "fp32", BF16: "bf16", F16: "fp16", None: "drawn"}[v]


def row_sizes(largest: int = 3072) -> list[int]:
    """Row lengths that reach every tile block_size() picks on a GPU (16 … 2048: a 2-D point (the moons
    data), then a power-of-two row each), and every alignment class DIV < 16 (div_of) at the largest
    tile, with a masked tail: `largest` (a 3×32×32 image: two 2048-tiles, the second masked) minus 16
    plus DIV; and an odd row on the 1024-tile (4 warps)."""
    return [2] + [16 << k for k in range(7)] + [1021, largest] + [largest - 16 + d for d in (8, 4, 2, 1)]


# The noise options a launcher's specializations() cover (noise_spec.py): each group of options, then
# all of them with an immiscible row map: with the plain stream, the values the SPEC constexpr takes.
NOISE_OPTIONS = {
    "offset": dict(offset=0.1, offset_random=True, adaptive_scale=0.05),
    "pyramid": dict(pyramid_iterations=3),
    "perturbation": dict(perturbation=0.1, perturbation_random=True),
    "all+rows": dict(offset=0.1, offset_random=True, adaptive_scale=0.05, pyramid_iterations=3, perturbation=0.1,
                     perturbation_random=True, rows=True),
}
IMAGE = (2, 3, 32, 32)  # the data shape of the noise-option launches (pyramid noise needs [B, C, H, W])


def noise_spec(x0: torch.Tensor, options: str | None):
    """The NoiseSpec (noise_spec.prepare, on the CPU: the torch backend reduces the pyramid's std) of
    NOISE_OPTIONS[options] for data x0; None for the plain stream."""
    from . import noise_spec as ns

    if options is None:
        return None
    kw = dict(NOISE_OPTIONS[options])
    rows = torch.arange(x0.shape[0]) if kw.pop("rows", False) else None
    spec, _ = ns.prepare(ns.NoiseOptions(**kw), x0.float(), seed=SEEDS[0], offset=torch.zeros((), dtype=torch.int64),
                         rows=rows, backend="torch")
    return spec


def loss_table(kind: int, T: int) -> torch.Tensor | None:
    """The threshold table c(t) a loss shape reads (loss_shape.py), else None."""
    from .loss_shape import needs_c

    return torch.full((T,), 0.1) if needs_c(kind) else None


def unaligned(shape, dtype) -> torch.Tensor:
    """A contiguous tensor whose data does not start on a 16-byte boundary (a view one element into
    its storage, as a slice of a larger batch can be): Triton then specialises the pointer as
    unaligned, and loads and stores go one element wide."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + 1, dtype=dtype)[1:].view(shape)
