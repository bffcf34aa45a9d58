"""The adaptive timestep sampler (fasttrain/diffusion/adaptive.py): the F-statistic and the selection of
S against scikit-learn, a synthetic bandit, common random numbers, state round trip and exact resume,
gradient accumulation, every input kind / model / prediction type, unbiased weights, no host syncs.
Every loop here is the hand-written trainer order of `step.reference_step`."""
import copy
import sys

import numpy as np
import pytest
import torch
from sklearn.feature_selection import SelectKBest, f_regression

from fasttrain import diffusion as fd
from fasttrain.diffusion import policy as P
from fasttrain.diffusion.adaptive import f_statistic, select_k_best
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.diffusion.lookahead import Probe, x0_mse
from fasttrain.diffusion.vlb import vlb_tables
from fasttrain.models import build_model
from fasttrain.step import reference_step

LIN = fd.schedule("linear", T=1000)
SMALL = dict(ch=8, attn_resolutions=())  # a narrow unet_tiny: the sampler's tests need a model, not a good one


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # 2 shared cores: two intra-op threads contend with other processes and run 10-40x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(model="unet_tiny", shape=(1, 8, 8), classes=10, pred="eps", weighting="min_snr", schedule=LIN, lr=1e-3,
         model_args=SMALL, **args):
    torch.manual_seed(0)
    if len(shape) == 3:
        net = build_model(model, in_channels=shape[0], image_size=shape[1], num_classes=classes, **model_args)
    else:
        net = build_model("mlp", in_channels=shape[0], hidden=32, depth=2, num_classes=classes)
    net = Denoiser(net, PredictionOutput(pred, schedule), schedule)  # the network with its x̂0 conversion
    obj = fd.DiffusionObjective(schedule, pred, weighting, "adaptive", sampler_args=args)
    return net, obj, torch.optim.AdamW(net.parameters(), lr=lr)


def batch(step, B, shape, classes=10):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, *shape, generator=g).clamp(-1, 1), torch.randint(0, classes, (B,), generator=g)


def run(net, obj, opt, steps, start=0, B=8, shape=(1, 8, 8), gen=None, accum=1):
    gen = gen or torch.Generator().manual_seed(7)
    for step in range(start, start + steps):
        micro = [batch(step * accum + m, B, shape) for m in range(accum)]
        reference_step(net, obj, opt, micro, step, [obj.sampler], generator=gen)
    return gen


# -- F-statistic and selection -------------------------------------------------------------------
def test_f_statistic_matches_sklearn_and_numpy_on_a_planted_signal():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 50))
    y = 2 * X[:, 7] - 2 * X[:, 31] + 0.3 * rng.normal(size=40)
    X[:, 3] = 1.5  # a constant column: F undefined → 0 (force_finite)
    F = f_statistic(torch.tensor(X), torch.tensor(y)).numpy()
    ref, _ = f_regression(X, y)
    np.testing.assert_allclose(F, ref, rtol=1e-9, atol=1e-12)
    # independently: r from numpy's corrcoef, F = r²/(1−r²)·(n−2)
    r = np.array([np.corrcoef(X[:, j], y)[0, 1] if j != 3 else 0.0 for j in range(50)])
    np.testing.assert_allclose(F, r**2 / (1 - r**2) * 38, rtol=1e-9)
    assert set(select_k_best(torch.tensor(F), 2).tolist()) == {7, 31}


def test_selection_is_select_k_best_including_ties():
    rng = np.random.default_rng(1)
    for n in [2, 3, 5, 20]:  # n = 2: zero degrees of freedom, every F is 0 → the last k indices
        X, y = rng.normal(size=(n, 40)), rng.normal(size=n)
        X[:, [4, 9, 30]] = 0.0
        F = f_statistic(torch.tensor(X), torch.tensor(y))
        ref = SelectKBest(f_regression, k=3).fit(X, y).get_support(indices=True)
        assert select_k_best(F, 3).tolist() == ref.tolist()


# -- construction ----------------------------------------------------------------------------------
def test_defaults_and_the_official_setting():
    smp = fd.timestep_sampler("adaptive", LIN)  # fasttrain: 16 strata, every 100 steps; the rest official
    assert (smp.n_select, smp.capacity, smp.lr, smp.entropy, smp.grad_clip) == (3, 20, 1e-2, 1e-2, 1.0)
    assert smp.policy_kind == "beta" and smp.biased and smp.variance == "large" and (smp.K, smp.every) == (16, 100)
    assert smp.S.tolist() == [0, 1, 2]
    official = fd.timestep_sampler("adaptive", LIN, tau_grid=0, every=40)
    assert official.K == 1000 and official.every == 40 and torch.equal(official._grid(5), torch.arange(1000))
    assert official.due(40) and not official.due(20) and smp.due(0) and not smp.due(40)


def test_stratified_grid_draws_one_timestep_per_stratum_every_update():
    smp = fd.timestep_sampler("adaptive", LIN, tau_grid=16)
    lo = torch.div(torch.arange(17) * 1000, 16, rounding_mode="floor")
    grids = torch.stack([smp._grid(k) for k in range(50)])
    assert ((grids >= lo[:-1]) & (grids < lo[1:])).all()
    assert torch.equal(smp._grid(3), fd.timestep_sampler("adaptive", LIN, tau_grid=16)._grid(3))  # any rank
    assert (grids.double().std(0) > 5).all()  # resampled each update


@pytest.mark.parametrize("args,match", [({"policy": "lstm"}, "policy"), ({"tau_grid": 2000}, "tau_grid"),
                                        ({"n_select": 20, "tau_grid": 16}, "n_select"), ({"every": 0}, "every"),
                                        ({"variance": "learned"}, "variance"), ({"capacity": 1}, "capacity")])
def test_bad_arguments_are_one_line_errors(args, match):
    with pytest.raises(ValueError, match=match):
        fd.timestep_sampler("adaptive", LIN, **args)


# -- learning: a synthetic bandit ----------------------------------------------------------------
def bandit(policy, reward_fn, updates, entropy=1e-2, seed=1, B=16):
    smp = fd.timestep_sampler("adaptive", LIN, policy=policy, entropy=entropy)
    g = torch.Generator().manual_seed(seed)
    masses = []
    for _ in range(updates):
        x = torch.randn(B, 1, 8, 8, generator=g)
        t, _ = smp.sample(B, g, x)
        smp.policy_step(x, reward_fn(t))
        masses.append(smp.probs())
    return smp, masses


@pytest.mark.parametrize("policy,updates", [("beta", 20), ("global", 80)])
def test_bandit_policy_mass_moves_to_the_rewarded_region(policy, updates):
    """Reward 1 for t < 250 (a quarter of the steps), 0 elsewhere: with the official lr = 1e-2 and
    entropy 1e-2 the policy's mass in the region passes 0.5 (from 0.25) within 20 updates for the
    conditional net and 80 for the two-parameter policy (measured over seeds 1-5: 5 and 63-67)."""
    _, masses = bandit(policy, lambda t: (t < 250).float(), updates)
    region = [float(p[:250].sum()) for p in masses]
    assert region[0] < 0.35 and max(region) > 0.5


@pytest.mark.parametrize("policy", ["beta", "global"])
def test_bandit_policy_stays_put_with_zero_reward(policy):
    smp0 = fd.timestep_sampler("adaptive", LIN, policy=policy)
    smp, masses = bandit(policy, lambda t: torch.zeros(t.shape), 30, entropy=0.0)
    p0 = P.timestep_probs(*[torch.tensor([0.974])] * 2, 1000)
    if policy == "global":  # (the conditional net is built at the first draw, from the same fixed seed)
        assert all(torch.equal(a, b) for a, b in zip(smp.net.state_dict().values(), smp0.net.state_dict().values()))
    assert max(float(0.5 * (p - p0).abs().sum()) for p in masses) < 1e-3
    # with the entropy bonus alone the policy only drifts towards its maximum-entropy neighbour, uniform
    _, masses = bandit(policy, lambda t: torch.zeros(t.shape), 60)
    assert max(float(0.5 * (p - p0).abs().sum()) for p in masses) < 0.1


# -- the look-ahead --------------------------------------------------------------------------------
def test_common_random_numbers_lower_the_reward_variance_on_a_fixed_model():
    """Same update θ_k → θ_{k+1}, 20 probe draws: the per-sample reward Σ_S ΔL_s with the same x_τ before
    and after (CRN) against fresh noise after (the official code). Measured ratio ~100-250×."""
    net, obj, opt = make()
    run(net, obj, opt, 10, B=8)
    before = copy.deepcopy(net)
    run(net, obj, opt, 1, start=10, B=8)
    coef = vlb_tables(LIN)[0].float()
    x0, _ = batch(99, 8, (1, 8, 8))
    xb, tb = x0.repeat_interleave(3, 0), torch.tensor([10, 300, 700]).repeat(8)

    def reward(p, q):
        return (coef[p.t] * x0_mse(before, p) - coef[q.t] * x0_mse(net, q)).view(8, 3).sum(1)

    crn, fresh = [], []
    for i in range(12):
        p = Probe.draw(obj, xb, tb, seed=1, offset=i * 10**6)
        crn.append(reward(p, p))
        fresh.append(reward(p, Probe.draw(obj, xb, tb, seed=2, offset=i * 10**6)))
    ratio = torch.stack(fresh).var(0).mean() / torch.stack(crn).var(0).mean()
    assert ratio > 20


def test_a_zero_update_gives_exactly_zero_deltas_and_rewards():
    """With CRN and lr = 0 the model is the same before and after, so every δ and reward is exactly 0."""
    net, obj, opt = make(lr=0.0, every=1, tau_grid=8)
    run(net, obj, opt, 3)
    smp = obj.sampler
    assert smp.fifo_count == 3 and torch.equal(smp.fifo_X[:3], torch.zeros(3, 8))
    m = smp.metrics()
    assert m["adaptive/reward"] == 0 and m["adaptive/reward_std"] == 0


def test_updates_fill_the_fifo_select_s_and_record_history():
    net, obj, opt = make(every=2, tau_grid=8, capacity=3)
    run(net, obj, opt, 9)
    smp = obj.sampler
    assert smp.updates == 5 and smp.fifo_count == 5  # steps 0, 2, 4, 6, 8
    X, y = smp.fifo_X.numpy(), smp.fifo_y.numpy()
    np.testing.assert_allclose(y, X.sum(1))
    assert smp.S.tolist() == SelectKBest(f_regression, k=3).fit(X, y).get_support(indices=True).tolist()
    h = smp.p_history(bins=50)
    assert h["steps"].tolist() == [0, 2, 4, 6, 8] and h["p"].shape == (5, 50) and h["S"].shape == (5, 3)
    np.testing.assert_allclose(h["p"].sum(1), 1, atol=1e-8)
    m = smp.metrics()
    for k in ["reward", "reward_std", "policy_entropy", "alpha", "beta", "S0", "S1", "S2", "lookahead_s", "updates"]:
        assert f"adaptive/{k}" in m and np.isfinite(float(m[f"adaptive/{k}"]))
    assert m["adaptive/lookahead_s"] > 0 and smp.metrics()["adaptive/lookahead_s"] == 0  # since the last read
    torch.testing.assert_close(smp.probs().sum(), torch.tensor(1.0, dtype=torch.float64))


def test_state_round_trip_and_exact_resume():
    args = dict(every=2, tau_grid=8, capacity=4)
    net, obj, opt = make(**args)
    gen = run(net, obj, opt, 5)  # steps 0-4: updates at 0, 2, 4
    saved = dict(net=copy.deepcopy(net.state_dict()), opt=copy.deepcopy(opt.state_dict()),
                 obj=copy.deepcopy(obj.state_dict()), gen=gen.get_state())
    torch.save(saved, _buffer := __import__("io").BytesIO())  # the state survives serialisation
    run(net, obj, opt, 6, start=5, gen=gen)
    net2, obj2, opt2 = make(**args)
    loaded = torch.load(__import__("io").BytesIO(_buffer.getvalue()), weights_only=False)
    net2.load_state_dict(loaded["net"])
    opt2.load_state_dict(loaded["opt"])
    obj2.load_state_dict(loaded["obj"])
    gen2 = torch.Generator().manual_seed(0)
    gen2.set_state(loaded["gen"])
    run(net2, obj2, opt2, 6, start=5, gen=gen2)
    a, b = obj.sampler, obj2.sampler
    assert a.updates == b.updates == 6 and a.S.tolist() == b.S.tolist()
    assert torch.equal(a.fifo_X, b.fifo_X) and torch.equal(a._u, b._u)
    assert all(torch.equal(x, y) for x, y in zip(a.net.state_dict().values(), b.net.state_dict().values()))
    assert all(torch.equal(x, y) for x, y in zip(net.state_dict().values(), net2.state_dict().values()))
    assert [s.tolist() for s in a.hist_S] == [s.tolist() for s in b.hist_S]
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


def test_gradient_accumulation_credits_the_first_micro_batch():
    net, obj, opt = make(every=1, tau_grid=4)
    smp = obj.sampler
    smp.set_partition(0, 1, accum_steps=2)
    gen = torch.Generator().manual_seed(3)
    first, second = batch(0, 6, (1, 8, 8)), batch(1, 4, (1, 8, 8))
    probe_gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        u0 = P.sample(smp._conc_of(first[0], 6), probe_gen)  # what micro-step 0 draws
    reference_step(net, obj, opt, [first, second], 0, [smp], generator=gen)
    assert smp.updates == 1 and torch.equal(smp._u, u0) and smp.micro_step == 0
    # without the partition the last micro-batch's draws would be credited: refused, not silently wrong
    net, obj, opt = make(every=1, tau_grid=4)
    with pytest.raises(RuntimeError, match="set_partition"):
        reference_step(net, obj, opt, [first, second], 0, [obj.sampler], generator=gen)


# -- every input, model, prediction type ---------------------------------------------------------
@pytest.mark.parametrize("model", ["unet_tiny", "dit_tiny"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (4, 16, 16)], ids=["pixel", "latent"])
def test_pixel_and_latent_inputs_with_a_unet_and_a_dit(model, shape):
    net, obj, opt = make(model, shape, every=1, tau_grid=4, n_select=2, model_args={})
    smp = obj.sampler
    run(net, obj, opt, 1, B=4, shape=shape)
    init = copy.deepcopy(smp.net.state_dict())
    run(net, obj, opt, 1, start=1, B=4, shape=shape)
    assert smp.net.in_shape == shape and smp.updates == 2
    assert any(not torch.equal(v, smp.net.state_dict()[k]) for k, v in init.items())
    assert all(np.isfinite(float(v)) for v in smp.metrics().values())


@pytest.mark.parametrize("policy", ["beta", "global"])
def test_toy_vectors_with_an_mlp(policy):
    net, obj, opt = make(shape=(2,), policy=policy, every=1, tau_grid=8)
    run(net, obj, opt, 3, B=16, shape=(2,))
    assert obj.sampler.updates == 3 and np.isfinite(float(obj.sampler.metrics()["adaptive/reward"]))


@pytest.mark.parametrize("pred,schedule,weighting", [
    ("eps", fd.schedule("linear", T=1000, zero_terminal_snr=True), "min_snr"),
    ("x0", LIN, "snr"), ("v", fd.schedule("cosine", T=1000), "soft_min_snr"),
    ("flow", fd.schedule("flow", T=1000), "constant"), ("eps", fd.schedule("flow", T=1000), "speed")])
def test_every_prediction_type_and_weighting(pred, schedule, weighting):
    net, obj, opt = make(pred=pred, schedule=schedule, weighting=weighting, every=1, tau_grid=0, n_select=3,
                         chunk=512)
    obj.sampler.S = torch.tensor([0, 500,
                                  999])  # include the decoder term and the last step (undefined for eps at SNR 0)
    run(net, obj, opt, 2, B=4)
    smp = obj.sampler
    assert torch.isfinite(smp.fifo_X).all() and np.isfinite(float(smp.metrics()["adaptive/reward"]))


def test_unbiased_weights_are_inverse_policy_masses_and_unbiased():
    smp = fd.timestep_sampler("adaptive", LIN, policy="global", unbiased=True)
    assert not smp.biased
    with torch.no_grad():
        smp.net.raw.copy_(torch.tensor([1.0, 0.0]))  # a skewed Beta(1.31, 0.69)
    g = torch.Generator().manual_seed(0)
    t, iw = smp.sample(60_000, g)
    p = smp.probs()
    torch.testing.assert_close(iw[:100], (1 / (1000 * p[t[:100]])).float())
    f = torch.sin(torch.arange(1000) / 150.0) + 1.5  # E_uniform[f] against E_p[iw·f]
    est, plain = (iw.double() * f[t].double()).mean(), f[t].double().mean()
    assert abs(float(plain) - float(f.double().mean())) > 0.1  # the policy does change the objective
    assert abs(float(est) - float(f.double().mean())) < 0.025  # ~4 standard errors (0.0064)


# -- no host syncs -------------------------------------------------------------------------------
def test_no_host_sync_in_sample_and_hooks(monkeypatch):
    """Reading a tensor back (item, tolist, bool, int, float, numpy, nonzero) from the sampler's own
    modules raises while sampling and running the hooks; torch and the model may do as they like."""
    ours = ("diffusion/adaptive.py", "diffusion/lookahead.py", "diffusion/policy.py", "diffusion/vlb.py")

    def guard(name, orig):
        def wrapped(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if caller.endswith(ours):
                raise AssertionError(f"host sync: Tensor.{name} called from {caller}")
            return orig(self, *a, **k)
        return wrapped

    net, obj, opt = make(every=1, tau_grid=8, unbiased=True)
    run(net, obj, opt, 1)  # build the policy and tables first
    for name in ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero"]:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", guard("nonzero", torch.nonzero))
    monkeypatch.setattr(torch, "multinomial", guard("multinomial", torch.multinomial))
    run(net, obj, opt, 2, start=1)
    assert obj.sampler.updates == 3


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    net, obj, opt = make(every=1, tau_grid=8)
    net, obj = net.cuda(), obj.cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x0 = [(torch.randn(8, 1, 8, 8, device="cuda"), torch.randint(0, 10, (8,), device="cuda"))]
    gen = torch.Generator("cuda").manual_seed(0)
    reference_step(net, obj, opt, x0, 0, [obj.sampler], generator=gen)  # warm-up builds the policy
    torch.cuda.set_sync_debug_mode("error")
    try:
        obj.sampler.sample(8, gen, x0[0][0])
        ctx = fd.lookahead.LookAheadContext(net, obj, x0[0][0], x0[0][1], 1)
        obj.sampler.before_update(ctx)
        obj.sampler.after_update(ctx)
    finally:
        torch.cuda.set_sync_debug_mode(0)
