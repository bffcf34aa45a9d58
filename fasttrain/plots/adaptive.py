"""Plots of what the adaptive timestep sampler learned: p(t) over training as a heatmap (timestep ×
step) and the selected set S over time. Inputs are plain arrays, the history the sampler records
(`Adaptive.p_history(bins)`: steps [U], p [U, bins], S [U, n_select], T), so the report can call
this from a checkpoint's sampler state without the trainer:

    h = sampler.p_history(bins=100)
    plot_adaptive("adaptive.png", h["steps"], h["p"], h["S"], h["T"])
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm

from .common import finish, plt


def plot_adaptive(path, steps, p, S, T: int, title: str = "") -> Path:
    """Left: T·p(t) (density relative to uniform, log colour scale centred on 1) per timestep bin (y)
    at each policy update (x). Right: the timesteps of S at each update. Also the first and last p(t)
    as curves, so that the movement reads without the colour scale."""
    steps, p, S = np.asarray(steps), np.asarray(p, dtype=float), np.asarray(S)
    if p.ndim != 2 or len(steps) != len(p) or len(S) != len(p):
        raise ValueError(f"expected steps [U], p [U, bins], S [U, k] with one row per update; got "
                         f"{steps.shape}, {p.shape}, {S.shape}")
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [2.2, 1, 1.2]})
    if len(p) == 0:
        for a in ax:
            a.text(0.5, 0.5, "no policy updates yet", ha="center", va="center", transform=a.transAxes)
        return finish(fig, path, title)
    bins = p.shape[1]
    rel = np.clip(p * bins, 1e-3, None)  # bin mass relative to uniform (bins·p = 1 everywhere for uniform)
    span = max(2.0, float(np.nanmax(np.abs(np.log10(rel)))) if np.isfinite(rel).all() else 2.0)
    x = steps if len(steps) > 1 else np.array([steps[0], steps[0] + 1])
    img = rel.T if len(steps) > 1 else np.repeat(rel.T, 2, axis=1)
    mesh = ax[0].pcolormesh(x, (np.arange(bins) + 0.5) * T / bins, img, shading="nearest", cmap="RdBu_r",
                            norm=LogNorm(vmin=10 ** -min(span, 3), vmax=10 ** min(span, 3)))
    fig.colorbar(mesh, ax=ax[0], label="p(t) relative to uniform")
    ax[0].set(xlabel="optimizer step", ylabel="timestep t", title="learned p(t) over training", ylim=(0, T))
    for k in range(S.shape[1] if S.ndim == 2 else 0):
        ax[1].scatter(steps, S[:, k], s=8, label=f"S[{k}]")
    ax[1].set(xlabel="optimizer step", ylabel="timestep", title="selected timesteps S", ylim=(-T * 0.02, T * 1.02))
    centers = (np.arange(bins) + 0.5) * T / bins
    ax[2].plot(centers, rel[0], label=f"step {steps[0]}", color="C0")
    ax[2].plot(centers, rel[-1], label=f"step {steps[-1]}", color="C3")
    ax[2].axhline(1, color="grey", ls=":", lw=0.8, label="uniform")
    ax[2].set(xlabel="timestep t", ylabel="p(t) relative to uniform", title="first and last p(t)", yscale="log")
    ax[2].legend(fontsize=8)
    return finish(fig, path, title)

