"""Packed latents (data/packed.py): `data prepare --pack` writes one memory-mapped array + index; the
`packed` kind gives the batches the per-file `latents` kind gives, in the same order, resumes exactly,
needs the per-file arrays no more, and refuses a stale or truncated pack in one line."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data.packed import INDEX, PACKED
from fasttrain.errors import DataError

sys.path.insert(0, str(Path(__file__).parent))
from folder_fixtures import write_images, write_latents


def _batches(stream, k):
    return [next(stream) for _ in range(k)]


@pytest.fixture
def packed(tmp_path):
    root = tmp_path / "lat"
    write_latents(root, n_per_class=5)  # 15 files, [4, 6, 6], element [0, 0, 0] = the file's index
    assert main(["data", "prepare", str(root), "--pack"]) == 0
    return root


def test_packed_batches_are_the_folder_batches_and_resume_exactly(packed):
    arr = np.load(packed / PACKED, mmap_mode="r")
    index = json.loads((packed / INDEX).read_text())
    assert arr.shape == (15, 4, 6, 6) and index["labels"] == [0] * 5 + [1] * 5 + [2] * 5
    assert sorted(arr[:, 0, 0, 0].tolist()) == list(range(15))
    at = dict(seed=3, rank=1, world_size=2)
    d = DataConfig(name="packed", batch_size=4, root=str(packed))
    files = _batches(build_data(DataConfig(name="latents", batch_size=4, root=str(packed), backend="torch"), **at)[0],
                     5)  # crosses an epoch (7 per rank)
    s, info = build_data(d, **at)
    got = _batches(s, 5)
    assert info.channels == 4 and info.image_size == 6 and info.num_classes == 3 and info.size == 15
    for (xa, ya), (xb, yb) in zip(files, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # resume: a new stream at the saved position continues with the same batches
    s2, _ = build_data(d, **at)
    _batches(s2, 2)
    state = s2.state_dict()
    s3, _ = build_data(d, **at)
    s3.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(got[2:], _batches(s3, 3)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_packed_training_needs_no_per_file_arrays_and_refuses_a_stale_pack(packed, tmp_path, capsys):
    for p in packed.rglob("*.npy"):
        if p.name != PACKED:
            p.unlink()  # only the packed file and the manifest are left
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "data.name=packed", f"data.root={packed}", "data.batch_size=4",
                 "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2",
                 "train.steps=2", "train.progress=false", "sample.num=0", "eval.num_samples=0",
                 "eval.bpd_samples=4", "eval.bpd_timesteps=2", "train.threads=1"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # the manifest lists other files than were packed: refused, naming the file and the fix
    m = json.loads((packed / "fasttrain-manifest.json").read_text())
    m["files"] = m["files"][:-1]
    (packed / "fasttrain-manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="packed from another file list.*--pack"):
        build_data(DataConfig(name="packed", batch_size=4, root=str(packed)))
    # a truncated pack (its index matching the manifest again) does not map
    from fasttrain.data.packed import _files_hash

    data = (packed / PACKED).read_bytes()
    (packed / PACKED).write_bytes(data[: len(data) // 2])
    index = json.loads((packed / INDEX).read_text())
    index["manifest_files_sha256"] = _files_hash(m["files"])
    (packed / INDEX).write_text(json.dumps(index))
    with pytest.raises(DataError, match=f"cannot map .*{PACKED}"):
        build_data(DataConfig(name="packed", batch_size=4, root=str(packed)))


def test_pack_refuses_an_image_folder_in_one_line(tmp_path, capsys):
    write_images(tmp_path / "img", n_per_class=2)
    assert main(["data", "prepare", str(tmp_path / "img"), "--pack"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fasttrain: error: --pack packs a folder of .npy latents") and "--vae" in err


def test_vae_latents_packed_train_with_their_record(tmp_path):
    pytest.importorskip("diffusers")
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from diffusers_fixtures import save_tiny_vae

    from fasttrain.bundle import ModelBundle

    images, vae, lat, run = tmp_path / "images", tmp_path / "vae", tmp_path / "latents", tmp_path / "run"
    write_images(images, n_per_class=4)
    save_tiny_vae(vae)
    assert main(["data", "prepare", str(images), "--vae", str(vae), "--latents-out", str(lat), "--image-size", "16",
                 "--batch-size", "8", "--pack"]) == 0
    assert np.load(lat / PACKED, mmap_mode="r").shape == (8, 8, 8, 8)  # [mean; std] of 4 channels
    assert main(["train", f"run_dir={run}", "data.name=packed", f"data.root={lat}", "data.batch_size=4",
                 "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2",
                 "train.steps=2", "train.progress=false", "sample.num=0", "eval.num_samples=0",
                 "eval.bpd_samples=4", "eval.bpd_timesteps=2", "train.threads=1"]) == 0
    spec = ModelBundle.load(run, device="cpu").spec
    assert spec.shape == (4, 8, 8) and spec.latents["norm"] == "vae" and spec.latents["posterior"]
