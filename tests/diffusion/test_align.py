"""Representation alignment (REPA): the loss against an oracle written from the official code's semantics
(sihyun-yu/REPA loss.py), the head against its models/sit.py layout, the hooks against the block's own output,
and training runs: it composes with prediction types and samplers, the logged loss and the statistics stay
the diffusion loss's, λ = 0 is the baseline bit for bit, cached targets equal in-step ones, resume is exact,
DiT, the UNet, a diffusers UNet2DConditionModel and a transformers DINOv2 folder work, bad input is one line."""
import pytest
import torch
import torch.nn.functional as F

from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.diffusion import align
from fasttrain.logger import read_jsonl
from fasttrain.train import Trainer, train

ENC = "diffusion.align.encoder=fasttrain.pretrained.digits_encoder:encoder"
TINY = ["model.args.ch=8", "train.progress=false", "sample.num=0", "optim.warmup_steps=5", "train.threads=1",
        "eval.num_samples=0", "eval.bpd=false", "train.log_every=1", "data.batch_size=8", "train.plots=false",
        "train.ckpt_every=0"]
ALIGN = [ENC, "diffusion.align.depth=4", "diffusion.align.projector_dim=24"]


def official_proj_loss(zs, zs_tilde):
    """REPA loss.py's projection loss, written out as its loops read: for every encoder i and image j,
    the mean over tokens of −<normalize(z_j), normalize(z̃_j)>, summed, divided by encoders × batch."""
    proj_loss = 0.0
    bsz = zs[0].shape[0]
    for z, z_tilde in zip(zs, zs_tilde):
        for z_j, z_tilde_j in zip(z, z_tilde):
            z_tilde_j = z_tilde_j / z_tilde_j.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            z_j = z_j / z_j.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            per_token = -(z_j * z_tilde_j).sum(dim=-1)
            proj_loss = proj_loss + per_token.sum() / per_token.numel()
    return proj_loss / (len(zs) * bsz)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, n, d", [(3, 9, 5), (1, 16, 64), (5, 1, 7)])
def test_the_loss_equals_repas_on_the_same_tensors(dtype, b, n, d):
    g = torch.Generator().manual_seed(b * 100 + n)
    pred = (torch.randn(b, n, d, generator=g) + 0.3).to(dtype).requires_grad_(True)
    target = torch.randn(b, n, d, generator=g).to(dtype)
    side = int(n ** 0.5)
    ours = align.repa_loss(pred, (side, n // side), target)
    p2 = pred.detach().float().requires_grad_(True)
    want = official_proj_loss([target.float()], [p2])
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    ours.backward()
    want.backward()
    torch.testing.assert_close(pred.grad.float(), p2.grad.to(dtype).float(), rtol=1e-2 if dtype != torch.float32
                               else 1e-5, atol=1e-6)


def test_tokens_on_another_grid_are_resized_to_the_encoders():
    """A 2×2 grid of head tokens against a 4×4 grid of targets: the head's map is resized bilinearly (each
    target position compared with the interpolated token there)."""
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(2, 4, 6, generator=g), torch.randn(2, 16, 6, generator=g)
    up = F.interpolate(pred.transpose(1, 2).reshape(2, 6, 2, 2), size=(4, 4), mode="bilinear",
                       align_corners=False).flatten(2).transpose(1, 2)
    torch.testing.assert_close(align.repa_loss(pred, (2, 2), target), official_proj_loss([target], [up]))


def test_the_head_is_repas_mlp_and_tokens_read_every_block_layout():
    head = align.projector(16, 32, 8)
    assert [type(m).__name__ for m in head] == ["Linear", "SiLU", "Linear", "SiLU", "Linear"]
    assert [(m.in_features, m.out_features) for m in head if isinstance(m, torch.nn.Linear)] == [(16, 32), (32, 32),
                                                                                                 (32, 8)]
    fmap = torch.randn(2, 5, 3, 4)
    t, grid = align.as_tokens(fmap)
    assert grid == (3, 4) and torch.equal(t[1, 7], fmap[1, :, 1, 3])  # position (1, 3) of the 3×4 map
    t, grid = align.as_tokens((torch.randn(2, 9, 4), ("skips",)))  # a diffusers down block's (states, skips)
    assert grid == (3, 3) and t.shape == (2, 9, 4)
    with pytest.raises(Exception, match="not a square grid"):
        align.as_tokens(torch.randn(2, 8, 4))


def _cfg(run, *over, preset="default", tiny=TINY):
    return load_config(preset, [f"run_dir={run}"] + tiny + list(over))


def test_the_hooks_see_the_blocks_output_and_leave_the_forward_unchanged(tmp_path):
    tr = Trainer(_cfg(tmp_path / "r", "train.steps=1", *ALIGN))
    try:
        net = tr.bundle.net
        block = align.feature_blocks(net.net)[3]  # depth 4 of unet_tiny: its middle stage (4×4)
        seen = {}
        h = block.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.detach()) or None)
        x, t = torch.randn(3, 1, 8, 8), torch.tensor([5, 500, 900])
        out = net(x, t)
        h.remove()
        head = net.align_head
        want = head(seen["out"].flatten(2).transpose(1, 2))
        got, grid = tr.alignment.tokens
        assert grid == (4, 4) and torch.equal(got, want)
        tr.alignment.tokens = None
        with torch.no_grad():  # sampling: no tokens, and the same output
            assert torch.equal(net(x, t), out.detach()) and tr.alignment.tokens is None
    finally:
        tr.close()


def _rows(run, key):
    return [r[key] for r in read_jsonl(run / "metrics.jsonl") if key in r]


@pytest.mark.parametrize("over", [
    ["diffusion.prediction=eps"],
    ["diffusion.prediction=v", "diffusion.weighting=min_snr", "diffusion.sampler=logit_normal"],
    ["diffusion.prediction=x0", "diffusion.sampler=loss_second_moment", "diffusion.sampler_args.history=2",
     "diffusion.stats_every=2", "diffusion.schedule=cosine", "diffusion.T=20"],
    ["diffusion.schedule=flow", "diffusion.prediction=flow", "diffusion.weighting=simple"],
    ["diffusion.prediction=mixed", "diffusion.sampler=adaptive", "diffusion.sampler_args.every=2",
     "diffusion.learned_weighting=true"],
])
def test_alignment_composes_and_the_logged_loss_and_statistics_stay_the_diffusion_losss(tmp_path, over):
    base, al = tmp_path / "base", tmp_path / "al"
    trb = Trainer(_cfg(base, "train.steps=1", *over))
    tra = Trainer(_cfg(al, "train.steps=1", *over, *ALIGN))
    try:
        for tr in (trb, tra):
            tr.fit()
        # the first step's diffusion loss and statistics come from the same weights and noise: equal
        assert _rows(base, "loss") == _rows(al, "loss")
        sb, sa = trb.objective.stats.state_dict(), tra.objective.stats.state_dict()
        assert sb.pop("kinds") == sa.pop("kinds")
        torch.testing.assert_close(sb, sa, rtol=0, atol=0)
        assert len(_rows(al, "align/loss")) == 1 and -1 <= _rows(al, "align/loss")[0] <= 1
        # and the update differs: the alignment's gradient reached the backbone
        wb = dict(trb.bundle.net.named_parameters())
        assert any(not torch.equal(p, wb[n]) for n, p in tra.bundle.net.named_parameters() if n in wb)
    finally:
        trb.close()
        tra.close()


def test_weight_zero_is_the_baseline_and_the_alignment_loss_falls(tmp_path):
    train(_cfg(tmp_path / "b", "train.steps=5"))
    train(_cfg(tmp_path / "z", "train.steps=5", *ALIGN, "diffusion.align.weight=0"))
    assert _rows(tmp_path / "b", "loss") == _rows(tmp_path / "z", "loss")  # bit for bit: the head adds nothing
    train(_cfg(tmp_path / "a", "train.steps=60", "train.log_every=20", "optim.lr=3e-3", *ALIGN))
    rows = _rows(tmp_path / "a", "align/loss")
    assert len(rows) == 3 and rows[-1] < rows[0] - 0.2, rows  # the head and the block learn the encoder's features


def test_cached_targets_equal_targets_in_the_step_and_resume_exactly(tmp_path):
    common = ["train.steps=6", *ALIGN]
    train(_cfg(tmp_path / "auto", *common))
    train(_cfg(tmp_path / "step", *common, "diffusion.align.targets=step"))
    la, ls = _rows(tmp_path / "auto", "loss"), _rows(tmp_path / "step", "loss")
    assert la != [] and torch.allclose(torch.tensor(la), torch.tensor(ls), rtol=1e-5, atol=1e-6)
    train(_cfg(tmp_path / "r", "train.steps=3", "train.grad_accum=2", *ALIGN))
    train(_cfg(tmp_path / "r", "train.steps=6", "train.grad_accum=2", *ALIGN), resume=True)
    train(_cfg(tmp_path / "u", "train.steps=6", "train.grad_accum=2", *ALIGN))
    assert _rows(tmp_path / "r", "loss") == _rows(tmp_path / "u", "loss")
    assert _rows(tmp_path / "r", "align/loss")[-3:] == _rows(tmp_path / "u", "align/loss")[-3:]


def test_an_aligned_run_is_a_bundle_that_samples_and_exports(tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(run, "train.steps=2", "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=3",
               "model.args.heads=2", ENC, "diffusion.align.depth=2", "diffusion.align.projector_dim=16",
               tiny=[t for t in TINY if "args.ch" not in t]))
    sd = torch.load(run / "last.pt", weights_only=True)
    assert {"align_head.0.weight", "align_head.4.weight"} <= set(sd["model"])  # trained and checkpointed
    assert tuple(sd["model"]["align_head.4.weight"].shape) == (64, 16)  # → the encoder's 64 features
    assert tuple(sd["model"]["align_head.0.weight"].shape) == (16, 32)  # ← the DiT's 32 channels
    assert main(["sample", "--ckpt", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    pytest.importorskip("diffusers")
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "pipe")]) == 0


def test_a_diffusers_unet2dcondition_and_a_dinov2_folder(tmp_path, monkeypatch):
    """The SD-style backbone of the digits-text demo (a UNet2DConditionModel on captioned digits), its
    mid block aligned to a tiny random DINOv2 saved as a transformers folder."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "dinov2"
    torch.manual_seed(0)
    cfg = transformers.Dinov2Config(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                    image_size=16, patch_size=4)
    transformers.Dinov2Model(cfg).save_pretrained(folder)
    run = tmp_path / "run"
    train(load_config("digits-text", [f"run_dir={run}", "train.steps=3", "train.threads=1", "train.progress=false",
                                      "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.log_every=1",
                                      "data.batch_size=4", f"diffusion.align.encoder={folder}",
                                      "diffusion.align.depth=3", "diffusion.align.projector_dim=16"]))
    rows = _rows(run, "align/loss")
    assert len(rows) == 3 and all(-1 <= r <= 1 for r in rows)
    sd = torch.load(run / "last.pt", weights_only=True)["model"]
    assert tuple(sd["align_head.4.weight"].shape) == (24, 16)  # DINOv2's width: 16 patch tokens of 24
    assert tuple(sd["align_head.0.weight"].shape) == (16, 64)  # the mid block: 64 channels on 4×4, as DINOv2's


@pytest.mark.parametrize("over, needle", [
    (["diffusion.align.depth=40"], "bad value for 'diffusion.align.depth': 40 (model unet_tiny has 8 blocks"),
    (["diffusion.align.encoder=no.such.module:fn"], "no module named 'no'"),
    (["diffusion.align.encoder=fasttrain.pretrained.digits_encoder:nothing"], "has no function 'nothing'"),
    (["diffusion.align.encoder=/nowhere"], "neither a model folder nor module:function"),
    (["diffusion.align.encoder_dim=10"], "(the encoder gives 64 features)"),
    (["data.name=synthetic", "data.channels=1"], "has no pixels"),
])
def test_bad_alignment_input_is_one_line(tmp_path, capsys, over, needle):
    args = ["train", f"run_dir={tmp_path / 'r'}", "train.steps=1"] + TINY + ALIGN + over
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fasttrain: error:") and needle in err[0], err


def test_cached_targets_keep_the_eager_step_where_a_graph_was_asked_for(capsys):
    """A graph replays the tensors it captured; cached targets are a new tensor per batch, so graph mode
    (parallel/graphs.py decides it alone) keeps the eager body and says why; targets in the step do not
    stop it there (the next check, the objective's, runs)."""
    from types import SimpleNamespace

    from fasttrain.parallel import graphs

    def body(*_):
        return None

    parts = SimpleNamespace(world_size=1, objective=None, scaler=None, optimizer=None,
                            align=SimpleNamespace(cached=True))
    assert graphs.step_function(body, parts, True, device=torch.device("cuda"), grad_accum=1) is body
    assert "diffusion.align's cached targets" in capsys.readouterr().err
    probe = SimpleNamespace(capture_problem=lambda: "the objective's reason")
    assert graphs.unsupported(torch.device("cuda"), 1, 1, probe, None, None,
                              align=SimpleNamespace(cached=False)) == "the objective's reason"
