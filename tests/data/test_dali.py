"""DALI CPU pipelines against PIL and numpy, sharding, seeding, last-batch policies, corrupt files."""
import json

import numpy as np
import pytest
import torch
from folder_fixtures import write_images
from PIL import Image

from fasttrain.config import DataConfig
from fasttrain.data import build_data, dali
from fasttrain.data.manifest import MANIFEST, prepare

pytestmark = pytest.mark.skipif(not dali.available(), reason="NVIDIA DALI is part of the dev extra")


def _ids(x):
    """Recover the file index from the flat grey level of channel 0 (10·i + 5, in [-1, 1])."""
    level = (x[:, 0].mean(dim=(1, 2)) + 1) * 127.5
    return ((level - 5) / 10).round().long().tolist()


def test_image_pipeline_shapes_values_labels(image_folder):
    s, info = build_data(DataConfig(name="folder", batch_size=4, root=str(image_folder), image_size=16,
                                    backend="dali", flip=False))
    assert isinstance(s, dali.DaliStream) and info.num_classes == 2 and info.size == 12
    x, y = next(s)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and -1 <= x.min() and x.max() <= 1
    for i, label in zip(_ids(x), y.tolist()):
        assert label == (0 if i < 6 else 1)


def test_decoded_pixels_match_pil(tmp_path):
    """No resize or flip (image_size = the shorter side, square images): DALI's decode equals PIL's
    within 1/255 for PNG and 3/255 for JPEG (both use libjpeg-turbo-class IDCTs, which may round apart)."""
    rng = np.random.default_rng(1)
    root = tmp_path / "px"
    (root / "a").mkdir(parents=True)
    smooth = (np.add.outer(np.arange(24), np.arange(24)) * 5 % 256).astype(np.uint8)
    arr = np.stack([smooth, smooth.T, 255 - smooth], -1)
    arr = np.clip(arr.astype(int) + rng.integers(-3, 4, arr.shape), 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(root / "a" / "0.png")
    Image.fromarray(arr).save(root / "a" / "1.jpg", quality=90)
    s, _ = build_data(DataConfig(name="folder", batch_size=1, root=str(root), image_size=24, backend="dali",
                                 flip=False))
    got = {}
    for _ in range(2):
        x, _ = next(s)
        got[len(got)] = x[0]
    files = [f for f, _ in s.epoch_files(0)]
    for k, f in enumerate(files):
        ref = torch.from_numpy(np.array(Image.open(root / f).convert("RGB"))).permute(2, 0, 1).float() / 127.5 - 1
        tol = (1 if f.endswith(".png") else 3) / 127.5
        assert (got[k] - ref).abs().max().item() <= tol + 1e-6, f


def test_shards_partition_each_epoch_and_seed_fixes_order(image_folder):
    def epoch_ids(rank, world, seed, epoch=0):
        s, _ = build_data(DataConfig(name="folder", batch_size=2, root=str(image_folder), image_size=8,
                                     backend="dali", flip=False), seed=seed, rank=rank, world_size=world)
        s.load_state_dict({"epoch": epoch, "pos": 0})
        return [i for x, _ in s.epoch_batches() for i in _ids(x)]

    shards = [epoch_ids(r, 3, seed=5) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(12))  # 3 ranks × 4: disjoint and complete
    assert epoch_ids(1, 3, seed=5) == shards[1]  # same seed, same order
    assert epoch_ids(1, 3, seed=6) != shards[1] or epoch_ids(1, 3, seed=5, epoch=1) != shards[1]
    assert sorted(epoch_ids(0, 1, seed=5, epoch=1)) == list(range(12))


@pytest.mark.parametrize("policy,sizes", [("drop", [5, 5]), ("partial", [5, 5, 2]), ("pad", [5, 5, 5])])
def test_last_batch_policies(image_folder, policy, sizes):
    files = [(f"{c}/{k:03d}.{'png' if k % 2 else 'jpg'}", j) for j, c in enumerate(("cat", "dog")) for k in range(6)]
    s = dali.DaliStream("images", str(image_folder), files, 5, image_size=8, flip=False, last_batch=policy)
    assert [x.shape[0] for x, _ in s.epoch_batches()] == sizes
    assert s.epoch == 1


def test_resume_mid_epoch_continues_the_same_batches(image_folder):
    a, _ = build_data(DataConfig(name="folder", batch_size=3, root=str(image_folder), image_size=8, backend="dali"),
                                 seed=2)
    first = [next(a) for _ in range(2)]
    state = a.state_dict()
    rest = [next(a) for _ in range(4)]
    b, _ = build_data(DataConfig(name="folder", batch_size=3, root=str(image_folder), image_size=8, backend="dali"),
                                 seed=2)
    b.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(rest, [next(b) for _ in range(4)]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert state == {"epoch": 0, "pos": 6, "world_size": 1} and len(first) == 2


def test_latent_pipeline_is_exact(latent_folder):
    s, info = build_data(DataConfig(name="latents", batch_size=4, root=str(latent_folder), backend="dali"), seed=1)
    assert (info.channels, info.image_size, info.num_classes, info.size) == (4, 6, 3, 15)
    files = s.epoch_files(0)
    x, y = next(s)
    assert x.shape == (4, 4, 6, 6)
    for k in range(4):
        np.testing.assert_array_equal(x[k].numpy(), np.load(latent_folder / files[k][0]))
        assert y[k].item() == files[k][1] == int(x[k, 0, 0, 0].item()) // 5


def test_dali_and_torch_give_the_same_batch_format(latent_folder, image_folder):
    for name, root in (("latents", latent_folder), ("folder", image_folder)):
        outs = []
        for backend in ("dali", "torch"):
            s, info = build_data(DataConfig(name=name, batch_size=4, root=str(root), image_size=8, backend=backend,
                                            flip=False), seed=3)
            outs.append(next(s))
        (xd, yd), (xt, yt) = outs
        assert xd.shape == xt.shape and xd.dtype == xt.dtype and yd.dtype == yt.dtype == torch.long
        assert torch.equal(yd, yt)  # the same seeded order on both backends
        if name == "latents":
            assert torch.equal(xd, xt)


def test_corrupt_file_is_skipped_and_reported(tmp_path, capsys):
    root = tmp_path / "c"
    write_images(root, n_per_class=3, corrupt=1)
    res = prepare(root)
    assert res["num_files"] == 6 and [b[0] for b in res["bad"]] == ["cat/broken0.jpg"]
    m = json.loads((root / MANIFEST).read_text())
    assert m["counts"] == {"0": 3, "1": 3} and m["classes"] == ["cat", "dog"] and m["sizes"] == {"[28, 20]": 6}
    s, info = build_data(DataConfig(name="folder", batch_size=2, root=str(root), image_size=8, backend="dali"))
    assert info.size == 6
    for _ in range(6):  # two full epochs without touching the broken file
        next(s)
    assert "skipping 1 unreadable file(s): cat/broken0.jpg" in capsys.readouterr().err
