"""The noise options of a run (fasttrain/diffusion/noise_options.py): config → options and its one-line
errors; the immiscible row map (official code: L2 distances, not squared; assignment over the batch's
own draws, knn over k fresh draws per image) on the stream's candidates; the objective's counter
layout; each option's effect visible in the per-timestep statistics."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.configure import load_config
from fasttrain.diffusion import noise_options
from fasttrain.diffusion.immiscible import exact_assignment
from fasttrain.diffusion.noise_options import Immiscible
from fasttrain.errors import ConfigError
from fasttrain.kernels import noise_spec as ns
from fasttrain.kernels import philox


def test_config_to_options():
    cfg = load_config("default", ["diffusion.noise.offset=0.1", "diffusion.noise.adaptive_offset=-0.5",
                                  "diffusion.noise.pyramid_iterations=6", "diffusion.noise.perturbation=0.2",
                                  "diffusion.noise.perturbation_random_strength=true",
                                  "diffusion.noise.immiscible=knn", "diffusion.noise.immiscible_k=4"])
    kw = noise_options.from_config(cfg.diffusion.noise)
    assert kw["noise"] == ns.NoiseOptions(offset=0.1, adaptive_scale=-0.5, pyramid_iterations=6, pyramid_discount=0.3,
                                          perturbation=0.2, perturbation_random=True)
    assert kw["immiscible"].mode == "knn" and kw["immiscible"].k == 4
    plain = noise_options.from_config(load_config("default").diffusion.noise)
    assert not plain["noise"].active and plain["immiscible"] is None


@pytest.mark.parametrize("over, key", [
    (["diffusion.noise.adaptive_offset=0.3"], "diffusion.noise.adaptive_offset"),
    (["diffusion.noise.offset_random_strength=true"], "diffusion.noise.offset_random_strength"),
    (["diffusion.noise.pyramid_iterations=2", "data.name=moons", "model.name=mlp"],
     "diffusion.noise.pyramid_iterations"),
    (["diffusion.noise.immiscible=hungarian"], "diffusion.noise.immiscible"),
    (["diffusion.noise.pyramid_discount=-1"], "diffusion.noise.pyramid_discount"),
    (["diffusion.loss.huber_schedule=cosine"], "diffusion.loss.huber_schedule"),
    (["diffusion.loss.huber_scale=0"], "diffusion.loss.huber_scale"),
])
def test_bad_values_are_one_line_errors_naming_the_key(over, key):
    with pytest.raises(ConfigError) as e:
        load_config("default", over)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)


def test_assignment_uses_l2_distances_to_the_batchs_own_draws(monkeypatch):
    seen = {}

    def spy(dist):
        seen["dist"] = dist
        return torch.tensor([2, 0, 3, 1])

    x0 = torch.rand(4, 2, 3, 3)
    cand = philox.randn((4, 2, 3, 3), 3, 50).flatten(1)
    want = torch.stack([torch.stack([torch.linalg.vector_norm(x0[i].flatten() - cand[j]) for j in range(4)])
                        for i in range(4)])
    exact = exact_assignment(want)
    rows, R = Immiscible("assignment").rows(x0, seed=3, offset=50, backend="native")
    assert R == 4 and torch.equal(rows, exact)  # CPU tensors: SciPy's exact assignment, as the official code
    for name in ("assignment", "exact_assignment"):
        monkeypatch.setattr(noise_options, name, spy)
    rows, R = Immiscible("assignment").rows(x0, seed=3, offset=50, backend="native")
    torch.testing.assert_close(seen["dist"], want, rtol=1e-5, atol=1e-5)  # L2, not squared (official code)
    assert rows.tolist() == [2, 0, 3, 1]


def test_knn_takes_the_nearest_of_k_fresh_draws_per_image():
    x0 = torch.rand(3, 2, 4, 4) * 2 - 1
    rows, R = Immiscible("knn", k=5).rows(x0, seed=1, offset=7, backend="native")
    cand = philox.randn((15, 32), 1, 7)
    assert R == 15
    for b in range(3):
        d = torch.linalg.vector_norm(x0[b].flatten() - cand[5 * b: 5 * b + 5], dim=1)
        assert rows[b].item() == 5 * b + d.argmin().item()


@pytest.mark.parametrize("mode", ["assignment", "knn"])
def test_objective_noise_is_the_assigned_draw_and_the_counter_moves_past_the_candidates(mode):
    s = fd.schedule("linear", T=1000)
    imm = Immiscible(mode, k=3)
    obj = fd.DiffusionObjective(s, "eps", "simple", "uniform", seed=2, backend="native", immiscible=imm)
    x0 = torch.rand(4, 1, 4, 4)
    seen = {}

    def model(x, t):
        seen["x"] = x
        return torch.zeros_like(x)

    _, info = obj(model, x0, generator=torch.Generator().manual_seed(0))
    rows, R = imm.rows(x0, seed=2, offset=0, backend="torch")
    cand = philox.randn((R, 1, 4, 4), 2, 0)
    eps = cand[rows]
    t = info["t"]
    torch.testing.assert_close(seen["x"], s.alpha[t].float().view(-1, 1, 1, 1) * x0
                               + s.sigma[t].float().view(-1, 1, 1, 1) * eps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(info["raw"], eps.pow(2).flatten(1).mean(1), rtol=1e-5, atol=1e-5)
    assert int(obj.offset) == R * 16  # the next step's candidates start after this step's
    if mode == "assignment":  # a permutation of the batch's draws: the noise set is unchanged
        assert sorted(rows.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("opts, expect", [
    (ns.NoiseOptions(), 1.0),
    (ns.NoiseOptions(offset=0.5), 1.25),                         # E[(z + c·n)²] = 1 + c²
    (ns.NoiseOptions(offset=0.6, offset_random=True), 1.12),     # 1 + c²·E[u²] = 1 + c²/3
    (ns.NoiseOptions(perturbation=0.5), 1.0),                    # the target keeps ε
    (ns.NoiseOptions(pyramid_iterations=6, pyramid_discount=0.8), 1.0),  # divided by its std
])
def test_each_option_shows_in_the_per_timestep_statistics(opts, expect):
    """A zero network with ε-prediction: raw_b = mean(ε_b²), so the statistics' raw means hold the
    second moment of the noise each option produces (moments over many samples: the sources' draws)."""
    s = fd.schedule("cosine", T=10)
    obj = fd.DiffusionObjective(s, "eps", "simple", "uniform", seed=4, backend="native", noise=opts)
    x0 = torch.rand(64, 3, 8, 8) * 2 - 1
    for step in range(30):
        obj(lambda x, t: torch.zeros_like(x), x0, generator=torch.Generator().manual_seed(step))
    obj.sync_stats()
    m = (obj.stats.means("raw") * obj.stats.count).sum() / obj.stats.count.sum()
    assert m.item() == pytest.approx(expect, rel=0.04)
