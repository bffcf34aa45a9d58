"""The noise kernel in Triton: x_t = alpha[t_b]·x0 + sigma[t_b]·eps (the op: noise.py).

eps ~ N(0, 1) from Philox keyed on (seed, offset + global element index), `tl.randn`; the offset is
read from a device scalar, so a captured CUDA graph draws new noise on every replay (philox.py is
the same stream in PyTorch). eps is never written to memory (an optional output for tests), and it
is identical for any block size or grid: the loss kernel (triton_diffusion_loss.py) regenerates it.

With noise options (SPEC != 0; noise_spec.py, triton_noise_spec.py) eps is the options' ε, and x_t is
built from eps + γ·ξ where there is a perturbation; the plain kernel (SPEC = 0) is unchanged.

Byte floor: read x0, write x_t (eps costs nothing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_shared as shared
from .noise_spec import PYRAMID
from .triton_noise_spec import launch_args, spec_eps, spec_perturbation
from .triton_shared import block_size, div_of


# The seed is not value-specialised (a seed of 1 would otherwise compile a kernel of its own).
@triton.jit(do_not_specialize=["seed"])
def noise_kernel(x0_ptr, t_ptr, alpha_ptr, sigma_ptr, eps_ptr, xt_ptr, eps_out_ptr, D, seed, offset_ptr,
                 rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L, K_XI, K_N, K_S, K_L, N,
                 HAS_EPS: tl.constexpr, WRITE_EPS: tl.constexpr, SPEC: tl.constexpr, BLOCK: tl.constexpr,
                 DIV: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    D = D // DIV * DIV  # == D: DIV-wide loads and stores (triton_shared.div_of)
    idx = c * BLOCK + tl.arange(0, BLOCK)
    mask = idx < D
    gidx = b.to(tl.int64) * D + idx  # global element index: the Philox counter
    tb = tl.load(t_ptr + b)
    a = tl.load(alpha_ptr + tb)
    s = tl.load(sigma_ptr + tb)
    x0 = tl.load(x0_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    if HAS_EPS:
        eps = tl.load(eps_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    elif SPEC == 0:
        eps = tl.randn(seed, tl.load(offset_ptr) + gidx)
    else:
        eps = spec_eps(seed, tl.load(offset_ptr), b.to(tl.int64), idx, mask, D, rows_ptr, tab_ptr, mean_ptr, std_ptr,
                       C, HW, H, W, L, K_N, K_S, K_L, N, SPEC=SPEC, NORM=True)
    if SPEC & 16:  # PERTURB (noise_spec.py; eps given comes without a spec: noise.py)
        e_x = eps + spec_perturbation(seed, tl.load(offset_ptr), b.to(tl.int64), idx, D, tab_ptr, K_XI, K_S, SPEC)
        tl.store(xt_ptr + gidx, (a * x0 + s * e_x).to(xt_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(xt_ptr + gidx, (a * x0 + s * eps).to(xt_ptr.dtype.element_ty), mask=mask)
    if WRITE_EPS:
        tl.store(eps_out_ptr + gidx, eps, mask=mask)


def noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec, interpret, block):
    """(x_t, eps or an empty tensor): one launch of a grid (B, ⌈D/BLOCK⌉)."""
    B, D = x0.shape[0], x0[0].numel()
    x0c = x0.contiguous()
    xt = torch.empty(x0.shape, dtype=out_dtype, device=x0.device)
    eps_out = torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device)
    args, flags = launch_args(spec, x0c)
    pyramid = bool(flags & PYRAMID)
    BLOCK = block_size(D, interpret, block, pyramid)
    noise_kernel[(B, triton.cdiv(D, BLOCK))](x0c, t, alpha, sigma, eps.contiguous() if eps is not None else x0c,
                                             xt, eps_out, D, seed, offset, *args, HAS_EPS=eps is not None,
                                             WRITE_EPS=write_eps, SPEC=flags, BLOCK=BLOCK, DIV=div_of(D),
                                             **shared.kernel_options(BLOCK, bool(flags), pyramid))
    return xt, eps_out


STREAMS = ("x0_ptr", "eps_ptr", "xt_ptr", "eps_out_ptr")  # rows of elements (aot_specs.Spec)


def specializations(aot):
    """Every compilation `noise` can launch on a GPU (aot_specs.Spec): each (data, model) dtype
    pair with eps drawn, given (fp32, as the probes pass it, or in x0's dtype) and written out, at a
    3×32×32 row; each tile size and alignment class (aot.row_sizes) in each dtype with an
    int32 and an int64 seed, some with an unaligned x0; each group of noise options
    (aot.NOISE_OPTIONS) in each dtype pair. A new launcher option extends this list."""
    def spec(x_dt, out_dt, D=3072, eps_dt=None, write_eps=False, seed=aot.SEEDS[0], aligned=True, options=None):
        def launch():
            shape = aot.IMAGE if options else (2, D)
            x0 = torch.zeros(shape, dtype=x_dt) if aligned else aot.unaligned(shape, x_dt).zero_()
            tab = torch.zeros(1000)
            eps = None if eps_dt is None else torch.empty(2, D, dtype=eps_dt)
            return noise(x0, torch.zeros(2, dtype=torch.int64), tab, tab, eps, seed,
                         torch.zeros((), dtype=torch.int64), out_dt, write_eps, aot.noise_spec(x0, options),
                         False, 0)
        axes = dict(x0=aot.name(x_dt), out=aot.name(out_dt), eps=aot.name(eps_dt), write_eps=write_eps,
                    D=D, seed=aot.name(seed), aligned=aligned, noise=options or "plain")
        return aot.Spec(axes, launch, min(div_of(D), block_size(D, False)), STREAMS)

    for x_dt, out_dt in aot.DTYPE_PAIRS:
        for eps_dt in dict.fromkeys((None, torch.float32, x_dt)):
            for write_eps in (False, True):
                yield spec(x_dt, out_dt, eps_dt=eps_dt, write_eps=write_eps)
    for i, D in enumerate(aot.row_sizes()):
        for j, dt in enumerate(aot.SAME_DTYPES):
            for seed in aot.SEEDS:
                yield spec(dt, dt, D, seed=seed)
            if (i + j) % 3 == 0:
                yield spec(dt, dt, D, seed=aot.SEEDS[(i + j) % 2], aligned=False)
    for i, options in enumerate(aot.NOISE_OPTIONS):
        for j, (x_dt, out_dt) in enumerate(aot.DTYPE_PAIRS):
            yield spec(x_dt, out_dt, options=options, write_eps=(i + j) % 2 == 1)
