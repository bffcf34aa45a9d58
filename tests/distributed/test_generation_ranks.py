"""`sample` and `eval` under torchrun: the images split by index across two ranks are the images one
process makes, bit for bit, and so are the FID/KID computed from the gathered features; a set started on
two ranks finishes on one (generation/ranks.py)."""
import json

import numpy as np
from torchrun_launch import cli

from fasttrain.cli import main
from fasttrain.generation import ranks as gen


def _pngs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("[0-9]*.png"))}


def test_two_ranks_sample_and_evaluate_what_one_rank_does(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "model.args.ch=8", "train.steps=2", "train.progress=false",
                 "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1"]) == 0
    common = ["--ckpt", str(run), "--num-samples", "7", "--steps", "2", "--chunk", "2", "--seed", "3",
              "--solver", "ddpm"]
    assert main(["sample", *common, "--out", str(tmp_path / "one"), "--npz", str(tmp_path / "one.npz")]) == 0
    cli(["sample", *common, "--out", str(tmp_path / "two"), "--npz", str(tmp_path / "two.npz")])  # 7 images, 4 chunks
    one = _pngs(tmp_path / "one")
    assert len(one) == 7 and _pngs(tmp_path / "two") == one
    with np.load(tmp_path / "one.npz") as a, np.load(tmp_path / "two.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    # started on two ranks, killed (chunks 1 and 3 lost), finished by one process: the same set
    store = gen.ChunkStore(tmp_path / "two")
    for k in (1, 3):
        store.path(k).unlink()
    assert main(["sample", *common, "--out", str(tmp_path / "two")]) == 0
    assert _pngs(tmp_path / "two") == one
    # eval: the same features gathered from two ranks give the same numbers as one process
    ev = ["eval", "--ckpt", str(run), "--num-samples", "21", "--steps", "2", "--chunk", "4", "--no-bpd",
          "--ref-stats", str(tmp_path / "ref.npz")]
    assert main(ev + ["--samples", str(tmp_path / "e1"), "--out", str(tmp_path / "e1.json")]) == 0
    cli(ev + ["--samples", str(tmp_path / "e2"), "--out", str(tmp_path / "e2.json")])
    e1, e2 = (json.loads((tmp_path / f"e{i}.json").read_text()) for i in (1, 2))
    for key in ("fid", "kid", "precision", "recall", "digits_confidence"):
        assert e1[key] == e2[key], key
    assert e1["fid"] > 0
