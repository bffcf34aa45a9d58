"""Class 5: shards and buckets. A shard index that is cut off or names a missing shard, a shard changed
since its index (an emptied tar), samples without an image (a whole pass without one usable sample once
looped forever): one line; buckets with 1×1 images, a batch larger than every bucket: one line; aspect
ratios far beyond the most extreme bucket: trained cropped, counted and named; a single image, images
larger than the largest bucket: trained (scaled into their bucket)."""
import io
import json
import shutil
import tarfile

import numpy as np
import pytest
from common import TINY, files, one_line
from folder_fixtures import write_images
from PIL import Image

from fasttrain.cli import main

pytest.importorskip("webdataset")
SHARDS = TINY + ["data.name=shards", "data.image_size=8", "data.batch_size=2", "train.steps=1"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    write_images(root / "imgs", n_per_class=2, size=(10, 10))
    assert main(["data", "prepare", str(root / "imgs"), "--shards", str(root / "sh"), "--shard-size", "2"]) == 0
    return root / "sh"


def _strip_images(tar):
    with tarfile.open(tar) as t:
        kept = [(m, t.extractfile(m).read()) for m in t.getmembers() if m.name.endswith(".cls")]
    with tarfile.open(tar, "w") as t:
        for m, b in kept:
            t.addfile(m, io.BytesIO(b))


@pytest.mark.parametrize("how,needle", [
    ("cut-off index", "fasttrain-shards.json is not valid JSON"),
    ("index of another format", "is not a shard index"),
    ("missing shard", "is listed in"),
    ("emptied shard", "has 0 bytes, its index says"),
    ("samples without images", "holds no usable sample"),
])
def test_broken_shard_sets_are_one_line_before_any_step(shards, tmp_path, capsys, how, needle):
    d = tmp_path / "sh"
    shutil.copytree(shards, d)
    tars = sorted(d.glob("*.tar"))
    index = d / "fasttrain-shards.json"
    if how == "cut-off index":
        index.write_text(index.read_text()[:40])
    elif how == "index of another format":
        index.write_text(json.dumps({"shards": ["shard-000000.tar"], "count": 4, "classes": []}))
    elif how == "missing shard":
        tars[0].unlink()
    elif how == "emptied shard":
        tars[0].write_bytes(b"")
    else:
        for t in tars:
            _strip_images(t)
        meta = json.loads(index.read_text())  # the index rewritten to match: only the samples are bad
        for s in meta["shards"]:
            s["bytes"] = (d / s["name"]).stat().st_size
        index.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["train", f"run_dir={tmp_path / 'run'}", f"data.root={d}"] + SHARDS) == 1
    one_line(capsys, needle, str(d), notes=True)
    assert not (tmp_path / "run" / "last.pt").exists()


def _images(root, sizes):
    root.mkdir()
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(np.full((h, w, 3), 8 * i + 3, np.uint8)).save(root / f"{i}.png")
    return root


BUCKETS = TINY + ["data.name=folder", "data.image_size=16", "data.buckets=true", "data.min_bucket_reso=8",
                  "data.max_bucket_reso=32", "data.bucket_reso_steps=8", "data.backend=torch", "train.steps=1"]


def test_hostile_bucket_folders(tmp_path, capsys):
    def run(name, sizes, batch):
        return main(["train", f"run_dir={tmp_path / ('r-' + name)}", f"data.batch_size={batch}",
                     f"data.root={_images(tmp_path / name, sizes)}"] + BUCKETS)

    assert run("dots", [(1, 1)] * 4, 2) == 1
    one_line(capsys, "every image is smaller than every bucket (data.min_bucket_reso 8)", notes=True)
    assert run("few", [(32, 16)] * 2 + [(16, 32)] * 3, 4) == 1
    one_line(capsys, "data.batch_size 4 leaves", "no batch per rank", notes=True)
    assert files(tmp_path / "r-dots") in ([], [".lock"]) and not (tmp_path / "r-few" / "last.pt").exists()
    # far beyond the widest bucket (4:1 here): trained, cropped to it, counted and named once
    assert run("strips", [(200, 2)] * 3 + [(16, 16)] * 3, 2) == 0
    err = capsys.readouterr().err
    assert ("3 image(s) have an aspect ratio more than twice the most extreme bucket's and are centre-cropped "
            "to it") in err and "0.png (200×2: 4% of it kept)" in err, err
    assert run("single", [(16, 16)], 1) == 0 and run("large", [(400, 300)] * 4, 2) == 0
    assert "buckets: 16×16: 1" in capsys.readouterr().err
