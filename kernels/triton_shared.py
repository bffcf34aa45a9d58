"""What the Triton kernels share: the default tile size of the noise and loss kernels, the alignment
class of a row length, the scatter of one per-sample value into the per-timestep bins (layout:
bins.py), and the vocabulary of the launchers' `specializations()` (every compilation a launcher can
produce on a GPU, enumerated next to it; kernels/aot.py compiles them for sm_80 and sm_90)."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl


def block_size(D: int, interpret: bool, block: int = 0) -> int:
    """Elements per program for samples of D elements (`block` overrides it: tests)."""
    if block:
        return block
    # Interpreter: few large programs (each costs ~0.5 ms of Python); GPU: 2048-element tiles.
    return min(16384 if interpret else 2048, max(16, triton.next_power_of_2(D)))


def launch_options(block: int) -> dict:
    """num_warps and the register budget of a noise or loss kernel program: at most 8 elements per
    thread (8 warps for 2048-element tiles, else Triton's 4) and at most 64 registers (`.maxnreg`: 4
    blocks of 8 warps per SM, 32 KB of each fp32 row stream in flight per SM). Found by kernels/aot.py:
    at 16 elements per thread ptxas held the one-element-wide paths (odd row lengths) to 80 registers
    on sm_90 and spilled 8-12 bytes; at 8 per thread with no budget it squeezed some variants to 32-40
    registers (for occupancy) and spilled 4; with a budget of 48 the loss kernel's odd-length half
    paths spilled 8-16; with 64 nothing spills."""
    return dict(num_warps=8 if block >= 2048 else 4, maxnreg=64)


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


def unaligned(shape, dtype) -> torch.Tensor:
    """A contiguous tensor whose data does not start on a 16-byte boundary (a view one element into
    its storage, as a slice of a larger batch can be): Triton then specialises the pointer as
    unaligned, and loads and stores go one element wide."""
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + 1, dtype=dtype)[1:].view(shape)
