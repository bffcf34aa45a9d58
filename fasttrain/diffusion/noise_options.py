"""The noise options of a run (`diffusion.noise`) → what the kernels take (kernels/noise_spec.py), and the
immiscible noise assignment's row map.

Per-step diffusion math that practitioners use through diffusers' example scripts and kohya-ss/sd-scripts,
fused into the noise and loss kernels on the one Philox stream (formulas: kernels/noise_spec.py and
kernels/torch_ref_noise.py):

  key                              diffusers                sd-scripts
  offset                           --noise_offset           --noise_offset
  offset_random_strength           —                        --noise_offset_random_strength
  adaptive_offset                  —                        --adaptive_noise_scale (needs the offset)
  pyramid_iterations / _discount   —                        --multires_noise_iterations / _discount (0.3)
  perturbation                     --input_perturbation     --ip_noise_gamma
  perturbation_random_strength     —                        --ip_noise_gamma_random_strength
  immiscible (assignment, knn)     — (official code of Li et al. 2024 and its "Improved" knn variant)

The sources draw their random strengths with torch.rand and the pyramid's factors with Python's
`random`; here they come from the stream at the step's counter, so a resumed run draws them again.

Immiscible diffusion (Li et al., NeurIPS 2024, arXiv 2406.12303): `assignment` pairs the batch's images
with the batch's noise draws by a linear assignment on the L2 distances (not squared, as the official
code; fp32 here where the official code uses fp16 of 0.1-scaled values: the scale changes nothing, fp16
rounding only near-ties), so the noise set is only permuted and stays N(0, I); `knn` ("Improved Immiscible Diffusion",
arXiv 2505.18521) draws k fresh candidates per image and keeps the nearest (biased toward the data:
a deliberate trade-off). The assignment is SciPy's exact one on CPU tensors (the official code's
solver, about 200x faster there than the auction: bench/results/immiscible-cpu.md; SciPy comes with
scikit-learn) and immiscible.py's device auction on GPUs (no host sync, no SciPy in the step; its gap
to the exact optimum: the same table, tests/diffusion/test_immiscible.py). Both act
through the kernels' row map: sample b takes the base noise of row rows[b], drawn at the step's counter
(candidates in their own rows for knn); the distance matrices are computed on the device from the same
candidates (the noise op's fast path: noise.randn). Per rank: the official assignment gathers every
rank's noise and assigns over the global batch; here each rank assigns within its micro-batch (as the
official knn does).
"""
from __future__ import annotations

import torch

from fasttrain.kernels.noise import randn
from fasttrain.kernels.noise_spec import MAX_LEVELS, NoiseOptions

from ..errors import ConfigError, InvalidInput
from .immiscible import assignment, exact_assignment, knn_choice

IMMISCIBLE = ("none", "assignment", "knn")


def options(cfg) -> NoiseOptions:
    """NoiseOptions from the `diffusion.noise` group; InvalidInput for values the kernels refuse."""
    try:
        return NoiseOptions(offset=float(cfg.offset), offset_random=bool(cfg.offset_random_strength),
                            adaptive_scale=float(cfg.adaptive_offset), pyramid_iterations=int(cfg.pyramid_iterations),
                            pyramid_discount=float(cfg.pyramid_discount), perturbation=float(cfg.perturbation),
                            perturbation_random=bool(cfg.perturbation_random_strength))
    except ValueError as e:
        raise InvalidInput(str(e)) from None


def check_config(cfg, images: bool) -> None:
    """The cross-key rules of `diffusion.noise` (one line naming the key); `images`: [B, C, H, W] data."""
    def bad(key, why):
        raise ConfigError(f"bad value for 'diffusion.noise.{key}': {cfg[key]!r} ({why})")

    if cfg.adaptive_offset and not cfg.offset:
        bad("adaptive_offset", "needs diffusion.noise.offset > 0, as sd-scripts' adaptive_noise_scale")
    if cfg.offset_random_strength and not cfg.offset:
        bad("offset_random_strength", "needs diffusion.noise.offset > 0")
    if cfg.perturbation_random_strength and not cfg.perturbation:
        bad("perturbation_random_strength", "needs diffusion.noise.perturbation > 0")
    if cfg.pyramid_iterations and not images:
        bad("pyramid_iterations", "pyramid noise needs image or latent data [B, C, H, W]")
    if cfg.pyramid_iterations > MAX_LEVELS:
        bad("pyramid_iterations", f"at most {MAX_LEVELS}")
    if cfg.immiscible not in IMMISCIBLE:
        bad("immiscible", f"choose from {', '.join(IMMISCIBLE)}")


class Immiscible:
    """The row map of an immiscible noise assignment for one step (module docstring)."""

    def __init__(self, mode: str = "assignment", k: int = 64):
        if mode not in IMMISCIBLE[1:]:
            raise InvalidInput(f"immiscible must be one of {', '.join(IMMISCIBLE)}, got {mode!r}")
        if int(k) < 1:
            raise InvalidInput(f"immiscible_k must be >= 1, got {k!r}")
        self.mode, self.k = mode, int(k)

    def n_rows(self, B: int) -> int:
        return B * self.k if self.mode == "knn" else B

    def rows(self, x0: torch.Tensor, *, seed: int, offset, backend: str) -> tuple[torch.Tensor, int]:
        """(rows Long[B], the number of candidate rows at the step's counter), on the device."""
        B = x0.shape[0]
        R = self.n_rows(B)
        with torch.no_grad():
            cand = randn((R, *x0.shape[1:]), seed=seed, offset=offset, device=x0.device, backend=backend)
            x = x0.detach().float().flatten(1)
            if self.mode == "assignment":
                # CPU tensors: SciPy's exact solver (nothing to sync with, and faster there); on a GPU the
                # device auction (no host sync)
                solve = exact_assignment if x0.device.type == "cpu" else assignment
                return solve(torch.cdist(x, cand.flatten(1))), R
            dist = torch.linalg.vector_norm(x[:, None] - cand.view(B, self.k, -1), dim=2)  # [B, k]
            return torch.arange(B, device=x0.device) * self.k + knn_choice(dist), R


def from_config(cfg) -> dict:
    """The objective's keyword arguments for the `diffusion.noise` group."""
    return {"noise": options(cfg), "immiscible": None if cfg.immiscible == "none" else
            Immiscible(cfg.immiscible, cfg.immiscible_k)}
