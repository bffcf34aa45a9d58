"""The model bundle stands without the trainer: a checkpoint alone generates and is evaluated."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main

sys.path.insert(0, str(Path(__file__).parent / "data"))
from folder_fixtures import write_images

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1"]


def test_train_on_a_folder_delete_it_then_sample_and_evaluate(tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    write_images(data, n_per_class=4)
    ref = tmp_path / "ref"
    shutil.copytree(data, ref)
    assert main(["train", f"run_dir={run}", "data.name=folder", f"data.root={data}", "data.backend=torch",
                 "data.image_size=8", "data.batch_size=4", "train.steps=3", "model.name=dit_tiny",
                 "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2"] + TINY) == 0
    shutil.rmtree(data)  # the training data are gone (and there is no manifest to rescan)
    b = ModelBundle.load(run)
    assert b.spec.shape == (3, 8, 8) and b.spec.num_classes == 2 and b.step == 3
    assert main(["sample", "--ckpt", str(run), "--n", "6", "--steps", "3", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "grid.png").is_file() and (tmp_path / "s" / "00005.png").is_file()
    capsys.readouterr()
    # FID against a reference folder given on the command line (offline: the digits extractor on RGB)
    assert main(["eval", "--ckpt", str(run), "--n", "8", "--steps", "3", "--ref", str(ref),
                 "--extractor", "fasttrain-digits"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["fid"] > 0 and "bpd" in ev and ev["bpd_se"] > 0
    # without --ref the missing folder is an error of the command (the bits/dim still written)
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--n", "8", "--steps", "3", "--extractor", "fasttrain-digits"]) == 1
    assert "pass --ref" in capsys.readouterr().err.strip().splitlines()[-1]
    assert "pass --ref" in json.loads((run / "eval.json").read_text())["fidelity_error"]
    assert main(["eval", "--ckpt", str(run), "--ref", str(tmp_path / "nope")]) == 1


def test_guidance_mixes_conditional_and_unconditional(tmp_path):
    main(["train", f"run_dir={tmp_path}", "train.steps=1", "model.args.ch=8"] + TINY)
    b = ModelBundle.load(tmp_path)

    def fake_x0(x, t, y):  # conditional estimate 0, unconditional 1
        return torch.where((y == b.spec.num_classes)[:, None, None, None], torch.ones_like(x), torch.zeros_like(x))

    b.x0_hat = fake_x0
    labels = torch.zeros(4, dtype=torch.long)
    for g, expect in ((1.0, 0.0), (3.0, -2.0)):  # uncond + g·(cond - uncond) = 1 + g·(0 - 1)
        x0, _ = b.solver_fn(labels, guidance=g)(torch.randn(4, 1, 8, 8), 10)
        torch.testing.assert_close(x0, torch.full_like(x0, expect))
    with pytest.raises(ValueError, match="guidance must be a finite number"):
        b.solver_fn(labels, guidance=float("nan"))


def test_non_finite_weights_are_refused(tmp_path, capsys):
    main(["train", f"run_dir={tmp_path}", "train.steps=1", "model.args.ch=8"] + TINY)
    st = torch.load(tmp_path / "last.pt", weights_only=True)
    name = next(iter(st["ema"]["shadow"]))
    st["ema"]["shadow"][name] = st["ema"]["shadow"][name] * float("nan")
    torch.save(st, tmp_path / "last.pt")
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(tmp_path), "--out", str(tmp_path / "s")]) == 1
    assert "non-finite weights" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(tmp_path)]) == 1


@pytest.mark.parametrize("prediction", ["eps", "mixed"])
def test_sample_eval_report_build_no_sampler_and_no_statistics(tmp_path, monkeypatch, prediction):
    """A model's x̂0 conversion lives in the network wrapper: loading an adaptive run (a learned policy,
    a loss history) to sample, evaluate and report constructs no timestep sampler and no statistics."""
    from fasttrain.diffusion.samplers import TimestepSampler
    from fasttrain.diffusion.stats import TimestepStats

    run = tmp_path / "run"
    extra = ["diffusion.prediction=mixed", "diffusion.mixed.mode=argmin"] if prediction == "mixed" else []
    assert main(["train", f"run_dir={run}", "train.steps=4", "model.args.ch=8", "diffusion.sampler=adaptive",
                 "diffusion.sampler_args.every=2", "diffusion.sampler_args.tau_grid=4", "sample.num=4",
                 "sample.steps=2", "train.log_every=2", "diffusion.stats_every=2"] + extra + TINY[:1] + TINY[2:]) == 0
    assert (run / "timesteps.png").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("a timestep sampler or statistics was constructed")

    monkeypatch.setattr(TimestepSampler, "__init__", refuse)
    monkeypatch.setattr(TimestepStats, "__init__", refuse)
    b = ModelBundle.load(run)
    assert b.generate(3, torch.arange(3), steps=2).shape == (3, 1, 8, 8)
    assert main(["sample", "--ckpt", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert main(["eval", "--ckpt", str(run), "--n", "8", "--steps", "2"]) == 0
    assert main(["report", str(run)]) == 0
    if prediction == "mixed":  # argmin's per-timestep choice came back with the weights
        assert (b.net.output.choice >= 0).any()


@pytest.mark.parametrize("layer", ["edm2", "linear"])
def test_the_log_variance_layer_is_initialised_from_the_runs_seed(layer):
    """EDM2's log-variance layer (random Fourier features, a random MPConv weight) draws from the run's
    seed, so seeds differ in it as in every other weight; the same seed builds the same layer, and the
    backbone's initial weights do not depend on it."""
    from fasttrain.bundle import DataSpec
    from fasttrain.configure import load_config

    spec = DataSpec("digits", 1, 8, 10, 0.1)

    def build(seed, learned):
        cfg = load_config("default", ["model.args.ch=8", f"train.seed={seed}", f"diffusion.logvar_layer={layer}",
                                      f"diffusion.learned_weighting={str(learned).lower()}"])
        return ModelBundle.build(cfg, spec, torch.device("cpu")).net

    a, a2, b = build(0, True), build(0, True), build(1, True)
    for name in ("freqs", "phases") + (("weight",) if layer == "edm2" else ()):
        x, y, z = (getattr(m.logvar, name) for m in (a, a2, b))
        assert torch.equal(x, y) and not torch.allclose(x, z), name
    plain = build(0, False)
    for k, v in plain.net.state_dict().items():
        assert torch.equal(v, a.net.state_dict()[k]), k
