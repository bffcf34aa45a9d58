"""FID sanity, the digits feature extractor, and the eval/sample/report commands on a tiny checkpoint."""
import json

import pytest
import torch

from fasttrain.cli import main
from fasttrain.data.builtin import digits
from fasttrain.generation.evaluate import fidelity
from fasttrain.generation.features import judge


def test_fid_is_zero_on_itself_and_large_when_shifted():
    x, _ = digits(8, "train")
    same = fidelity(x, x, "fasttrain-digits", prc=True)
    assert abs(same["fid"]) < 1e-3
    assert same["precision"] > 0.99 and same["recall"] > 0.99
    shifted = fidelity(torch.roll(x, 3, dims=3), x, "fasttrain-digits", prc=False)
    assert shifted["fid"] > 5
    # two halves of the same data (KID is unbiased, so near 0; the set has some exact duplicates)
    halves = fidelity(x[::2], x[1::2], "fasttrain-digits", prc=False)
    assert shifted["kid"] > 10 * abs(halves["kid"]) and halves["fid"] < shifted["fid"] / 5


def test_digit_classifier_recognises_held_out_digits():
    x, y = digits(8, "test")
    r = judge(x, y)
    assert r["label_agreement"] > 0.95 and r["classes_present"] == 10
    noise = torch.rand(200, 1, 8, 8) * 2 - 1
    assert judge(noise)["confidence"] < r["confidence"] - 0.2


def test_sample_eval_report_commands(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "model.args.ch=8", "train.steps=4", "sample.num=10", "sample.steps=5",
                 "train.progress=false", "eval.every=2", "eval.num_samples=50", "eval.steps=5",
                 "eval.bpd_samples=20", "eval.bpd_timesteps=5"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/fid" in r] == [2,
                                                            4] and all("eval/bpd" in r for r in rows if "eval/fid" in r)
    assert main(["sample", "--ckpt", str(run), "--n", "12", "--steps", "5", "--out", str(tmp_path / "s"),
                 "--solver", "heun", "--label", "3"]) == 0
    assert (tmp_path / "s" / "grid.png").is_file() and (tmp_path / "s" / "00011.png").is_file()
    assert main(["eval", "--ckpt", str(run), "--n", "30", "--steps", "5", "--no-bpd"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["step"] == 4 and ev["fid"] > 0 and "bpd" not in ev
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4
    assert "<th>fid</th>" in page and "<th>bpd_se</th>" in page
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "not a fasttrain run directory" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1


def test_sliced_w2_is_zero_on_itself_and_the_shift_on_a_translate():
    from fasttrain.generation.evaluate import sliced_w2

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 2, generator=g)
    assert sliced_w2(x, x) == 0.0
    # a translation by c along e1: every 1-D W2 is |c·θ1|, so SW2² = c²·E[θ1²] = c²/2 on the circle
    shifted = sliced_w2(x, x + torch.tensor([0.6, 0.0]), projections=4096)
    assert shifted == pytest.approx(0.6 / 2**0.5, rel=0.02)
    other = sliced_w2(x, torch.randn(4000, 2, generator=g))  # two samples of one law: small, not 0
    assert 0 < other < 0.1 * shifted


def test_sliced_w2_matches_the_column_sorted_definition_in_any_dimension():
    """The rows-sorted computation against the textbook one (projections as columns, each sorted)."""
    from fasttrain.generation.evaluate import sliced_w2

    g = torch.Generator().manual_seed(3)
    for d in (2, 5):
        x, y = torch.randn(301, d, generator=g), 1.5 * torch.rand(301, d, generator=g) + 0.2
        theta = torch.randn(64, d, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        theta = theta / theta.norm(dim=1, keepdim=True)
        px, py = (x.double() @ theta.T).sort(0).values, (y.double() @ theta.T).sort(0).values
        assert sliced_w2(x, y, projections=64, seed=11) == pytest.approx(float(((px - py) ** 2).mean().sqrt()),
                                                                        rel=1e-12)


def test_evaluation_at_the_start_and_the_eval_seed(tmp_path):
    """eval.at_start adds the initial network's evaluation and changes nothing else; eval.seed chooses the
    sampling noise of every evaluation (the convergence study gives each training seed its own)."""
    from fasttrain.configure import load_config
    from fasttrain.logger import read_jsonl
    from fasttrain.train import train

    def run(name, *over):
        cfg = load_config("default", [f"run_dir={tmp_path / name}", "data.name=checkerboard", "model.name=mlp",
                                      "model.args.hidden=32", "train.steps=10", "train.log_every=5", "eval.every=5",
                                      "eval.num_samples=300", "eval.steps=5", "eval.bpd=false", "sample.num=0",
                                      "train.progress=false", "train.plots=false", "train.threads=1", *over])
        train(cfg)
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        return ({r["step"]: r["eval/sw2"] for r in rows if "eval/sw2" in r},
                [r["loss"] for r in rows if r.get("loss") is not None])

    start, losses = run("start", "eval.at_start=true", "eval.seed=7")
    plain, plain_losses = run("plain", "eval.seed=7")
    other, _ = run("other", "eval.seed=8")
    assert sorted(start) == [0, 5, 10] and sorted(plain) == [5, 10]
    assert start[0] > start[10] > 0  # the untrained network is the farthest from the density
    assert losses == plain_losses and all(start[k] == plain[k] for k in plain)  # nothing else moved
    assert all(other[k] != plain[k] for k in plain)  # another sampling seed: other draws
