"""Aspect-ratio buckets (data/buckets.py): sd-scripts' resolutions and selection, one bucket per batch,
the recorded table, a batch order that ranks split alike and that resumes exactly, too-small images left
out in one line, training (UNet and DiT) on buckets that resumes exactly, and VAE latents cached per
bucket (data/bucket_latents.py)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.cli import main
from fasttrain.config import DataConfig
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
    d = DataConfig(name="folder", batch_size=batch, root=str(root), image_size=16, backend="torch", buckets=True,
                   min_bucket_reso=8, max_bucket_reso=32, bucket_reso_steps=8, **kw)
    s, info = build_data(d, seed=3, rank=rank, world_size=world)
    assert not info.fixed_shape  # declared: a CUDA graph keeps the eager step (parallel/graphs.py)
    return s


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


def test_vae_latents_cached_per_bucket_train_one_bucket_per_batch(folder, tmp_path, capsys):
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from diffusers_fixtures import save_tiny_vae

    from fasttrain.bundle import ModelBundle
    from fasttrain.data.bucket_latents import INDEX

    vae, lat = save_tiny_vae(tmp_path / "vae"), tmp_path / "lat"  # 16×16 images ↔ 4×8×8 latents (f = 2)
    assert main(["data", "prepare", str(folder), "--vae", str(vae), "--latents-out", str(lat), "--buckets",
                 "--image-size", "16", "--min-bucket-reso", "8", "--max-bucket-reso", "32", "--bucket-reso-steps", "8",
                 "--batch-size", "4"]) == 0
    index = json.loads((lat / INDEX).read_text())
    shapes = {tuple(b["reso"]): tuple(np.load(lat / b["file"], mmap_mode="r").shape) for b in index["buckets"]}
    assert shapes == {(16, 16): (10, 8, 8, 8), (24, 8): (4, 8, 4, 12), (8, 24): (8, 8, 12, 4)}  # [n, 2C, h/2, w/2]
    assert index["count"] == 22 and index["latents"]["posterior"] == "mean_std"
    assert any("smaller than every bucket" in why for _, why in index["latents"]["skipped_images"])
    s, info = build_data(DataConfig(name="bucket_latents", batch_size=2, root=str(lat)), seed=1)
    seen = {tuple(next(s)[0].shape[1:]) for _ in range(10)}
    assert seen == {(4, 8, 8), (4, 4, 12), (4, 12, 4)} and info.image_size == 8 and info.channels == 4
    assert not info.fixed_shape  # declared: a CUDA graph keeps the eager step (parallel/graphs.py)
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "data.name=bucket_latents", f"data.root={lat}", "data.batch_size=2",
                 "model.args.ch=8", "train.steps=3", "train.progress=false", "sample.num=2", "sample.steps=2",
                 "eval.num_samples=0", "eval.bpd=false", "train.threads=1"]) == 0
    spec = ModelBundle.load(run, device="cpu").spec
    assert spec.shape == (4, 8, 8) and spec.latents["norm"] == "vae" and spec.latents["posterior"]
    assert main(["sample", "--ckpt", str(run), "--n", "2", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    assert Image.open(tmp_path / "s" / "00001.png").size == (16, 16)  # decoded at the square base
    capsys.readouterr()
    assert main(["data", "prepare", str(folder), "--buckets"]) == 1
    assert "--buckets encodes VAE latents" in capsys.readouterr().err
