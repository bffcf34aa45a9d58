"""The noise options of one step as the noise and loss kernels receive them (the "noise spec"): the
options, their counter layout, the checks and the per-step preparation. Their PyTorch reference math
(the oracle of every backend and the `torch` backend itself) is torch_ref_noise.py; the pyramid's std,
an op of its own, is noise_std.py (reference: torch_ref_noise_std.py); a step's spec, with that std
reduced on the device, is noise_prepare.py's `prepare` (above both, so neither imports the other back).

Options (`NoiseOptions`, per run; research note: docs/architecture.md, "Noise and loss options"):
  offset          noise offset (diffusers --noise_offset, sd-scripts noise_offset): ε + s·n, n one normal
                  per sample and channel, broadcast over the pixels; s = c, or c·u with u ~ U[0, 1) once
                  per batch (sd-scripts noise_offset_random_strength), plus, for sd-scripts'
                  adaptive_noise_scale a, s = max(0, s + a·|mean over pixels of x0|) per sample and channel.
  pyramid         multi-resolution noise (sd-scripts pyramid_noise_like, multires_noise_iterations and
                  _discount): for level l = 0, 1, ... the factor r_l ~ U[2, 4), the size
                  (max(1, int(H / r_l^l)), max(1, int(W / r_l^l))), a normal field of that size upsampled
                  bilinearly (align_corners False) to H × W and added with weight discount^l; stop after a
                  level with a side of 1; then ε / std(ε), the unbiased std over the whole batch.
  perturbation    input perturbation (Ning et al. 2023; diffusers --input_perturbation, sd-scripts
                  ip_noise_gamma and its random strength): x_t is built from ε + γ·ξ (γ·u, u ~ U[0, 1) once
                  per batch, for the random strength), the target keeps ε.
  rows            immiscible noise assignment: sample b takes the base noise of row rows[b] (identity
                  when absent).
Order as sd-scripts: offset, then pyramid (whose std includes the offset), then the perturbation.

Every random number is the Philox stream (philox.py) at the step's counter `offset`, in sub-ranges
whose starts (relative to the offset) depend only on the shapes:
  [0, R·D)            base ε: sample b, element i at rows[b]·D + i (R rows: B, or k·B knn candidates)
  K_XI + b·D + i      ξ (perturbation)
  K_N + b·C + c       n (offset)
  K_S + 0, K_S + 1    u of the offset and of the perturbation (tl.rand: the first Philox word)
  K_S + 2 + l         r_l = 2 + 2·u (float64; r_l^l by l-fold multiplication)
  K_L + l·N + ((b·C + c)·h_l + y)·w_l + x   level l's field (N = B·D: a level never overruns its range)
Without options the step draws exactly B·D counters, as before. The random strengths and the r_l
come from the stream, so a resumed run draws them again exactly.

What the ops receive (`NoiseSpec`): `ints` (flags, levels, C, H, W, K_XI, K_N, K_S, K_L: host
integers), `table` float32 [3 + L] on the device (offset c, adaptive scale a, γ, the level weights
float32(discount^l): per run), and per step `rows` int64 [B], `mean` float32 [B, C] (|mean over pixels
of x0|, adaptive offset) and `std` float32 0-d (the pyramid's std, from the `noise_std` op: a
reduction over the regenerated noise before the noise op; on the device, no host sync).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

OFFSET, OFFSET_RANDOM, ADAPTIVE, PYRAMID, PERTURB, PERTURB_RANDOM = 1, 2, 4, 8, 16, 32
ROWS = 64  # not in `ints`: the kernels' switch for the rows tensor (Triton constexpr SPEC)
MAX_LEVELS = 16  # pyramid levels the native kernels hold (a side of 2^15 reaches 1 by level 16)
FLAGS, LEVELS, CH, HH, WW, K_XI, K_N, K_S, K_L = range(9)  # positions in `ints`
NINTS = 9
T_OFFSET, T_ADAPTIVE, T_GAMMA, T_LEVELS = 0, 1, 2, 3  # positions in `table`


@dataclass(frozen=True)
class NoiseOptions:
    """The noise options of a run (module docstring); all off by default."""
    offset: float = 0.0
    offset_random: bool = False
    adaptive_scale: float = 0.0
    pyramid_iterations: int = 0
    pyramid_discount: float = 0.3
    perturbation: float = 0.0
    perturbation_random: bool = False

    def __post_init__(self):
        for name in ("offset", "adaptive_scale", "pyramid_discount", "perturbation"):
            if not math.isfinite(float(getattr(self, name))):
                raise ValueError(f"noise option {name} must be finite, got {getattr(self, name)!r}")
        if self.offset < 0 or self.perturbation < 0 or self.pyramid_discount < 0:
            raise ValueError("noise offset, perturbation and pyramid discount must be >= 0")
        if not 0 <= int(self.pyramid_iterations) <= MAX_LEVELS:
            raise ValueError(f"pyramid iterations must lie in [0, {MAX_LEVELS}], got {self.pyramid_iterations!r}")
        if self.adaptive_scale and not self.offset:
            raise ValueError("an adaptive noise offset scale needs a noise offset (as sd-scripts requires)")

    @property
    def flags(self) -> int:
        f = 0
        if self.offset:
            f |= OFFSET | (OFFSET_RANDOM if self.offset_random else 0) | (ADAPTIVE if self.adaptive_scale else 0)
        if self.pyramid_iterations:
            f |= PYRAMID
        if self.perturbation:
            f |= PERTURB | (PERTURB_RANDOM if self.perturbation_random else 0)
        return f

    @property
    def active(self) -> bool:
        return self.flags != 0

    def table(self, device="cpu") -> torch.Tensor:
        """float32 [3 + L]: offset c, adaptive scale, γ, and float32(discount^l) for each level, the values
        torch uses when it multiplies float32 noise by these Python floats (as the sources do)."""
        w = [self.pyramid_discount ** lv for lv in range(int(self.pyramid_iterations))]
        return torch.tensor([self.offset, self.adaptive_scale, self.perturbation] + w, dtype=torch.float32,
                            device=device)


class NoiseSpec(NamedTuple):
    ints: tuple                      # NINTS host integers (positions above)
    table: torch.Tensor | None       # float32 [3 + L] on the data's device
    rows: torch.Tensor | None        # int64 [B]: the base-noise row of each sample
    mean: torch.Tensor | None        # float32 [B, C]: |mean over pixels of x0| (adaptive offset)
    std: torch.Tensor | None         # float32 0-d: the pyramid's global std


class Layout(NamedTuple):
    ints: tuple
    counters: int  # how far this step's counter advances


def geometry(shape) -> tuple[int, int, int, int, int]:
    """(B, D, C, H, W): channels are dim 1 (1 for [B] data); H, W the spatial dims of [B, C, H, W] data."""
    B = int(shape[0])
    D = 1
    for s in shape[1:]:  # (a loop: torch.compile traces it, not math.prod over a generator)
        D *= int(s)
    C = int(shape[1]) if len(shape) > 1 else 1
    H, W = (int(shape[2]), int(shape[3])) if len(shape) == 4 else (1, 1)
    return B, D, C, H, W


def layout(options: NoiseOptions | None, shape, rows: int | None = None) -> Layout:
    """The counter sub-ranges of one step for data of `shape` with `rows` base-noise rows (default B)."""
    return _layout(options or NoiseOptions(), tuple(int(s) for s in shape), None if rows is None else int(rows))


@functools.lru_cache(maxsize=64)  # per run: a handful of shapes; host integers only
def _layout(options: NoiseOptions, shape: tuple, rows: int | None) -> Layout:
    B, D, C, H, W = geometry(shape)
    f, L = options.flags, int(options.pyramid_iterations)
    if f & PYRAMID and len(shape) != 4:
        raise ValueError(f"pyramid noise needs [B, C, H, W] data, got shape {tuple(shape)}")
    R = B if rows is None else int(rows)
    if R < B:
        raise ValueError(f"{R} noise rows cannot serve a batch of {B}")
    N = B * D
    k = R * D
    k_xi = k
    k += N if f & PERTURB else 0
    k_n = k
    k += B * C if f & OFFSET else 0
    k_s = k
    k += 2 + L if f & (OFFSET_RANDOM | PERTURB_RANDOM | PYRAMID) else 0
    k_l = k
    k += L * N if f & PYRAMID else 0
    return Layout((f, L if f & PYRAMID else 0, C, H, W, k_xi, k_n, k_s, k_l), k)


def check(spec: NoiseSpec | None, shape, device) -> None:
    """One-line errors for a spec that does not fit data of `shape` (all backends)."""
    if spec is None:
        return
    B, D, C, H, W = geometry(shape)
    if len(spec.ints) != NINTS:
        raise ValueError(f"a noise spec holds {NINTS} integers, got {len(spec.ints)}")
    f, L = spec.ints[FLAGS], spec.ints[LEVELS]
    if spec.ints[CH] != C or (f & PYRAMID and (spec.ints[HH], spec.ints[WW]) != (H, W)):
        raise ValueError(f"the noise spec was laid out for another shape than {tuple(shape)}")
    if f and (spec.table is None or spec.table.numel() < 3 + L or spec.table.dtype != torch.float32):
        raise ValueError(f"the noise spec needs a float32 table of {3 + L} values")
    if spec.rows is not None and (spec.rows.shape != (B,) or spec.rows.dtype != torch.int64):
        raise ValueError(f"noise rows must be int64 [{B}], got {spec.rows.dtype} {tuple(spec.rows.shape)}")
    if f & ADAPTIVE and (spec.mean is None or tuple(spec.mean.shape) != (B, C)):
        raise ValueError(f"an adaptive noise offset needs |mean(x0)| of shape [{B}, {C}]")
    if f & PYRAMID and spec.std is None:
        raise ValueError("pyramid noise needs its std (noise_prepare.prepare computes it)")
    for name in ("table", "rows", "mean", "std"):
        x = getattr(spec, name)
        if x is not None and x.device != torch.device(device):
            raise ValueError(f"noise spec {name} is on {x.device}, the data on {device}")


def op_args(spec: NoiseSpec | None) -> tuple:
    """(ints, table, rows, mean, std) as the custom ops take them: an empty list is the plain stream."""
    if spec is None:
        return [], None, None, None, None
    return list(spec.ints), spec.table, spec.rows, spec.mean, spec.std


def pixel_mean(x0: torch.Tensor) -> torch.Tensor:
    """|mean over the pixels| per sample and channel, float32 [B, C] (sd-scripts' adaptive offset:
    abs(latents.mean(dim=(2, 3))))."""
    x = x0.float()
    if x.ndim == 1:
        x = x[:, None]
    return (x.mean(tuple(range(2, x.ndim))) if x.ndim > 2 else x).abs().contiguous()
