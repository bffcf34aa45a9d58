"""Periodic actions of a run as declared components: each says when it is due, which named parts of the
run it reads, what it saves, and whether its time counts as training time. The trainer runs the
registered ones in their declared `order` after every optimizer step and knows none of them by name, so
a new one (a profiler, another logger, FID every N steps) is one module in this package plus its test.
The actions: `stats_sync.py` (statistics → sampler), `log.py` (the metric line), `nonfinite.py` (the
non-finite stop), `checkpoint.py` (last.pt / dcp), `evaluation.py` (eval every N steps),
`ema_snapshots.py` (post-hoc EMA snapshots), `align_log.py` (the alignment loss's line).

    @register("name")
    class MyAction(Periodic):
        order = 60                       # after evaluation
        reads = ("state", "objective")   # the run's parts it reads (RunParts' fields)
        saves = ("my-file.json",)        # what it writes (files of the run folder, checkpoint entries)

        def __init__(self, cfg): self.every = cfg.train.log_every
        def due(self, step, last): return step % self.every == 0
        def __call__(self, run): ...     # run: the parts it declared (run.state, run.objective)

The parts (`RunParts`) are named objects the trainer builds and hands over once (as torchtitan's
checkpointer receives Stateful objects), not the trainer: an action is given exactly the parts it
declares in `reads`; one it did not declare is not there (AttributeError naming it), and one that no
run has is refused when the actions are built. `run.step` and `run.images` are the progress in
`run.state` (TrainState).

`in_step = True` marks an action that belongs to the optimizer step's bookkeeping (no host read, no
file: the statistics sync), which the trainer's `train_step` runs, so that the step's benchmarks and its
no-sync tests include it; the others run in the run loop (`Trainer.fit`). `start(run)` is called once
before the loop; `pauses_clock` actions (checkpoints, evaluations) are not counted as training time;
`final` actions also act when a signal stops the run and when it ends (the checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..registry import Registry
from ..registry import discover as _discover

PERIODIC = Registry("periodic action")
register = PERIODIC.register


class Periodic:
    """The declaration every periodic action makes (module docstring)."""
    name: str = ""
    order: int = 0
    reads: tuple[str, ...] = ()
    saves: tuple[str, ...] = ()
    in_step: bool = False
    pauses_clock: bool = False
    final: bool = False

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def due(self, step: int, last: bool) -> bool:
        """Whether to act after optimizer step `step` (counted from 1); `last`: the run's final step."""
        raise NotImplementedError

    def start(self, run) -> None:
        """Once, before the run loop (after a resume: at the resumed step)."""

    def __call__(self, run) -> None:
        """Act; `run`: the parts this action declared in `reads` (ActionParts)."""
        raise NotImplementedError


@dataclass
class Throughput:
    """What the log line turns steps into rates with: images per optimizer step (all ranks), the model's
    training FLOPs per image and the devices' peak FLOP/s (None where unknown: no MFU)."""
    images_per_step: int
    flops_per_image: float | None = None
    peak_flops: float | None = None


@dataclass
class RunParts:
    """The named parts of a run that periodic actions may read (`Periodic.reads` names them): built by the
    trainer once, `log`, `bar` and `clock` when the run loop starts. An action is given a view of the
    parts it declares (`view`), never the trainer."""
    state: Any = None           # train_state.TrainState: step, images, skipped-step counters, the log interval
    model: Any = None           # the training network (parallelized)
    ema: Any = None             # optim.ema.EMA of its weights
    objective: Any = None       # the training objective (its statistics, metrics, T)
    spec: Any = None            # bundle.DataSpec: the data's shape and kind
    device: Any = None          # the training device
    dist: Any = None            # parallel.distributed.DistInfo: rank, world_size, is_main
    run_dir: Any = None         # the run's folder (Path)
    checkpoints: Any = None     # checkpoint.CheckpointManager
    lr_sched: Any = None        # the learning-rate schedule
    hooks: tuple = ()           # the step's look-ahead hooks
    interference: Any = None    # the interference diagnostic (None: off)
    evaluate: Any = None        # generation.evaluate.RunEvaluation: () -> the bundle's metrics
    throughput: Any = None      # Throughput
    phema: Any = None           # optim.phema.PowerEMA: the post-hoc EMA profiles (None: phema.every=0)
    alignment: Any = None       # diffusion.align.Alignment: REPA's loss and its statistics (None: off)
    log: Any = None             # logger.MetricLogger (rank 0; a no-op elsewhere)
    bar: Any = None             # the progress bar
    clock: Any = None           # train_state.StepClock: the log interval's training time

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def images(self) -> int:
        return self.state.images


PARTS = tuple(f.name for f in fields(RunParts)) + ("step", "images")


class ActionParts:
    """The parts one action declared in `reads`, read from the run's `RunParts` when it acts; any other
    part is not there, and nothing can be set."""

    def __init__(self, parts: RunParts, action: Periodic):
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_action", action)

    def __getattr__(self, name: str):
        if name not in self._action.reads:
            raise AttributeError(f"periodic action {self._action.name!r} reads {name!r} but does not declare it "
                                 f"(reads = {self._action.reads})")
        return getattr(self._parts, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"periodic action {self._action.name!r} may not set {name!r} on the run")


def build(cfg) -> list[Periodic]:
    """Every registered action for this config, in their declared order; one that reads a part no run has
    is refused here, before the run starts."""
    actions = sorted((PERIODIC.get(name)(cfg) for name in PERIODIC), key=lambda a: a.order)
    for a in actions:
        unknown = [r for r in a.reads if r not in PARTS]
        if unknown:
            raise TypeError(f"periodic action {a.name!r} reads {', '.join(map(repr, unknown))}, which is no part of "
                            f"a run (periodic.RunParts: {', '.join(PARTS)})")
    return actions


def view(parts: RunParts, action: Periodic) -> ActionParts:
    return ActionParts(parts, action)


_discover(__name__)  # the actions in their own modules register themselves

__all__ = ["PARTS", "PERIODIC", "ActionParts", "Periodic", "RunParts", "Throughput", "build", "register", "view"]
