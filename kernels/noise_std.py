"""The noise_std op: the pyramid noise's batch-global std (sd-scripts' pyramid_noise_like divides the
summed levels by `noise.std()`), one reduction over the noise a step regenerates, before the noise op
reads it (noise_prepare.prepare calls it; on the device, no host sync).

`fasttrain::noise_std` is a `torch.library.custom_op` with `register_fake` (no autograd: the noise is a
constant). Backends (backend.py): the Triton reduction (triton_noise_spec.moments), the native C++/CUDA
op (native.py), the PyTorch reference (torch_ref_noise_std.py).
"""
from __future__ import annotations

import torch

from . import native, noise_spec, philox
from . import torch_ref_noise_std as ref
from .backend import as_offset, resolve_backend
from .noise_spec import NoiseSpec


@torch.library.custom_op("fasttrain::noise_std", mutates_args=())
def _std_op(x0: torch.Tensor, seed: int, offset: torch.Tensor, spec_i: list[int], table: torch.Tensor | None,
            rows: torch.Tensor | None, mean: torch.Tensor | None, backend: str, block: int) -> torch.Tensor:
    spec = NoiseSpec(tuple(spec_i), table, rows, mean, None)
    if backend == "native":
        return native.noise_std(x0, seed, offset, spec_i, table, rows, mean)
    if backend == "torch":
        return ref.reference_std(spec, x0.shape, seed, offset, x0.device).reshape(())
    from . import triton_noise_spec  # imports triton: only now, after resolve_backend (backend.py)

    s = triton_noise_spec.moments(x0, seed, offset, spec, backend == "interpret", block)
    n = x0.numel()
    return torch.sqrt((s[1] - s[0] * s[0] / n) / (n - 1)).float()


@_std_op.register_fake
def _(x0, seed, offset, spec_i, table, rows, mean, backend, block):
    return torch.empty((), dtype=torch.float32, device=x0.device)


def noise_std(x0: torch.Tensor, spec: NoiseSpec, *, seed: int, offset, backend: str = "auto",
              block: int = 0) -> torch.Tensor:
    """The pyramid's global std (float32 0-d on x0's device) of the noise `spec` draws at (seed, offset)
    for data shaped like x0: one reduction over the regenerated noise, no host sync."""
    backend = resolve_backend(backend, x0.device)
    noise_spec.check(spec._replace(std=torch.ones((), device=x0.device)), x0.shape, x0.device)
    ints, table, rows, mean, _ = noise_spec.op_args(spec)
    return _std_op(x0, philox.check_seed(seed), as_offset(offset, x0.device), ints, table, rows, mean, backend, block)
