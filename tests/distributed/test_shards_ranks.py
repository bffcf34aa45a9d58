"""WebDataset shards on two gloo ranks (torchrun): the ranks split the global order that one process
reads, and a position saved on two ranks continues on one (and one's on two) exactly; a training run
on shards resumes on another rank count from its checkpoint."""
import json
import sys
from pathlib import Path

import pytest
import torch
from torchrun_launch import HERE, cli, torchrun

from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
from folder_fixtures import write_images

pytest.importorskip("webdataset")


def _ids(s, batches):
    out = []
    for _ in range(batches):
        x, _ = next(s)
        out += [int(round(((v + 1) * 127.5 - 5) / 10)) for v in x[:, 0].mean((1, 2)).tolist()]
    return out


def _stream(root):
    return build_data(DataConfig(name="shards", batch_size=2, root=str(root), image_size=8, flip=False,
                                 shuffle_buffer=4), seed=5)[0]


def test_shard_streams_resume_across_rank_counts(tmp_path):
    images, shards = tmp_path / "images", tmp_path / "shards"
    write_images(images, n_per_class=6)
    assert main(["data", "prepare", str(images), "--shards", str(shards), "--shard-size", "5"]) == 0
    whole = _ids(_stream(shards), 12)  # one process, two epochs of 12
    # two ranks, 2 batches each: rank r holds the global samples r, r + 2, ...
    torchrun([str(HERE / "shards_worker.py"), str(shards), str(tmp_path / "a.json"), "2"])
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["ids"] == [[whole[r + 2 * j] for j in range(4)] for r in range(2)]
    # ... saved, then one process continues the global order where the two stopped (8 samples in)
    one = _stream(shards)
    one.load_state_dict(a["state"])
    assert _ids(one, 5) == whole[8:18]
    # one process stopped after 6 samples; two ranks continue its order
    one = _stream(shards)
    _ids(one, 3)
    (tmp_path / "one.json").write_text(json.dumps(one.state_dict()))
    torchrun([str(HERE / "shards_worker.py"), str(shards), str(tmp_path / "b.json"), "3", str(tmp_path / "one.json")])
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["ids"] == [[whole[6 + r + 2 * j] for j in range(6)] for r in range(2)]
    # the trainer: 2 ranks train 2 steps on the shards, one process resumes their checkpoint
    run = tmp_path / "run"
    common = [f"run_dir={run}", "data.name=shards", f"data.root={shards}", "data.image_size=8", "data.batch_size=2",
              "data.shuffle_buffer=4", "data.flip=false", "model.args.ch=8", "train.progress=false", "sample.num=0",
              "eval.num_samples=0", "eval.bpd=false", "train.threads=1", "train.seed=5"]
    cli(["train", "train.steps=2"] + common)
    assert main(["train", "train.steps=3", "--resume"] + common) == 0
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    # 2 steps × 2 ranks × 2 = 8 global samples, then 1 step × 2 on one rank: slot 10 of epoch 0
    assert (state["epoch"], state["pos"], state["world_size"]) == (0, 10, 1)
