"""The adaptive sampler's Beta policies (fasttrain/diffusion/policy.py) against independent
computations: scipy's Beta distribution and incomplete beta function, torch.distributions."""
import numpy as np
import pytest
import torch
from scipy.special import betainc
from scipy.stats import beta as scipy_beta
from scipy.stats import chisquare

from fasttrain.diffusion import policy as P

T = 1000
SHAPES = [(0.2, 0.3), (0.974, 0.974), (5.0, 0.5), (0.5, 5.0), (30.0, 60.0), (100.0, 40.0), (2.0, 90.0)]


@pytest.mark.parametrize("a,b", SHAPES)
def test_incomplete_beta_matches_scipy(a, b):
    x = np.concatenate([np.linspace(0, 1, 101), np.random.default_rng(0).uniform(size=40), [1e-7, 5e-4, 1 - 5e-4]])
    cdf, sf = P.cdf_pair(torch.tensor(x), torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
    ref = betainc(a, b, x)
    np.testing.assert_allclose(cdf.numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(sf.numpy(), 1 - ref, atol=1e-12)


@pytest.mark.parametrize("a,b", SHAPES + [(0.3, 3000.0), (7000.0, 17000.0)])
def test_timestep_masses_match_scipy_bins(a, b):
    t = torch.arange(T)
    A, B = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    lo, hi = np.clip((np.arange(T) - 0.5) / (T - 1), 0, 1), np.clip((np.arange(T) + 0.5) / (T - 1), 0, 1)
    ref = scipy_beta.cdf(hi, a, b) - scipy_beta.cdf(lo, a, b)
    np.testing.assert_allclose(P.timestep_probs(A, B, T).numpy(), ref, atol=1e-9)
    np.testing.assert_allclose(P.timestep_masses(A, B, t, T).numpy(), ref, atol=1e-9)
    np.testing.assert_allclose(P.timestep_probs(A, B, T, bins=100).numpy(), ref.reshape(100, 10).sum(1), atol=1e-8)


def test_log_prob_and_entropy_match_torch_distributions():
    a, b = torch.tensor([0.3, 0.974, 4.0, 50.0]), torch.tensor([2.0, 0.974, 0.7, 20.0])
    u = torch.tensor([0.1, 0.5, 0.93, 0.7])
    ref = torch.distributions.Beta(a, b)
    torch.testing.assert_close(P.log_prob(u, a, b), ref.log_prob(u))
    torch.testing.assert_close(P.entropy(a, b), ref.entropy())


def test_draws_follow_the_generator_and_the_timestep_masses():
    a, b = torch.full((50_000,), 2.0), torch.full((50_000,), 5.0)
    u1 = P.sample(torch.stack([a, b], -1), torch.Generator().manual_seed(3))
    u2 = P.sample(torch.stack([a, b], -1), torch.Generator().manual_seed(3))
    assert torch.equal(u1, u2) and ((u1 > 0) & (u1 < 1)).all()
    t = P.to_timestep(u1, T)
    torch.testing.assert_close(t, torch.round(u1 * (T - 1)).long())  # the official mapping
    p = P.timestep_probs(a[:1], b[:1], T, bins=20).numpy()
    counts = np.bincount(t.numpy() * 20 // T, minlength=20)
    assert chisquare(counts, p * counts.sum()).pvalue > 1e-3


def test_initial_policies_are_the_official_near_uniform_beta():
    init = float(torch.nn.functional.softplus(torch.tensor(0.5))) + 1e-5  # ≈ 0.974
    for net, x in [(P.ConditionalBeta((3, 32, 32)), torch.randn(5, 3, 32, 32)),
                   (P.ConditionalBeta((4, 16, 16)), torch.randn(5, 4, 16, 16)),
                   (P.ConditionalBeta((2,)), torch.randn(5, 2)), (P.GlobalBeta(), torch.randn(5, 2))]:
        a, b = net(x).unbind(-1)
        assert a.shape == b.shape == (5,)
        torch.testing.assert_close(a, torch.full((5,), init))
        torch.testing.assert_close(b, torch.full((5,), init))
    p = P.timestep_probs(torch.tensor([init]), torch.tensor([init]), T)
    assert 0.5 * (p - 1.0 / T).abs().sum() < 0.02  # near uniform in total variation


def test_conditional_policy_takes_any_resolution_and_channel_count():
    net = P.ConditionalBeta((4, 16, 16))
    torch.nn.init.normal_(net.mlp[-1].weight)  # leave the zero init so that the output depends on x0
    a1, _ = net(torch.randn(3, 4, 16, 16)).unbind(-1)
    assert torch.isfinite(a1).all() and (a1 > 0).all() and a1.std() > 0
    for shape in [(1, 8, 8), (3, 32, 32), (3, 64, 48), (8, 1, 1)]:
        a, b = P.ConditionalBeta(shape)(torch.randn(2, *shape)).unbind(-1)
        assert a.shape == (2,) and (a > 0).all() and (b > 0).all()
