"""The trainer's own small state, as named objects the checkpoint manager saves and restores.

  TrainState   progress (steps, images: EDM2 counts images so a change of world size keeps it), the
               skipped-step counters (device tensors: the step never syncs), and the log interval's
               running sums, so that the first metric line after a resume covers the whole interval
  RankRNG      this process's streams: the trainer's generator (timesteps, label dropout) and torch's
               global RNGs; on another world size every rank gets a fresh stream derived from the step
"""
from __future__ import annotations

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


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class RankRNG:
    """Per-rank random streams. `train` gives the step a resume on another world size reseeds from."""

    def __init__(self, generator: torch.Generator, seed: int, train: TrainState):
        self.gen, self.seed, self.train = generator, seed, train

    def rank_state(self) -> dict:
        return {"gen": self.gen.get_state(), **_rng_state()}

    def load_rank_states(self, states: list[dict], rank: int, world_size: int) -> None:
        if len(states) != world_size:  # another world size: fresh per-rank streams
            self.gen.manual_seed(seeds.derive(self.seed, "reseed", rank, self.train.step))
            return
        mine = states[rank]
        self.gen.set_state(mine["gen"])
        torch.set_rng_state(mine["torch"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(mine["cuda"])
