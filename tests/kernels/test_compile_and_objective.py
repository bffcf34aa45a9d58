"""The ops inside torch.compile(fullgraph=True), and DiffusionObjective on the fused kernels: Triton
(the interpreter on CPU) and the native ops where fasttrain._C is built."""
import pytest
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion import prediction as P
from fasttrain.kernels import TimestepBins, native, philox, torch_ref
from fasttrain.kernels.diffusion_loss import diffusion_loss
from fasttrain.kernels.noise import noise
from fasttrain.models import build_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if torch.cuda.is_available() else "interpret"
FUSED = [BACKEND] + (["native"] if native.available(DEVICE) else [])


def _step(model, x0, t, iw, a, s, w, coef, bins, backend):
    x_t = noise(x0, t, a, s, seed=3, offset=99, backend=backend)
    pred = model(x_t, t)
    loss, per, raw, _ = diffusion_loss(pred, x0, t, w, iw, coef, seed=3, offset=99, bins=bins, backend=backend)
    return loss, raw


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("arch", ["dit", "unet"])
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_ops_inside_fullgraph_compile(compiler, arch, backend):
    torch._dynamo.reset()
    s = fd.schedule("cosine", T=100)
    a, sg = s.alpha.float().to(DEVICE), s.sigma.float().to(DEVICE)
    w = fd.loss_weight("min_snr", s, prediction="v").float().to(DEVICE)
    model = (build_model("dit_tiny", in_channels=2, image_size=4, hidden=32, depth=1, heads=2) if arch == "dit"
             else build_model("unet_tiny", in_channels=2, image_size=4, ch=8, attn_resolutions=())).to(DEVICE)
    x0 = torch.rand(3, 2, 4, 4, device=DEVICE) - 0.5
    t = torch.tensor([5, 50, 99], device=DEVICE)
    iw = torch.ones(3, device=DEVICE)
    coef = P.get("v").table(s.alpha, s.sigma).to(DEVICE)
    bins_e, bins_c = TimestepBins(100, 2, DEVICE), TimestepBins(100, 2, DEVICE)
    loss_e, raw_e = _step(model, x0, t, iw, a, sg, w, coef, bins_e, backend)
    loss_e.backward()
    g_e = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(_step, fullgraph=True, backend=compiler)
    loss_c, raw_c = compiled(model, x0, t, iw, a, sg, w, coef, bins_c, backend)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(raw_c, raw_e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bins_c.data, bins_e.data, rtol=1e-5, atol=1e-8)  # the in-place scatter survives compile
    for p, g in zip(model.parameters(), g_e):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("pred", fd.PREDICTIONS)
def test_objective_on_fused_kernels_matches_reference(pred, backend):
    s = fd.schedule("flow" if pred == "flow" else "linear", T=1000)
    obj = fd.DiffusionObjective(s, pred, "min_snr", "speed", sampler_args={"dual": pred != "flow"},
                                backend=backend, seed=4).to(DEVICE)
    lin = torch.nn.Linear(6, 6).to(DEVICE)
    model = lambda x, t: lin(x)
    x0 = torch.rand(5, 6, device=DEVICE) * 2 - 1
    offset = int(obj.offset)
    loss, info = obj(model, x0, generator=torch.Generator(DEVICE).manual_seed(0))
    t = info["t"]
    eps = philox.randn(x0.shape, 4, offset, DEVICE)  # the stream the kernels draw
    x_t = torch_ref.noise(x0, t, obj.alpha, obj.sigma, eps)
    per, raw = torch_ref.loss(lin(x_t), x0, eps, t, obj.weight, info["iw"], obj.coef)
    torch.testing.assert_close(loss, per.mean(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(info["raw"], raw.detach(), rtol=1e-4, atol=1e-6)
    obj.sync_stats()
    assert obj.stats.count.sum().item() == 5
    torch.testing.assert_close(obj.stats.means("raw")[t], raw.detach().double(), rtol=1e-4, atol=1e-6)


def test_trainer_runs_on_the_interpreter(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the interpreter backend is for CPU tensors")
    from fasttrain.configure import load_config
    from fasttrain.train import train

    cfg = load_config("default", [f"run_dir={tmp_path}", "diffusion.backend=interpret", "train.steps=4",
                                  "model.args.ch=8", "sample.num=0", "train.progress=false", "diffusion.stats_every=2",
                                  "eval.num_samples=0", "eval.bpd=false"])
    summary = train(cfg)
    assert summary["steps"] == 4
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    counted = state["objective"]["_extra_state"]["stats"]["count"].sum().item()
    pending = state["ranks"][0]["objective"]["window"]["bins"][0].sum().item()
    assert counted + pending == 4 * 16 and counted == 4 * 16  # stats_every=2 divides 4: nothing pending
