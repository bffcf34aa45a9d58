"""Per-timestep statistics bins: the one definition of the layout that the fused loss kernels scatter into.

For V per-sample values (the raw and the weighted loss, and for mixed prediction each head's x0 error)
a window of bins holds, per timestep t, in float64:

    data[0, t]          count n
    data[1 + 2v, t]     Σ (x_v - c_v[t])       for each value v
    data[2 + 2v, t]     Σ (x_v - c_v[t])²

shifted by a pivot c_v[t] (`pivots`, [V, T]): the "shifted data" algorithm, so that Σ² - (Σ)²/n
cancels only what the spread around the pivot is worth, not the mean itself (Chan, Golub & LeVeque
1983). Owners set the pivots to their running means. `moments()` is the only place that undoes the
shift; kernels receive `data` and `pivots` and add to them; non-finite values are not scattered (a
skipped, non-finite training step must not poison the statistics).
"""
from __future__ import annotations

import torch


class TimestepBins:
    def __init__(self, T: int, n_values: int = 2, device="cpu"):
        if T < 1 or n_values < 1:
            raise ValueError(f"bins need T >= 1 and n_values >= 1, got T={T}, n_values={n_values}")
        self.T, self.n_values = int(T), int(n_values)
        self.data = torch.zeros(1 + 2 * n_values, T, dtype=torch.float64, device=device)
        self.pivots = torch.zeros(n_values, T, dtype=torch.float64, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device) -> TimestepBins:
        self.data, self.pivots = self.data.to(device), self.pivots.to(device)
        return self

    def zero_(self) -> TimestepBins:
        self.data.zero_()
        return self

    def set_pivots(self, pivots: torch.Tensor) -> None:
        """New shifts (say the running means); only valid while the window is empty. In place: kernels
        captured in a CUDA graph keep reading the same memory."""
        self.pivots.copy_(pivots.to(self.data.device, torch.float64).reshape(self.n_values, self.T))

    def scatter_(self, t: torch.Tensor, values: torch.Tensor) -> TimestepBins:
        """Add per-sample values [V, B] at timesteps t [B] (the reference of the kernels' scatter)."""
        scatter_into(self.data, self.pivots, t, values)
        return self

    def moments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(count [T], mean [V, T], M2 [V, T]) of the window, unshifted; mean is 0 where count is 0."""
        n = self.data[0]
        safe = n.clamp_min(1)
        s1, s2 = self.data[1::2], self.data[2::2]
        mean = torch.where(n > 0, self.pivots + s1 / safe, 0.0)
        m2 = torch.clamp(s2 - s1 * s1 / safe, min=0.0)
        return n, mean, m2

    def state_dict(self) -> dict:
        return {"data": self.data.clone(), "pivots": self.pivots.clone()}

    def load_state_dict(self, state: dict) -> None:
        data, pivots = state["data"], state["pivots"]
        if tuple(data.shape) != tuple(self.data.shape):
            raise ValueError(f"bins of shape {tuple(data.shape)} do not fit {tuple(self.data.shape)}")
        self.data.copy_(data.to(self.data.device, torch.float64))
        self.pivots.copy_(pivots.to(self.data.device, torch.float64))


def scatter_into(data: torch.Tensor, pivots: torch.Tensor, t: torch.Tensor, values: torch.Tensor) -> None:
    """The layout above on raw tensors (what the custom ops receive): add per-sample values [V, B] at
    timesteps t [B] into `data` [1 + 2V, T], shifted by `pivots` [V, T]; non-finite samples left out."""
    v = values.detach().to(data.device, torch.float64).reshape(pivots.shape[0], -1)
    t = t.to(data.device)
    ok = torch.isfinite(v).all(0).to(torch.float64)  # [B]
    d = torch.where(ok.bool(), v - pivots[:, t], 0.0)
    rows = [ok]
    for r in d:
        rows += [r, r * r]
    data.index_add_(1, t, torch.stack(rows))
