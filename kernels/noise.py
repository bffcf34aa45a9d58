"""The noise op: x_t = alpha[t]·x0 + sigma[t]·eps (DDPM's q(x_t | x0), Ho et al. 2020 eq. 4; a flow
schedule is the same with alpha = 1 - t, sigma = t), eps = philox(seed, offset + element index).

`fasttrain::noise` is an opaque `torch.library.custom_op` with `register_fake`, so a model compiled
with `fullgraph=True` can call it (a raw Triton launch, or `triton_op`, cannot be traced under the
interpreter); its autograd rule is ∂x_t/∂x0 = alpha[t]. Backends (backend.py): the Triton kernel
(triton_noise.py), the native C++/CUDA op (native.py), the PyTorch reference (torch_ref_noise.py).

Noise options (noise offset, pyramid noise, input perturbation, immiscible rows: noise_spec.py) arrive as
a `NoiseSpec`; without one every backend runs its plain kernel, unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native, noise_spec, philox
from . import torch_ref_noise as ref
from .backend import as_offset, resolve_backend
from .noise_spec import NoiseSpec


@torch.library.custom_op("fasttrain::noise", mutates_args=())
def _noise_op(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
              eps: Optional[torch.Tensor], seed: int, offset: torch.Tensor, out_dtype: torch.dtype,
              write_eps: bool, spec_i: list[int], table: Optional[torch.Tensor], rows: Optional[torch.Tensor],
              mean: Optional[torch.Tensor], std: Optional[torch.Tensor], backend: str,
              block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "native":
        return native.noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec_i, table, rows, mean,
                            std)
    spec = NoiseSpec(tuple(spec_i), table, rows, mean, std) if spec_i else None
    if backend == "torch":
        e = eps.float() if eps is not None else ref.reference_eps(spec, x0.shape, seed, offset, x0.device)
        eps_out = e.clone() if write_eps else x0.new_empty(0, dtype=torch.float32)
        xi = ref.reference_perturbation(spec, x0.shape, seed, offset, x0.device)
        return ref.noise(x0, t, alpha, sigma, e if xi is None else e + xi, out_dtype), eps_out
    from . import triton_noise  # imports triton: only now, after resolve_backend (backend.py)

    return triton_noise.noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec,
                              backend == "interpret", block)


@_noise_op.register_fake
def _(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec_i, table, rows, mean, std, backend, block):
    return (torch.empty(x0.shape, dtype=out_dtype, device=x0.device),
            torch.empty(x0.shape if write_eps else (0,), dtype=torch.float32, device=x0.device))


class _Noise(torch.autograd.Function):
    """Autograd rule of the noise op: ∂x_t/∂x0 = alpha[t] (eps is a constant, never differentiated)."""

    @staticmethod
    def forward(ctx, x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec_i, table, rows, mean, std,
                backend, block):
        xt, e = _noise_op(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec_i, table, rows, mean,
                          std, backend, block)
        ctx.save_for_backward(t, alpha)
        ctx.x0_dtype = x0.dtype
        ctx.mark_non_differentiable(e)
        return xt, e

    @staticmethod
    def backward(ctx, g_xt, g_eps):
        t, alpha = ctx.saved_tensors
        return (ref.column(alpha, t, g_xt.ndim) * g_xt.float()).to(ctx.x0_dtype), *([None] * 15)


def noise(x0, t, alpha, sigma, *, seed: int = 0, offset: int = 0, eps=None, out_dtype=None,
          return_eps: bool = False, spec: NoiseSpec | None = None, backend: str = "auto", block: int = 0):
    """x_t (and the eps it used when `return_eps`: the target's ε, without the perturbation). Tables are
    float32 [T] on x0's device; `offset` an int or an int64 0-d tensor on that device (a device counter:
    no host sync); `spec` the step's noise options (noise_prepare.prepare); `eps` given overrides the stream
    (tests, probes; not with a spec); `block` overrides the Triton tile (tests)."""
    backend = resolve_backend(backend, x0.device)
    if spec is not None and eps is not None:
        raise ValueError("give either eps or a noise spec, not both")
    noise_spec.check(spec, x0.shape, x0.device)
    xt, e = _Noise.apply(x0, t, alpha, sigma, eps, philox.check_seed(seed), as_offset(offset, x0.device),
                         out_dtype or x0.dtype, return_eps, *noise_spec.op_args(spec), backend, block)
    return (xt, e) if return_eps else xt


def randn(shape, *, seed: int, offset, device, backend: str = "auto") -> torch.Tensor:
    """The plain stream's ε [shape] (philox.randn) through the noise op's fast kernel (x_t = 0·0 + 1·ε is ε
    exactly): candidate noise for an immiscible assignment without philox.py's ~150 passes."""
    shape = tuple(shape)
    z = torch.zeros(shape, dtype=torch.float32, device=device)
    t = torch.zeros(shape[0], dtype=torch.int64, device=device)
    zero, one = torch.zeros(1, device=device), torch.ones(1, device=device)
    return noise(z, t, zero, one, seed=seed, offset=offset, out_dtype=torch.float32, backend=backend)
