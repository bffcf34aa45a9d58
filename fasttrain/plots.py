"""Matplotlib plots of a run: per-timestep loss mean/variance, sampling probability, effective
x0-space weight, the loss curve, and 2-D samples against the data."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def _finish(fig, path, title: str = "") -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _np(x) -> np.ndarray:
    return x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=float)


def plot_timesteps(path, stats, probs, eff_weight, title: str = "", buckets: int = 50) -> Path:
    """2×2 panels over t: loss mean and standard deviation (raw and weighted; per timestep faint,
    merged into `buckets` buckets bold), sampling probability p(t), effective x0-space weight."""
    t = np.arange(stats.T)
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for kind, color in (("raw", "C0"), ("weighted", "C1")):
        b = stats.bucketed(buckets, kind)
        centers = (np.array(b["edges"][:-1]) + np.array(b["edges"][1:]) - 1) / 2
        mean = _np(stats.means(kind))
        ok = np.isfinite(mean) & (mean > 0)
        ax[0, 0].plot(t[ok], mean[ok], color=color, lw=0.5, alpha=0.3)
        ax[0, 0].plot(centers, _np(b["mean"]), color=color, lw=1.8, label=f"{kind} (pred-space MSE)" if kind == "raw" else "weighted (w·MSE)")
        ax[0, 1].plot(centers, np.sqrt(_np(b["var"])), color=color, lw=1.8, label=kind)
    ax[0, 0].set(yscale="log", xlabel="timestep t", ylabel="mean per-sample loss", title="loss per timestep")
    ax[0, 1].set(yscale="log", xlabel="timestep t", ylabel="std of per-sample loss", title=f"loss spread ({buckets} buckets)")
    ax[0, 0].legend(fontsize=8)
    ax[0, 1].legend(fontsize=8)
    ax[1, 0].plot(t, _np(probs), color="C2")
    ax[1, 0].axhline(1 / stats.T, color="grey", ls=":", lw=0.8, label="uniform")
    ax[1, 0].set(xlabel="timestep t", ylabel="p(t)", title="sampling probability", ylim=(0, None))
    ax[1, 0].legend(fontsize=8)
    ax[1, 1].plot(t, _np(eff_weight), color="C3")
    ax[1, 1].set(yscale="log", xlabel="timestep t", ylabel="T·p(t)·iw·w(t)·c(t)", title="effective x0-space weight")
    return _finish(fig, path, title)


def plot_loss_curve(path, rows: list[dict]) -> Path:
    rows = [r for r in rows if r.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        ax.plot([r["images"] for r in rows], [r["loss"] for r in rows], lw=1)
    ax.set(xlabel="training images seen", ylabel="loss (mean over the log interval)", yscale="log", title="training loss")
    return _finish(fig, path)


def plot_eval_curves(path, rows: list[dict]) -> Path | None:
    """FID, KID and bits/dim against images seen, from the eval rows of metrics.jsonl."""
    keys = [k for k in ("eval/fid", "eval/kid", "eval/bpd") if any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    fig, ax = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for a, k in zip(ax[0], keys):
        pts = [(r["images"], r[k]) for r in rows if r.get(k) is not None]
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        a.set(xlabel="training images seen", ylabel=k.split("/")[1], title=k.split("/")[1].upper() + " over training")
    return _finish(fig, path)


def plot_points(path, samples: torch.Tensor, data: torch.Tensor, title: str = "") -> Path:
    """Scatter of 2-D samples next to the data they should match."""
    fig, ax = plt.subplots(1, 2, figsize=(8, 4), sharex=True, sharey=True)
    for a, pts, name in ((ax[0], data, "data"), (ax[1], samples, "samples")):
        p = _np(pts)
        a.scatter(p[:, 0], p[:, 1], s=2, alpha=0.5)
        a.set(title=name, aspect="equal")
    return _finish(fig, path, title)
