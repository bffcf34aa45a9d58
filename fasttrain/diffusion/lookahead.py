"""Look-ahead around the optimizer step: the one generic hook through which components learn how an
update changes the model's losses (the adaptive timestep sampler; the cross-timestep interference
diagnostic), and the shared machinery that measures it.

The hook. The trainer knows nothing about either component: every `train.step`, for each component
that is a `LookAhead` and whose `due(step)` is true, it calls `before_update(ctx)` after the
gradients of the step are complete (all micro-batches accumulated) and before `optimizer.step()`,
and `after_update(ctx)` right after it. `ctx` (`LookAheadContext`) carries the model, the objective
and the step's first micro-batch; components evaluate the model on their own probes through it.

The machinery (what both components share):
  Probe        a fixed set of (x0, t) pairs with x_t = a[t]·x0 + s[t]·ε drawn ONCE from the
               project's counter-based noise (the noise op, `fasttrain.kernels.noise`) at a
               (seed, offset) the component chooses. Evaluating the same Probe before and after
               the update uses the same ε and x_t: common random numbers (CRN), so the difference
               measures the update, not the noise.
  x0_mse       per-element mean_d (x0 − x̂0)² of a Probe: ONE model forward per element, in chunks
               of equal size (FSDP needs every rank to make the same calls with the same shapes),
               no autograd, fp32 arithmetic after the model, x̂0 through the network's output head
               (`Denoiser.x0_hat`, so a mixed prediction is honoured). Any per-timestep loss is a table times this
               (vlb.py: L_τ = coef[τ]·mse + const[τ]; a training weighting: w[t]·c(t)·mse).
  RankSplit    a grid of n probe elements split in contiguous, equal, padded shares over ranks;
               `scatter` puts a rank's values at their global positions (zeros elsewhere), so ONE
               all-reduce (`all_reduce_sum_`) assembles the whole grid on every rank.
  HookTimer    seconds spent in the hooks (CUDA events on GPU: no sync until they are read).

Who uses what: the adaptive sampler evaluates Probes with `x0_mse` before and after the update,
split over ranks with `RankSplit`, timed with `HookTimer`. The cross-timestep interference diagnostic
(interference.py) is a LookAhead on the same hook, called after the update; it keeps its own fixed
probe (fixed images, timesteps and noise, so measurements are comparable) and measures first-order
effects through per-bucket gradients rather than before/after losses, since one optimizer step
cannot be attributed to a single bucket.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fasttrain.kernels.noise import noise


@dataclass
class LookAheadContext:
    model: Any                      # the training Denoiser (possibly FSDP/DDP-wrapped): call it, do not unwrap it
    objective: Any                  # the training objective: schedule, tables, seed, backend, probe_loss
    x0: torch.Tensor                # the step's first micro-batch
    labels: torch.Tensor | None     # its labels (after label dropout), or None
    step: int                       # the optimizer step about to be taken (0-based)
    rank: int = 0
    world_size: int = 1
    lr: float | None = None         # the step's learning rate (for components that imitate an update)
    optimizer: Any = None           # the training optimizer (its state: read, never changed)


class LookAhead:
    """Mixin for components with a look-ahead. `every` is the period in optimizer steps; `acts_before`
    declares whether `before_update` does anything (a component that acts only after the update can
    follow a step replayed from a CUDA graph)."""

    every: int = 0
    acts_before: bool = True

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def before_update(self, ctx: LookAheadContext) -> None:
        pass

    def after_update(self, ctx: LookAheadContext) -> None:
        pass

    def metrics(self) -> dict:
        """Values for the trainer's log lines (0-d tensors or floats); read at log steps only."""
        return {}


def lookaheads(*components) -> list[LookAhead]:
    return [c for c in components if isinstance(c, LookAhead)]


# -- probes with common random numbers -----------------------------------------------------------
@dataclass
class Probe:
    x0: torch.Tensor                # [N, ...] (may be an expanded view)
    t: torch.Tensor                 # [N] long
    x_t: torch.Tensor               # [N, ...] in x0's dtype, drawn once
    labels: torch.Tensor | None = None

    @classmethod
    def draw(cls, objective, x0: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None, *,
             seed: int, offset: int) -> Probe:
        """x_t = a[t]·x0 + s[t]·ε with ε of element i, dimension d at counter offset + i·D + d of the
        Philox stream `seed` (the noise op: the training step's own noise path and backend)."""
        backend = objective.kernels(x0.device)
        x_t = noise(x0, t, objective.alpha, objective.sigma, seed=seed, offset=offset, backend=backend)
        return cls(x0, t, x_t, labels)

    def __len__(self) -> int:
        return self.t.shape[0]

    @staticmethod
    def cat(*probes: Probe) -> Probe:
        labels = [p.labels for p in probes]
        if any(lb is None for lb in labels) and not all(lb is None for lb in labels):
            raise ValueError("probes to concatenate must all have labels or all have none")
        return Probe(torch.cat([p.x0 for p in probes]), torch.cat([p.t for p in probes]),
                     torch.cat([p.x_t for p in probes]), None if labels[0] is None else torch.cat(labels))


_HAS_DROPOUT: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def _has_dropout(model) -> bool:
    if model not in _HAS_DROPOUT:  # one walk per model (a look-ahead evaluates it twice per update)
        _HAS_DROPOUT[model] = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
                                  for m in model.modules())
    return _HAS_DROPOUT[model]


@contextlib.contextmanager
def probe_mode(model):
    """Evaluate in eval mode when the model has active dropout (else the before/after forwards would
    draw different masks and CRN would not hold); otherwise leave its mode alone, so that a
    torch.compile'd model is not recompiled for a flag it does not read."""
    flip = model.training and _has_dropout(model)
    if flip:
        model.eval()
    try:
        yield
    finally:
        if flip:
            model.train()


@torch.no_grad()
def x0_mse(model, probe: Probe, chunk: int = 0) -> torch.Tensor:
    """mean_d (x0 − x̂0)² per probe element, fp32 [N]: one forward per element, `chunk` elements per
    call (0: all at once), x̂0 through the network's own output head (`Denoiser.x0_hat`, so a mixed
    prediction is honoured). The number and shapes of calls depend only on N and chunk."""
    n = len(probe)
    chunk = n if chunk <= 0 else chunk
    out = []
    with probe_mode(model):
        for i in range(0, n, chunk):
            sl = slice(i, min(i + chunk, n))
            y = None if probe.labels is None else probe.labels[sl]
            x0_hat = model.x0_hat(probe.x_t[sl], probe.t[sl], y, dtype=torch.float32)
            out.append((probe.x0[sl].float() - x0_hat).pow(2).flatten(1).mean(1))
    return torch.cat(out)


# -- distributed ---------------------------------------------------------------------------------
class RankSplit:
    """Contiguous shares of an n-element grid, `per` = ⌈n/world⌉ elements each (as the official code's
    `torch.chunk(arange(T), world)`, but padded so that every rank has the same count: the last
    indices repeat and are masked out)."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1, device=None):
        self.n, self.rank, self.world_size = int(n), int(rank), int(world_size)
        self.per = -(-self.n // self.world_size)
        self.start = self.rank * self.per
        pos = torch.arange(self.start, self.start + self.per, device=device)
        self.mask = pos < self.n                   # bool [per]: real elements
        self.index = pos.clamp(max=self.n - 1)     # [per]: global index of each element (padding repeats)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[n] zeros with this rank's real `values` ([per]) at their global positions."""
        full = values.new_zeros(self.n)
        return full.index_add_(0, self.index, torch.where(self.mask, values, torch.zeros_like(values)))


def distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def all_reduce_sum_(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum over ranks in place (a no-op on one process)."""
    if distributed(world_size):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_(tensor: torch.Tensor, world_size: int, src: int = 0) -> torch.Tensor:
    if distributed(world_size):
        dist.broadcast(tensor, src=src)
    return tensor


# -- timing --------------------------------------------------------------------------------------
class HookTimer:
    """Seconds spent inside the hooks. On CUDA each span is a pair of events, resolved (one sync) only
    when `read()` is called at a log step; on CPU the host clock is the device clock."""

    def __init__(self):
        self._pending: list = []
        self._seconds = 0.0
        self.total = 0.0

    @contextlib.contextmanager
    def span(self, device: torch.device):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._seconds += time.perf_counter() - t0

    def read(self) -> float:
        """Seconds since the previous read (resolves pending CUDA events: a sync)."""
        for start, end in self._pending:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1e3
        self._pending.clear()
        out, self._seconds = self._seconds, 0.0
        self.total += out
        return out
