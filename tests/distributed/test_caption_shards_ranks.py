"""Captioned latent shards (data/latent_shards.py) on two gloo ranks (torchrun): each rank reads only its
own samples' bytes (≈ 1/2 of an epoch each, none twice), with each batch's caption encodings arriving in
its device table; a position saved on two ranks continues the one-process global order on one (2 → 1)
and one's on two (1 → 2), by seeking; a text UNet trains on two ranks from the shards and a resume on
one rank continues where the two stopped."""
import json

import pytest
import torch
from text_fixtures import save_sd1, write_captioned
from text_runs import TRAIN
from torchrun_launch import HERE, cli, torchrun

from fasttrain import checkpoint as ckpt
from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data.latent_shards import write_synthetic
from fasttrain.data.shard_index import ShardIndex

pytest.importorskip("webdataset")


def _stream(root):
    return build_data(DataConfig(name="captioned_shards", batch_size=2, root=str(root), latent_norm="none",
                                 shuffle_buffer=4), seed=5)[0]


def _ids(s, batches):
    return [i for _ in range(batches) for i in next(s)[0][:, 0, 0, 0].round().long().tolist()]


def test_two_ranks_read_half_each_and_resume_on_one_and_back_by_seeking(tmp_path):
    root = tmp_path / "syn"
    write_synthetic(root, 16, captions=2, shard_size=5)
    index = ShardIndex(root)
    whole = _ids(_stream(root), 16)  # one process, two epochs of 16
    assert sorted(whole[:16]) == list(range(16)) and whole[:16] != whole[16:]
    worker = [str(HERE / "shards_worker.py"), "captioned_shards", str(root)]
    torchrun(worker + [str(tmp_path / "a.json"), "3"])
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["ids"] == [[whole[r + 2 * j] for j in range(6)] for r in range(2)]  # rank r: global r, r + 2, ...
    assert a["checked"] == [6, 6]  # every sample's encodings arrived with it
    # bytes: each rank its own samples' (and the next batch, read ahead), no sample twice, ≈ half the set each
    order = [whole[r::2] for r in range(2)]
    assert a["bytes"] == [index.span_bytes(order[r][:8]) for r in range(2)]
    assert abs(a["bytes"][0] - a["bytes"][1]) < 0.2 * index.span_bytes(range(16)) / 2
    # 2 → 1: rank 0's position (12 global samples in) continues on one process without reading the first 12
    one = _stream(root)
    one.load_state_dict(a["state"])
    assert _ids(one, 4) == whole[12:20]  # across the epoch's end too
    assert one.bytes_read() == index.span_bytes(whole[12:22])
    # 1 → 2: one process stopped after 5 batches (10 samples); two ranks continue its order
    one = _stream(root)
    _ids(one, 5)
    (tmp_path / "one.json").write_text(json.dumps(one.state_dict()))
    torchrun(worker + [str(tmp_path / "b.json"), "1", str(tmp_path / "one.json")])
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["ids"] == [[whole[10 + r + 2 * j] for j in range(2)] for r in range(2)]


@pytest.mark.slow
def test_a_text_unet_trains_on_two_ranks_from_captioned_shards_and_resumes_on_one(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    pipe = save_sd1(tmp_path / "pipe")
    images = write_captioned(tmp_path / "img")
    shards = tmp_path / "shards"
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--shards", str(shards), "--shard-size", "3", "--image-size", "16"]) == 0
    run = tmp_path / "run"
    common = TRAIN + [f"run_dir={run}", "data.name=captioned_shards", f"data.root={shards}", "data.batch_size=2",
                      f"model.args.pretrained={pipe}", "sample.num=0", "data.shuffle_buffer=4",
                      "diagnostics.interference_every=0", "train.ckpt_every=2"]
    cli(["train", "train.steps=2"] + common)
    state = ckpt.read_dcp_extra(run / "dcp")["data"]  # FSDP2's sharded checkpoint
    assert (state["epoch"], state["pos"], state["world_size"]) == (1, 0, 2)  # 2 steps × 2 ranks × 2: the epoch's 8
    assert main(["train", "train.steps=3", "--resume"] + common) == 0
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    assert (state["epoch"], state["pos"], state["world_size"]) == (1, 2, 1)  # then one step of 2 on one rank
