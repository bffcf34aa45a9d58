"""End-to-end trainer runs on tiny settings: the loss falls, resume is exact, crashes lose nothing."""
import json

import pytest
import torch

from fasttrain.config import load_config
from fasttrain.logger import read_jsonl
from fasttrain.train import Trainer, train

TINY = ["model.args.ch=16", "train.progress=false", "sample.num=0", "optim.warmup_steps=10", "train.threads=1",
        "eval.num_samples=0", "eval.bpd=false"]


def _cfg(tmp_path, *over, preset="default", tiny=TINY):
    return load_config(preset, [f"run_dir={tmp_path}"] + tiny + list(over))


def test_short_run_loss_falls_and_writes_artifacts(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=200", "train.log_every=20", "optim.lr=2e-3", "sample.num=20", "sample.steps=10",
               "eval.num_samples=100", "eval.steps=10", "eval.every=0")
    summary = train(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"], [r["loss"] for r in rows]
    assert rows[-1]["images"] == 200 * 16
    for f in ("last.pt", "samples.png", "timesteps.png", "loss.png", "config.yaml", "summary.json"):
        assert (tmp_path / f).is_file(), f
    assert any((tmp_path / "tb").iterdir())
    assert 0 <= summary["eval"]["digits_confidence"] <= 1 and summary["eval"]["fid"] > 0


@pytest.mark.parametrize("over", [
    ["diffusion.sampler=stratified", "train.grad_accum=2", "diffusion.stats_every=3"],
    ["diffusion.sampler=loss_second_moment", "diffusion.sampler_args.history=2", "diffusion.schedule=cosine",
     "diffusion.T=20", "diffusion.weighting=snr", "diffusion.stats_every=2", "diffusion.prediction=v"],
    ["diffusion.sampler=speed", "diffusion.weighting=speed", "diffusion.learned_weighting=true"],
])
def test_resume_gives_the_same_next_losses(tmp_path, over):
    common = ["train.log_every=1", "train.ckpt_every=0", "data.batch_size=8"] + over
    a = _cfg(tmp_path / "a", "train.steps=16", *common)
    train(a)
    b = _cfg(tmp_path / "b", "train.steps=8", *common)
    train(b)
    b2 = _cfg(tmp_path / "b", "train.steps=16", *common)
    train(b2, resume=True)
    la = [r["loss"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert len(la) == len(lb) == 16
    assert la[8:] == lb[8:]  # bit-identical on CPU
    sa = torch.load(tmp_path / "a" / "last.pt", weights_only=True)
    sb = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    for k in sa["ema"]:
        torch.testing.assert_close(sa["ema"][k], sb["ema"][k], rtol=0, atol=0)


def test_resume_refuses_a_different_model(tmp_path):
    train(_cfg(tmp_path, "train.steps=2"))
    with pytest.raises(ValueError, match="config key 'model.args.ch' differs"):
        train(load_config("default", [f"run_dir={tmp_path}", "model.args.ch=8", "train.steps=4", "sample.num=0",
                                      "train.progress=false", "eval.num_samples=0"]), resume=True)


def test_crash_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "train.steps=10", "train.ckpt_every=2")
    tr = Trainer(cfg)
    real = tr.train_step

    def flaky():
        if tr.step == 5:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(tr, "train_step", flaky)
    with pytest.raises(KeyboardInterrupt):
        tr.fit()
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 5  # Ctrl-C: resumable state

    tr2 = Trainer(cfg)
    tr2.load(tmp_path / "last.pt")

    def nan_step():
        if tr2.step == 7:
            raise FloatingPointError("loss became nan")
        return real2()

    real2 = tr2.train_step
    monkeypatch.setattr(tr2, "train_step", nan_step)
    with pytest.raises(FloatingPointError):
        tr2.fit()
    assert torch.load(tmp_path / "crash.pt", weights_only=True)["step"] == 7
    assert torch.load(tmp_path / "last.pt", weights_only=True)["step"] == 6  # the good one stays


def test_toy_run_with_mlp(tmp_path):
    cfg = _cfg(tmp_path, "data.name=moons", "model.name=mlp", "model.args.hidden=64", "train.steps=60",
               "sample.num=300", "sample.steps=20", "data.batch_size=64", tiny=TINY[1:])
    summary = train(cfg)
    assert (tmp_path / "samples.png").is_file()
    assert len(summary["sample_mean"]) == 2 and all(v == v for v in summary["sample_std"])
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 60


def test_apex_optimizer_is_a_clear_error_when_missing(tmp_path):
    try:
        import apex  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="optim.impl=apex but apex is not installed"):
            Trainer(_cfg(tmp_path, "optim.impl=apex"))
    assert isinstance(Trainer(_cfg(tmp_path, "optim.impl=torch")).opt, torch.optim.AdamW)
