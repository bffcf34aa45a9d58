"""Aspect-ratio buckets (data/buckets.py): sd-scripts' resolutions and selection, one bucket per batch,
the recorded table, a batch order that ranks split alike and that resumes exactly, too-small images left
out in one line, and training (UNet and DiT) on buckets that resumes exactly."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.cli import main
from fasttrain.data import build_data
from fasttrain.data.buckets import TABLE, epoch_batches, resolutions, select
from fasttrain.logger import read_jsonl

SIZES = [(32, 16), (16, 32), (24, 24), (40, 20), (20, 40), (30, 10), (10, 30), (24, 24), (6, 5), (48, 16), (16, 48),
         (36, 36)]
BUCKETS = ["data.name=folder", "data.image_size=16", "data.buckets=true", "data.min_bucket_reso=8",
           "data.max_bucket_reso=32", "data.bucket_reso_steps=8", "data.backend=torch"]


@pytest.fixture
def folder(tmp_path):
    """24 images of 11 aspect ratios (two 6×5 ones smaller than every bucket); image i's mean level is 8·i."""
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(SIZES * 2):
        d = tmp_path / "imgs" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        a = np.full((h, w, 3), 8 * i, np.uint8) + (rng.random((h, w, 3)) * 4).astype(np.uint8)
        Image.fromarray(a).save(d / f"{i:03d}.png")
    return tmp_path / "imgs"


def test_resolutions_and_selection_follow_sd_scripts():
    # base 512, 256..1024 step 64: the 17 buckets sd-scripts lists for SD 1.x fine-tuning at 512
    r = resolutions(512, 256, 1024, 64)
    assert r == [(256, 832), (256, 896), (256, 960), (256, 1024), (320, 704), (320, 768), (384, 640), (448, 576),
                 (512, 512), (576, 448), (640, 384), (704, 320), (768, 320), (832, 256), (896, 256), (960, 256),
                 (1024, 256)]
    assert all(w % 64 == 0 and h % 64 == 0 and w * h <= 512 * 512 for w, h in r)
    assert r == sorted(r) and len(set(r)) == len(r)
    # nearest aspect ratio, scaled to cover the bucket (int(x + 0.5)), the image's own size kept when a bucket
    assert select(1000, 600, r) == ((640, 384), (640, 384))
    assert select(600, 1000, r) == ((384, 640), (384, 640))
    assert select(512, 512, r) == ((512, 512), (512, 512))
    assert select(300, 200, r) == ((640, 384), (640, 427))  # 1.5 → 5:3, width fitted; upscaled (its default)
    assert select(1000, 300, r) == ((832, 256), (853, 256))  # wider than the bucket: height fitted
    (bw, bh), (w, h) = select(1000, 300, r)
    assert w >= bw and h >= bh and (w == bw or h == bh)


def _stream(root, world=1, rank=0, batch=2, **kw):
    return build_data("folder", batch_size=batch, root=str(root), image_size=16, backend="torch", seed=3, rank=rank,
                      world_size=world, buckets=True, min_bucket_reso=8, max_bucket_reso=32, bucket_reso_steps=8,
                      **kw)[0]


def test_batches_come_from_one_bucket_split_alike_on_any_rank_count_and_resume(folder, capsys):
    s = _stream(folder)
    err = capsys.readouterr().err
    assert "left out 2 image(s) smaller than every bucket" in err and "(6×5)" in err
    table = json.loads((folder / TABLE).read_text())
    assert len(table["items"]) == 22 and len(table["small"]) == 2
    for _, b, w, h in table["items"]:  # the recorded bucket and scaled size cover each other
        bw, bh = table["resolutions"][b]
        assert w >= bw and h >= bh and (w == bw or h == bh)
    whole = [next(s) for _ in range(12)]
    assert {tuple(x.shape[-2:]) for x, _ in whole} == {(16, 16), (8, 24), (24, 8)}  # [h, w] per bucket
    batches = epoch_batches(table, 2, 3, 0)
    rows = [r for b in batches for r in b]
    assert len(rows) == len(set(rows)) and all(len({table["items"][r][1] for r in b}) == 1 for b in batches)
    # two ranks: rank r's k-th batch is global batch r + 2k
    for r in range(2):
        part = _stream(folder, 2, r)
        for k in range(4):
            x, y = next(part)
            assert torch.equal(x, whole[r + 2 * k][0]) and torch.equal(y, whole[r + 2 * k][1])
    # resume: two ranks stopped after 3 batches each; one process continues at global batch 6
    part = _stream(folder, 2, 0)
    for _ in range(3):
        next(part)
    one = _stream(folder)
    one.load_state_dict(part.state_dict())
    for k in range(6, 12):  # across the epoch boundary (10 batches an epoch)
        x, _ = next(one)
        assert torch.equal(x, whole[k][0]), k


def test_bucketed_training_resumes_exactly_with_unet_and_runs_a_dit(folder, tmp_path):
    common = BUCKETS + [f"data.root={folder}", "data.batch_size=2", "train.progress=false",
                        "sample.num=2", "sample.steps=2", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
                        "train.log_every=1", "train.ckpt_every=0"]
    unet = common + ["model.args.ch=8"]
    assert main(["train", f"run_dir={tmp_path / 'a'}", "train.steps=6"] + unet) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=3"] + unet) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=6", "--resume"] + unet) == 0
    la = [r["loss"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert len(la) == 6 and la == lb
    dit = ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2"]
    assert main(["train", f"run_dir={tmp_path / 'd'}", "train.steps=4"] + common + dit) == 0


def test_buckets_refused_where_they_do_not_apply(tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'r'}", "data.buckets=true"]) == 2  # digits: built in
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.buckets" in err and "image folders" in err
    assert main(["train", f"run_dir={tmp_path / 'r'}", "data.root=/nonexistent"] + BUCKETS[:5]
                + ["data.bucket_reso_steps=0"]) == 2
    assert "data.bucket_reso_steps" in capsys.readouterr().err
