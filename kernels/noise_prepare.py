"""A step's noise spec (noise_spec.py: the options, their counter layout, the spec the ops receive), with
the pyramid's std reduced on the device by the noise_std op (noise_std.py). It sits above both: the spec
module is what every op builds on, and the std op is one of those ops."""
from __future__ import annotations

import torch

from .noise_spec import ADAPTIVE, PYRAMID, NoiseOptions, NoiseSpec, layout, pixel_mean
from .noise_std import noise_std


def prepare(options: NoiseOptions | None, x0: torch.Tensor, *, seed: int, offset, table: torch.Tensor | None = None,
            rows: torch.Tensor | None = None, n_rows: int | None = None, backend: str = "auto"
            ) -> tuple[NoiseSpec | None, int]:
    """(the step's spec, counters it draws): None for the plain stream. `table`: options.table() on the
    data's device (cache it: it is per run); `rows`/`n_rows`: the immiscible row map and the number of
    base-noise rows it indexes. The pyramid's std is reduced here, on the device."""
    options = options or NoiseOptions()
    lay = layout(options, x0.shape, n_rows)
    if not options.active and rows is None:
        return None, lay.counters
    if table is None and options.active:
        table = options.table(x0.device)
    mean = pixel_mean(x0) if options.flags & ADAPTIVE else None
    spec = NoiseSpec(lay.ints, table, rows, mean, None)
    if options.flags & PYRAMID:
        spec = spec._replace(std=noise_std(x0, spec, seed=seed, offset=offset, backend=backend))
    return spec, lay.counters
