"""Kernels the AOT check (kernels/aot.py) must reject, each for one reason, with launchers and
`specializations()` in the shape of the real Triton modules: a constexpr misuse only the compiler
refuses (the interpreter runs it: a tile size from a runtime int), a kernel that spills (its launcher
caps the registers), a copy whose mask hides its rows' alignment (the masked form the noise and loss
kernels had before DIV: 32-bit accesses where 128-bit are possible), and a flag no launch sets.
tests/kernels/test_aot.py compiles them."""
import torch
import triton
import triton.language as tl

from fasttrain.kernels.aot import Spec
from fasttrain.kernels.triton_shared import div_of


@triton.jit
def arange_kernel(x_ptr, y_ptr, N):
    i = tl.arange(0, N)  # N is a runtime int, not a tl.constexpr
    tl.store(y_ptr + i, tl.load(x_ptr + i))


@triton.jit
def spill_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    s = tl.sum(x * x, axis=0)
    tl.store(y_ptr + i, tl.exp(x) * s + tl.sin(x))  # x (32 fp32 per thread) live across the reduction


@triton.jit
def copy_kernel(x_ptr, y_ptr, D, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    b = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    mask = idx < D  # with D % 16 != 0 Triton cannot tell rows start aligned: scalar accesses
    v = tl.load(x_ptr + b * D + idx, mask=mask)
    if FLAG:
        v = -v
    tl.store(y_ptr + b * D + idx, v, mask=mask)


def arange(x):
    y = torch.empty_like(x)
    arange_kernel[(1,)](x, y, x.numel())


def spill(x):
    y = torch.empty_like(x)
    spill_kernel[(1,)](x, y, BLOCK=x.numel(), maxnreg=32)


def copy(x):
    y = torch.empty_like(x)
    copy_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), FLAG=False)


def specializations(aot=None):
    yield Spec(dict(case="arange"), lambda: arange(torch.empty(64)), 1, ())
    yield Spec(dict(case="spill"), lambda: spill(torch.empty(4096)), 1, ())
    D = 1020  # DIV 4: four fp32 per access are possible
    yield Spec(dict(case="copy", D=D), lambda: copy(torch.empty(2, D)), min(div_of(D), 1024), ("x_ptr", "y_ptr"))
