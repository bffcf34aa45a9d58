"""The trainer's own small state, as named objects the checkpoint manager saves and restores.

  TrainState   progress (steps, images: EDM2 counts images so a change of world size keeps it), the
               skipped-step counters (device tensors: the step never syncs), and the log interval's
               running sums, so that the first metric line after a resume covers the whole interval
  StepClock    the log interval's training time (periodic actions that pause it left out)
  RankRNG      this process's streams: the step's generators (timesteps; label dropout) and torch's
               global RNGs; on another world size every rank gets fresh streams derived from the step
"""
from __future__ import annotations

import contextlib
import time

import torch

from . import seeds


class TrainState:
    def __init__(self, device: torch.device):
        self.step, self.images = 0, 0
        self.skipped = torch.zeros((), dtype=torch.long, device=device)      # non-finite steps in all
        self.skipped_run = torch.zeros((), dtype=torch.long, device=device)  # ... and in a row
        # the log interval: Σ loss, Σ grad norm, finite steps (device), and the steps it spans (host)
        self.interval = torch.zeros(3, dtype=torch.float64, device=device)
        self.interval_steps = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "images": self.images, "skipped": int(self.skipped),
                "skipped_run": int(self.skipped_run), "interval": self.interval.cpu().tolist(),
                "interval_steps": self.interval_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.images = int(state["step"]), int(state.get("images", 0))
        self.skipped.fill_(int(state.get("skipped", 0)))
        self.skipped_run.fill_(int(state.get("skipped_run", 0)))
        if "interval" in state:  # older checkpoints start a fresh interval
            self.interval.copy_(torch.tensor(state["interval"], dtype=torch.float64))
            self.interval_steps = int(state["interval_steps"])
        else:
            self.interval.zero_()
            self.interval_steps = 0


class StepClock:
    """The log interval's training time: steps timed in this process and the seconds since the interval
    began, with the periodic actions that pause it (checkpoints, evaluations) left out."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.timed, self.t0 = 0, time.time()

    def tick(self) -> None:
        self.timed += 1

    def read(self) -> tuple[int, float]:
        return self.timed, time.time() - self.t0

    @contextlib.contextmanager
    def paused(self):
        start = time.time()
        try:
            yield
        finally:
            self.t0 += time.time() - start


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class RankRNG:
    """Per-rank random streams (step.Generators). `train` gives the step a resume on another world size
    reseeds from."""

    def __init__(self, generators, seed: int, train: TrainState):
        self.gens, self.seed, self.train = generators, seed, train

    def rank_state(self) -> dict:
        return {"gen": self.gens.timesteps.get_state(), "labels": self.gens.labels.get_state(), **_rng_state()}

    def load_rank_states(self, states: list[dict], rank: int, world_size: int) -> None:
        if len(states) != world_size:  # another world size: fresh per-rank streams
            self.gens.timesteps.manual_seed(seeds.derive(self.seed, "reseed", rank, self.train.step))
            self.gens.labels.manual_seed(seeds.derive(self.seed, "labels", rank, self.train.step))
            return
        mine = states[rank]
        self.gens.timesteps.set_state(mine["gen"])
        if "labels" in mine:
            self.gens.labels.set_state(mine["labels"])
        else:  # a checkpoint from before label dropout had its own stream (it drew from the timesteps'):
            # a fresh one, derived from the run seed, rank and step, so the resumed run stays deterministic
            self.gens.labels.manual_seed(seeds.derive(self.seed, "labels", rank, self.train.step))
        torch.set_rng_state(mine["torch"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["cuda"])
