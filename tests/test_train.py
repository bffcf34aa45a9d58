"""End-to-end trainer runs on tiny settings: the loss falls, resume is exact, nothing is lost or
overwritten, non-finite steps and signals are handled (fault injection with real faults)."""
import json
import os
import random
import signal

import pytest
import torch

from fasttrain.configure import load_config
from fasttrain.logger import read_jsonl
from fasttrain.train import Trainer, train

TINY = ["model.args.ch=16", "train.progress=false", "sample.num=0", "optim.warmup_steps=10", "train.threads=1",
        "eval.num_samples=0", "eval.bpd=false"]


def _cfg(tmp_path, *over, preset="default", tiny=TINY):
    return load_config(preset, [f"run_dir={tmp_path}"] + tiny + list(over))


def _losses(run):
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _weights(path):
    st = torch.load(path, weights_only=True)
    return st["model"], st["ema"]["shadow"]


def _assert_same_state(a, b):
    for sa, sb in zip(_weights(a), _weights(b)):
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


def test_short_run_loss_falls_and_writes_artifacts(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=200", "train.log_every=20", "optim.lr=2e-3", "sample.num=20", "sample.steps=10",
               "eval.num_samples=100", "eval.steps=10", "eval.every=0")
    summary = train(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"], [r["loss"] for r in rows]
    assert rows[-1]["images"] == 200 * 16 and rows[-1]["skipped_steps"] == 0
    for f in ("last.pt", "samples.png", "timesteps.png", "loss.png", "config.yaml", "summary.json"):
        assert (tmp_path / f).is_file(), f
    assert any((tmp_path / "tb").iterdir())
    assert 0 <= summary["eval"]["digits_confidence"] <= 1 and summary["eval"]["fid"] > 0


def test_plots_false_skips_the_figures_and_keeps_the_summary(tmp_path):
    train(_cfg(tmp_path, "train.steps=3", "train.log_every=1", "train.plots=false"))
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "last.pt").is_file()
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("over", [
    ["diffusion.sampler=stratified", "train.grad_accum=2", "diffusion.stats_every=3"],
    ["diffusion.sampler=loss_second_moment", "diffusion.sampler_args.history=2", "diffusion.schedule=cosine",
     "diffusion.T=20", "diffusion.weighting=snr", "diffusion.stats_every=2", "diffusion.prediction=v"],
    ["diffusion.sampler=speed", "diffusion.weighting=speed", "diffusion.learned_weighting=true",
     "diffusion.stats_every=3"],
    ["diffusion.sampler=adaptive", "diffusion.sampler_args.every=3", "diagnostics.interference_every=4"],
    ["diffusion.prediction=mixed", "diffusion.mixed.gate=timestep", "diffusion.mixed.mode=argmin",
     "diffusion.mixed.argmin_buckets=4", "diffusion.stats_every=3"],
    # every noise option and a loss shape with mixed prediction and a learned sampler (issue 21): the
    # random strengths and the pyramid's factors come from the stream at the step's counter
    ["diffusion.noise.offset=0.1", "diffusion.noise.offset_random_strength=true", "diffusion.noise.adaptive_offset=0.2",
     "diffusion.noise.pyramid_iterations=6", "diffusion.noise.perturbation=0.1",
     "diffusion.noise.perturbation_random_strength=true", "diffusion.loss.type=pseudo_huber",
     "diffusion.prediction=mixed", "diffusion.sampler=adaptive", "diffusion.sampler_args.every=3",
     "diffusion.stats_every=3"],
    ["diffusion.noise.immiscible=assignment", "diffusion.noise.offset=0.05", "diffusion.loss.type=huber",
     "diffusion.loss.huber_schedule=exponential", "diffusion.prediction=v", "diffusion.stats_every=3"],
])
def test_resume_gives_the_same_next_losses(tmp_path, over):
    common = ["train.log_every=1", "train.ckpt_every=0", "data.batch_size=8"] + over
    train(_cfg(tmp_path / "a", "train.steps=16", *common))
    train(_cfg(tmp_path / "b", "train.steps=7", *common))  # stops between two statistics syncs
    train(_cfg(tmp_path / "b", "train.steps=16", *common), resume=True)
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(la) == len(lb) == 16
    assert la == lb  # bit-identical on CPU, and one series in metrics.jsonl
    _assert_same_state(tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt")


def test_lookahead_components_log_and_plot(tmp_path):
    train(_cfg(tmp_path, "train.steps=12", "train.log_every=6", "diffusion.sampler=adaptive",
               "diffusion.sampler_args.every=3", "diagnostics.interference_every=4", "diagnostics.buckets=3"))
    row = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    assert row["adaptive/updates"] == 4 and 0 < row["lookahead_share"] < 1 and row["loss_cv"] > 0
    assert row["interference/diag_mean"] < 0 and row["interference/grad_norm_cv"] > 0
    for f in ("adaptive.png", "interference.png", "timesteps.png"):
        assert (tmp_path / f).is_file(), f


def test_learned_weighting_lives_in_the_network(tmp_path):
    train(_cfg(tmp_path, "train.steps=5", "diffusion.learned_weighting=true", "optim.lr=1e-2"))
    model, ema = _weights(tmp_path / "last.pt")
    assert "logvar.linear.weight" in model and "logvar.linear.weight" in ema
    assert model["logvar.linear.weight"].abs().sum() > 0  # trained like every other weight


def test_resume_refuses_a_different_model(tmp_path):
    train(_cfg(tmp_path, "train.steps=2"))
    with pytest.raises(ValueError, match="config key 'model.args.ch' differs"):
        train(_cfg(tmp_path, "train.steps=4", tiny=[t for t in TINY if "model.args" not in t] + ["model.args.ch=8"]),
              resume=True)


def test_a_fresh_run_never_overwrites_an_earlier_one(tmp_path):
    train(_cfg(tmp_path, "train.steps=3", "train.log_every=1"))
    before = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(RuntimeError, match="already holds a run.*--resume.*--restart"):
        train(_cfg(tmp_path, "train.steps=3", "train.log_every=1"))
    assert (tmp_path / "last.pt").read_bytes() == before and len(_losses(tmp_path)) == 3
    train(_cfg(tmp_path, "train.steps=2", "train.log_every=1"), restart=True)
    assert (tmp_path / "previous-1" / "last.pt").read_bytes() == before  # moved aside, not lost
    assert len(_losses(tmp_path)) == 2


def test_two_trainers_on_one_run_directory(tmp_path):
    first = Trainer(_cfg(tmp_path, "train.steps=2"))
    try:
        with pytest.raises(RuntimeError, match="another fasttrain process is using"):
            Trainer(_cfg(tmp_path, "train.steps=2"))
    finally:
        first.close()
    Trainer(_cfg(tmp_path, "train.steps=2")).close()  # free again


def test_resume_applies_changed_optimizer_settings(tmp_path):
    train(_cfg(tmp_path, "train.steps=4", "optim.warmup_steps=0"))
    tr = Trainer(_cfg(tmp_path, "train.steps=6", "optim.lr=3e-4", "optim.weight_decay=0.05", "optim.warmup_steps=0"),
                 resume=True)
    tr.restore(tmp_path / "last.pt")
    g = tr.opt.param_groups[0]
    assert g["lr"] == pytest.approx(3e-4) and g["weight_decay"] == 0.05
    tr.close()


def test_nonfinite_steps_are_skipped_and_the_run_stops_with_good_checkpoints(tmp_path):
    """A real fault: a learning rate of 1e30 blows the weights up after one step."""
    train(_cfg(tmp_path, "train.steps=4", "train.ckpt_every=2"))
    good = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(FloatingPointError, match="non-finite steps in a row"):
        train(_cfg(tmp_path, "train.steps=40", "train.ckpt_every=1", "train.log_every=5", "train.max_nonfinite=5",
                   "optim.lr=1e30", "optim.warmup_steps=0"), resume=True)
    assert (tmp_path / "last.pt").read_bytes() == good  # never saved over with broken weights
    assert (tmp_path / "crash.pt").is_file()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert max(r.get("skipped_steps", 0) for r in rows) >= 5
    from fasttrain.cli import main
    assert main(["sample", "--ckpt", str(tmp_path), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert main(["sample", "--ckpt", str(tmp_path / "crash.pt"), "--n", "4", "--steps", "2",
                 "--out", str(tmp_path / "s2")]) == 1


def test_a_failing_crash_save_does_not_hide_the_error(tmp_path, monkeypatch, capsys):
    """A full disk while writing crash.pt: the run's own error is still the one raised, the save's
    failure is one line, and the metrics log is closed (its rows are on disk)."""
    real = Trainer.save

    def save(self, name="last.pt"):
        if name == "crash.pt":
            raise OSError(28, "No space left on device")
        return real(self, name)

    monkeypatch.setattr(Trainer, "save", save)
    with pytest.raises(FloatingPointError, match="non-finite steps in a row"):
        train(_cfg(tmp_path, "train.steps=40", "train.log_every=5", "train.max_nonfinite=5", "optim.lr=1e30",
                   "optim.warmup_steps=0"))
    assert "fasttrain: crash.pt not written (OSError: [Errno 28] No space left on device)" in capsys.readouterr().err
    assert not (tmp_path / "crash.pt").exists() and read_jsonl(tmp_path / "metrics.jsonl")


def test_a_run_that_fails_before_its_first_checkpoint_says_so(tmp_path):
    """Only crash.pt: the error does not promise a checkpoint, skipped intervals log no loss (not 0),
    --resume and a plain rerun both point at --restart."""
    from fasttrain.errors import UserError

    cfg = _cfg(tmp_path, "train.steps=40", "train.log_every=1", "train.max_nonfinite=3", "optim.lr=1e30",
               "optim.grad_clip=0", "optim.warmup_steps=0")
    with pytest.raises(FloatingPointError, match="no checkpoint had been written, crash.pt holds this state"):
        train(cfg)
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] is None and rows[-1]["grad_norm"] is None and rows[-1]["skipped_steps"] >= 3
    assert all(r["loss"] is None or r["loss"] > 0 for r in rows)
    with pytest.raises(FileNotFoundError, match="crash.pt holds a failed run's state.*--restart"):
        train(cfg, resume=True)
    with pytest.raises(UserError, match="it has no checkpoint to continue from, so start over with --restart"):
        train(cfg)


def test_a_skipped_step_changes_nothing(tmp_path):
    """A non-finite gradient leaves weights, optimizer state and EMA exactly as they were."""
    tr = Trainer(_cfg(tmp_path, "train.steps=3"))
    try:
        tr.train_step()
        before = [p.detach().clone() for p in tr.model.parameters()] + [s.clone() for s in tr.ema.shadow]
        real = tr.objective.forward

        def poisoned(*a, **k):
            loss, info = real(*a, **k)
            return loss * float("nan"), info

        tr.objective.forward = poisoned
        tr.train_step()
        after = [p.detach() for p in tr.model.parameters()] + list(tr.ema.shadow)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert int(tr.state.skipped) == 1 and int(tr.state.skipped_run) == 1
        assert torch.isfinite(tr.objective.stats.window.data).all()
    finally:
        tr.close()


def _interrupt_at(tr, call: int, signum):
    """Send `signum` to this process during the `call`-th objective evaluation (mid-step)."""
    real, n = tr.objective.forward, {"i": 0}

    def fwd(*a, **k):
        n["i"] += 1
        if n["i"] == call:
            os.kill(os.getpid(), signum)
        return real(*a, **k)

    tr.objective.forward = fwd


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_at_random_times_then_resume_equal_the_uninterrupted_run(tmp_path, signum):
    common = ["train.log_every=1", "train.ckpt_every=0", "data.batch_size=8", "train.grad_accum=2",
              "diffusion.sampler=loss_second_moment", "diffusion.sampler_args.history=2", "diffusion.stats_every=3"]
    train(_cfg(tmp_path / "a", "train.steps=14", *common))
    rng = random.Random(int(signum))
    run = tmp_path / "b"
    resume = False
    for _ in range(3):
        tr = Trainer(_cfg(run, "train.steps=14", *common), resume=resume)
        try:
            if resume:
                tr.restore(run / "last.pt")
            _interrupt_at(tr, rng.randint(1, 6), signum)
            with pytest.raises(KeyboardInterrupt):
                tr.fit()
        finally:
            tr.close()
        resume = True
    train(_cfg(run, "train.steps=14", *common), resume=True)
    assert _losses(tmp_path / "a") == _losses(run)
    _assert_same_state(tmp_path / "a" / "last.pt", run / "last.pt")


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
    tr = Trainer(_cfg(tmp_path / "t", "optim.impl=torch"))
    assert isinstance(tr.opt, torch.optim.AdamW)
    tr.close()


@pytest.mark.parametrize("over", [[], ["diffusion.sampler=loss_second_moment", "diffusion.stats_every=1"],
                                  ["diffusion.prediction=mixed", "diffusion.stats_every=1"],
                                  ["diffusion.noise.offset=0.1", "diffusion.noise.adaptive_offset=0.2",
                                   "diffusion.noise.offset_random_strength=true",
                                   "diffusion.noise.pyramid_iterations=6", "diffusion.noise.perturbation=0.1",
                                   "diffusion.noise.immiscible=assignment", "diffusion.loss.type=smooth_l1"],
                                  ["diffusion.noise.immiscible=knn", "diffusion.noise.immiscible_k=4",
                                   "diffusion.prediction=mixed", "diffusion.loss.type=l1"]])
def test_the_step_reads_nothing_back_to_the_host(tmp_path, over):
    """A CPU proxy of the GPU no-sync test: no `.item()`-style read (aten::_local_scalar_dense) in a
    whole trainer step, data, statistics sync and EMA included, except inside kernels whose CPU
    implementation reads its scalar arguments (fused AdamW's lr/found_inf, the native ops' noise
    offset), which their CUDA implementations read on the device."""
    from torch.profiler import ProfilerActivity, profile

    tr = Trainer(_cfg(tmp_path, "train.steps=10", "diagnostics.interference_every=0", *over))
    try:
        for _ in range(2):
            tr.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                tr.train_step()
        def inside_kernel(e):
            while e is not None:
                if e.name.startswith(("aten::_fused_adam", "fasttrain_C::")):
                    return True
                e = e.cpu_parent
            return False

        reads = [e.name for e in prof.events() if e.name == "aten::item" and not inside_kernel(e)]
        assert not reads, reads
    finally:
        tr.close()
