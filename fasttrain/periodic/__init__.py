"""Periodic actions of a run as declared components: each says when it is due, what state of the run it
reads, what it saves, and whether its time counts as training time. The trainer runs the registered
ones in their declared `order` after every optimizer step and knows none of them by name, so a new
one (a profiler, another logger, FID every N steps) is one module in this package plus its test.
The actions: `stats_sync.py` (statistics → sampler), `log.py` (the metric line), `nonfinite.py` (the
non-finite stop), `checkpoint.py` (last.pt / dcp), `evaluation.py` (eval every N steps).

    @register("name")
    class MyAction(Periodic):
        order = 60                       # after evaluation
        reads = ("state", "objective")   # attributes of the trainer it may read (RunView enforces it)
        saves = ("my-file.json",)        # what it writes (files of the run folder, checkpoint entries)

        def __init__(self, cfg): self.every = cfg.train.log_every
        def due(self, step, last): return step % self.every == 0
        def __call__(self, run): ...     # run: the RunView of the trainer

`in_step = True` marks an action that belongs to the optimizer step's bookkeeping (no host read, no
file: the statistics sync), which the trainer's `train_step` runs, so that the step's benchmarks and its
no-sync tests include it; the others run in the run loop (`Trainer.fit`). `start(run)` is called once
before the loop; `pauses_clock` actions (checkpoints, evaluations) are not counted as training time;
`final` actions also act when a signal stops the run and when it ends (the checkpoint).
"""
from __future__ import annotations

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
        raise NotImplementedError


class RunView:
    """The trainer as one action sees it: only the attributes the action declares in `reads`, so the
    declaration is what it can read."""

    def __init__(self, run, action: Periodic):
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_action", action)

    def __getattr__(self, name: str):
        if name not in self._action.reads:
            raise AttributeError(f"periodic action {self._action.name!r} reads {name!r} but does not declare it "
                                 f"(reads = {self._action.reads})")
        return getattr(self._run, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"periodic action {self._action.name!r} may not set {name!r} on the run")


def build(cfg) -> list[Periodic]:
    """Every registered action for this config, in their declared order."""
    return sorted((PERIODIC.get(name)(cfg) for name in PERIODIC), key=lambda a: a.order)


def view(run, action: Periodic) -> RunView:
    return RunView(run, action)


_discover(__name__)  # the actions in their own modules register themselves

__all__ = ["PERIODIC", "Periodic", "RunView", "build", "register", "view"]
