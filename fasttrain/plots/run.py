"""Matplotlib figures of a run: per-timestep loss mean/variance, sampling probability, effective
x0-space weight, the loss curve, evaluation curves, sample grids (images, latents, 2-D points), the
interference matrix. The trainer and the commands draw through `save_samples` and `plot_run`, so each
figure is made in one place."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .adaptive import plot_adaptive
from .common import finish, plt, to_numpy


def plot_timesteps(path, stats, probs, eff_weight, title: str = "", buckets: int = 50,
                   head_errors: dict | None = None) -> Path:
    """2×2 panels over t: loss mean and standard deviation (raw and weighted; per timestep faint,
    merged into `buckets` buckets bold), sampling probability p(t), effective x0-space weight; with a
    mixed prediction a third row: each head's running x0 error against t."""
    t = np.arange(stats.T)
    rows = 3 if head_errors else 2
    fig, ax = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    if head_errors:
        for name, err in head_errors.items():
            e = to_numpy(err)
            ok = np.isfinite(e) & (e > 0)
            ax[2, 0].plot(t[ok], e[ok], lw=1.2, label=name)
        ax[2, 0].set(yscale="log", xlabel="timestep t", ylabel="EMA of mean (x̂0 − x0)²",
                     title="x0 error of each head")
        ax[2, 0].legend(fontsize=8)
        ax[2, 1].axis("off")
    for kind, color in (("raw", "C0"), ("weighted", "C1")):
        b = stats.bucketed(buckets, kind)
        centers = (np.array(b["edges"][:-1]) + np.array(b["edges"][1:]) - 1) / 2
        mean = to_numpy(stats.means(kind))
        ok = np.isfinite(mean) & (mean > 0)
        ax[0, 0].plot(t[ok], mean[ok], color=color, lw=0.5, alpha=0.3)
        ax[0, 0].plot(centers, to_numpy(b["mean"]), color=color, lw=1.8,
                      label=f"{kind} (pred-space MSE)" if kind == "raw" else "weighted (w·MSE)")
        ax[0, 1].plot(centers, np.sqrt(to_numpy(b["var"])), color=color, lw=1.8, label=kind)
    ax[0, 0].set(yscale="log", xlabel="timestep t", ylabel="mean per-sample loss", title="loss per timestep")
    ax[0, 1].set(yscale="log", xlabel="timestep t", ylabel="std of per-sample loss",
                 title=f"loss spread ({buckets} buckets)")
    ax[0, 0].legend(fontsize=8)
    ax[0, 1].legend(fontsize=8)
    ax[1, 0].plot(t, to_numpy(probs), color="C2")
    ax[1, 0].axhline(1 / stats.T, color="grey", ls=":", lw=0.8, label="uniform")
    ax[1, 0].set(xlabel="timestep t", ylabel="p(t)", title="sampling probability", ylim=(0, None))
    ax[1, 0].legend(fontsize=8)
    ax[1, 1].plot(t, to_numpy(eff_weight), color="C3")
    ax[1, 1].set(yscale="log", xlabel="timestep t", ylabel="T·p(t)·iw·w(t)·c(t)", title="effective x0-space weight")
    return finish(fig, path, title)


def plot_loss_curve(path, rows: list[dict]) -> Path:
    from ..logger import number

    pts = [(number(r, "images"), number(r, "loss")) for r in rows]
    pts = [p for p in pts if None not in p]
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1)
    ax.set(xlabel="training images seen", ylabel="loss (mean over the log interval)", yscale="log",
           title="training loss")
    return finish(fig, path)


def plot_eval_curves(path, rows: list[dict]) -> Path | None:
    """FID, KID and bits/dim against images seen, from the eval rows of metrics.jsonl."""
    from ..logger import number

    pts = {k: [(number(r, "images"), number(r, k)) for r in rows] for k in ("eval/fid", "eval/kid", "eval/bpd")}
    pts = {k: [p for p in v if None not in p] for k, v in pts.items()}
    keys = [k for k, v in pts.items() if v]
    if not keys:
        return None
    fig, ax = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for a, k in zip(ax[0], keys):
        a.plot([p[0] for p in pts[k]], [p[1] for p in pts[k]], marker="o")
        a.set(xlabel="training images seen", ylabel=k.split("/")[1], title=k.split("/")[1].upper() + " over training")
    return finish(fig, path)


def plot_points(path, samples: torch.Tensor, data: torch.Tensor, title: str = "") -> Path:
    """Scatter of 2-D samples next to the data they should match."""
    fig, ax = plt.subplots(1, 2, figsize=(8, 4), sharex=True, sharey=True)
    for a, pts, name in ((ax[0], data, "data"), (ax[1], samples, "samples")):
        p = to_numpy(pts)
        a.scatter(p[:, 0], p[:, 1], s=2, alpha=0.5)
        a.set(title=name, aspect="equal")
    return finish(fig, path, title)


def save_samples(path, x: torch.Tensor, spec, reference: torch.Tensor | None = None, nrow: int | None = None) -> Path:
    """A grid of generated images (one column per class when conditional, upscaled to ~64 px), the
    first channel of latents (the tensor itself saved beside as .pt, to decode elsewhere), or a
    scatter of 2-D points next to the data."""
    import math

    import torch.nn.functional as F
    from torchvision.utils import save_image

    path = Path(path)
    if not spec.image_size:
        return plot_points(path, x, reference if reference is not None else x[:0], title=spec.name)
    if spec.traits.latents:
        torch.save(x.cpu(), path.with_suffix(".pt"))
        x = x[:, :1] / x[:, :1].abs().amax().clamp_min(1e-8)
    nrow = nrow or spec.num_classes or int(math.sqrt(len(x))) or 1
    big = F.interpolate(x.float().cpu(), scale_factor=max(1, 64 // spec.image_size), mode="nearest")
    save_image(big * 0.5 + 0.5, path, nrow=nrow, padding=2, pad_value=1.0)
    return path


def plot_interference(path, history: list[dict], title: str = "") -> Path | None:
    """Left: the latest interference matrix M[i, j] (first-order change of bucket j's loss from the
    optimizer's step on bucket i's gradient alone; red = it raises j's loss). Right: the mean diagonal
    (own-bucket progress) and off-diagonal entries over training."""
    if not history:
        return None
    m = to_numpy(history[-1]["matrix"])
    B = m.shape[0]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
    lim = np.nanmax(np.abs(m)) or 1.0
    im = ax[0].imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim)
    for i in range(B):
        for j in range(B):
            ax[0].text(j, i, f"{m[i, j]:.2g}", ha="center", va="center", fontsize=8)
    names = [f"{k}/{B}" for k in range(1, B + 1)]
    ax[0].set_xticks(range(B), names)
    ax[0].set_yticks(range(B), names)
    ax[0].set(xlabel="loss of timestep bucket j (low t → high t)", ylabel="update driven by bucket i",
              title=f"interference at step {history[-1]['step']}")
    fig.colorbar(im, ax=ax[0], fraction=0.046)
    steps = [h["step"] for h in history]
    eye = np.eye(B, dtype=bool)
    ax[1].plot(steps, [to_numpy(h["matrix"])[eye].mean() for h in history], marker="o", label="own bucket (diagonal)")
    ax[1].plot(steps, [to_numpy(h["matrix"])[~eye].mean() for h in history], marker="o",
               label="other buckets (off-diagonal)")
    ax[1].axhline(0, color="grey", lw=0.8, ls=":")
    ax[1].set(xlabel="training step", ylabel="mean first-order change of loss", title="interference over training")
    ax[1].legend(fontsize=8)
    return finish(fig, path, title)


def plot_run(run_dir, objective=None, title: str = "", interference=None) -> list[Path]:
    """The run's figures: timesteps.png (from the objective's statistics), adaptive.png (a learned
    sampler's p(t) over training), interference.png, loss.png and eval.png (from metrics.jsonl)."""
    from ..logger import read_jsonl

    run_dir, out = Path(run_dir), []
    h = objective.p_history(bins=100) if objective is not None else None
    if h is not None and len(h["steps"]):
        out.append(plot_adaptive(run_dir / "adaptive.png", h["steps"], h["p"], h["S"], h["T"], title=title))
    if interference is not None and interference.history:
        out.append(plot_interference(run_dir / "interference.png", interference.history, title=title))
    if objective is not None and objective.stats is not None:
        out.append(plot_timesteps(run_dir / "timesteps.png", objective.stats, objective.probs(),
                                  objective.effective_weight(), title=title, head_errors=objective.head_errors()))
    if (run_dir / "metrics.jsonl").is_file():
        rows = read_jsonl(run_dir / "metrics.jsonl")
        out.append(plot_loss_curve(run_dir / "loss.png", rows))
        ev = plot_eval_curves(run_dir / "eval.png", rows)
        if ev is not None:
            out.append(ev)
    return out
