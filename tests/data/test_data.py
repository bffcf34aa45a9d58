import numpy as np
import pytest
import torch
from PIL import Image

from fasttrain.config import DataConfig
from fasttrain.data import build_data, digits, toy


def test_digits_splits():
    x, y = digits(8, "train")
    xt, yt = digits(8, "test")
    assert x.shape == (1397, 1, 8, 8) and xt.shape == (400, 1, 8, 8)
    assert x.min() >= -1 and x.max() <= 1 and x.std() > 0.3
    assert set(y.tolist()) == set(range(10)) and y.dtype == torch.long
    allx = digits(8, "all")[0]
    assert len(allx) == 1797
    x16, _ = digits(16, "train")
    assert x16.shape == (1397, 1, 16, 16)


@pytest.mark.parametrize("name", ["moons", "8gaussians", "checkerboard"])
def test_toys(name):
    x = toy(name, n=5000)
    assert x.shape == (5000, 2) and torch.isfinite(x).all()
    assert 0.3 < x.std(0).min() and x.std(0).max() < 2.0


def test_stream_is_resumable_and_covers_each_epoch():
    s, info = build_data(DataConfig(name="digits", batch_size=100), seed=3)
    assert (info.channels, info.image_size, info.num_classes, info.size) == (1, 8, 10, 1397)
    first = [next(s) for _ in range(5)]
    state = s.state_dict()
    cont = [next(s) for _ in range(20)]
    s2, _ = build_data(DataConfig(name="digits", batch_size=100), seed=3)
    s2.load_state_dict(state)
    for (a, ya), (b, yb) in zip(cont, [next(s2) for _ in range(20)]):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    # epoch 0 is a permutation: its first 1300 samples are distinct images
    seen = torch.cat([b[0] for b in first + cont])[:1300].flatten(1)
    assert torch.unique(seen, dim=0).shape[0] >= 1290  # (a few digits in the set are exact duplicates)


def _write_folder(root, with_classes=True):
    rng = np.random.default_rng(0)
    for c in (["cats", "dogs"] if with_classes else [""]):
        d = root / c
        d.mkdir(parents=True, exist_ok=True)
        for i in range(3):
            arr = rng.integers(0, 256, (20, 27, 3), dtype=np.uint8)
            Image.fromarray(arr).save(d / f"{i}.{'png' if i % 2 else 'jpg'}")


def test_image_folder(tmp_path):
    _write_folder(tmp_path)
    s, info = build_data(DataConfig(name="folder", batch_size=4, root=str(tmp_path), image_size=16, backend="torch"))
    assert info.num_classes == 2 and info.size == 6 and info.channels == 3
    x, y = next(s)
    assert x.shape == (4, 3, 16, 16) and x.min() >= -1 and x.max() <= 1
    assert set(y.tolist()) <= {0, 1}


def test_flat_folder_and_errors(tmp_path):
    _write_folder(tmp_path, with_classes=False)
    s, info = build_data(DataConfig(name="folder", batch_size=2, root=str(tmp_path), image_size=8, channels=1,
                                    backend="torch"))
    x, y = next(s)
    assert x.shape == (2, 1, 8, 8) and info.num_classes == 0 and (y == 0).all()
    with pytest.raises(ValueError, match="is not a directory"):
        build_data(DataConfig(name="folder", batch_size=2, root=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        build_data(DataConfig(name="folder", batch_size=2, root=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="data.backend=dali reads image or latent folders"):
        build_data(DataConfig(name="digits", batch_size=2, backend="dali"))
    with pytest.raises(ValueError, match="larger than the data set"):
        build_data(DataConfig(name="digits", batch_size=5000))
    with pytest.raises(ValueError, match="unknown data set 'mnist'"):
        build_data(DataConfig(name="mnist", batch_size=2))


def test_falls_back_to_the_dataloader_without_dali(tmp_path, monkeypatch):
    from fasttrain.cli import main
    from fasttrain.data import dali

    _write_folder(tmp_path / "f")
    monkeypatch.setattr(dali, "available", lambda: False)
    s, _ = build_data(DataConfig(name="folder", batch_size=2, root=str(tmp_path / "f"), image_size=8, backend="auto"))
    assert not isinstance(s, dali.DaliStream) and next(s)[0].shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="DALI is not installed"):
        build_data(DataConfig(name="folder", batch_size=2, root=str(tmp_path / "f"), image_size=8, backend="dali"))
    assert main(["train", "data.name=folder", f"data.root={tmp_path / 'f'}", "data.backend=dali",
                 f"run_dir={tmp_path / 'run'}", "train.progress=false"]) == 1


def test_folder_augmentations_are_seeded_and_resumable_on_the_dataloader(tmp_path):
    """The torch backend draws flips and crop positions from the same table as DALI
    (order.augment_table): a resumed stream repeats them, and each sample is mirrored exactly when
    its draw says so."""
    from fasttrain.data.order import augment_table, epoch_order

    _write_folder(tmp_path)
    kw = dict(name="folder", batch_size=2, root=str(tmp_path), image_size=16, backend="torch")
    s, _ = build_data(DataConfig(flip=True, crop="random", **kw), seed=5)
    first = [next(s) for _ in range(2)]
    state = s.state_dict()
    cont = [next(s) for _ in range(7)]  # past the end of epoch 0 (3 batches of 2)
    s2, _ = build_data(DataConfig(flip=True, crop="random", **kw), seed=5)
    s2.load_state_dict(state)
    for (a, ya), (b, yb) in zip(cont, [next(s2) for _ in range(7)]):
        assert torch.equal(a, b) and torch.equal(ya, yb)
    centre, _ = build_data(DataConfig(flip=True, crop="center", **kw), seed=5)
    assert any(not torch.equal(a, next(centre)[0]) for a, _ in first + cont)  # the random crops do move

    flipped, _ = build_data(DataConfig(flip=True, crop="center", **kw), seed=5)
    plain, _ = build_data(DataConfig(flip=False, crop="center", **kw), seed=5)
    mirror = torch.cat([augment_table(6, 5, e, 0, True, False)[:, 0] for e in range(2)])
    assert 0 < mirror.sum() < len(mirror) and len(epoch_order(6, 5, 0)) == 6
    xs = torch.cat([next(flipped)[0] for _ in range(6)])
    ys = torch.cat([next(plain)[0] for _ in range(6)])
    for k in range(12):
        assert torch.equal(xs[k], ys[k].flip(-1) if mirror[k] else ys[k]), k
