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

from .triton_noise_spec import launch_args, spec_eps, spec_perturbation
from .triton_shared import block_size


@triton.jit
def noise_kernel(x0_ptr, t_ptr, alpha_ptr, sigma_ptr, eps_ptr, xt_ptr, eps_out_ptr, D, seed, offset_ptr,
                 rows_ptr, tab_ptr, mean_ptr, std_ptr, C, HW, H, W, L, K_XI, K_N, K_S, K_L, N,
                 HAS_EPS: tl.constexpr, WRITE_EPS: tl.constexpr, SPEC: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
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
    BLOCK = block_size(D, interpret, block)
    args, flags = launch_args(spec, x0c)
    noise_kernel[(B, triton.cdiv(D, BLOCK))](x0c, t, alpha, sigma, eps.contiguous() if eps is not None else x0c,
                                             xt, eps_out, D, seed, offset, *args, HAS_EPS=eps is not None,
                                             WRITE_EPS=write_eps, SPEC=flags, BLOCK=BLOCK)
    return xt, eps_out
