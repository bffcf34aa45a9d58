"""Training objectives: schedule × prediction × weighting × sampler × stats → one training loss.

    loss, info = objective(model, x0, cond)

`Objective` is what every objective shares: the timestep draw, the noise counter, the statistics and
their sync with the sampler, persistence, and the hooks the trainer calls (declared here, never
discovered by attribute). Two objectives are registered by prediction kind (`OBJECTIVES`):
`DiffusionObjective` below for a single prediction type (every name of the prediction registry),
and `MixedObjective` (mixed.py) for several heads mixed by a gate. Each also says what the network
must output (`out_channels`) and gives the network wrapper its output head (`output_head`, held by
`Denoiser`: the output → x̂0 conversion generation uses, and the coefficient tables the loss op reads),
so generation never builds an objective and the objective holds no tables of a parameterisation: it
reads them from the head it is given (`output`: the network's; its own when built without one).

One step (docs/architecture.md): t, iw ~ sampler; the noise kernel: x_t = alpha[t]·x0 + sigma[t]·eps
with eps from the counter-based stream (seed, offset); pred = model(x_t, t, cond); the loss kernel:
per-sample ℓ_b = w[t_b]·iw_b·mean((pred - target)²) with the same eps, the gradient written in the
forward pass, and the raw and weighted losses scattered into the TimestepStats window. Nothing here
syncs with the host: the noise offset is a device counter advanced in place. With a learned weighting
the network also returns its per-timestep log-variance u(t) (EDM2), and ℓ_b becomes ℓ_b/exp(u) + u.
The ops come from `fasttrain.kernels` (noise.py, diffusion_loss.py); every backend draws the same
noise stream. Noise options (noise offset, pyramid noise, input perturbation, immiscible assignment:
noise_options.py) reach both ops as the step's noise spec; a loss shape (l1, the Huber family with its
c(t) table: loss_shapes.py) replaces d² in the loss op. Without them the step is the plain one.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fasttrain.kernels import philox
from fasttrain.kernels.backend import BACKENDS, BackendUnavailable, resolve_backend
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise
from fasttrain.kernels.noise_prepare import prepare as prepare_noise
from fasttrain.kernels.noise_spec import NoiseOptions, NoiseSpec

from ..errors import ConfigError, InvalidInput
from ..registry import Registry
from . import prediction as P
from .denoiser import OutputHead, PredictionOutput
from .loss_shapes import LossShape
from .noise_options import Immiscible
from .samplers import TimestepSampler, timestep_sampler
from .schedule import NoiseSchedule
from .stats import TimestepStats
from .weighting import effective_x0_weight, loss_weight, uncertainty_loss

OBJECTIVES = Registry("objective", positional=1)  # prediction kinds beyond the single types → their class
register = OBJECTIVES.register


class Draw(NamedTuple):
    """One step's draw: timesteps, importance weights, the backend, the noise counter, x_t and the noise
    spec the loss op must regenerate the same ε with (None: the plain stream)."""
    t: torch.Tensor
    iw: torch.Tensor
    backend: str
    offset: torch.Tensor
    x_t: torch.Tensor
    spec: NoiseSpec | None


def kernel_backend(backend: str, device, key: str | None = None) -> str:
    """The concrete kernel backend for data on `device` (`auto` decides here): the one boundary between
    fasttrain and the kernels' choice. A choice that cannot run there (triton without CUDA, native
    where fasttrain._C is not built, interpret with CUDA data) is one line: a ConfigError naming `key`
    when given (the trainer checks before its run folder is touched), else an InvalidInput."""
    try:
        return resolve_backend(backend, device)
    except BackendUnavailable as e:
        if key is not None:
            raise ConfigError(f"bad value for '{key}': {backend!r} ({e})") from None
        raise InvalidInput(str(e)) from None


def config_options(diffusion, schedule: NoiseSchedule) -> dict:
    """The objective's noise options and loss shape from the `diffusion.noise` and `diffusion.loss` groups."""
    from .noise_options import from_config

    return {**from_config(diffusion.noise), "loss": LossShape.from_config(schedule, diffusion.loss)}


class Objective(nn.Module):
    """The shared part: tables, sampler, statistics, noise counter, persistence and the trainer's hooks.
    Everything its callers use is declared here (docs/architecture.md, "Objective"): subclasses implement
    `from_config`, `forward`, `probe_loss`, `effective_weight` and the class-level network contract
    (`output_head` at least); `prediction` names the kind (a prediction type, or a registered kind)."""
    prediction: str

    def __init__(self, schedule: NoiseSchedule, weight: torch.Tensor, sampler, *, sampler_args: dict | None,
                 stats: TimestepStats | bool, stat_kinds: tuple[str, ...], learned_weighting: bool, backend: str,
                 seed: int, noise: NoiseOptions | None = None, immiscible: Immiscible | None = None,
                 loss: LossShape | None = None):
        super().__init__()
        self.output: OutputHead  # the network's output head, set by the subclass: the loss op reads its tables
        self.schedule = schedule
        if backend not in BACKENDS:
            raise InvalidInput(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        self.backend = backend  # the choice; `kernels(device)` is the concrete backend, decided once per device
        self._kernels: dict[torch.device, str] = {}
        # fp32 copies of the tables: what the kernels gather by t
        self.register_buffer("weight", weight.to(torch.float32), persistent=False)
        self.register_buffer("weight64", weight.to(torch.float64), persistent=False)  # for plots
        self.register_buffer("alpha", schedule.alpha.float(), persistent=False)
        self.register_buffer("sigma", schedule.sigma.float(), persistent=False)
        self.register_buffer("offset", torch.zeros((), dtype=torch.int64), persistent=False)
        self.sampler: TimestepSampler = (timestep_sampler(sampler, schedule, **(sampler_args or {}))
                                         if isinstance(sampler, str) else sampler)
        if stats is True:
            stats = TimestepStats(schedule.T, schedule.device, history=self.sampler.history, kinds=stat_kinds)
        if stats and tuple(stats.kinds) != tuple(stat_kinds):
            raise ValueError(f"this objective's statistics need kinds {tuple(stat_kinds)}, got {tuple(stats.kinds)}")
        self.stats: TimestepStats | None = stats or None
        self.learned_weighting = bool(learned_weighting)
        self.seed = philox.check_seed(seed)
        self.input_dtype: torch.dtype | None = None  # x_t's dtype (the model's compute dtype); None: x0's
        self.noise_options = noise or NoiseOptions()
        self.immiscible = immiscible
        self._plain_noise = not self.noise_options.active and immiscible is None  # the old step, unchanged
        self.register_buffer("noise_table", self.noise_options.table(), persistent=False)
        self.loss_shape = loss or LossShape(schedule)
        self.register_buffer("c_table", self.loss_shape.c_table, persistent=False)  # None for l2 and l1

    @property
    def loss_args(self) -> dict:
        """The loss ops' shape arguments (kernels/loss_shape.py)."""
        return {"loss": self.loss_shape.loss, "c_table": self.c_table}

    def _apply(self, fn, recurse=True):
        # Keep the non-module pieces (sampler, stats, schedule) on the same device as the buffers.
        out = super()._apply(fn, recurse)
        dev = self.alpha.device
        self.schedule = self.schedule.to(dev)
        self.sampler.to(dev)
        if self.stats is not None:
            self.stats.to(dev)
        return out

    @property
    def T(self) -> int:
        return self.schedule.T

    def kernels(self, device) -> str:
        """The concrete kernel backend for data on `device`, decided on first use there (`auto` once);
        the trainer passes a concrete one, checked at set-up (`kernel_backend`)."""
        device = torch.device(device)
        if device not in self._kernels:
            self._kernels[device] = kernel_backend(self.backend, device)
        return self._kernels[device]

    @classmethod
    def from_config(cls, diffusion, schedule: NoiseSchedule, output: nn.Module | None = None, **kw) -> Objective:
        """The objective of a run's `diffusion` config group on `schedule`, reading its tables from `output`
        (the network's output head); `kw`: what the bundle decides (weighting and sampler arguments,
        statistics, learned weighting, the kernel backend, the noise seed)."""
        raise NotImplementedError

    # -- the network contract (class level: the bundle builds the network before any objective) ------
    @classmethod
    def out_channels(cls, diffusion, channels: int) -> int | None:
        """The backbone's output width for `channels` data channels (None: the model's default)."""
        return None

    @classmethod
    def output_head(cls, diffusion, schedule: NoiseSchedule) -> nn.Module:
        """The network wrapper's output → x̂0 conversion (denoiser.py)."""
        raise NotImplementedError

    @classmethod
    def gate_heads(cls, diffusion) -> int:
        """Heads of a per-timestep gate table the network wrapper holds (0: none)."""
        return 0

    @classmethod
    def check_config(cls, diffusion, schedule: NoiseSchedule, model_args: dict) -> None:
        """What this prediction kind needs of the rest of the config (configure.py); InvalidInput."""

    # -- one step --------------------------------------------------------------------------------
    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """(the batch's loss, info: t, iw, per-sample raw/weighted losses, ...) for the network `model` on
        data x0 with condition `cond`: the timesteps from the sampler (or `t`, iw = 1), the noise and
        loss ops, the statistics recorded; the step (step.py) calls it and backpropagates the loss."""
        raise NotImplementedError

    def probe_loss(self, model, x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, cond=None) -> torch.Tensor:
        """Per-sample loss (iw = 1) at the given t and eps, with no statistics and no noise-counter move,
        differentiable in the model's parameters: for probes (the interference diagnostic, look-aheads)."""
        raise NotImplementedError

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """The eps of the next (seed, offset) (what the kernels draw without noise options); advances the offset."""
        eps = philox.randn(like.shape, self.seed, self.offset.to(like.device), like.device)
        self.offset += like.numel()
        return eps

    def draw(self, x0: torch.Tensor, generator: torch.Generator | None = None, t: torch.Tensor | None = None) -> Draw:
        """The step's draw: timesteps from the sampler (or given, iw = 1), the noise spec of the options
        (immiscible rows, the pyramid's std: on the device), the noise op at this step's counter; the device
        counter moves on in place by what the step drew."""
        B = x0.shape[0]
        if t is None:
            t, iw = self.sampler.sample(B, generator, x0)
        else:
            iw = torch.ones(B, device=x0.device)
        backend = self.kernels(x0.device)
        offset = self.offset.clone()
        spec = None
        if not self._plain_noise:
            rows, n_rows = (None, None) if self.immiscible is None else self.immiscible.rows(
                x0, seed=self.seed, offset=offset, backend=backend)
            spec, counters = prepare_noise(self.noise_options, x0, seed=self.seed, offset=offset,
                                           table=self.noise_table, rows=rows, n_rows=n_rows, backend=backend)
            self.offset += counters
        else:
            self.offset += x0.numel()
        x_t = noise(x0, t, self.alpha, self.sigma, seed=self.seed, offset=offset, out_dtype=self.input_dtype,
                    spec=spec, backend=backend)
        return Draw(t, iw, backend, offset, x_t, spec)

    def _with_uncertainty(self, loss, per_sample, logvar):
        if logvar is None:
            return loss, per_sample
        per_sample = uncertainty_loss(per_sample, logvar)
        return per_sample.mean(), per_sample

    # -- hooks the trainer calls ------------------------------------------------------------------
    def set_partition(self, rank: int = 0, world_size: int = 1, accum_steps: int = 1) -> None:
        """Where this process's micro-batches sit in the global batch (the sampler's strata)."""
        self.sampler.set_partition(rank, world_size, accum_steps)

    def lookaheads(self) -> list:
        """The components of this objective that learn from a look-ahead around the optimizer step."""
        la = self.sampler.lookahead()
        return [] if la is None else [la]

    def metrics(self) -> dict:
        """Values for the trainer's log lines (the sampler's)."""
        return self.sampler.metrics()

    def capture_problem(self) -> str | None:
        """Why this objective's step cannot be captured in a CUDA graph, or None."""
        return self.sampler.capture_problem()

    def p_history(self, bins: int = 100) -> dict | None:
        """The sampler's learned p(t) over training, for plots (None when it does not learn one)."""
        return self.sampler.p_history(bins)

    def sync_stats(self) -> None:
        """All-reduce the statistics and let the sampler learn from them (every K steps)."""
        if self.stats is not None:
            self.stats.all_reduce()
            self.sampler.observe(self.stats)

    # -- views for plots and logs ----------------------------------------------------------------
    def probs(self) -> torch.Tensor:
        return self.sampler.probs()

    def head_errors(self) -> dict | None:
        """Per-head running x0 error per timestep (mixed prediction's third plot row), or None."""
        return None

    def effective_weight(self, probs: torch.Tensor | None = None) -> torch.Tensor:
        """T·p(t)·iw(t)·w(t)·c(t): the x0-space weight of each timestep in this objective (plots), for the
        sampler's marginal or the given `probs`."""
        raise NotImplementedError

    def _effective(self, prediction: str, probs: torch.Tensor | None) -> torch.Tensor:
        p = self.probs() if probs is None else probs
        iw = None if self.sampler.biased else 1.0 / (self.T * p)
        return effective_x0_weight(self.weight64, self.schedule, prediction, p, iw)

    # -- persistence: shared (identical on every rank) and per-rank parts --------------------------
    # The shared part is nn.Module's extra state, so `state_dict()`/`load_state_dict()` carry it (the
    # objective has no persistent tensors of its own); the per-rank part is `rank_state`.
    def get_extra_state(self) -> dict:
        return {"offset": int(self.offset), "sampler": self.sampler.state_dict(),
                "stats": self.stats.state_dict() if self.stats is not None else None}

    def set_extra_state(self, state: dict) -> None:
        """The seed is not restored: it is derived per rank from the config (seeds.py)."""
        self.offset.fill_(int(state["offset"]))
        self.sampler.load_state_dict(state["sampler"])
        if self.stats is not None and state["stats"] is not None:
            self.stats.load_state_dict(state["stats"])

    def rank_state(self) -> dict:
        return {"window": self.stats.window_state() if self.stats is not None else None}

    def load_rank_states(self, states: list[dict], rank: int, world_size: int) -> None:
        """This rank's pending statistics window from the checkpoint's per-rank states: its own on the
        same layout; on another world size rank 0 takes every rank's window, merged."""
        if self.stats is None:
            return
        if len(states) == world_size:
            self.stats.load_window_state(states[rank]["window"])
            return
        windows = [s["window"] for s in states if s["window"] is not None]
        self.stats.load_window_state(self.stats.merge_window_states(windows) if windows and rank == 0 else None)


class DiffusionObjective(Objective):
    """One prediction type (prediction.py): the fused noise and loss kernels."""

    def __init__(self, schedule: NoiseSchedule, prediction: str = "eps", weighting="simple",
                 sampler="uniform", *, weighting_args: dict | None = None, sampler_args: dict | None = None,
                 stats: TimestepStats | bool = True, learned_weighting: bool = False,
                 backend: str = "auto", seed: int = 0, output: PredictionOutput | None = None, **options):
        """`output`: the network's output head (PredictionOutput), whose `coef` table the loss op reads (an
        objective built without a network makes its own); `options`: noise (NoiseOptions), immiscible
        (Immiscible), loss (LossShape); see `Objective`."""
        self.prediction = P.check(prediction)
        if isinstance(weighting, str):
            weighting = loss_weight(weighting, schedule, prediction, **(weighting_args or {}))
        super().__init__(schedule, weighting, sampler, sampler_args=sampler_args, stats=stats,
                         stat_kinds=("raw", "weighted"), learned_weighting=learned_weighting, backend=backend,
                         seed=seed, **options)
        if output is None:
            output = PredictionOutput(prediction, schedule)
        elif output.prediction != prediction:
            raise InvalidInput(f"the output head predicts {output.prediction!r}, the objective {prediction!r}")
        self.output = output  # a submodule without persistent state: the objective's checkpoint keys are unchanged

    @property
    def coef(self) -> torch.Tensor:
        """The loss op's target table [2, T] (ce, cx), read from the output head."""
        return self.output.coef

    @classmethod
    def from_config(cls, diffusion, schedule: NoiseSchedule, output: nn.Module | None = None,
                    **kw) -> DiffusionObjective:
        return cls(schedule, diffusion.prediction, diffusion.weighting, diffusion.sampler, output=output,
                   **config_options(diffusion, schedule), **kw)

    @classmethod
    def output_head(cls, diffusion, schedule: NoiseSchedule) -> nn.Module:
        return PredictionOutput(diffusion.prediction, schedule)

    @classmethod
    def check_config(cls, diffusion, schedule: NoiseSchedule, model_args: dict) -> None:
        """A prediction whose x̂0 is undefined at some step (ε at SNR = 0) cannot be sampled: refused now."""
        if bool((P.conditioning(diffusion.prediction, schedule) < 1e-6).any()):
            raise InvalidInput(f"{diffusion.prediction!r} cannot be sampled on this schedule (SNR = 0 at t = T-1 "
                               f"makes x̂0 = (x - σ·ε̂)/α undefined); use v, x0 or flow")

    def _call(self, model, x_t, t, cond):
        kw = {} if cond is None else {"y": cond}
        if self.learned_weighting:
            return model(x_t, t, return_logvar=True, **kw)
        return model(x_t, t, **kw), None

    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None):
        t, iw, backend, offset, x_t, spec = self.draw(x0, generator, t)
        pred, logvar = self._call(model, x_t, t, cond)
        st = self.stats
        loss, per_sample, raw, weighted = diffusion_loss(pred, x0, t, self.weight, iw, self.coef, uses=self.output.uses,
                                                         seed=self.seed, offset=offset, spec=spec, backend=backend,
                                                         bins=st.window if st is not None else None, **self.loss_args)
        if st is not None:
            st.record(t, weighted)
        loss, per_sample = self._with_uncertainty(loss, per_sample, logvar)
        info = {"t": t, "iw": iw, "raw": raw.detach(), "weighted": weighted.detach(),
                "loss_per_sample": per_sample.detach()}
        return loss, info

    def probe_loss(self, model, x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor, cond=None) -> torch.Tensor:
        """Per-sample loss ℓ_b (iw = 1) at the given t and eps, with no statistics and no noise-counter
        move: for probes (diagnostics, look-aheads). Differentiable in the model's parameters. The loss
        shape applies; the noise options do not (the probe's eps is given)."""
        backend = self.kernels(x0.device)
        x_t = noise(x0, t, self.alpha, self.sigma, eps=eps, backend=backend)
        pred, logvar = self._call(model, x_t, t, cond)
        iw = torch.ones(x0.shape[0], device=x0.device)
        per = diffusion_loss(pred, x0, t, self.weight, iw, self.coef, uses=self.output.uses, eps=eps,
                             backend=backend, **self.loss_args).per_sample
        return self._with_uncertainty(None, per, logvar)[1]

    def effective_weight(self, probs: torch.Tensor | None = None) -> torch.Tensor:
        """T·p(t)·iw(t)·w(t)·c(t): the x0-space weight of each timestep in this objective."""
        return self._effective(self.prediction, probs)


def objective_class(prediction: str) -> type[Objective]:
    """The objective for a prediction kind: a registered one (mixed.py), else a single prediction type."""
    if prediction in OBJECTIVES:
        return OBJECTIVES.get(prediction)
    P.check(prediction)
    return DiffusionObjective


def prediction_kinds() -> tuple[str, ...]:
    """Every value `diffusion.prediction` can take."""
    return P.names() + OBJECTIVES.names()
