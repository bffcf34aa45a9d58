"""The trained network as everything downstream sees it: a backbone from `fasttrain.models`, its output
→ x̂0 conversion (the *output head*, as k-diffusion's `Denoiser` and EDM2's `Precond` own it), and
optionally EDM2's learned per-timestep log-variance u(t) (Karras et al. 2024, §5) and mixed
prediction's learned per-timestep gate logits (mixed.py, gate=timestep).

    x0 = denoiser.x0_hat(x_t, t, y)     # generation, NELBO, look-aheads: no training objective needed

Output heads (`OutputHead`): `PredictionOutput` (one prediction type, prediction.py) and
`mixed.MixedOutput` (several heads and a gate); the objective class of the run's prediction kind
provides it (objective.py). A head owns both directions of its parameterisation: the output → x̂0
conversion that generation uses, and the coefficient tables the training loss op reads (`coef` of a
prediction type, the mixed `table`), so a new parameterisation is one head class and the objective
holds no tables of its own. What a head learns from the training statistics (mixed argmin's choice)
it learns itself, in `observe`, as a timestep sampler does.
Keeping u(t), the gate table and the head's persistent state inside the network means they are
sharded by FSDP, reduced by DDP, averaged by the EMA (parameters) and checkpointed like every other
weight; the forward returns u and the gate when asked (`return_logvar=True`, `return_gate=True`), as
EDM2's Precond does, so that wrapped models (FSDP gathers parameters in the root's forward) work
unchanged. Without `return_gate` a timestep gate's logits are appended to the output as H channels,
constant over the pixels, so that the output head sees the pixel gate's layout (heads, then logits).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidInput
from . import prediction as P
from .schedule import NoiseSchedule
from .weighting import LearnedLogVar


def column(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample [B] tensor shaped to broadcast against `like` [B, ...]."""
    return x.view(-1, *([1] * (like.ndim - 1)))


class OutputHead(nn.Module):
    """The network's output head: what generation and the training loss read of a parameterisation."""

    def to_x0(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x̂0 from the network's output at (x_t, t)."""
        raise NotImplementedError

    def x0_defined(self) -> torch.Tensor:
        """Bool [T]: where x̂0 can be recovered from the output."""
        raise NotImplementedError

    def check_sampling(self) -> None:
        """A one-line InvalidInput where a solver could visit a step without x̂0."""

    def observe(self, stats, **kw) -> None:
        """Learn from the training statistics after a sync (nothing, unless the head chooses by them)."""


class PredictionOutput(OutputHead):
    """One prediction type (prediction.py): x̂0 = (ce·x_t − σ·pred)/det for generation, and the loss
    op's target table `coef` = [ce, cx] [2, T] with `uses` (which of ε, x0 the target reads)."""

    def __init__(self, prediction: str, schedule: NoiseSchedule):
        super().__init__()
        self.prediction, self.schedule_name = P.check(prediction), schedule.name
        self.pred = P.get(prediction)
        self.uses = self.pred.uses
        self.register_buffer("alpha", schedule.alpha.float(), persistent=False)
        self.register_buffer("sigma", schedule.sigma.float(), persistent=False)
        self.register_buffer("coef", self.pred.table(schedule.alpha, schedule.sigma), persistent=False)
        self.register_buffer("defined", P.conditioning(prediction, schedule).to(schedule.alpha.device) > 1e-6,
                             persistent=False)

    def to_x0(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a, s = column(self.alpha[t], x_t).to(x_t.dtype), column(self.sigma[t], x_t).to(x_t.dtype)
        return self.pred.to_x0_eps(output.to(x_t.dtype), x_t, a, s)[0]

    def x0_defined(self) -> torch.Tensor:
        """Bool [T]: where x̂0 can be recovered from this prediction (det ≠ 0)."""
        return self.defined

    def check_sampling(self) -> None:
        if not bool(self.defined.all()):
            raise InvalidInput(sampling_refusal(self.prediction, self.schedule_name))


def sampling_refusal(prediction: str, schedule_name: str) -> str:
    return (f"prediction {prediction!r} cannot be sampled on schedule {schedule_name!r} with SNR = 0 at its last "
            f"step: x̂0 = (x - σ·ε̂)/α is undefined where α = 0 (use v, x0 or flow)")


class TimestepGate(nn.Module):
    """Mixed prediction's learned table of gate logits per timestep and head (mixed.py, gate=timestep);
    zero at start: the conditioning prior decides."""

    def __init__(self, T: int, heads: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(T, heads))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.logits[t]  # [B, H]; autograd scatters its gradient back to the rows t


class Denoiser(nn.Module):
    def __init__(self, net: nn.Module, output: nn.Module, schedule: NoiseSchedule | None = None,
                 learned_weighting: bool = False, gate_heads: int = 0, logvar_layer: str = "linear",
                 logvar_seed: int = 0):
        super().__init__()
        self.net = net
        self.output = output
        self.logvar = LearnedLogVar(schedule, seed=logvar_seed, layer=logvar_layer) if learned_weighting else None
        self.gate = TimestepGate(schedule.T, gate_heads) if gate_heads else None

    def repeated_blocks(self) -> list[nn.Module]:
        """The backbone's repeated units (parallel/wrap.py checkpoints, compiles and shards them)."""
        return self.net.repeated_blocks()

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None, return_logvar: bool = False,
                return_gate: bool = False):
        """out; or (out, logvar), (out, gate [B, H]), (out, logvar, gate) for what is asked."""
        out = self.net(x, t, y)
        extra = []
        if return_logvar:
            if self.logvar is None:
                raise ValueError("this network has no learned weighting (diffusion.learned_weighting=false)")
            extra.append(self.logvar(t))
        if self.gate is not None:
            g = self.gate(t)
            if return_gate:
                extra.append(g)
            else:
                g = g.to(out.dtype).reshape(*g.shape, *([1] * (out.ndim - 2)))
                out = torch.cat([out, g.expand(-1, -1, *out.shape[2:])], dim=1)
        elif return_gate:
            raise ValueError("this network has no timestep gate (mixed.gate=timestep)")
        return (out, *extra) if extra else out

    def x0_hat(self, x_t: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """The network's estimate of x0 at (x_t, t), computed in `dtype` (default x_t's) after the
        network: the one conversion that generation, the NELBO, look-aheads and diagnostics use. Calls
        the module itself, so FSDP's and compile's forward hooks run."""
        out = self(x_t, t) if y is None else self(x_t, t, y)
        x_t = x_t if dtype is None else x_t.to(dtype)
        return self.output.to_x0(out.to(x_t.dtype), x_t, t)

    def x0_defined(self) -> torch.Tensor:
        """Bool [T]: timesteps where x̂0 is defined (a bound evaluated elsewhere is 0, vlb.py)."""
        return self.output.x0_defined()

    def check_sampling(self) -> None:
        """A one-line error where the output head cannot give x̂0 at some step a solver visits."""
        self.output.check_sampling()
