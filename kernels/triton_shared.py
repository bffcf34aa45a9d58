"""What the Triton kernels share: the default tile size of the noise and loss kernels, the scatter
of one per-sample value into the per-timestep bins (layout: bins.py), and the loss shapes
(loss_shape.py)."""
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
