"""What the Triton kernels share: the default tile size of the noise and loss kernels, and the scatter
of one per-sample value into the per-timestep bins (layout: bins.py)."""
from __future__ import annotations

import triton
import triton.language as tl


def block_size(D: int, interpret: bool, block: int = 0) -> int:
    """Elements per program for samples of D elements (`block` overrides it: tests)."""
    if block:
        return block
    # Interpreter: few large programs (each costs ~0.5 ms of Python); GPU: 2048-element tiles.
    return min(16384 if interpret else 2048, max(16, triton.next_power_of_2(D)))


@triton.jit
def scatter_value(bins_ptr, pivot_ptr, v, row, tb, T, mask):
    """Add one value (row `row` of V) of one sample at timestep tb: Σ(x - c) and Σ(x - c)² (bins.py)."""
    d = v.to(tl.float64) - tl.load(pivot_ptr + row * T + tb, mask=mask, other=0.0)
    tl.atomic_add(bins_ptr + (1 + 2 * row) * T + tb, d, mask=mask)
    tl.atomic_add(bins_ptr + (2 + 2 * row) * T + tb, d * d, mask=mask)
