"""Reference statistics read a chunk at a time (data/reference.py `ReferenceImages`,
feature_stats.py `ReferenceStats.from_images`): equal to the whole-in-memory statistics, and no chunk the
extractor sees is larger than --chunk (the reference is never materialised at once)."""
import json

import numpy as np
import pytest
import test_generation
import torch
from PIL import Image

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.data import data_kind
from fasttrain.generation.feature_stats import Extractor, ReferenceStats, metrics
from fasttrain.generation.ranks import to_uint8

run = test_generation.run  # the fixture: a tiny digits run trained once per module (test_generation.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    rng = np.random.default_rng(0)
    for i in range(11):  # 10×10 RGB: resized and made grey like the training data
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(root / f"{i:03d}.png")
    return root


class Counting:
    """A real extractor that records the size of every batch it is given."""

    def __init__(self, ex):
        self.ex, self.sizes = ex, []
        self.name, self.layers = ex.name, ex.layers

    def __call__(self, u):
        self.sizes.append(len(u))
        return self.ex(u)


def test_chunked_reference_statistics_equal_the_whole_set(run, folder):
    b = ModelBundle.load(run)
    kind = data_kind(b.spec.name)
    whole = kind.reference(b.cfg, b.spec, str(folder), 10).train  # the whole-in-memory path: 10 of 11
    ex = Extractor("fasttrain-digits", device="cpu")
    ref = ReferenceStats.from_features(ex(to_uint8(whole)), ex, str(folder))
    counting = Counting(ex)
    images = kind.reference_images(b.cfg, b.spec, str(folder), 10)
    chunked = ReferenceStats.from_images(images, counting, 4)
    assert counting.sizes == [4, 4, 2]  # never more than a chunk at once, every image once
    np.testing.assert_allclose(chunked.mu, ref.mu, rtol=1e-5, atol=1e-6)  # float32 features: batch-size rounding
    np.testing.assert_allclose(chunked.sigma, ref.sigma, rtol=1e-5, atol=1e-6)  # float32 features: batch-size rounding
    gen = ex(to_uint8(torch.rand(12, 1, 8, 8) * 2 - 1))
    a, c = metrics(gen, ref, ex), metrics(gen, chunked, ex)
    assert a["fid"] > 0 and c["fid"] == pytest.approx(a["fid"], rel=1e-5)
    assert c["kid"] == pytest.approx(a["kid"], rel=1e-5, abs=1e-9)
    # the reader yields at most a chunk of images at a time
    assert [len(x) for x in kind.reference_images(b.cfg, b.spec, str(folder), 100).chunks(5)] == [5, 5, 1]


def test_eval_reads_the_reference_folder_a_chunk_at_a_time(run, folder, tmp_path, monkeypatch):
    b = ModelBundle.load(run)
    sizes = []
    call = Extractor.__call__

    def counted(self, u):
        sizes.append(len(u))
        return call(self, u)

    monkeypatch.setattr(Extractor, "__call__", counted)
    stats = tmp_path / "ref.npz"
    assert main(["eval", "--ckpt", str(run), "--n", "6", "--steps", "2", "--no-bpd", "--chunk", "3", "--ref",
                 str(folder), "--ref-n", "10", "--ref-stats", str(stats), "--out", str(tmp_path / "e.json")]) == 0
    assert max(sizes) == 3 and sum(sizes) == 10 + 6  # the reference's 10 images and the 6 samples, by 3
    whole = data_kind(b.spec.name).reference(b.cfg, b.spec, str(folder), 10).train
    ex = Extractor("fasttrain-digits", device="cpu")
    ref = ReferenceStats.from_features(ex(to_uint8(whole)), ex, str(folder))
    with np.load(stats) as z:
        np.testing.assert_allclose(z["mu"], ref.mu, rtol=1e-5, atol=1e-6)  # float32 features: batch-size rounding
        np.testing.assert_allclose(z["sigma"], ref.sigma, rtol=1e-5, atol=1e-6)  # float32 features: batch-size rounding
    assert json.loads((tmp_path / "e.json").read_text())["fid"] > 0


def test_an_empty_reference_folder_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    base = ["eval", "--ckpt", str(run), "--n", "4", "--steps", "2", "--no-bpd", "--ref-stats", str(tmp_path / "r.npz")]
    capsys.readouterr()
    assert main(base + ["--ref", str(empty)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no" in err and str(empty) in err
    assert not (tmp_path / "r.npz").exists()


def test_shards_reference_streams_the_same_images(tmp_path):
    """The run's own data when it is WebDataset shards: decoded a chunk at a time, the same images in the
    same order as the whole reference (the first n decodable samples, centre-cropped)."""
    pytest.importorskip("webdataset")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    from folder_fixtures import write_images

    images, shards, run = tmp_path / "images", tmp_path / "shards", tmp_path / "run"
    write_images(images, n_per_class=6)
    assert main(["data", "prepare", str(images), "--shards", str(shards), "--shard-size", "5"]) == 0
    assert main(["train", f"run_dir={run}", "data.name=shards", f"data.root={shards}", "data.image_size=8",
                 "data.batch_size=4", "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1",
                 "model.args.heads=2", "train.steps=1", "train.progress=false", "sample.num=0",
                 "eval.num_samples=0", "eval.bpd=false", "train.threads=1"]) == 0
    b = ModelBundle.load(run)
    kind = data_kind(b.spec.name)
    whole = kind.reference(b.cfg, b.spec, None, 9).train
    parts = list(kind.reference_images(b.cfg, b.spec, None, 9).chunks(4))
    assert [len(x) for x in parts] == [4, 4, 1] and torch.equal(torch.cat(parts), whole)
