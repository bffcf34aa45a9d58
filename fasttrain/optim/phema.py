"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models",
EDM2 §3 and Appendix C.1–C.3): training tracks a few power-function EMA profiles and writes them as
snapshots; after training, the EMA of any relative length σ_rel is reconstructed from the snapshots as
the least-squares combination of their profiles.

A power-function EMA at training time t (counted in images, as EDM2 counts it) averages the weights
θ(τ) with the profile (EDM2 Eq. 121, the continuous form)

    p_{γ,t}(τ) = (γ + 1) τ^γ / t^(γ+1),   0 ≤ τ ≤ t,

which scales with t; its relative standard deviation (the std of τ under p over the time t) is
σ_rel = sqrt((γ + 1) / ((γ + 2)² (γ + 3)))  (Eq. 123). Tracking it with an EMA takes
β_t = (1 − Δt / t)^(γ+1) at each update of Δt images (Eq. 127): the weight of the past is its share of
the profile's mass, ((t − Δt)/t)^(γ+1).

Reconstruction (App. C.3, Algorithm 3): for snapshots i (profiles p_i at times t_i) and a target profile
p_out, the coefficients x minimise ∫ (Σ_i x_i p_i − p_out)² dτ, i.e. A x = b with A_ij = ⟨p_i, p_j⟩,
b_i = ⟨p_i, p_out⟩, normalised to Σ x = 1 (EDM2 normalises so the weights sum to one). The inner product
of two profiles, integrated over [0, min(t_a, t_b)] where both are non-zero:

    ⟨p_a, p_b⟩ = (γa+1)(γb+1) m^(γa+γb+1) / ((γa+γb+1) t_a^(γa+1) t_b^(γb+1)),   m = min(t_a, t_b),

computed here in log space (tests/optim/test_phema.py checks it against numerical quadrature).

`PowerEMA` keeps the profiles beside the parameters as `EMA` keeps its average (ema.py: DTensor shards
under FSDP2, no host sync per update: the time t is a device counter). A skipped (non-finite) step
updates the profiles too: its weights did not change, and the profile is over the weights as a function
of time, which stayed where they were.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InvalidInput
from .ema import clean_name, fsdp_modules, trained

SIGMA_REL_MAX = math.sqrt(1 / 12)  # γ → 0: the uniform average over the whole run (Eq. 123 at γ = 0)
DEFAULT_SIGMA_RELS = (0.05, 0.10)  # EDM2's two tracked profiles (training/phema.py PowerFunctionEMA)


def check_sigma_rel(s: float, what: str = "σ_rel") -> float:
    s = float(s)
    if not (0 < s < SIGMA_REL_MAX) or s != s:
        raise InvalidInput(f"{what} must lie in (0, {SIGMA_REL_MAX:.4f}) (a power-function profile with γ > 0), "
                           f"got {s:g}")
    return s


def check_config(pc) -> None:
    """The `phema` config group: at least one σ_rel, no two alike (their profiles would be one, and the
    reconstruction's system singular)."""
    sig = [check_sigma_rel(s, "phema.sigma_rels") for s in pc.sigma_rels]
    if pc.every and not sig:
        raise InvalidInput("bad value for 'phema.sigma_rels': [] (track at least one profile, EDM2: [0.05, 0.1])")
    if len(set(sig)) != len(sig):
        raise InvalidInput(f"bad value for 'phema.sigma_rels': {sig} (each profile once)")


def sigma_rel_of(gamma: float) -> float:
    """Eq. 123: the relative standard deviation of the profile with exponent γ."""
    g = float(gamma)
    return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))


def gamma_of(sigma_rel: float) -> float:
    """The exponent γ > 0 whose profile has this σ_rel: Eq. 123 inverted. σ_rel(γ) decreases on γ ≥ 0
    (its log-derivative 1/(γ+1) − 2/(γ+2) − 1/(γ+3) is negative there), so bisection on log γ finds the
    one root to float64 resolution."""
    s = check_sigma_rel(sigma_rel)
    lo, hi = -40.0, 40.0  # log γ: γ from 4e-18 (σ_rel ≈ 0.2887) to 2e17 (σ_rel ≈ 2e-9)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if sigma_rel_of(math.exp(mid)) > s:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def inner(t_a: float, g_a: float, t_b: float, g_b: float) -> float:
    """⟨p_{γa,ta}, p_{γb,tb}⟩ (module docstring), in log space."""
    m = min(t_a, t_b)
    log = (math.log(g_a + 1) + math.log(g_b + 1) + (g_a + g_b + 1) * math.log(m) - math.log(g_a + g_b + 1)
           - (g_a + 1) * math.log(t_a) - (g_b + 1) * math.log(t_b))
    return math.exp(log)


def coefficients(times, sigma_rels, out_time: float, out_sigma_rels) -> torch.Tensor:
    """float64 [snapshots, outputs]: the weight of snapshot profile i (at `times[i]`, σ_rel `sigma_rels[i]`)
    in the reconstruction of each output profile (at `out_time`), columns summing to one (Algorithm 3)."""
    times, sig = [float(t) for t in times], [float(s) for s in sigma_rels]
    if len(times) != len(sig) or not times:
        raise InvalidInput("post-hoc EMA needs at least one snapshot profile (a time and a σ_rel each)")
    if min(times) <= 0 or out_time <= 0:
        raise InvalidInput("post-hoc EMA profiles start at t = 0: snapshot times must be > 0")
    g = [gamma_of(s) for s in sig]
    g_out = [gamma_of(s) for s in out_sigma_rels]
    A = torch.tensor([[inner(ti, gi, tj, gj) for tj, gj in zip(times, g)] for ti, gi in zip(times, g)],
                     dtype=torch.float64)
    b = torch.tensor([[inner(ti, gi, out_time, go) for go in g_out] for ti, gi in zip(times, g)],
                     dtype=torch.float64)
    x = torch.linalg.solve(A, b)
    return x / x.sum(0, keepdim=True)


class PowerEMA:
    """Power-function EMA profiles of the trained parameters (module docstring), one shadow set per
    σ_rel. `images_per_step`: Δt of an update (the global batch); the time t lives on the device."""

    def __init__(self, model: nn.Module, sigma_rels=DEFAULT_SIGMA_RELS, images_per_step: int = 1):
        self.sigma_rels = tuple(check_sigma_rel(s, "phema.sigma_rels") for s in sigma_rels)
        if not self.sigma_rels:
            raise InvalidInput("phema.sigma_rels: give at least one σ_rel to track")
        self.gammas = [gamma_of(s) for s in self.sigma_rels]
        self.names = [clean_name(n) for n, _ in trained(model)]
        self.shadows = [[p.detach().clone() for _, p in trained(model)] for _ in self.sigma_rels]
        dev = self.shadows[0][0].device if self.names else torch.device("cpu")
        self.time = torch.zeros((), dtype=torch.float64, device=dev)  # images so far (t)
        self.images_per_step = float(images_per_step)
        self._walked = None  # (model, its FSDP modules, its parameters, the first one), as EMA._walk

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        """The trained parameters, found once per model (ema.EMA._walk: walking the tree per step costs on CPU),
        after FSDP2's blocks are back in their sharded form."""
        w = self._walked
        if w is None or w[0] is not model:
            w = self._walked = (model, fsdp_modules(model), None, None)
        for m in w[1]:
            m.reshard()
        first = next(model.parameters(), None)
        if w[2] is None or first is not w[3]:
            w = self._walked = (model, w[1], [p for _, p in trained(model)], first)
        return w[2]

    @property
    def images(self) -> float:
        """t (a host read: snapshots, checkpoints, tests)."""
        return float(self.time)

    @torch.no_grad()
    def update(self, model: nn.Module, applied: torch.Tensor | None = None) -> None:
        """One update after an optimizer step: t += Δt, each profile lerped by 1 − β_t (Eq. 127). `applied`
        is accepted for the step's signature and not used (module docstring: a skipped step is part of the
        trajectory)."""
        params = self._params(model)
        if not params:
            return
        dev = self.shadows[0][0].device
        if self.time.device != dev:
            self.time = self.time.to(dev)
        self.time += self.images_per_step
        ratio = 1 - self.images_per_step / self.time  # (t − Δt)/t, float64 on the device
        dtype = self.shadows[0][0].dtype
        for shadow, g in zip(self.shadows, self.gammas):
            w = (1 - ratio ** (g + 1)).to(dtype)  # 1 − β_t: 1 at the first update (the profile starts at θ)
            if dev.type == "cpu" and not hasattr(shadow[0], "device_mesh"):
                torch._foreach_lerp_(shadow, params, [w] * len(shadow))  # one pass per tensor (ema.py)
            else:  # a device weight: sub, mul, add keep CUDA's multi-tensor kernels (ema.py)
                delta = torch._foreach_sub(params, shadow)
                torch._foreach_mul_(delta, w)
                torch._foreach_add_(shadow, delta)

    # -- state: checkpoints (exact resume) and snapshots ----------------------------------------------------
    def shadow_state(self) -> dict:
        """{"p0": {name: tensor}, "p1": ...}: the tensors (sharded like the model under FSDP2)."""
        return {f"p{k}": dict(zip(self.names, s)) for k, s in enumerate(self.shadows)}

    def meta(self) -> dict:
        return {"sigma_rels": list(self.sigma_rels), "images": self.images}

    def state_dict(self) -> dict:
        return {**self.meta(), "shadow": self.shadow_state()}

    def check_meta(self, meta: dict) -> None:
        """The state `meta` was written with the same profiles (InvalidInput naming the key otherwise)."""
        theirs = [float(s) for s in meta["sigma_rels"]]
        if theirs != list(self.sigma_rels):
            raise InvalidInput(f"phema.sigma_rels={list(self.sigma_rels)} differs from the checkpoint's {theirs} "
                               f"(the profiles track from step 0: keep the checkpoint's)")

    def load_state_dict(self, state: dict) -> None:
        self.check_meta(state)
        self.time.fill_(float(state["images"]))
        with torch.no_grad():
            for k, shadow in enumerate(self.shadows):
                src = state["shadow"][f"p{k}"]
                for name, s in zip(self.names, shadow):
                    t = src[name]
                    if hasattr(s, "device_mesh") and not hasattr(t, "device_mesh"):  # full tensor → FSDP shard
                        from torch.distributed.tensor import distribute_tensor

                        t = distribute_tensor(t.to(s.device), s.device_mesh, s.placements)
                    s.copy_(t)
