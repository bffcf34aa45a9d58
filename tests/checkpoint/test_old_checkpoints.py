"""Checkpoints written by an earlier fasttrain resume with today's code (tests/fixtures/main-0a93d06: made
by tests/fixtures/make_old_checkpoints.py with the code of commit 0a93d06, with what that code logged
when it resumed them itself)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from fasttrain.configure import load_config
from fasttrain.logger import read_jsonl
from fasttrain.train import train

FIXTURES = Path(__file__).parents[1] / "fixtures" / "main-0a93d06"


def _resume(name: str, run: Path) -> tuple[list[dict], list[dict]]:
    """(what the old code logged over steps 1..8, what today's code logs resuming its step-4 last.pt)."""
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    run.mkdir(parents=True)
    shutil.copy(FIXTURES / name / "last.pt", run / "last.pt")
    # configured as `fasttrain train --resume` configures it: what the checkpoint records (its conventions) taken
    cfg = load_config(expected["preset"], [f"run_dir={run}", "train.steps=8"] + expected["overrides"], resume=True)
    train(cfg, resume=True)
    return expected["logged"], [r for r in read_jsonl(run / "metrics.jsonl") if r.get("loss") is not None]


def test_an_old_unconditional_checkpoint_resumes_exactly_as_the_old_code_resumed_it(tmp_path):
    """Mixed prediction with the argmin head (the objective's state holds the head's choice), stratified
    timesteps, statistics synced every 2 steps: losses, gradient norms and per-bucket losses of steps
    5..8 equal those the old code logged to float32 rounding (CPU, one thread: bit for bit on the CPU kind
    that made the fixture, an AMD EPYC; an Intel Xeon's vector paths round a gradient norm differently in
    its 8th digit)."""
    old, new = _resume("moons-mixed", tmp_path / "run")
    assert [r["step"] for r in new] == [5, 6, 7, 8]
    for a, b in zip(old[4:], new):
        assert (b["loss"], b["grad_norm"]) == pytest.approx((a["loss"], a["grad_norm"]), rel=1e-5, abs=1e-7)
        assert b["loss_by_t_bucket"] == pytest.approx(a["loss_by_t_bucket"], rel=1e-5, abs=1e-7)
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert state["train"]["step"] == 8 and (state["model"]["output.choice"] >= 0).any()


def test_an_old_class_conditional_checkpoint_resumes_with_a_fresh_label_dropout_stream(tmp_path):
    """Its per-rank RNG state has no label-dropout generator (label dropout drew from the timestep
    generator then): the run resumes, derives that stream from the run seed, and continues
    deterministically; the timestep generator's saved state is restored as before."""
    _, a = _resume("digits-cond", tmp_path / "a")
    _, b = _resume("digits-cond", tmp_path / "b")
    assert [r["step"] for r in a] == [5, 6, 7, 8] and all(r["loss"] > 0 for r in a)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ranks = torch.load(tmp_path / "a" / "last.pt", weights_only=True)["ranks"][0]["rng"]
    assert "labels" in ranks  # saved from now on
