"""What the Triton kernels share: the default tile size of the noise and loss kernels and their launch
options, the alignment class of a row length, the scatter of one per-sample value into the
per-timestep bins (layout: bins.py) and the loss shapes (loss_shape.py). The vocabulary of the
launchers' `specializations()` (what kernels/aot.py compiles for sm_80 and sm_90) is aot.py's."""
from __future__ import annotations

import triton
import triton.language as tl

# Tile of the kernels when pyramid noise is on (noise_spec.py): each element draws 4 normals per
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


def kernel_options(block: int, options: bool, pyramid: bool) -> dict:
    """num_warps and register budget of a noise or loss kernel with noise options (`options`; `pyramid`:
    pyramid noise among them): launch_options without options; the pyramid's (pyramid_options) with
    pyramid noise; else a 96-register budget (the loss kernel with the adaptive offset spilled 8 bytes
    on sm_90 under 64: kernels/aot.py, full set)."""
    if pyramid:
        return pyramid_options()
    return {**launch_options(block), "maxnreg": 96} if options else launch_options(block)


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
