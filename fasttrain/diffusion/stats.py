"""Per-timestep loss statistics that never leave the device.

Each step scatters its per-sample values (the raw and the weighted loss; for mixed prediction also
each head's x0 error) into a *pending* window of per-timestep bins (`fasttrain.kernels.TimestepBins`,
whose layout and pivot shift are defined there, once); the fused loss kernel does that scatter in the
same pass as the loss. Every K steps `all_reduce()` sums the windows of all ranks (one collective;
every rank holds the same pivots), reads the window's (count, mean, M2) through `bins.moments()`,
merges it into the running totals with Chan et al.'s parallel update, moves the pivots to the new
means, updates the EMA view and the ring of recent losses, and clears the window. All ranks
therefore see identical statistics, and samplers read them in `observe(stats)`.

Checkpoints: the totals are the same on every rank (`state_dict`); the window is each rank's own
(`window_state`), saved per rank and merged when a run resumes on another number of processes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fasttrain.kernels import TimestepBins

from ..errors import InvalidInput

KINDS = ("raw", "weighted")


def chan_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Merge two sets of (count, mean, M2) elementwise (Chan, Golub & LeVeque 1979)."""
    n = n_a + n_b
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = mean_b - mean_a
    mean = torch.where(n > 0, mean_a + delta * n_b / safe, mean_a)
    m2 = m2_a + m2_b + delta**2 * n_a * n_b / safe
    return n, mean, m2


class TimestepStats:
    def __init__(self, T: int, device="cpu", ema_decay: float = 0.9, history: int = 0,
                 kinds: tuple[str, ...] = KINDS):
        if not 0 <= ema_decay < 1:
            raise InvalidInput(f"ema_decay must lie in [0, 1), got {ema_decay!r}")
        self.T, self.ema_decay, self.history, self.kinds = T, ema_decay, history, tuple(kinds)
        self.window = TimestepBins(T, len(self.kinds), device)
        z = lambda: torch.zeros(T, dtype=torch.float64, device=self.device)
        self.count = z()
        self.mean = {k: z() for k in self.kinds}
        self.m2 = {k: z() for k in self.kinds}
        self.ema = {k: z() for k in self.kinds}
        self.ema_seen = torch.zeros(T, dtype=torch.bool, device=self.device)
        self._pending_samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ring = torch.zeros(T, max(history, 1), dtype=torch.float32, device=self.device)
        self.ring_count = torch.zeros(T, dtype=torch.long, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.window.device

    def to(self, device) -> TimestepStats:
        if torch.device(device) != self.device:
            state, window = self.state_dict(), self.window_state()
            self.window.to(device)
            self.load_state_dict(state)
            self.load_window_state(window)
        return self

    # -- per step (no host sync) -----------------------------------------------------------------
    def add(self, t: torch.Tensor, *values: torch.Tensor) -> None:
        """Add one batch without a fused kernel: t Long[B] and one [B] tensor per kind."""
        t = t.to(self.device)
        self.window.scatter_(t, torch.stack([v.detach().to(self.device, torch.float64) for v in values]))
        self.record(t, values[self.kinds.index("weighted")] if "weighted" in self.kinds else values[0])

    def record(self, t: torch.Tensor, weighted: torch.Tensor) -> None:
        """Queue (t, weighted loss) for the ring of recent losses (when one is kept). Callers whose
        kernel scattered into the window itself call only this."""
        if self.history > 0:
            self._pending_samples.append((t.to(self.device), weighted.detach().float().to(self.device)))

    # -- every K steps ---------------------------------------------------------------------------
    def all_reduce(self, group=None) -> None:
        """Merge the pending window of every rank into the totals (identical on all ranks)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        if distributed:
            dist.all_reduce(self.window.data, group=group)
        samples = self._gather_samples(group) if distributed else self._local_samples()
        n, mean_b, m2_b = self.window.moments()
        for i, k in enumerate(self.kinds):
            new_n, self.mean[k], self.m2[k] = chan_merge(self.count, self.mean[k], self.m2[k], n, mean_b[i], m2_b[i])
            blended = self.ema_decay * self.ema[k] + (1 - self.ema_decay) * mean_b[i]
            self.ema[k] = torch.where(n > 0, torch.where(self.ema_seen, blended, mean_b[i]), self.ema[k])
        self.ema_seen |= n > 0
        self.count = new_n
        self.window.zero_()
        self.window.set_pivots(torch.stack([self.mean[k] for k in self.kinds]))
        if samples is not None:
            self._push_ring(*samples)
        self._pending_samples = []

    def _local_samples(self):
        if not self._pending_samples:
            return None
        return torch.cat([s[0] for s in self._pending_samples]), torch.cat([s[1] for s in self._pending_samples])

    def _gather_samples(self, group):
        """Every rank's queued (t, loss) pairs. Ranks may hold different numbers (a resumed run's
        rank 0 carries the merged queue of an old layout), so sizes are exchanged first."""
        if self.history <= 0:
            return None
        t, v = self._local_samples() or (torch.zeros(0, dtype=torch.long, device=self.device),
                                         torch.zeros(0, device=self.device))
        ws = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(ws)]
        dist.all_gather(sizes, torch.tensor([t.numel()], device=self.device), group=group)
        size = int(max(s.item() for s in sizes))  # one small sync every K steps
        pad_t = torch.cat([t, t.new_zeros(size - t.numel())])
        pad_v = torch.cat([v, v.new_zeros(size - v.numel())])
        tg, vg = [torch.empty_like(pad_t) for _ in range(ws)], [torch.empty_like(pad_v) for _ in range(ws)]
        dist.all_gather(tg, pad_t, group=group)
        dist.all_gather(vg, pad_v, group=group)
        keep = [(a[: int(s.item())], b[: int(s.item())]) for a, b, s in zip(tg, vg, sizes)]
        return torch.cat([a for a, _ in keep]), torch.cat([b for _, b in keep])

    def _push_ring(self, t: torch.Tensor, v: torch.Tensor) -> None:
        """Write each loss into slot (count[t] + k) % H of its timestep's ring, k its arrival order among
        this batch's samples at t, keeping only the last H per timestep (iDDPM's per-term deque) without
        a host sync."""
        order = torch.argsort(t, stable=True)  # arrival order kept within each timestep
        ts, vs = t[order], v[order]
        idx = torch.arange(ts.numel(), device=ts.device)
        is_start = torch.ones_like(ts, dtype=torch.bool)
        is_start[1:] = ts[1:] != ts[:-1]
        before = idx - torch.where(is_start, idx, 0).cummax(0).values  # earlier samples with this t
        size = torch.zeros_like(self.ring_count).index_add_(0, ts, torch.ones_like(ts))
        # Writes with `after >= H` would be overwritten anyway: masking them (instead of boolean
        # indexing, which syncs) sends them to slot H, a scratch column that is dropped.
        keep = (size[ts] - 1 - before) < self.history
        slot = torch.where(keep, (self.ring_count[ts] + before) % self.history, self.history)
        ring = torch.cat([self.ring, self.ring.new_zeros(self.T, 1)], dim=1)
        ring.index_put_((ts, slot), vs)
        self.ring = ring[:, : self.history].contiguous()
        self.ring_count += size

    # -- views -----------------------------------------------------------------------------------
    def variance(self, kind: str = "raw") -> torch.Tensor:
        """Unbiased per-timestep variance (NaN where fewer than 2 samples)."""
        return torch.where(self.count > 1, self.m2[kind] / (self.count - 1).clamp_min(1), torch.nan)

    def means(self, kind: str = "raw") -> torch.Tensor:
        return torch.where(self.count > 0, self.mean[kind], torch.nan)

    def ema_view(self, kind: str = "raw") -> torch.Tensor:
        return torch.where(self.ema_seen, self.ema[kind], torch.nan)

    def bucketed(self, n_buckets: int = 10, kind: str = "raw") -> dict:
        """Merge timesteps into `n_buckets` equal-width buckets: count, mean, unbiased variance."""
        edges = torch.linspace(0, self.T, n_buckets + 1).round().long()
        out = {"edges": edges.tolist(), "count": [], "mean": [], "var": []}
        for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist()):
            n, mean, m2 = self.count[lo:hi], self.mean[kind][lo:hi], self.m2[kind][lo:hi]
            tot = n.sum()
            mu = (n * mean).sum() / tot.clamp_min(1)
            m2_all = (m2 + n * (mean - mu) ** 2).sum()  # Chan merge over the bucket's timesteps
            out["count"].append(tot)
            out["mean"].append(torch.where(tot > 0, mu, torch.nan))
            out["var"].append(torch.where(tot > 1, m2_all / (tot - 1).clamp_min(1), torch.nan))
        for k in ("count", "mean", "var"):
            out[k] = torch.stack(out[k])
        return out

    def history_ring(self, history: int):
        if history != self.history:
            raise ValueError(f"the stats keep a history of {self.history} losses per timestep, "
                             f"the sampler wants {history}")
        return self.ring, self.ring_count

    # -- persistence -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The totals: identical on every rank after `all_reduce`."""
        return {"kinds": list(self.kinds), "count": self.count, "mean": dict(self.mean), "m2": dict(self.m2),
                "ema": dict(self.ema), "ema_seen": self.ema_seen, "ring": self.ring, "ring_count": self.ring_count}

    def load_state_dict(self, state: dict) -> None:
        def own(x):  # copies: a loaded state must not alias the tensors of the object it came from
            return x.to(self.device, copy=True)

        if tuple(state.get("kinds", KINDS)) != self.kinds:
            raise ValueError(f"statistics of {state.get('kinds')} cannot be loaded into {list(self.kinds)}")
        self.count, self.ema_seen = own(state["count"]), own(state["ema_seen"])
        self.mean = {k: own(v) for k, v in state["mean"].items()}
        self.m2 = {k: own(v) for k, v in state["m2"].items()}
        self.ema = {k: own(v) for k, v in state["ema"].items()}
        self.ring, self.ring_count = own(state["ring"]), own(state["ring_count"])
        self.window.set_pivots(torch.stack([self.mean[k] for k in self.kinds]))

    def window_state(self) -> dict:
        """This rank's pending window and queued ring samples (not yet all-reduced)."""
        queued = self._local_samples()
        return {"bins": self.window.data.clone(), "t": None if queued is None else queued[0],
                "v": None if queued is None else queued[1]}

    def load_window_state(self, state: dict | None) -> None:
        """Restore a window (None: empty). Pivots come from the totals, so load those first."""
        self.window.zero_()
        self._pending_samples = []
        if state is None:
            return
        self.window.data.copy_(state["bins"].to(self.device))
        if state["t"] is not None:
            self._pending_samples = [(state["t"].to(self.device), state["v"].to(self.device))]

    @staticmethod
    def merge_window_states(states: list[dict]) -> dict:
        """One window holding several ranks' windows (they share the pivots): for a resume on
        another number of processes, where one rank takes the merged window and the others none."""
        ts = [s["t"] for s in states if s["t"] is not None]
        return {"bins": sum(s["bins"] for s in states), "t": torch.cat(ts) if ts else None,
                "v": torch.cat([s["v"] for s in states if s["v"] is not None]) if ts else None}
