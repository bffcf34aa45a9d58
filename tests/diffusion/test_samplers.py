"""Each sampler's empirical histogram against probs() (chi-square, fixed seed), stratified coverage,
SpeeD's marginal with the mirror, and the loss-second-moment sampler's arithmetic and unbiasedness."""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from fasttrain import diffusion as fd

LIN = fd.schedule("linear", T=1000)
N = 200_000


def chi2_pvalue(t: torch.Tensor, probs: torch.Tensor, bins: int = 40) -> float:
    """Chi-square of the histogram of t against probs, merged into `bins` equal-mass-ish groups so
    that every expected count is large."""
    counts = torch.bincount(t, minlength=probs.numel()).double().numpy()
    p = probs.double().numpy()
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    edges = np.searchsorted(np.cumsum(p), np.linspace(0, 1, bins + 1)[1:-1])
    obs = np.array([c.sum() for c in np.split(counts, edges)])
    exp = np.array([q.sum() for q in np.split(p, edges)]) * counts.sum()
    keep = exp > 0
    assert (obs[~keep] == 0).all(), "samples where probs() says probability 0"
    return chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


SAMPLERS = [
    ("uniform", {}),
    ("stratified", {}),
    ("logit_normal", {"mean": 0.0, "std": 1.0}),
    ("logit_normal", {"mean": -0.5, "std": 0.7}),
    ("mode", {"scale": 1.29}),
    ("mode", {"scale": -0.5}),
    ("lognormal", {"p_mean": -1.2, "p_std": 1.2}),
    ("speed", {"k": 5, "tau": 700, "dual": False}),
    ("timestep_bias", {"strategy": "later", "multiplier": 3.0, "portion": 0.3}),
    ("timestep_bias", {"strategy": "range", "multiplier": 0.25, "begin": 100, "end": 650}),
]


@pytest.mark.parametrize("name,args", SAMPLERS)
def test_histogram_matches_probs(name, args):
    smp = fd.timestep_sampler(name, LIN, **args)
    g = torch.Generator().manual_seed(123)
    t = torch.cat([smp.sample(1000, g)[0] for _ in range(N // 1000)])
    assert t.dtype == torch.long and t.min() >= 0 and t.max() < 1000
    assert chi2_pvalue(t, smp.probs()) > 1e-3


def test_chi_square_has_power():
    """The same test rejects a wrong marginal: uniform draws against SpeeD's probs."""
    g = torch.Generator().manual_seed(0)
    t = fd.timestep_sampler("uniform", LIN).sample(N, g)[0]
    assert chi2_pvalue(t, fd.timestep_sampler("speed", LIN).probs()) < 1e-10


@pytest.mark.parametrize("n", [1, 4, 7, 256])
def test_speed_dual_marginal_and_structure(n):
    smp = fd.timestep_sampler("speed", LIN, k=5, tau=700, dual=True)
    assert smp.m == 642  # first t with d sqrt(1-ᾱ)/dt < 1e-4 on linear β(1e-4, 0.02)
    g = torch.Generator().manual_seed(7)
    batches = [smp.sample(n, g)[0] for _ in range(max(N // n, 2000))]
    for b in batches[:50]:
        n_p = n // 2 + 1
        prim, dual = b[:n_p], b[n_p:]
        mirrored = torch.where(prim < 642, 642 - prim, prim - 642)[: n - n_p]
        assert torch.equal(dual, mirrored)
    assert chi2_pvalue(torch.cat(batches), smp.probs(n)) > 1e-3


def test_speed_official_probabilities():
    smp = fd.timestep_sampler("speed", LIN, k=5, tau=700, dual=False)
    p = smp.probs()
    assert p[0].item() == pytest.approx(5 / (5 * 700 + 300)) and p[999].item() == pytest.approx(1 / (5 * 700 + 300))
    # the notes' table: with the mirror, k = 5 leaves 3.95% of the mass at t >= τ (large batches)
    dual = fd.timestep_sampler("speed", LIN, k=5, tau=700, dual=True)
    assert dual.probs()[700:].sum().item() == pytest.approx(0.0395, abs=5e-4)
    assert fd.timestep_sampler("speed", LIN, k=2).probs()[700:].sum().item() == pytest.approx(0.088, abs=1e-3)
    assert fd.timestep_sampler("speed", fd.schedule("cosine")).m == 959


def test_stratified_covers_every_stratum_of_the_global_batch():
    """n = 2 per micro-batch, 2 ranks × 2 accumulation steps: the 8 samples of each global batch fall
    in the 8 strata of width T/8, exactly one each."""
    T, n, world, accum = 1000, 2, 2, 2
    samplers = []
    for r in range(world):
        smp = fd.timestep_sampler("stratified", LIN)
        smp.set_partition(rank=r, world_size=world, accum_steps=accum)
        samplers.append((smp, torch.Generator().manual_seed(100 + r)))
    for _ in range(200):
        ts = torch.cat([smp.sample(n, g)[0] for smp, g in samplers for _ in range(accum)])
        assert sorted((ts * 8 // T).tolist()) == list(range(8))


def _push(stats, t, v):
    stats.add(torch.tensor(t), torch.tensor(v, dtype=torch.float32), torch.tensor(v, dtype=torch.float32))


def test_loss_second_moment_hand_computed():
    s = fd.schedule("cosine", T=4)
    smp = fd.timestep_sampler("loss_second_moment", s, history=2, uniform_prob=0.1)
    stats = fd.TimestepStats(4, history=2)
    _push(stats, [0, 1, 2, 3, 0, 1, 2], [5.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0])
    stats.all_reduce()
    smp.observe(stats)
    torch.testing.assert_close(smp.probs(), torch.full((4,), 0.25, dtype=torch.float64))  # t=3 has 1 loss
    _push(stats, [3, 0], [4.0, 1.0])  # t=0 now holds its last two losses (1, 1): the 5 dropped out
    stats.all_reduce()
    smp.observe(stats)
    w = np.array([1.0, 2.0, 3.0, 4.0])  # sqrt(mean(L²)) over the last two losses of each t
    expect = w / w.sum() * 0.9 + 0.1 / 4
    np.testing.assert_allclose(smp.probs().numpy(), expect, rtol=1e-12)
    t, iw = smp.sample(5000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(iw, (1 / (4 * torch.from_numpy(expect)[t])).float())


def test_loss_second_moment_is_unbiased():
    T = 50
    s = fd.schedule("linear", T=T)
    smp = fd.timestep_sampler("loss_second_moment", s, history=3)
    stats = fd.TimestepStats(T, history=3)
    g = torch.Generator().manual_seed(5)
    per_t = torch.rand(T, generator=g, dtype=torch.float64) ** 3 * 10  # a very non-uniform loss profile
    for _ in range(3):
        _push(stats, list(range(T)), (per_t * (1 + 0.1 * torch.rand(T, generator=g, dtype=torch.float64))).tolist())
    stats.all_reduce()
    smp.observe(stats)
    p = smp.probs()
    assert p.max() / p.min() > 10  # it is learning something
    # Monte Carlo with the sampler's own draws and importance weights: E[iw·ℓ_t] = the uniform-t mean
    t, iw = smp.sample(400_000, g)
    est = iw.double() * per_t[t]
    se = est.std().item() / len(est) ** 0.5
    assert abs(est.mean().item() - per_t.mean().item()) < 4 * se
    # the same draws without the weights are biased far beyond that: the check has power
    assert abs(per_t[t].mean().item() - per_t.mean().item()) > 20 * se


@pytest.mark.parametrize("name,args", SAMPLERS + [("speed", {}), ("loss_second_moment", {})])
def test_state_round_trip(name, args):
    a = fd.timestep_sampler(name, LIN, **args)
    a.set_partition(0, 1, 3)
    g = torch.Generator().manual_seed(0)
    a.sample(5, g)
    b = fd.timestep_sampler(name, LIN, **args)
    b.set_partition(0, 1, 3)
    b.load_state_dict(a.state_dict())
    st = g.get_state()
    ta, ia = a.sample(9, g)
    g.set_state(st)
    tb, ib = b.sample(9, g)
    assert torch.equal(ta, tb) and torch.equal(ia, ib)


def test_errors():
    with pytest.raises(ValueError, match="unknown timestep sampler 'unifrom'"):
        fd.timestep_sampler("unifrom", LIN)
    with pytest.raises(ValueError, match="unknown argument 'gamma'"):
        fd.timestep_sampler("speed", LIN, gamma=1)
    with pytest.raises(ValueError, match="scale must lie"):
        fd.timestep_sampler("mode", LIN, scale=3.0)
    with pytest.raises(ValueError, match="std must be > 0"):
        fd.timestep_sampler("logit_normal", LIN, std=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(fd.SAMPLERS))
def test_no_host_sync_on_cuda(name):
    s = fd.schedule("linear").to("cuda")
    smp = fd.timestep_sampler(name, s)
    stats = fd.TimestepStats(1000, "cuda", history=getattr(smp, "history", 0))
    g = torch.Generator("cuda").manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            t, iw = smp.sample(64, g)
            stats.add(t, iw, iw)
        stats.all_reduce()
        smp.observe(stats)
    finally:
        torch.cuda.set_sync_debug_mode(0)
