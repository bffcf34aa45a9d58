"""WebDataset shards (data/shards.py): `data prepare --shards`, the global order that any number of
ranks splits alike, exact resume across rank counts, a changed shard set refused, truncated shards and
corrupt members skipped, counted and named. The torchrun version: tests/distributed/test_shards_ranks.py."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data.shards import INDEX, ShardSet, ShardStream
from fasttrain.errors import DataError

sys.path.insert(0, str(Path(__file__).parent))
from folder_fixtures import write_images

pytest.importorskip("webdataset")


def ident(x: torch.Tensor) -> list[int]:
    """write_images' file i is a flat grey 10·i + 5 (channel 0): the sample's index back from its pixels."""
    return [int(round(((v + 1) * 127.5 - 5) / 10)) for v in x[:, 0].mean((1, 2)).tolist()]


def stream(root, world=1, rank=0, batch=2, buffer=4):
    s, _ = build_data(DataConfig(name="shards", batch_size=batch, root=str(root), image_size=8, flip=False,
                                 shuffle_buffer=buffer), seed=5, rank=rank, world_size=world)
    return s


def take(s, batches):
    out = []
    for _ in range(batches):
        x, _ = next(s)
        out += ident(x)
    return out


@pytest.fixture
def shards(tmp_path):
    images, out = tmp_path / "images", tmp_path / "shards"
    write_images(images, n_per_class=6, corrupt=1)  # 12 readable images, one corrupt file the manifest skips
    (images / "cat" / "000.txt").write_text("a grey cat")
    assert main(["data", "prepare", str(images), "--shards", str(out), "--shard-size", "5"]) == 0
    return out


def test_prepare_writes_shards_and_their_index(shards):
    index = json.loads((shards / INDEX).read_text())
    assert [s["count"] for s in index["shards"]] == [5, 5, 2] and index["count"] == 12
    assert index["classes"] == ["cat", "dog"]
    import webdataset as wds

    first = next(iter(wds.WebDataset(str(shards / "shard-000000.tar"), shardshuffle=False)))
    assert first["__key__"] == "00000000" and first["cls"] == b"0" and first["txt"] == b"a grey cat"


def test_the_global_order_is_split_alike_on_any_rank_count_and_resumes_exactly(shards):
    whole = take(stream(shards), 12)  # two epochs of 12 on one rank
    assert sorted(whole[:12]) == list(range(12)) and sorted(whole[12:]) == list(range(12))
    assert whole[:12] != list(range(12)) and whole[:12] != whole[12:]  # shuffled, anew each epoch
    two = [stream(shards, 2, r) for r in range(2)]
    parts = [take(s, 6) for s in two]  # each rank 6 per epoch: two epochs
    for r in range(2):
        assert parts[r] == [whole[e * 12 + r + 2 * j] for e in range(2) for j in range(6)]
    # 2 ranks → 1: rank 0's position after 2 batches (8 samples of the global order) continues on one rank
    two = [stream(shards, 2, r) for r in range(2)]
    for s in two:
        take(s, 2)
    one = stream(shards)
    one.load_state_dict(two[0].state_dict())
    assert take(one, 5) == whole[8:18]  # across the epoch boundary too
    # 1 → 2: after 3 batches (6 samples) each of two ranks continues with its share of the rest
    one = stream(shards)
    take(one, 3)
    state = one.state_dict()
    for r in range(2):
        s = stream(shards, 2, r)
        s.load_state_dict(state)
        assert take(s, 2) == [whole[6 + r + 2 * j] for j in range(4)]


def test_a_changed_shard_set_is_refused(shards, tmp_path):
    s = stream(shards)
    take(s, 1)
    state = s.state_dict()
    other = tmp_path / "other"
    assert main(["data", "prepare", str(tmp_path / "images"), "--shards", str(other), "--shard-size", "4"]) == 0
    with pytest.raises(DataError, match="not those the checkpoint read.*refusing to resume"):
        stream(other).load_state_dict(state)
    with open(shards / "shard-000001.tar", "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(DataError, match=r"shard-000001.tar has \d+ bytes, its index says"):
        stream(shards)


def _reindex(root):
    index = json.loads((root / INDEX).read_text())
    for s in index["shards"]:
        s["bytes"] = (root / s["name"]).stat().st_size
    (root / INDEX).write_text(json.dumps(index))


def test_truncated_shards_and_corrupt_members_are_skipped_counted_and_named(shards, capsys):
    data = (shards / "shard-000001.tar").read_bytes()
    (shards / "shard-000001.tar").write_bytes(data[: len(data) // 2])  # cut inside a member
    _reindex(shards)
    s = ShardStream(ShardSet(shards), 2, 5, 8, world_size=1, buffer=4, flip=False)
    got = [i for _ in range(3) for i in ident(next(s)[0])]
    assert len(got) == 6 and set(got) <= set(range(12))
    assert any("shard-000001.tar" in m for m in s.skipped)
    assert "fasttrain: shards: skipped shard-000001.tar" in capsys.readouterr().err
    # a member whose bytes are not an image: skipped by the rank that owns it, named with its key
    import webdataset as wds

    bad = shards / "shard-000002.tar"
    with open(bad, "wb") as f, wds.TarWriter(f) as w:
        w.write({"__key__": "00000010", "jpg": b"\xff\xd8 not a jpeg", "cls": "1"})
        w.write({"__key__": "00000011", "png": (shards.parent / "images" / "dog" / "005.png").read_bytes(),
                 "cls": "1"})
        w.write({"__key__": "00000012", "cls": "1"})  # no image at all
    _reindex(shards)
    s = ShardStream(ShardSet(shards), 1, 5, 8, world_size=1, buffer=4, flip=False)
    for _ in range(6):
        next(s)
    assert any("shard-000002.tar:00000010.jpg: cannot decode" in m for m in s.skipped)
    assert any("00000012: incomplete sample" in m for m in s.skipped)


def test_training_on_shards_with_its_reference(shards, tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "data.name=shards", f"data.root={shards}", "data.image_size=8",
                 "data.batch_size=4", "data.shuffle_buffer=8", "model.name=dit_tiny", "model.args.hidden=32",
                 "model.args.depth=1", "model.args.heads=2", "train.steps=2", "train.progress=false", "sample.num=0",
                 "eval.num_samples=0", "eval.bpd_samples=4", "eval.bpd_timesteps=2", "train.threads=1"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["eval"]["bpd"] > 0
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    assert state["pos"] == 8 and state["shards"] == ShardSet(shards).fingerprint
    assert np.isfinite(summary["eval"]["bpd"])
