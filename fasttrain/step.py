"""One training step as a function of named parts: the only place the step's order is written
(docs/architecture.md, "One training step"). The trainer, `reference_step` below (tests and benchmarks
of the look-ahead components) and a CUDA graph's capture (parallel/graphs.py) all run these two functions:

    parts = StepParts(model, objective, optimizer, Generators(g), ema=ema, conditioning=..., hooks=...)
    loss, gnorm = train_step(parts, [(x0, y), ...], step=k, lr=lr)

`update(parts, x0, y, x0, y, ...)` is the body (with loss masks, `parts.masked`: x0, y, mask, ...; the mask
goes to the objective's loss as the per-pixel weight): for each micro-batch the condition (with its dropout,
conditioning.py) → the objective (timesteps, noise op, model, loss op, statistics) → backward of
loss / accum; then (fp16) unscale, clip, the finite check (a device scalar), the look-ahead hooks that
act before the update, the optimizer step (a non-finite step skipped on the device), zero_grad, the EMA
(weight 0 for a skipped step) and the skipped-step counters. It syncs with the host nowhere and changes
no host-side state, so with one micro-batch and no before-update hook it can be captured and replayed
(`train_step`'s `fixed`). `train_step` adds what brackets it: which look-ahead hooks are due, and those
that act after the update (outside any graph; they may run their own backward, so the gradients are
cleared again after them).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .diffusion.lookahead import LookAhead, LookAheadContext, lookaheads
from .optim.adamw import skip_if_not_finite


@dataclass
class Generators:
    """The step's random streams (per rank): timesteps (the sampler's draws) and the condition's dropout."""
    timesteps: torch.Generator | None = None
    labels: torch.Generator | None = None

    def all(self) -> list[torch.Generator]:
        """Every stream, for a CUDA graph to register (graphs.py)."""
        return [g for g in (self.timesteps, self.labels) if g is not None]


@dataclass
class StepParts:
    """What a step reads and updates, by name. Optional parts may be None (tests and benchmarks run a
    step without an EMA, a scaler or counters). `conditioning` maps a micro-batch's labels to the
    condition the network sees (conditioning.py; None: the labels as they come); `precision` gives the
    autocast region of the forward (precision.py); `after_backward` runs once the gradients of every
    micro-batch are complete (a hand-written gradient all-reduce where no DDP/FSDP does it);
    `skip_nonfinite`: a non-finite update is skipped on the device (optim.skip_if_not_finite; a bare
    reference step leaves the optimizer alone); `counters` holds `skipped` and `skipped_run` device
    tensors (train_state.TrainState); `masked`: each micro-batch carries a loss mask after its labels
    (data.mask)."""
    model: torch.nn.Module
    objective: Any
    optimizer: torch.optim.Optimizer
    generators: Generators
    ema: Any = None
    scaler: torch.amp.GradScaler | None = None
    conditioning: Callable | None = None
    precision: Any = None
    grad_clip: float = 0.0
    counters: Any = None
    hooks: Sequence[LookAhead] = ()
    after_backward: Callable[[], None] | None = None
    skip_nonfinite: bool = True
    averages: Sequence[Any] = ()  # further averages after the EMA (optim/phema.py: post-hoc EMA profiles)
    align: Any = None  # representation alignment (diffusion/align.py): `loss(x0)` after the objective's forward
    rank: int = 0
    world_size: int = 1
    masked: bool = False

    def __post_init__(self):
        # the parameters the step clips, listed once: model.parameters() walks the whole module tree
        # (named_modules), which every step did for the clip before (issue 35's profile)
        self.params = list(self.model.parameters())

    def autocast(self, cache: bool = True):
        return self.precision.context(cache=cache) if self.precision is not None else contextlib.nullcontext()

    def context(self, x0, cond, step: int, lr) -> LookAheadContext:
        return LookAheadContext(self.model, self.objective, x0, cond, step, self.rank, self.world_size, lr=lr,
                                optimizer=self.optimizer)


def update(parts: StepParts, *tensors: torch.Tensor | None, before: Sequence[LookAhead] = (), step: int = 0,
           lr: float | None = None):
    """The step's body on the micro-batches `tensors` = x0, y, x0, y, ... (x0, y, mask, ... with
    `parts.masked`; module docstring). Returns (mean loss, gradient norm, the first micro-batch's
    condition after dropout): device tensors."""
    model, opt = parts.model, parts.optimizer
    n = 3 if parts.masked else 2
    accum = len(tensors) // n
    total = torch.zeros((), device=tensors[0].device)
    first = None
    for m in range(accum):
        x0, y = tensors[n * m], tensors[n * m + 1]
        mask = {"mask": tensors[n * m + 2]} if parts.masked else {}
        cond = parts.conditioning(y) if parts.conditioning is not None else y
        first = cond if m == 0 else first
        with parts.autocast(cache=False):  # no autocast weight cache: a graph replays the casts
            loss, _ = parts.objective(model, x0, cond, parts.generators.timesteps, **mask)
            aux = parts.align.loss(x0) if parts.align is not None else None  # added to the loss, not to its stats
        scaled = (loss if aux is None else loss + aux) / accum
        (parts.scaler.scale(scaled) if parts.scaler else scaled).backward()
        total += loss.detach() / accum
    if parts.after_backward is not None:
        parts.after_backward()
    if parts.scaler:
        parts.scaler.unscale_(opt)  # true gradients before clipping (fp16)
    clip = parts.grad_clip
    gnorm = torch.nn.utils.clip_grad_norm_(parts.params, clip if clip > 0 else math.inf)
    if hasattr(gnorm, "full_tensor"):
        gnorm = gnorm.full_tensor()  # a DTensor under FSDP
    finite = torch.isfinite(total) & torch.isfinite(gnorm)
    if before:  # the look-ahead brackets the optimizer step, not a micro-step
        ctx = parts.context(tensors[0], first, step, lr)
        for h in before:
            with parts.autocast():
                h.before_update(ctx)
    if parts.scaler:  # fp16: the scaler skips an overflowing step itself (found_inf) and adapts its scale
        parts.scaler.step(opt)
        parts.scaler.update()
    else:
        if parts.skip_nonfinite:
            skip_if_not_finite(opt, finite)
        opt.step()
    opt.zero_grad(set_to_none=True)
    if parts.ema is not None:
        parts.ema.update(model, applied=finite)
    for avg in parts.averages:
        avg.update(model, applied=finite)
    if parts.counters is not None:
        parts.counters.skipped += (~finite).long()
        parts.counters.skipped_run.copy_((parts.counters.skipped_run + 1) * (~finite).long())
    return total, gnorm.detach(), first


def train_step(parts: StepParts, batches: Sequence[tuple], *, step: int, lr: float | None = None,
               fixed: Callable | None = None):
    """One optimizer step on the micro-batches `batches` [(x0, y), ...] ((x0, y, mask) with
    `parts.masked`): the look-ahead hooks due at
    `step` around `update`. `fixed`, when given, runs `update` for one micro-batch with no before-update
    hook (graphs.GraphedStep replays it); it is used where that is the step's structure. Returns
    (loss, gradient norm): device tensors, never read here."""
    due = [h for h in parts.hooks if h.due(step)]
    if fixed is not None and len(batches) == 1 and not any(h.acts_before for h in due):
        loss, gnorm, first = fixed(*batches[0])
    else:  # several micro-batches, or a hook that must see the gradients before the update
        loss, gnorm, first = update(parts, *[x for b in batches for x in b], before=due, step=step, lr=lr)
    if due:  # after the update, gradients cleared (the body's last act)
        ctx = parts.context(batches[0][0], first, step, None if lr is None else float(lr))
        for h in due:
            with parts.autocast():  # probes see the model as the forward does
                h.after_update(ctx)
        parts.optimizer.zero_grad(set_to_none=True)  # a hook may have run its own backward
    return loss, gnorm


def reference_step(model, objective, optimizer, micro_batches, step: int, components=(), *, rank: int = 0,
                   world_size: int = 1, generator: torch.Generator | None = None, before_step=None) -> None:
    """One optimizer step of the trainer's own step function with only these parts, for tests and
    benchmarks of the look-ahead components (diffusion/lookahead.py): every micro-batch's loss and
    backward; `before_step()` (a hand-written gradient all-reduce, clipping); for each due LookAhead
    `before_update(ctx)`; `optimizer.step()`; `after_update(ctx)`. `micro_batches` is a list of
    (x0, labels), the labels used as they are; ctx carries the first."""
    parts = StepParts(model, objective, optimizer, Generators(generator), hooks=lookaheads(*components),
                      after_backward=before_step, skip_nonfinite=False, rank=rank, world_size=world_size)
    train_step(parts, micro_batches, step=step)
