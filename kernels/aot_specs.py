"""The vocabulary of the Triton modules' `specializations(aot)` (aot.py passes this module in as `aot`):
a launch a launcher can make on a GPU (`Spec`), the dtype pairs, seeds, row sizes and noise options the
launches cover, and the small helpers that build their arguments on the CPU. Used only by the AOT check
(aot.py, tests/kernels/test_aot.py, bench/kernels_aot.py); the kernels themselves never import it."""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Spec(NamedTuple):
    """One launch a launcher can make on a GPU. `launch()` calls the launcher with CPU tensors of
    these dtypes and shapes (`capture` below intercepts the kernel call: the launcher itself decides
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
    """The NoiseSpec (noise_prepare.prepare, on the CPU: the torch backend reduces the pyramid's std) of
    NOISE_OPTIONS[options] for data x0; None for the plain stream."""
    from .noise_prepare import prepare
    from .noise_spec import NoiseOptions

    if options is None:
        return None
    kw = dict(NOISE_OPTIONS[options])
    rows = torch.arange(x0.shape[0]) if kw.pop("rows", False) else None
    spec, _ = prepare(NoiseOptions(**kw), x0.float(), seed=SEEDS[0], offset=torch.zeros((), dtype=torch.int64),
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
