"""Per-timestep loss statistics that never leave the device.

Each step scatters its per-sample losses into a *pending* window of per-timestep bins: count, Σ(v - c)
and Σ(v - c)² in fp64 for the raw and the weighted loss, shifted by a per-timestep pivot c = the
running mean so far (the "shifted data" algorithm: Σ² - (Σ)²/n then cancels only what the spread
around the running mean is worth, not the mean itself). This is the contract of the fused loss
kernel, which writes the same bins. Every K steps `all_reduce()` sums the windows of all ranks (one
collective; every rank holds the same pivots), turns the window into (count, mean, M2), merges it
into the running totals with Chan et al.'s parallel update, moves the pivots to the new means,
updates the EMA view and the ring of recent losses, and clears the window. All ranks therefore see
identical statistics, and samplers read them in `update(stats)`.

Precision: a timestep's first window has pivot 0, so its variance carries a relative error of about
1e-16·(mean/std)²; later windows are centred on the running mean.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fasttrain.kernels import reference as ref

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
    def __init__(self, T: int, device="cpu", ema_decay: float = 0.9, history: int = 0):
        if not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay must lie in [0, 1), got {ema_decay!r}")
        self.T, self.device, self.ema_decay, self.history = T, torch.device(device), ema_decay, history
        z = lambda: torch.zeros(T, dtype=torch.float64, device=self.device)  # noqa: E731
        self.count = z()
        self.mean = {k: z() for k in KINDS}
        self.m2 = {k: z() for k in KINDS}
        self.ema = {k: z() for k in KINDS}
        self.ema_seen = torch.zeros(T, dtype=torch.bool, device=self.device)
        self.pending = torch.zeros(5, T, dtype=torch.float64, device=self.device)  # n, Σr, Σr², Σw, Σw² (shifted)
        self._pending_samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ring = torch.zeros(T, max(history, 1), dtype=torch.float32, device=self.device)
        self.ring_count = torch.zeros(T, dtype=torch.long, device=self.device)
        self.syncs = 0
        self._pivots = torch.zeros(len(KINDS), T, dtype=torch.float64, device=self.device)

    # -- per step (no host sync) -----------------------------------------------------------------
    def pivots(self) -> torch.Tensor:
        """[2, T] shift of the pending bins: the running mean of each kind (0 where unseen). It only
        changes in `all_reduce`, so it is cached there and kernels read it every step for free."""
        return self._pivots

    def update(self, t: torch.Tensor, raw: torch.Tensor, weighted: torch.Tensor, bins: torch.Tensor | None = None):
        """Add one batch: t Long[B], per-sample raw and weighted losses. `bins` ([5, T], already
        shifted by `pivots()`) comes from the fused loss kernel, which scattered them itself."""
        t = t.to(self.device)
        if bins is None:
            values = torch.stack([raw.detach(), weighted.detach()]).to(self.device, torch.float64)
            bins = ref.scatter_stats(t, values - self.pivots()[:, t], self.T)
        self.pending += bins
        self.record(t, weighted)

    def record(self, t: torch.Tensor, weighted: torch.Tensor) -> None:
        """Queue (t, weighted loss) for the ring of recent losses (when one is kept). Callers whose
        kernel scattered into `pending` itself call only this."""
        if self.history > 0:
            self._pending_samples.append((t.to(self.device), weighted.detach().float().to(self.device)))

    # -- every K steps ---------------------------------------------------------------------------
    def all_reduce(self, group=None) -> None:
        """Merge the pending window of every rank into the totals (identical on all ranks)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        pending = self.pending
        if distributed:
            ws = dist.get_world_size(group)
            dist.all_reduce(pending, group=group)
        samples = None
        if self._pending_samples:
            t = torch.cat([s[0] for s in self._pending_samples])
            v = torch.cat([s[1] for s in self._pending_samples])
            if distributed:  # every rank holds K·B samples, so the gather has equal sizes
                tg, vg = [torch.empty_like(t) for _ in range(ws)], [torch.empty_like(v) for _ in range(ws)]
                dist.all_gather(tg, t, group=group)
                dist.all_gather(vg, v, group=group)
                t, v = torch.cat(tg), torch.cat(vg)
            samples = (t, v)
        n = pending[0]
        safe = n.clamp_min(1)
        for i, k in enumerate(KINDS):
            s1, s2 = pending[1 + 2 * i], pending[2 + 2 * i]
            mean_b = torch.where(n > 0, self.mean[k] + s1 / safe, 0.0)  # pivot + mean of the shifted values
            m2_b = torch.clamp(s2 - s1 * s1 / safe, min=0.0)
            new_n, self.mean[k], self.m2[k] = chan_merge(self.count, self.mean[k], self.m2[k], n, mean_b, m2_b)
            seen = n > 0
            blended = self.ema_decay * self.ema[k] + (1 - self.ema_decay) * mean_b
            self.ema[k] = torch.where(seen, torch.where(self.ema_seen, blended, mean_b), self.ema[k])
        self.ema_seen |= n > 0
        self.count = new_n
        self._pivots = torch.stack([self.mean[k] for k in KINDS])
        if samples is not None:
            self._push_ring(*samples)
        self.pending = torch.zeros_like(self.pending)
        self._pending_samples = []
        self.syncs += 1

    def _push_ring(self, t: torch.Tensor, v: torch.Tensor) -> None:
        """Write each loss into slot (count[t] + rank) % H of its timestep's ring, in arrival order,
        keeping only the last H per timestep (iDDPM's per-term deque) without a host sync."""
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
        samples = self._pending_samples
        return {
            "count": self.count, "mean": dict(self.mean), "m2": dict(self.m2), "ema": dict(self.ema),
            "ema_seen": self.ema_seen, "pending": self.pending, "ring": self.ring,
            "ring_count": self.ring_count, "syncs": self.syncs,
            "pending_t": torch.cat([s[0] for s in samples]) if samples else None,
            "pending_v": torch.cat([s[1] for s in samples]) if samples else None,
        }

    def load_state_dict(self, state: dict) -> None:
        def own(x):  # copies: a loaded state must not alias the tensors of the object it came from
            return x.to(self.device, copy=True)

        self.count, self.ema_seen = own(state["count"]), own(state["ema_seen"])
        self.mean = {k: own(v) for k, v in state["mean"].items()}
        self.m2 = {k: own(v) for k, v in state["m2"].items()}
        self.ema = {k: own(v) for k, v in state["ema"].items()}
        self.pending, self.ring, self.ring_count = own(state["pending"]), own(state["ring"]), own(state["ring_count"])
        self.syncs = int(state["syncs"])
        self._pivots = torch.stack([self.mean[k] for k in KINDS])
        self._pending_samples = [] if state["pending_t"] is None else [(own(state["pending_t"]), own(state["pending_v"]))]
