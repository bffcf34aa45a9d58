"""Mixed prediction on the diffusion side: head conversions, the one-hot limit, argmin, numerical safety
at α → 0 / σ → 0, the Gaussian-mixture oracle through x0_hat, the timestep gate as a network
parameter, the objective end to end, resume, and the loss-variation helpers."""
import gmm_oracle as gmm
import numpy as np
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import mixed as M
from fasttrain.diffusion import prediction as P
from fasttrain.diffusion import variation as V
from fasttrain.diffusion.denoiser import Denoiser
from fasttrain.kernels import philox
from fasttrain.kernels import torch_ref_mixed_loss as mixed_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.mixed_loss import mixed_loss
from fasttrain.kernels.noise import noise

# CPU tensors throughout: the interpreter where it is set (conftest.py), the reference on a GPU machine
# (tests/kernels/test_mixed_loss.py runs the compiled kernel there).
BACKEND = "torch" if torch.cuda.is_available() else "interpret"


class Net(torch.nn.Module):
    """A backbone with the models' signature around one layer."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, t, y=None):
        return self.layer(x)


def zts(T=1000):
    return fd.schedule("linear", T=T, zero_terminal_snr=True)


def col(x, ndim):
    return x.view(-1, *([1] * (ndim - 1)))


@pytest.mark.parametrize("sched,heads", [("linear", ("eps", "x0", "v")), ("cosine", ("v", "eps")),
                                         ("flow", ("eps", "x0", "v", "flow"))])
def test_each_head_x0_conversion_is_exact(sched, heads):
    """head_x0 (generation) and the kernels' residual form e = k1·(pred − target) + fb·x0 (training)
    against prediction.to_x0_eps, the single-head conversion, in float64 and fp32."""
    s = fd.schedule(sched, T=100)
    obj = M.MixedObjective(s, heads, backend="torch")
    head = M.MixedOutput(heads, s)  # the network wrapper's x̂0 conversion
    g = torch.Generator().manual_seed(0)
    B, C, H = 6, 3, len(heads)
    t = torch.tensor([0, 1, 30, 60, 97, 98])
    x0, eps = torch.randn(B, C, 4, generator=g), torch.randn(B, C, 4, generator=g)
    a, sg = col(s.alpha[t], 3), col(s.sigma[t], 3)
    x_t = (a * x0.double() + sg * eps.double()).float()
    preds = [P.target(h, x0.double(), eps.double(), a, sg) + 0.3 * torch.randn(B, C, 4, generator=g,
                                                                               dtype=torch.float64)
             for h in heads]
    out = torch.cat([p.float() for p in preds] + [torch.randn(B, H, 4, generator=g)], 1)
    xs = head.head_x0(out, x_t, t)
    for i, h in enumerate(heads):
        expect = P.to_x0_eps(h, preds[i], x_t.double(), a, sg)[0]
        torch.testing.assert_close(xs[:, i].double(), expect, rtol=1e-5, atol=1e-5)
    _, e, _, _, _ = mixed_ref.parts(out, x0, eps, t, obj.tab)
    for i, h in enumerate(heads):
        expect = P.to_x0_eps(h, preds[i], (a * x0.double() + sg * eps.double()), a, sg)[0]
        torch.testing.assert_close((e[:, i] + x0).double(), expect, rtol=1e-5, atol=1e-5)
    # exact targets give x0 back through every head
    exact = torch.cat([P.target(h, x0.double(), eps.double(), a, sg).float() for h in heads] + [out[:, H * C:]], 1)
    torch.testing.assert_close(head.to_x0(exact, x_t, t), x0, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sched,heads", [("linear", ("eps", "x0", "v")), ("flow", ("flow", "eps", "x0"))])
def test_one_hot_gate_reproduces_the_single_head_loss(sched, heads):
    """With the gate all on head j and aux_weight 0, the mixed loss and gradient are head j's single-head
    loss with the same x0-space weighting (w_x0·k1² = w_x0/c_j), and the other heads get no gradient."""
    s = fd.schedule(sched, T=1000)
    g = torch.Generator().manual_seed(1)
    B, C, H = 5, 2, len(heads)
    x0, eps = torch.rand(B, C, 3, generator=g) * 2 - 1, torch.randn(B, C, 3, generator=g)
    t = torch.tensor([0, 7, 400, 800, 998])  # SNR > 0 (the SNR = 0 guard differs between spaces)
    iw = torch.rand(B, generator=g) + 0.5
    tab = M.head_table(heads, s, aux_weight=0.0)
    w_x0 = fd.loss_weight("min_snr", s, "x0").float()
    for j, h in enumerate(heads):
        out = torch.randn(B, H * C + H, 3, generator=g)
        out[:, H * C:] = -1e4
        out[:, H * C + j] = 1e4
        o = out.clone().requires_grad_()
        res = mixed_loss(o, x0, t, w_x0, iw, tab, eps=eps, backend=BACKEND)
        res.loss.backward()
        pred = out[:, j * C:(j + 1) * C].clone().requires_grad_()
        w_j = fd.loss_weight("min_snr", s, h).float()
        single = diffusion_loss(pred, x0, t, w_j, iw, P.get(h).table(s.alpha, s.sigma), eps=eps, backend=BACKEND)
        single.loss.backward()
        torch.testing.assert_close(res.per_sample, single.per_sample, rtol=2e-5, atol=0)
        torch.testing.assert_close(o.grad[:, j * C:(j + 1) * C], pred.grad, rtol=2e-5, atol=1e-9)
        others = torch.cat([o.grad[:, i * C:(i + 1) * C] for i in range(H) if i != j] + [o.grad[:, H * C:]], 1)
        assert torch.equal(others, torch.zeros_like(others))


def test_argmin_picks_the_head_with_the_lowest_x0_error():
    """Constructed case through the fused kernel and the statistics: heads with constant output errors
    δ_eps = δ_x0 = 0.1, δ_v = 0.12 have x0 errors (0.1·σ/α)², 0.1², (0.12·σ)², whose argmin per t is
    known (eps where α > 0.83, v for 0.55 < α < 0.83, x0 below); the eps head is masked at t = T−1
    (zero-terminal SNR) whatever its error."""
    T = 50
    s = zts(T)
    head = M.MixedOutput(("eps", "x0", "v"), s, mode="argmin")
    obj = M.MixedObjective(s, ("eps", "x0", "v"), mode="argmin", argmin_buckets=T, backend=BACKEND, seed=2, output=head)
    x0 = torch.rand(T, 1, 3, 3) * 2 - 1
    t = torch.arange(T)
    t[10:13] = 9  # timesteps 10..12 unseen: the gate stays in charge there
    eps = philox.randn(x0.shape, 2, 0)

    def model(x_t, tt):
        a, sg = col(s.alpha[tt].float(), 4), col(s.sigma[tt].float(), 4)
        heads = [eps + 0.1, x0 + 0.1, a * eps - sg * x0 + 0.12]
        return torch.cat(heads + [torch.zeros(T, 3, 3, 3)], 1)

    _, info = obj(model, x0, t=t)
    obj.sync_stats()
    a, sg = s.alpha[t], s.sigma[t]
    expect_err = torch.stack([(0.1 * sg / a) ** 2, torch.full_like(a, 0.01), (0.12 * sg) ** 2], 1)
    torch.testing.assert_close(info["x0_error"][:-1].double(), expect_err[:-1], rtol=1e-4, atol=1e-7)
    expect = expect_err.argmin(1)
    expect[-1] = expect_err[-1, 1:].argmin() + 1  # masked eps head
    expect[10:13] = -1
    assert head.choice.tolist() == expect.tolist()  # written into the network at the statistics sync
    assert {0, 1, 2} <= set(expect.tolist())  # the case exercises every head
    # x0_hat follows the choice: head i's estimate is x0 + i + 1 everywhere (k1 of x0 is 1)
    x_t = torch.randn(T, 1, 3, 3)
    k1, k2 = (k[:, t].T.reshape(T, 3, 1, 1, 1) for k in head.k12.double())
    target = torch.stack([x0 + i + 1 for i in range(3)], 1).double()
    heads = torch.where(k1 != 0, (target - k2 * x_t.double()[:, None]) / torch.where(k1 != 0, k1, 1.0), 0.0)
    out = torch.cat([heads.reshape(T, 3, 3, 3).float(), torch.zeros(T, 3, 3, 3)], 1)
    got = head.to_x0(out, x_t, t)
    for b in range(T):
        c = int(head.choice[t[b]])
        expect_b = x0[b] + c + 1 if c >= 0 else (head.gate_weights(out, x_t, t)[b] * head.head_x0(out, x_t,
                                                                                                  t)[b]).sum(0)
        torch.testing.assert_close(got[b], expect_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sched,heads", [("zts", ("eps", "x0", "v")), ("zts", ("eps", "v")),
                                         ("flow", ("eps", "flow")), ("cosine", ("eps", "x0"))])
def test_numerical_safety_where_alpha_or_sigma_vanish(sched, heads):
    s = zts() if sched == "zts" else fd.schedule(sched, T=1000)
    T, H, C = s.T, len(heads), 2
    tab = M.head_table(heads, s, aux_weight=0.0)
    assert torch.isfinite(tab).all()
    # x0 head κ = 1, v and flow κ = σ ≤ 1: the prior bounds π_i·κ_i ≤ 1 with zero learned logits ...
    kappa = M.conditioning(heads, s)
    pi = torch.softmax(M.prior_bias(heads, s), 0)
    assert (pi * torch.where(torch.isfinite(kappa), kappa, 0)).max() <= 1 + 1e-9
    # ... where an even gate lets the eps head's mixed gradient grow like σ/α
    finite = torch.isfinite(kappa[0])
    if sched != "cosine":
        assert (kappa[0][finite] / H).max() > 100
        assert pi[0, -1] == 0 and tab[0, mixed_ref.K1, -1] == 0 and tab[0, mixed_ref.FB, -1] == -1
    g = torch.Generator().manual_seed(4)
    t = torch.tensor([0, 1, T // 2, T - 2, T - 1])
    B = t.numel()
    x0, eps = torch.rand(B, C, 5, generator=g) * 2 - 1, torch.randn(B, C, 5, generator=g)
    out = 100 * torch.randn(B, H * C + H, 5, generator=g)  # a wild, untrained network
    out[:, H * C:] = 0
    w = fd.loss_weight("snr", s, "x0").float()  # x0-space SNR: ~1e4..1e6 at σ → 0
    o = out.clone().requires_grad_()
    res = mixed_loss(o, x0, t, w, torch.ones(B), tab, eps=eps, backend=BACKEND)
    res.loss.backward()
    assert torch.isfinite(res.per_sample).all() and torch.isfinite(res.x0_error).all()
    assert torch.isfinite(o.grad).all()
    # |∂L/∂pred_eps| ≤ |∂L/∂x̂0| = |∂L/∂pred_x0-like head| / (π·κ of that head)
    ge = o.grad[:, :C]
    gE = 2 * w[t].view(B, 1, 1) * (res.raw.new_tensor(1.0) / (B * C * 5)) * mixed_ref.parts(out, x0, eps, t, tab)[2]
    assert (ge.abs() <= gE.abs() * (1 + 1e-4) + 1e-12).all()
    if sched != "cosine":
        assert torch.equal(ge[-1], torch.zeros_like(ge[-1]))  # masked: no mixed gradient at all
    obj = M.MixedObjective(s, heads, backend="torch")
    x_t = noise(x0, t, obj.alpha, obj.sigma, eps=eps, backend="torch")
    assert torch.isfinite(M.MixedOutput(heads, s).to_x0(out, x_t, t)).all()


@pytest.mark.parametrize("sched,heads,gate,mode", [("zts", ("eps", "x0", "v"), "pixel", "gate"),
                                                   ("linear", ("x0", "eps"), "timestep", "gate"),
                                                   ("flow", ("eps", "flow", "v"), "pixel", "argmin")])
def test_oracle_heads_reproduce_the_mixture_posterior_mean(sched, heads, gate, mode):
    """A mixed model whose heads are the exact Gaussian-mixture oracle: any gate mixes identical x0
    estimates, so x0_hat must return E[x0 | x_t] (where a head is masked its estimate must not leak in)."""
    s = zts(200) if sched == "zts" else fd.schedule(sched, T=200)
    oracles = [gmm.OracleModel(s, h) for h in heads]
    H = len(heads)

    class Net(torch.nn.Module):
        def forward(self, x, t, y=None):
            g = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(5)) * 3
            return torch.cat([o(x, t) for o in oracles] + ([g] if gate == "pixel" else []), 1)

    model = Denoiser(Net(), M.MixedOutput(heads, s, gate, mode), s, gate_heads=H if gate == "timestep" else 0)
    if gate == "timestep":
        torch.nn.init.normal_(model.gate.logits, std=3.0)
    if mode == "argmin":
        model.output.choice.copy_(torch.arange(s.T) % (H + 1) - 1)  # every head and the gate somewhere
    g = torch.Generator().manual_seed(6)
    t = torch.cat([torch.randint(0, s.T, (60,), generator=g), torch.tensor([0, s.T - 1])])
    x0 = gmm.sample(t.numel(), g)
    x_t = (col(s.alpha[t], 2) * x0 + col(s.sigma[t], 2) * torch.randn(x0.shape, generator=g, dtype=torch.float64))
    est = model.x0_hat(x_t.float(), t)
    expect = gmm.x0_posterior_mean(x_t, s.alpha[t], s.sigma[t])
    torch.testing.assert_close(est.double(), expect, rtol=1e-3, atol=2e-3)


def test_timestep_gate_is_a_network_parameter_and_learns_by_t():
    """The table's gradient is the per-sample gate gradients (written by the kernel) summed by t."""
    s = fd.schedule("linear", T=100)
    obj = M.MixedObjective(s, ("eps", "x0", "v"), "timestep", "min_snr", backend=BACKEND, seed=3)
    net = Net(torch.nn.Conv1d(2, 6, 1))
    model = Denoiser(net, M.MixedOutput(("eps", "x0", "v"), s, "timestep"), s, gate_heads=3)
    torch.nn.init.normal_(model.gate.logits)
    assert any(p is model.gate.logits for p in model.parameters()) and "gate.logits" in model.state_dict()
    x0 = torch.rand(6, 2, 5) * 2 - 1
    t = torch.tensor([4, 4, 50, 99, 4, 7])
    offset = int(obj.offset)
    loss, info = obj(model, x0, t=t)
    loss.backward()
    eps = philox.randn(x0.shape, 3, offset)
    x_t = noise(x0, t, obj.alpha, obj.sigma, eps=eps, backend="torch")
    gl = model.gate.logits.detach()[t].clone().requires_grad_()
    per = mixed_ref.loss(net(x_t, t).detach(), x0, eps, t, obj.weight, info["iw"], obj.tab, gl)[0]
    per.mean().backward()
    expect = torch.zeros_like(model.gate.logits).index_add_(0, t, gl.grad)
    torch.testing.assert_close(model.gate.logits.grad, expect, rtol=1e-5, atol=1e-8)
    assert (model.gate.logits.grad.abs().sum(1) > 0).nonzero().flatten().tolist() == [4, 7, 50, 99]
    # without return_gate the wrapper appends the logits as constant channels: the pixel-gate layout
    out = model(x_t, t)
    assert out.shape == (6, 9, 5) and torch.equal(out[:, 6:], model.gate.logits[t][:, :, None].expand(6, 3, 5))


@pytest.mark.parametrize("gate", ["pixel", "timestep"])
def test_objective_on_fused_kernel_matches_reference_and_fills_statistics(gate):
    s = fd.schedule("cosine", T=1000)
    obj = M.MixedObjective(s, ("eps", "v"), gate, "min_snr", "stratified", backend=BACKEND, seed=4)
    net = Net(torch.nn.Linear(3, 6 + (2 if gate == "pixel" else 0)))
    model = Denoiser(net, M.MixedOutput(("eps", "v"), s, gate), s, gate_heads=2 if gate == "timestep" else 0)
    x0 = torch.rand(5, 3) * 2 - 1
    offset = int(obj.offset)
    loss, info = obj(model, x0, generator=torch.Generator().manual_seed(0))
    t = info["t"]
    eps = philox.randn(x0.shape, 4, offset)
    x_t = noise(x0, t, obj.alpha, obj.sigma, eps=eps, backend="torch")
    gl = model.gate.logits[t] if gate == "timestep" else None
    per, raw, _, x0e = mixed_ref.loss(net(x_t, t), x0, eps, t, obj.weight, info["iw"], obj.tab, gl)
    torch.testing.assert_close(loss, per.mean(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(info["x0_error"], x0e.detach(), rtol=1e-4, atol=1e-6)
    assert obj.offset == offset + x0.numel()
    obj.sync_stats()
    st = obj.stats
    assert st.kinds == ("raw", "weighted", "x0_error_eps", "x0_error_v") and st.count.sum() == 5
    for i, k in enumerate(st.kinds[2:]):
        for b in range(5):
            same = t == t[b]
            assert st.means(k)[t[b]].item() == pytest.approx(x0e[same, i].double().mean().item(), rel=1e-4)
    # the probe: same loss at the same (t, eps), no statistics, no counter move
    probe = obj.probe_loss(model, x0, t, eps)
    torch.testing.assert_close(probe, per.detach() / info["iw"], rtol=1e-4, atol=1e-6)
    assert obj.offset == offset + x0.numel() and st.window.data.abs().sum() == 0


def test_resume_restores_statistics_and_argmin_choice_exactly():
    s = fd.schedule("linear", T=100)

    def make():
        head = M.MixedOutput(("eps", "x0"), s, mode="argmin")
        return M.MixedObjective(s, ("eps", "x0"), mode="argmin", argmin_buckets=10, backend="torch", seed=1,
                                output=head)

    net = Net(torch.nn.Linear(2, 6))
    a = make()
    for _ in range(3):
        a(net, torch.randn(16, 2))
        a.sync_stats()
    a(net, torch.randn(16, 2))  # a pending window too
    b = make()
    b.load_state_dict(a.state_dict())
    b.load_rank_states([a.rank_state()], 0, 1)
    assert torch.equal(a.output.choice, b.output.choice) and (a.output.choice >= 0).any()
    x = torch.randn(8, 2)
    la, ia = a(net, x, generator=torch.Generator().manual_seed(9))
    lb, ib = b(net, x, generator=torch.Generator().manual_seed(9))
    assert torch.equal(la, lb) and torch.equal(ia["x0_error"], ib["x0_error"])
    a.sync_stats()
    b.sync_stats()
    assert torch.equal(a.output.choice, b.output.choice)
    for k in a.stats.kinds:
        torch.testing.assert_close(a.stats.means(k), b.stats.means(k), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name,kw", [("unet_tiny", dict(in_channels=1, image_size=8)),
                                     ("dit_tiny", dict(in_channels=1, image_size=8)),
                                     ("dit_s2", dict(in_channels=4, image_size=32)),
                                     ("adm_32", dict(in_channels=3, image_size=32)),
                                     ("mlp", dict(in_channels=2))])
def test_every_model_family_outputs_heads_and_gate(name, kw):
    from fasttrain.models import build_model

    heads = ("eps", "x0", "v")
    C = kw["in_channels"]
    shape = (2, C) + ((kw["image_size"],) * 2 if "image_size" in kw else ())
    s = fd.schedule("linear", T=1000)
    for gate in M.GATES:
        head = M.MixedOutput(heads, s, gate)
        with torch.device("meta"):
            net = build_model(name, out_channels=M.output_channels(heads, C, gate), **kw)
            model = Denoiser(net, head, s, gate_heads=3 if gate == "timestep" else 0)
            out = model(torch.empty(shape), torch.zeros(2, dtype=torch.long))
            assert out.shape == (2, 3 * C + 3) + shape[2:]


def test_head_set_and_option_validation():
    lin = fd.schedule("linear", T=100)
    assert M.check_heads(["v", "eps"], lin) == ("v", "eps")
    assert M.check_heads(("eps", "flow"), fd.schedule("flow", T=10)) == ("eps", "flow")
    for bad, msg in [(("eps",), "two or more"), (("eps", "eps"), "two or more"), (("eps", "noise"),
                                                                                  "unknown mixed head"),
                     (("eps", "flow"), "needs the flow schedule")]:
        with pytest.raises(ValueError, match=msg):
            M.check_heads(bad, lin)
    with pytest.raises(ValueError, match="mixed.gate must be one of pixel, timestep"):
        M.MixedObjective(lin, gate="channel")
    with pytest.raises(ValueError, match="mixed.mode must be"):
        M.MixedObjective(lin, mode="best")
    with pytest.raises(ValueError, match="mixed.aux_weight must be >= 0"):
        M.head_table(("eps", "x0"), lin, aux_weight=-1)
    assert M.output_channels(("eps", "x0", "v"), 3, "pixel") == 12 and M.output_channels(("eps", "x0"), 4,
                                                                                         "timestep") == 8
    with pytest.raises(ValueError, match="no timestep gate"):
        Denoiser(Net(torch.nn.Identity()), M.MixedOutput(("eps", "x0"), lin), lin)(
            torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), return_gate=True)


def test_coefficient_of_variation_helpers():
    v = torch.tensor([1.0, 2.0, 4.0, float("nan")])
    assert V.coefficient_of_variation(v).item() == pytest.approx(np.std([1, 2, 4]) / np.mean([1, 2, 4]))
    assert torch.isnan(V.coefficient_of_variation(torch.tensor([3.0])))
    st = fd.TimestepStats(10)
    t = torch.tensor([0, 1, 5, 6, 9])
    loss = torch.tensor([1.0, 3.0, 2.0, 2.0, 8.0], dtype=torch.float64)
    st.add(t, loss, loss)
    st.all_reduce()
    assert V.loss_cv(st, n_buckets=2).item() == pytest.approx(np.std([2.0, 4.0]) / 3.0)  # buckets [0,5), [5,10)
    ts = V.bucket_timesteps(1000, 4, 3)
    assert ts.tolist()[0] == [41, 125, 208] and ((ts // 250) == torch.arange(4)[:, None]).all()


def test_grad_norm_cv_on_a_probe_batch():
    """Per-bucket gradient norms against a hand loop; they differ across buckets for a plain eps model
    and the CV is their std/mean; the probe leaves statistics, counter and .grad alone."""
    s = fd.schedule("linear", T=1000)
    obj = fd.DiffusionObjective(s, "eps", "min_snr", backend="torch")
    lin = torch.nn.Linear(3, 3)
    model = lambda x, t, y=None: lin(x)
    x0 = torch.rand(4, 3) * 2 - 1
    cv, norms = V.grad_norm_cv(obj, model, x0, n_buckets=3, params=list(lin.parameters()))
    eps = V.probe_noise(x0)
    for k, t in enumerate(V.bucket_timesteps(1000, 3, 4)):
        lin.zero_grad()
        per, _ = ops_ref_loss(obj, lin, x0, t, eps)
        per.mean().backward()
        n = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in lin.parameters()))
        assert norms[k].item() == pytest.approx(n.item(), rel=1e-5)
    assert cv.item() == pytest.approx((norms.std(unbiased=False) / norms.mean()).item(), rel=1e-9)
    assert obj.offset == 0 and obj.stats.window.data.abs().sum() == 0


def ops_ref_loss(obj, lin, x0, t, eps):
    from fasttrain.kernels import torch_ref

    x_t = torch_ref.noise(x0, t, obj.alpha, obj.sigma, eps)
    return torch_ref.loss(lin(x_t), x0, eps, t, obj.weight, torch.ones(x0.shape[0]), obj.coef)


@pytest.mark.parametrize("sched,heads,gate", [("zts", ("eps", "x0", "v"), "pixel"), ("flow", ("eps", "flow"), "pixel")])
def test_sampling_a_mixed_oracle_reproduces_the_mixture(sched, heads, gate):
    """Generation goes through the network's mixed x̂0 head: with oracle heads and a random gate, DDIM
    reproduces the Gaussian mixture, also where a head (eps) is masked at SNR = 0."""
    from fasttrain.diffusion.solvers import generate

    s = zts(1000) if sched == "zts" else fd.schedule(sched, T=1000)
    head = M.MixedOutput(heads, s, gate)
    oracles = [gmm.OracleModel(s, h) for h in heads]

    def denoise(x, t):
        tt = torch.full((x.shape[0],), t, dtype=torch.long)
        g = torch.randn(x.shape[0], len(heads), generator=torch.Generator().manual_seed(t)) * 2
        out = torch.cat([o(x, tt) for o in oracles] + [g], 1)
        x0 = head.to_x0(out, x, tt)
        return x0, (x - s.alpha[t].float() * x0) / s.sigma[t].float()

    x = generate(denoise, s, (4000, 2), solver="ddim", steps=50, generator=torch.Generator().manual_seed(0)).double()
    mean, cov = gmm.moments()
    torch.testing.assert_close(x.mean(0), mean, atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.06, rtol=0.08)
    assert (x[:, 0] < 0).double().mean().item() == pytest.approx(0.3, abs=0.04)
