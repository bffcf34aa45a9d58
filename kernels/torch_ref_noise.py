"""The PyTorch reference math of the noise op (noise.py): the test oracle of every other backend, and
the `torch` backend itself.

Contract (x0, eps [B, ...]; t Long[B]; tables float [T]):
  noise(x0, t, alpha, sigma, eps)     x_t = alpha[t]·x0 + sigma[t]·eps, in x0's dtype (or out_dtype)
The plain noise is `philox.randn(shape, seed, offset)`, the stream the kernels draw in place; with noise
options (noise_spec.py: the options, their counter layout and the spec the ops receive) the ε of the
target is `reference_eps` and x_t adds `reference_perturbation`. Every op that regenerates ε (the loss
ops, noise_std) reads its reference ε here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import philox
from .noise_spec import (
    ADAPTIVE,
    FLAGS,
    K_L,
    K_N,
    K_S,
    K_XI,
    LEVELS,
    OFFSET,
    OFFSET_RANDOM,
    PERTURB,
    PERTURB_RANDOM,
    PYRAMID,
    T_ADAPTIVE,
    T_GAMMA,
    T_LEVELS,
    T_OFFSET,
    NoiseSpec,
    geometry,
)


def column(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather a [T] table at t as float32 and shape it [B, 1, ...] to broadcast over a sample."""
    return table.to(torch.float32)[t].view(-1, *([1] * (ndim - 1)))


def noise(x0: torch.Tensor, t: torch.Tensor, alpha: torch.Tensor, sigma: torch.Tensor,
          eps: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    x_t = column(alpha, t, x0.ndim) * x0.float() + column(sigma, t, x0.ndim) * eps.float()
    return x_t.to(out_dtype or x0.dtype)


def rand(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, counter)`: float32 U[0, 1) from the first Philox word."""
    return philox.uniform(philox.philox4x32(seed, counters)[0])


def draws(spec: NoiseSpec, seed: int, offset, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u of the offset, u of the perturbation: float32 0-d, 1 where not random; r_l: float64 [L])."""
    f, L = spec.ints[FLAGS], spec.ints[LEVELS]
    ctr = torch.arange(2 + L, dtype=torch.int64, device=device) + spec.ints[K_S] + offset
    u = rand(seed, ctr)
    one = torch.ones((), dtype=torch.float32, device=device)
    return (u[0] if f & OFFSET_RANDOM else one, u[1] if f & PERTURB_RANDOM else one,
            2.0 + 2.0 * u[2:].double())


def level_sizes(r: torch.Tensor, H: int, W: int) -> list[tuple[int, int]]:
    """The live levels' (h, w): max(1, int(H / r_l^l)) (r_l^l by l-fold float64 multiplication), up to and
    including the first level with a side of 1 (sd-scripts' break). Reads r on the host."""
    sizes = []
    for lv, rl in enumerate(r.tolist()):
        p = 1.0
        for _ in range(lv):
            p *= rl
        h, w = max(1, int(H / p)), max(1, int(W / p))
        sizes.append((h, w))
        if h == 1 or w == 1:
            break
    return sizes


def pre_std_eps(spec: NoiseSpec, shape, seed: int, offset, device) -> torch.Tensor:
    """ε before the pyramid's division by its std (float32), for the rows, offset and pyramid of `spec`."""
    B, D, C, H, W = geometry(shape)
    f = spec.ints[FLAGS]
    rows = spec.rows if spec.rows is not None else torch.arange(B, device=device)
    ctr = rows.to(device, torch.int64)[:, None] * D + torch.arange(D, dtype=torch.int64, device=device) + offset
    eps = philox.normal(seed, ctr).view(tuple(shape))
    if not f:
        return eps
    u_off, _, r = draws(spec, seed, offset, device)
    bc = (B, C) + (1,) * (len(shape) - 2)
    if f & OFFSET:
        s = (spec.table[T_OFFSET] * u_off).expand(B, C)
        if f & ADAPTIVE:
            s = torch.clamp(s + spec.table[T_ADAPTIVE] * spec.mean, min=0)
        n = philox.randn((B, C), seed, offset + spec.ints[K_N], device)
        eps = eps + (s * n).reshape(bc)
    if f & PYRAMID:
        for lv, (h, w) in enumerate(level_sizes(r, H, W)):
            z = philox.randn((B, C, h, w), seed, offset + spec.ints[K_L] + lv * B * D, device)
            eps = eps + F.interpolate(z, size=(H, W), mode="bilinear", align_corners=False) * spec.table[T_LEVELS + lv]
    return eps


def reference_eps(spec: NoiseSpec | None, shape, seed: int, offset, device) -> torch.Tensor:
    """The ε of the target (and of x_t, before the perturbation), float32 (the spec's std divides the
    pyramid noise, as the kernels do; the reference std: `reference_std`)."""
    if spec is None:
        return philox.randn(shape, seed, offset, device)
    eps = pre_std_eps(spec, shape, seed, offset, device)
    return eps / spec.std if spec.ints[FLAGS] & PYRAMID else eps


def reference_perturbation(spec: NoiseSpec | None, shape, seed: int, offset, device) -> torch.Tensor | None:
    """γ·u·ξ (float32), added to ε for x_t only; None without a perturbation."""
    if spec is None or not spec.ints[FLAGS] & PERTURB:
        return None
    _, u_ip, _ = draws(spec, seed, offset, device)
    xi = philox.randn(shape, seed, offset + spec.ints[K_XI], device)
    return (spec.table[T_GAMMA] * u_ip) * xi
