"""`torchrun` CLI runs on two ranks: FSDP2 and DDP training, sharded checkpoints that resume on any
world size (2 → 1 → 2), exact distributed resume, and commands that read a DCP folder alone."""
import json

import pytest
import torch
from torchrun_launch import cli

from fasttrain import checkpoint as ckpt
from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.logger import read_jsonl

BASE = ["train.progress=false", "sample.num=4", "sample.steps=3", "eval.num_samples=0", "eval.bpd=false",
        "data.batch_size=8", "train.log_every=1", "train.threads=1"]
UNET = ["model.args.ch=8"]
DIT = ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2", "model.args.heads=2"]


def _losses(run):
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _same_weights(a, b):
    ba, bb = ModelBundle.load(a), ModelBundle.load(b)
    for (na, pa), (nb, pb) in zip(ba.net.state_dict().items(), bb.net.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    for sa, sb in zip(ba.ema.shadow, bb.ema.shadow):
        assert torch.equal(sa, sb)


def test_fsdp_resumes_across_world_sizes_and_commands_read_the_dcp_folder(tmp_path):
    run = tmp_path / "run"
    common = [f"run_dir={run}", "parallel.ac=full", "diffusion.sampler=stratified"] + BASE + UNET
    cli(["train", "train.steps=4"] + common)  # 2 ranks, FSDP2 (auto under torchrun)
    assert (run / "dcp" / ".metadata").is_file() and not (run / "last.pt").exists()
    plain = ckpt.read_dcp_extra(run / "dcp")
    assert plain["train"]["step"] == 4 and plain["world_size"] == 2 and len(plain["ranks"]) == 2
    # the bundle alone (no process group) generates from the sharded checkpoint
    assert main(["sample", "--ckpt", str(run), "--n", "4", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    # 2 → 1: one process resumes the sharded checkpoint and writes last.pt
    assert main(["train", "train.steps=6", "--resume"] + common) == 0
    assert ckpt.latest(run) == run / "last.pt" and torch.load(run / "last.pt", weights_only=True)["train"]["step"] == 6
    # 1 → 2: two ranks resume last.pt
    cli(["train", "train.steps=8", "--resume"] + common)
    assert ckpt.read_dcp_extra(run / "dcp")["train"]["step"] == 8
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))  # one series across the three launches
    assert main(["report", str(run)]) == 0


@pytest.mark.parametrize("strategy,model", [("fsdp", UNET), ("ddp", DIT + ["diffusion.learned_weighting=true"])])
def test_two_rank_resume_continues_exactly(tmp_path, strategy, model):
    """Stopped after 5 steps (between two statistics syncs) and resumed on two ranks: the same
    losses, weights, EMA and statistics as the run that never stopped."""
    common = [f"parallel.strategy={strategy}", "diffusion.sampler=loss_second_moment", "diffusion.stats_every=3",
              "diffusion.sampler_args.history=2", "train.ckpt_every=0"] + BASE + model
    cli(["train", f"run_dir={tmp_path / 'a'}", "train.steps=10"] + common)
    cli(["train", f"run_dir={tmp_path / 'b'}", "train.steps=5"] + common)
    cli(["train", f"run_dir={tmp_path / 'b'}", "train.steps=10", "--resume"] + common)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b") and len(_losses(tmp_path / "a")) == 10
    _same_weights(tmp_path / "a", tmp_path / "b")
    sa, sb = (ckpt.read_dcp_extra(tmp_path / r / "dcp") for r in "ab")
    for k in ("count", "ring", "ring_count"):
        assert torch.equal(sa["objective"]["_extra_state"]["stats"][k], sb["objective"]["_extra_state"]["stats"][k]), k
    for ra, rb in zip(sa["ranks"], sb["ranks"]):  # each rank's own pending window
        assert torch.equal(ra["objective"]["window"]["bins"], rb["objective"]["window"]["bins"])
    windows = [r["objective"]["window"]["bins"] for r in sa["ranks"]]
    assert not torch.equal(windows[0], windows[1])  # ranks saw different timesteps: kept apart


@pytest.mark.slow
def test_compiled_dit_with_selective_ac_and_bf16_trains(tmp_path):
    run = tmp_path / "run"
    cli(["train", f"run_dir={run}", "train.steps=3", "parallel.compile=blocks", "parallel.ac=selective",
         "parallel.precision=bf16"] + BASE + DIT, timeout=900)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and all(l == l for l in _losses(run))


def test_ddp_with_bf16_autocast_trains_and_saves_fp32(tmp_path):
    run = tmp_path / "run"
    cli(["train", f"run_dir={run}", "train.steps=4", "parallel.strategy=ddp", "parallel.precision=bf16"] + BASE + DIT)
    assert all(l == l for l in _losses(run)) and len(_losses(run)) == 4
    b = ModelBundle.load(run)
    assert all(p.dtype == torch.float32 for p in b.net.parameters())
    assert all(s.dtype == torch.float32 for s in b.ema.shadow)
