"""Aspect-ratio buckets on two gloo ranks (torchrun): ranks train on batches of different buckets in the
same step (FSDP2), and the run resumes on one process at the global batch where the two stopped."""
import numpy as np
import torch
from PIL import Image
from torchrun_launch import cli

from fasttrain.cli import main

SIZES = [(32, 16), (16, 32), (24, 24), (40, 20), (20, 40), (30, 10), (10, 30), (24, 24), (6, 5), (48, 16), (16, 48),
         (36, 36)]  # as tests/data/test_buckets.py: 10 batches of 2 an epoch in buckets 16×16, 24×8, 8×24
BUCKETS = ["data.name=folder", "data.image_size=16", "data.buckets=true", "data.min_bucket_reso=8",
           "data.max_bucket_reso=32", "data.bucket_reso_steps=8", "data.backend=torch"]


def test_bucketed_training_on_two_ranks_resumes_on_one(tmp_path):
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(SIZES * 2):
        d = tmp_path / "imgs" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(d / f"{i:03d}.png")
    run = tmp_path / "run"
    common = BUCKETS + [f"run_dir={run}", f"data.root={tmp_path / 'imgs'}", "data.batch_size=2", "model.args.ch=8",
                        "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false",
                        "train.threads=1"]
    cli(["train", "train.steps=2"] + common)  # 2 ranks: global batches 0..3 of epoch 0
    assert main(["train", "train.steps=3", "--resume"] + common) == 0
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    assert (state["epoch"], state["pos"], state["world_size"]) == (0, 5, 1)  # one more batch on one rank
