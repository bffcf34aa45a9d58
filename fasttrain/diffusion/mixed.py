"""Mixed prediction (Xie & Agam 2025, arXiv 2502.01990): several x0 estimates from one network, mixed
by a learned gate, trained on the x0-space error of the mix.

The paper argues that the prediction types estimate x0 differently well at different timesteps and
proposes to pick the most accurate estimate per situation. Concretely (the multi-head design of
lucidrains' `WeightedObjectiveGaussianDiffusion`): the network outputs H heads, each a linear
prediction type (prediction.py: eps, x0, v; flow on the flow schedule), and gate logits; each head
gives x̂0⁽ⁱ⁾ = k1ᵢ(t)·predᵢ + k2ᵢ(t)·x_t, and the estimate is x̂0 = Σᵢ softmax(g + βᵢ(t))ᵢ ⊙ x̂0⁽ⁱ⁾.

  gate=pixel     the network outputs H gate channels after the heads (a logit per head and pixel,
                 shared by the channels): out has H·C + H channels. For flat data (no spatial
                 dims, the 2-D toys) a "pixel" is the sample: the gate is per sample.
  gate=timestep  a learned table of logits per (timestep, head), `TimestepGate`, held by the
                 network wrapper (denoiser.py) so that it is a network parameter: sharded, reduced,
                 averaged by the EMA and checkpointed like the others. The network outputs H·C
                 channels; the wrapper appends the table's logits as H constant channels, so every
                 consumer (x0_hat, samplers) sees the same layout as the pixel gate.
  mode=gate      generation uses the mixed x̂0;  mode=argmin: at each timestep the single head with the
                 lowest running x0 error (EMA of the per-head, per-timestep statistics).

Loss per sample (kernels/torch_ref_mixed_loss.py): w_x0[t]·mean((x̂0 − x0)²) + aux_weight·Σᵢ mean((predᵢ −
targetᵢ)²), times the sampler's importance weight; lucidrains' aux weight is 0.1. A loss shape
(`diffusion.loss`, loss_shapes.py) replaces every square, the main term's and the aux terms', by ρ
(one c(t) table for both); the per-head x0 errors stay MSEs.

Numerical safety where α → 0 or σ → 0. κᵢ(t) = |k1ᵢ| = |σ/detᵢ| is the factor by which head i's own
error is amplified into x0 space: 1 for x0, σ/α for eps (→ ∞ as α → 0: zero-terminal SNR, the last
flow step), σ for v on VP schedules and for flow on the flow schedule. Three rules:
  1. Where detᵢ = 0 (or κᵢ ≥ KAPPA_MAX) x̂0⁽ⁱ⁾ is undefined: the table sets k1 = k2 = 0 (x̂0⁽ⁱ⁾ := 0,
     never formed by a division) and βᵢ = MASKED, so its gate weight is exactly 0; the head still
     learns from its own-space aux loss, whose target ce·ε + cx·x0 is finite everywhere.
  2. Elsewhere the gate logits are offset by the conditioning prior βᵢ(t) = −log(1 + κᵢ²): prior
     weights ∝ 1/(1 + κᵢ²), the inverse variances of the x̂0 estimates for unit own-space errors
     (the 1 keeps the well-conditioned heads on an equal footing). Every allowed head set contains a
     head j with κⱼ ≤ 1 (x0; v on VP; flow on flow), so πᵢ·κᵢ ≤ exp(gᵢ − gⱼ)·(κᵢ/(1 + κᵢ²))·2 ≤
     exp(gᵢ − gⱼ): the mixed term's gradient into head i (πᵢ·k1ᵢ·∂L/∂x̂0) is bounded by the learned
     logit gap, not by the schedule (without the prior it is πᵢ·σ/α, ≈ 78 at t = T−1 of the linear
     schedule with an even gate). It is a bias, not a clamp: the gate can still learn to trust a head.
  3. The main term is weighted in x0 space and the aux terms are plain own-space MSEs, so the loss
     never divides by c(t) = (det/σ)², which is infinite where σ → 0 (eps: SNR).
"""
from __future__ import annotations

import torch

from fasttrain.kernels import torch_ref_mixed_loss as mixed_ref
from fasttrain.kernels.mixed_loss import mixed_loss
from fasttrain.kernels.noise import noise

from ..errors import ConfigError, InvalidInput
from . import prediction as P
from .denoiser import OutputHead
from .objective import Objective, config_options
from .objective import register as register_objective
from .schedule import NoiseSchedule
from .stats import TimestepStats
from .weighting import loss_weight

HEADS = ("eps", "x0", "v", "flow")
GATES = ("pixel", "timestep")
MODES = ("gate", "argmin")
KAPPA_MAX = 1e8  # beyond this amplification x̂0 is treated as undefined (fp32 tables, squared errors)


def check_heads(heads, schedule: NoiseSchedule | None = None) -> tuple[str, ...]:
    """Two or more distinct heads of eps, x0, v (and flow on the flow schedule), in output order."""
    heads = tuple(heads)
    bad = [h for h in heads if h not in HEADS]
    if bad:
        raise InvalidInput(f"unknown mixed head {bad[0]!r}; choose two or more of {', '.join(HEADS)}")
    if len(heads) < 2 or len(set(heads)) != len(heads):
        raise InvalidInput(f"mixed.heads needs two or more distinct heads, got {list(heads)}")
    if "flow" in heads and schedule is not None and schedule.name != "flow":
        raise InvalidInput(f"the flow head needs the flow schedule, not {schedule.name!r}")
    return heads


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidInput(f"mixed.{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def gate_channels(heads, gate: str) -> int:
    """Gate channels the *backbone* outputs (the timestep gate's come from the wrapper)."""
    return len(heads) if check_choice("gate", gate, GATES) == "pixel" else 0


def output_channels(heads, channels: int, gate: str) -> int:
    """The backbone's out_channels for `channels` data channels: H·C plus the pixel gate's H."""
    return len(heads) * channels + gate_channels(heads, gate)


# -- the per-head tables (float64 on the host) --------------------------------------------------
def conversion(heads, schedule: NoiseSchedule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k1, k2, ok), [H, T] float64: x̂0⁽ⁱ⁾ = k1·predᵢ + k2·x_t (prediction.py: (ce·x_t − σ·pred)/det)
    where ok, and k1 = k2 = 0 where head i cannot recover x0 (rule 1 of the module docstring)."""
    a, s = schedule.alpha.double().cpu(), schedule.sigma.double().cpu()
    k1s, k2s, oks = [], [], []
    for h in check_heads(heads, schedule):
        ce, cx = (torch.as_tensor(c, dtype=torch.float64).expand_as(a) for c in P.get(h).coefficients(a, s))
        det = a * ce - s * cx
        k1, k2 = -s / det, ce / det  # inf/NaN where det = 0: masked just below
        ok = torch.isfinite(k1) & torch.isfinite(k2) & (k1.abs() < KAPPA_MAX) & (k2.abs() < KAPPA_MAX)
        k1s.append(torch.where(ok, k1, 0.0))
        k2s.append(torch.where(ok, k2, 0.0))
        oks.append(ok)
    return torch.stack(k1s), torch.stack(k2s), torch.stack(oks)


def conditioning(heads, schedule: NoiseSchedule) -> torch.Tensor:
    """κ [H, T]: |k1| = |σ/det|, the amplification of a head's own error into x0 space (inf: undefined)."""
    k1, _, ok = conversion(heads, schedule)
    return torch.where(ok, k1.abs(), torch.inf)


def prior_bias(heads, schedule: NoiseSchedule, prior: bool = True) -> torch.Tensor:
    """β [H, T] float64: −log(1 + κ²) (0 without the prior), MASKED where x̂0⁽ⁱ⁾ is undefined."""
    k1, _, ok = conversion(heads, schedule)
    beta = -torch.log1p(k1**2) if prior else torch.zeros_like(k1)
    if not ok.any(0).all():
        raise ValueError("no mixed head can recover x0 at some timestep")  # unreachable for allowed sets
    return torch.where(ok, beta, mixed_ref.MASKED)


def head_table(heads, schedule: NoiseSchedule, aux_weight: float = 0.1, prior: bool = True) -> torch.Tensor:
    """The kernels' float32 [H, NROWS, T] table (layout: kernels/torch_ref_mixed_loss.py)."""
    if not float(aux_weight) >= 0:
        raise InvalidInput(f"mixed.aux_weight must be >= 0, got {aux_weight!r}")
    heads = check_heads(heads, schedule)
    a, s = schedule.alpha.double().cpu(), schedule.sigma.double().cpu()
    k1, _, ok = conversion(heads, schedule)
    beta = prior_bias(heads, schedule, prior)
    rows = []
    for i, h in enumerate(heads):
        ce, cx = (torch.as_tensor(c, dtype=torch.float64).expand_as(a) for c in P.get(h).coefficients(a, s))
        fb = torch.where(ok[i], 0.0, -1.0)  # e = k1·d + fb·x0: x̂0 := 0 where undefined
        rows.append(torch.stack([ce, cx, k1[i], fb, beta[i], torch.full_like(a, float(aux_weight))]))
    return torch.stack(rows).float().to(schedule.device)


def argmin_heads(errors: torch.Tensor, usable: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Long[T]: per timestep, the head with the lowest x0 error averaged over its bucket of timesteps
    (`errors` [H, T], NaN where unseen); a head that is unusable anywhere in the bucket is not chosen;
    -1 (use the gate) where the bucket has not been seen. n_buckets = T: per timestep. No host sync."""
    H, T = errors.shape
    err = torch.where(usable, errors.double(), torch.inf)
    edges = torch.linspace(0, T, n_buckets + 1, dtype=torch.float64).round().long().to(errors.device)
    bucket = torch.searchsorted(edges[1:], torch.arange(T, device=errors.device), right=True)  # [T]
    seen = ~torch.isnan(err)
    sums = err.new_zeros(H, n_buckets).index_add_(1, bucket, torch.where(seen, err, 0.0))
    counts = err.new_zeros(H, n_buckets).index_add_(1, bucket, seen.double())
    mean = torch.where(counts > 0, sums / counts.clamp_min(1), torch.inf)  # inf: unseen or unusable
    best = torch.where(torch.isfinite(mean.min(0).values), mean.argmin(0), -1)
    return best[bucket]


class MixedOutput(OutputHead):
    """The network wrapper's output head for a mixed prediction (denoiser.py). Generation: the gated mix
    Σ π ⊙ x̂0⁽ⁱ⁾ (mode=gate), or the head with the lowest running x0 error per timestep where the
    training statistics have chosen one (mode=argmin; `choice`, a persistent buffer of the network that
    the head updates itself when it observes the synced statistics, so a loaded model generates as
    trained). Training: the mixed loss op's per-head `table` [H, NROWS, T] (head_table: the heads'
    targets, x0 conversions, the prior and the aux weight). The output has H·C + H channels (the
    timestep gate's wrapper appends its logits)."""

    def __init__(self, heads, schedule: NoiseSchedule, gate: str = "pixel", mode: str = "gate", prior: bool = True,
                 aux_weight: float = 0.1):
        super().__init__()
        self.heads = check_heads(heads, schedule)
        self.gate = check_choice("gate", gate, GATES)
        self.mode = check_choice("mode", mode, MODES)
        self.prior, self.aux_weight = bool(prior), float(aux_weight)
        k1, k2, ok = conversion(self.heads, schedule)
        dev = schedule.device
        self.register_buffer("k12", torch.stack([k1, k2]).float().to(dev), persistent=False)
        self.register_buffer("bias", prior_bias(self.heads, schedule, prior).float().to(dev), persistent=False)
        self.register_buffer("usable", ok.to(dev), persistent=False)
        self.register_buffer("table", head_table(self.heads, schedule, aux_weight, prior), persistent=False)
        self.register_buffer("choice", torch.full((schedule.T,), -1, dtype=torch.long, device=dev))
        self._register_load_state_dict_pre_hook(self._default_choice)

    def _default_choice(self, state, prefix, *args):
        # a checkpoint written before the choice lived in the network holds no entry: -1 (the gate)
        state.setdefault(prefix + "choice", torch.full_like(self.choice, -1))

    @property
    def H(self) -> int:
        return len(self.heads)

    def split(self, output: torch.Tensor, x_t: torch.Tensor):
        H, C = self.H, x_t.shape[1]
        if output.shape[1] != H * C + H or output.shape[2:] != x_t.shape[2:]:
            raise ValueError(f"a mixed model's output must be [B, {H * C + H}, *S] ({H} heads × {C} channels "
                             f"+ {H} gate logits), got {tuple(output.shape)}")
        return mixed_ref.split(output, H, C, True)

    def head_x0(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Every head's x̂0 [B, H, C, *S] in fp32 (0 where a head cannot recover x0 at t)."""
        heads, _ = self.split(output, x_t)
        k1, k2 = (k[:, t].T.reshape(x_t.shape[0], self.H, *([1] * (x_t.ndim - 1))) for k in self.k12)
        return k1 * heads.float() + k2 * x_t.float()[:, None]

    def gate_weights(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """π [B, H, 1, *S]: softmax over heads of the gate logits plus the prior (zero where masked)."""
        _, g = self.split(output, x_t)
        bias = self.bias[:, t].T.reshape(x_t.shape[0], self.H, *([1] * (x_t.ndim - 1)))
        return torch.softmax(g.float().unsqueeze(2) + bias, dim=1)

    def to_x0(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        xs = self.head_x0(output, x_t, t)
        est = (self.gate_weights(output, x_t, t) * xs).sum(1)
        if self.mode == "argmin":
            c = self.choice[t]
            pick = xs[torch.arange(xs.shape[0], device=xs.device), c.clamp_min(0)]
            est = torch.where((c >= 0).view(-1, *([1] * (est.ndim - 1))), pick, est)
        return est.to(x_t.dtype)

    def x0_defined(self) -> torch.Tensor:
        return self.usable.any(0)  # some head recovers x0 at every t of an allowed head set

    def check_sampling(self) -> None:
        """Heads that cannot recover x0 at a timestep are masked there: every step can be sampled."""

    # -- what the head learns from the training statistics (mode=argmin) ------------------------------
    def error_table(self, stats) -> torch.Tensor:
        """[H, T]: each head's running (EMA) x0 error per timestep in `stats` (kinds x0_error_<head>); NaN
        where unseen, and where the head cannot recover x0 (the kernel's residual there is −x0, not an
        error of the head)."""
        T = self.choice.shape[0]
        if stats is None:
            return torch.full((self.H, T), torch.nan, dtype=torch.float64, device=self.usable.device)
        err = torch.stack([stats.ema_view(f"x0_error_{h}") for h in self.heads])
        return torch.where(self.usable.to(err.device).reshape(err.shape), err, torch.nan)

    def observe(self, stats, *, buckets: int) -> None:
        """mode=argmin: choose, per timestep, the head with the lowest x0 error over its bucket of
        `buckets` timestep buckets (argmin_heads; -1: the gate where unseen). No host sync."""
        if self.mode == "argmin" and stats is not None:
            errors = self.error_table(stats).to(self.usable.device)
            self.choice.copy_(argmin_heads(errors, self.usable, buckets).to(self.choice.device))


@register_objective("mixed")
class MixedObjective(Objective):
    """The objective for prediction="mixed": the same call and info as DiffusionObjective (plus
    "x0_error" [B, H]), the fused mixed loss (kernels/mixed_loss.py) and statistics with one x0-error
    kind per head. The loss op reads its table from `output`, the network wrapper's MixedOutput (or
    the objective's own when built without a network); with mode=argmin the head chooses its
    per-timestep head from the statistics at every sync (MixedOutput.observe).

    `weighting` is an x0-space weighting (loss_weight(name, schedule, "x0"): "simple" and "constant"
    are the plain x0-MSE). The network is called as model(x_t, t[, y]); with gate="timestep" as
    model(x_t, t, return_gate=True) (Denoiser with `gate_heads=H`: the table's gradient is the
    kernel's per-sample gate gradient, which autograd's backward of the gather `logits[t]` sums by
    t), with a learned weighting also return_logvar=True."""

    def __init__(self, schedule: NoiseSchedule, heads=("eps", "x0"), gate: str = "pixel", weighting="simple",
                 sampler="uniform", *, aux_weight: float = 0.1, mode: str = "gate", prior: bool = True,
                 argmin_buckets: int = 20, weighting_args: dict | None = None, sampler_args: dict | None = None,
                 stats: TimestepStats | bool = True, learned_weighting: bool = False, backend: str = "auto",
                 seed: int = 0, output: MixedOutput | None = None, **options):
        self.heads = check_heads(heads, schedule)
        if isinstance(weighting, str):  # the main term is an x0-space MSE: the x0-space weight
            weighting = loss_weight(weighting, schedule, "x0", **(weighting_args or {}))
        super().__init__(schedule, weighting, sampler, sampler_args=sampler_args, stats=stats,
                         stat_kinds=("raw", "weighted") + tuple(f"x0_error_{h}" for h in self.heads),
                         learned_weighting=learned_weighting, backend=backend, seed=seed, **options)
        self.prediction = "mixed"
        self.gate = check_choice("gate", gate, GATES)
        self.mode = check_choice("mode", mode, MODES)
        if not 1 <= int(argmin_buckets) <= schedule.T:
            raise InvalidInput(f"mixed.argmin_buckets must lie in [1, T={schedule.T}], got {argmin_buckets!r}")
        self.argmin_buckets = int(argmin_buckets)
        if output is None:  # an objective without a network: its own head (the trainer's is the network's)
            output = MixedOutput(self.heads, schedule, gate, mode, prior, aux_weight)
        elif (output.heads, output.prior, output.aux_weight) != (self.heads, bool(prior), float(aux_weight)):
            raise InvalidInput(f"the output head was built for heads {list(output.heads)}, prior={output.prior}, "
                               f"aux_weight={output.aux_weight}, not {list(self.heads)}, {prior}, {aux_weight}")
        self.output = output  # a submodule: its persistent `choice` is saved with the objective's state too

    @property
    def tab(self) -> torch.Tensor:
        """The mixed loss op's per-head table [H, NROWS, T], read from the output head."""
        return self.output.table

    # -- the network contract ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, diffusion, schedule: NoiseSchedule, output: MixedOutput | None = None, **kw):
        m = diffusion.mixed
        return cls(schedule, list(m.heads), m.gate, diffusion.weighting, diffusion.sampler, aux_weight=m.aux_weight,
                   mode=m.mode, prior=m.prior, argmin_buckets=m.argmin_buckets, output=output,
                   **config_options(diffusion, schedule), **kw)

    @classmethod
    def out_channels(cls, diffusion, channels: int) -> int:
        return output_channels(list(diffusion.mixed.heads), channels, diffusion.mixed.gate)

    @classmethod
    def output_head(cls, diffusion, schedule: NoiseSchedule) -> MixedOutput:
        m = diffusion.mixed
        return MixedOutput(list(m.heads), schedule, m.gate, m.mode, m.prior, m.aux_weight)

    @classmethod
    def gate_heads(cls, diffusion) -> int:
        return len(diffusion.mixed.heads) if diffusion.mixed.gate == "timestep" else 0

    @classmethod
    def check_config(cls, diffusion, schedule: NoiseSchedule, model_args: dict) -> None:
        """What a mixed prediction's config must satisfy beyond the field types (one line naming the key)."""
        m = diffusion.mixed
        try:
            check_heads(list(m.heads), schedule)
        except InvalidInput as e:
            raise ConfigError(f"bad value for 'diffusion.mixed.heads': {list(m.heads)} ({e})") from None
        if not 1 <= m.argmin_buckets <= schedule.T:
            raise ConfigError(f"bad value for 'diffusion.mixed.argmin_buckets': {m.argmin_buckets!r} (in [1, "
                              f"diffusion.T])")
        if "out_channels" in model_args:
            raise ConfigError("bad value for 'model.args.out_channels': a mixed prediction sets the output width "
                              "itself")

    @property
    def H(self) -> int:
        return len(self.heads)

    # -- training --------------------------------------------------------------------------------
    def _network(self, model, x_t, t, cond):
        """(out, logvar or None, per-sample gate logits or None)."""
        kw = {} if cond is None else {"y": cond}
        if self.learned_weighting:
            kw["return_logvar"] = True
        if self.gate == "timestep":
            kw["return_gate"] = True
        res = model(x_t, t, **kw)
        if not (self.learned_weighting or self.gate == "timestep"):
            return res, None, None
        res = tuple(res)
        return res[0], res[1] if self.learned_weighting else None, res[-1] if self.gate == "timestep" else None

    def forward(self, model, x0: torch.Tensor, cond=None, generator: torch.Generator | None = None,
                t: torch.Tensor | None = None):
        t, iw, backend, offset, x_t, spec = self.draw(x0, generator, t)
        out, logvar, gate = self._network(model, x_t, t, cond)
        st = self.stats
        res = mixed_loss(out, x0, t, self.weight, iw, self.tab, gate=gate, seed=self.seed, offset=offset, spec=spec,
                         backend=backend, bins=st.window if st is not None else None, **self.loss_args)
        if st is not None:
            st.record(t, res.weighted)
        loss, per_sample = self._with_uncertainty(res.loss, res.per_sample, logvar)
        info = {"t": t, "iw": iw, "raw": res.raw.detach(), "weighted": res.weighted.detach(),
                "loss_per_sample": per_sample.detach(), "x0_error": res.x0_error.detach()}
        return loss, info

    def probe_loss(self, model, x0, t, eps, cond=None) -> torch.Tensor:
        """Per-sample loss (iw = 1) at the given t and eps, with no statistics and no noise-counter
        move: for probes (diagnostics, look-aheads)."""
        backend = self.kernels(x0.device)
        x_t = noise(x0, t, self.alpha, self.sigma, eps=eps, backend=backend)
        out, logvar, gate = self._network(model, x_t, t, cond)
        iw = torch.ones(x0.shape[0], device=x0.device)
        per = mixed_loss(out, x0, t, self.weight, iw, self.tab, gate=gate, eps=eps, backend=backend,
                         **self.loss_args).per_sample
        return self._with_uncertainty(None, per, logvar)[1]

    # -- statistics, persistence -------------------------------------------------------------------
    def head_errors(self) -> dict:
        """Each head's running x0 error per timestep (the output head's view of the statistics)."""
        return dict(zip(self.heads, self.output.error_table(self.stats)))

    def sync_stats(self) -> None:
        super().sync_stats()
        self.output.observe(self.stats, buckets=self.argmin_buckets)  # mode=argmin: the head chooses

    def set_extra_state(self, state: dict) -> None:
        super().set_extra_state(state)
        # the head's choice from the restored statistics: a resumed run chooses the same heads
        self.output.observe(self.stats, buckets=self.argmin_buckets)

    def effective_weight(self, probs: torch.Tensor | None = None) -> torch.Tensor:
        """T·p(t)·iw(t)·w_x0(t) of the main (mixed x0-space) term."""
        return self._effective("x0", probs)
