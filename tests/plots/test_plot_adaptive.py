"""fasttrain/plots/adaptive.py: the heatmap of the learned p(t) and S over time, from a sampler's history."""
import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.plots import plot_adaptive


def test_plot_from_a_sampler_history(tmp_path):
    smp = fd.timestep_sampler("adaptive", fd.schedule("linear", T=1000), policy="global", tau_grid=8)
    g = torch.Generator().manual_seed(0)
    for step in range(0, 400, 40):  # a bandit that rewards late timesteps, so that p(t) moves
        t, _ = smp.sample(16, g)
        _, st = smp.policy_step(None, (t > 700).float())
        smp._record(step, st["ab"], torch.tensor([1, 500, 900]))
    h = smp.p_history(bins=50)
    assert h["p"].shape == (10, 50) and h["steps"].tolist() == list(range(0, 400, 40))
    assert h["p"][-1, -10:].sum() > h["p"][0, -10:].sum()  # mass moved to the rewarded end
    out = plot_adaptive(tmp_path / "adaptive.png", h["steps"], h["p"], h["S"], h["T"], title="bandit")
    assert out.stat().st_size > 10_000
    one = plot_adaptive(tmp_path / "one.png", h["steps"][:1], h["p"][:1], h["S"][:1], h["T"])
    assert one.is_file()
    empty = plot_adaptive(tmp_path / "empty.png", np.zeros(0), np.zeros((0, 50)), np.zeros((0, 3)), 1000)
    assert empty.is_file()


def test_plot_rejects_mismatched_history(tmp_path):
    with pytest.raises(ValueError, match="one row per update"):
        plot_adaptive(tmp_path / "x.png", np.arange(3), np.ones((4, 10)) / 10, np.zeros((3, 3)), 1000)
