"""Captioned latent shards (data/latent_shards.py): `data prepare IMAGES --vae --text-encoders --shards`
writes each image's posterior, its captions' encodings and text into tar shards with an index, resumes
after an interruption without encoding a written shard again, refuses other settings; training streams
them with the encodings arriving with the latents into a device table whose size does not depend on the
number of captions, the caption draw and dropout seeded as for a captioned folder; a text UNet trains on
them (LoRA too) and a resume continues the global order. The two-rank version:
tests/distributed/test_caption_shards_ranks.py."""
import json

import numpy as np
import pytest
import torch
from text_fixtures import save_sd1, write_captioned
from text_runs import TRAIN

from fasttrain.cli import main
from fasttrain.conditioning import TextCaptions
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data import latent_shards as ls
from fasttrain.data.shard_index import INDEX, ShardIndex, parse_sample

pytest.importorskip("webdataset")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")


def _prepare(images, pipe, out, *extra):
    return main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--shards", str(out), "--shard-size", "3", "--image-size", "16", "--batch-size", "2",
                 *extra])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("capshards")
    pipe = save_sd1(root / "pipe")
    images = write_captioned(root / "img")  # 4 red (two captions each) and 4 blue (one)
    assert _prepare(images, pipe, root / "shards") == 0
    return root, pipe, images, root / "shards"


def _members(path):
    index = ShardIndex(path)
    out = {}
    for k, name in enumerate(index.names):
        with open(path / name, "rb") as f:
            for off, size in index.spans[k].tolist():
                f.seek(off)
                s = parse_sample(f.read(size))
                out[s.pop("__key__")] = s
    return out


def test_prepare_writes_latents_captions_and_an_index(made):
    root, pipe, images, out = made
    index = json.loads((out / INDEX).read_text())
    assert index["kind"] == "captioned_latents" and index["count"] == 8
    assert [s["count"] for s in index["shards"]] == [3, 3, 2] and all(len(s["sha256"]) == 64 for s in index["shards"])
    assert index["text"]["family"] == "sd1" and index["text"]["max_captions"] == 2 and index["text"]["captions"] == 12
    assert index["latents"]["vae"]["weights_sha256"] and index["latents"]["shape"] == [8, 8, 8]
    assert not (out / ls.PROGRESS).exists()
    m = _members(out)
    files = json.loads((images / "fasttrain-manifest.json").read_text())["files"]
    for i, (rel, _) in enumerate(files):
        s = m[f"{i:08d}"]
        caps = (images / rel).with_suffix(".txt").read_text().split("\n")[:-1]
        assert s["txt"].decode().split("\n") == caps  # the raw captions, for steps that need text
        lat, states = ls.from_npy(s["latent.npy"]), ls.from_npy(s["states.npy"])
        assert lat.dtype == np.float16 and lat.shape == (8, 8, 8) and states.shape == (len(caps), 12, 32)
        assert (lat[4:] > 0).all()  # the posterior's std
    # the encodings are those of the captioned-folder path (the same encoders, fp16)
    from fasttrain.pretrained.text_encoders import TextEncoders

    enc = TextEncoders.load(pipe).encode(["a red square", "a photo of a red square"])
    red = next(i for i, (rel, _) in enumerate(files) if rel.startswith("red"))
    got = torch.from_numpy(ls.from_npy(m[f"{red:08d}"]["states.npy"])).float()
    assert torch.allclose(got, enc["states"].half().float())


def test_an_interrupted_prepare_continues_without_encoding_a_written_shard_again(made, tmp_path, monkeypatch, capsys):
    root, pipe, images, whole = made
    out = tmp_path / "shards"
    real, written = ls.write_shard, []

    def stop_after_one(path, samples):
        if written:
            raise KeyboardInterrupt  # as a ^C while the second shard is encoded
        real(path, samples)
        written.append(path.name)

    monkeypatch.setattr(ls, "write_shard", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        _prepare(images, pipe, out)
    assert written == ["shard-000000.tar"] and not (out / INDEX).exists() and (out / ls.PROGRESS).exists()
    assert not list(out.glob(".*.tmp"))  # nothing half-written is left under a shard's name
    first = (out / "shard-000000.tar").stat().st_mtime_ns
    monkeypatch.setattr(ls, "write_shard", lambda p, s: (written.append(p.name), real(p, s)))
    assert _prepare(images, pipe, out) == 0
    assert written[1:] == ["shard-000001.tar", "shard-000002.tar"]  # the first one kept
    assert (out / "shard-000000.tar").stat().st_mtime_ns == first
    a, b = _members(whole), _members(out)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)  # the same samples as one uninterrupted pass
    capsys.readouterr()
    assert _prepare(images, pipe, out, "--image-size", "24") != 0
    assert "holds shards of other settings (image_size differ)" in capsys.readouterr().err


def _stream(root, batch=2, world=1, rank=0, per_step=1, **kw):
    return build_data(DataConfig(name="captioned_shards", root=str(root), batch_size=batch, latent_norm="none",
                                 shuffle_buffer=4, **kw), seed=3, rank=rank, world_size=world,
                      batches_per_step=per_step)


def test_the_stream_brings_each_batch_s_encodings_and_the_table_does_not_grow_with_the_captions(tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    ls.write_synthetic(small, 20, captions=2, shard_size=6)
    ls.write_synthetic(big, 400, captions=2, shard_size=50)
    sizes = []
    for root in (small, big):
        s, info = _stream(root, batch=4, per_step=2)
        t = info.text_table
        assert t.per_batch and t.rows == 2 * 4 * 2 + 1 and t.empty == t.rows - 1
        sizes.append(sum(v.numel() * v.element_size() for v in (t.states, t.mask)))
        members = _members(root)
        for _ in range(3):
            for micro in range(2):
                x, y = next(s)
                ids = x[:, 0, 0, 0].round().long().tolist()  # synthetic sample i's latent is i
                assert y.tolist() == [micro * 4 + b for b in range(4)]  # this micro-batch's slot of the table
                for b, i in enumerate(ids):
                    want = torch.from_numpy(ls.from_npy(members[f"{i:08d}"]["states.npy"]))
                    rows = t.offsets[y[b]] + torch.arange(2)
                    assert torch.equal(t.states[rows], want) and int(t.counts[y[b]]) == 2
    assert sizes[0] == sizes[1]
    # the caption draw and dropout: TextCaptions over the streamed table, drawn as over a folder's table
    s, info = _stream(small, batch=4)
    x, y = next(s)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    codes = TextCaptions(info.text_table, 0.5, g1)(y)
    u = torch.rand((2, 4), generator=g2)
    want = y * 2 + (u[0] * 2).long()
    assert torch.equal(codes, torch.where(u[1] < 0.5, want + info.text_table.rows, want))


def test_a_damaged_sample_is_replaced_by_its_shard_s_next_one(tmp_path):
    root = tmp_path / "syn"
    ls.write_synthetic(root, 12, captions=1, shard_size=6)
    index = ShardIndex(root)
    off, size = index.spans[1][2].tolist()  # sample 8
    with open(root / index.names[1], "r+b") as f:
        f.seek(off + size - 600)  # inside the last member's data, the header intact
        f.write(b"\xff" * 80)
    s, _ = _stream(root, batch=12)
    ids = next(s)[0][:, 0, 0, 0].round().long().tolist()
    assert sorted(ids) == sorted([i for i in range(12) if i != 8] + [9])


def test_a_text_unet_trains_on_captioned_shards_and_resumes_where_it_stopped(made, tmp_path, capsys):
    root, pipe, images, out = made
    common = TRAIN + [f"data.root={out}", "data.name=captioned_shards", f"model.args.pretrained={pipe}",
                      "data.batch_size=2", "sample.num=0", "data.shuffle_buffer=4"]
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=2", "train.ckpt_every=2", "model.lora.rank=2",
                 "diagnostics.interference_every=1"] + common) == 0
    assert "the interference diagnostic is off" in capsys.readouterr().err  # its probe outlives a step's table
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    assert (state["epoch"], state["pos"]) == (0, 4) and state["order"] == "blocks-v1"
    assert main(["train", f"run_dir={run}", "train.steps=5", "--resume", "model.lora.rank=2"] + common) == 0
    state = torch.load(run / "last.pt", weights_only=False)["data"]
    assert (state["epoch"], state["pos"]) == (1, 2)  # 10 samples of 8 per epoch
    summary = json.loads((run / "summary.json").read_text())
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert summary["steps"] == 5 and len(losses) == 5 and np.isfinite(losses).all()


UNET = ('model.args.config={"block_out_channels": [16, 32], "down_block_types": ["CrossAttnDownBlock2D", '
        '"DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 1, '
        '"norm_num_groups": 8, "attention_head_dim": 8, "cross_attention_dim": 32}')


@pytest.mark.parametrize("over", [
    pytest.param(["diffusion.sampler=adaptive", "diffusion.sampler_args.every=2"], marks=pytest.mark.slow),
    ["diffusion.prediction=mixed", "diffusion.mixed.gate=timestep", "diffusion.stats_every=2",
     "diffusion.noise.immiscible=assignment", "train.grad_accum=2"],
])
def test_timestep_strategies_train_on_captioned_shards_and_resume_exactly(tmp_path, over):
    """The per-batch table's codes travel where labels travel (the adaptive sampler's probes, the mixed
    head's statistics, immiscible assignment, micro-batches of one step in their own slots); a run
    stopped and resumed gives the losses of the run that never stopped."""
    from fasttrain.configure import load_config
    from fasttrain.train import train

    root = tmp_path / "syn"
    ls.write_synthetic(root, 24, captions=2, length=8, width=32, shape=(4, 8, 8), shard_size=7, ids=False)
    common = ["data.name=captioned_shards", f"data.root={root}", "data.batch_size=4", "data.shuffle_buffer=6",
              "model.name=diffusers", "model.args.class_name=UNet2DConditionModel", UNET, "train.threads=1",
              "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.log_every=1",
              "train.ckpt_every=0", "diagnostics.interference_every=0", "data.caption_dropout=0.3"] + over
    train(load_config("default", [f"run_dir={tmp_path / 'a'}", "train.steps=4"] + common))
    train(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=2"] + common))
    train(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=4"] + common, resume=True), resume=True)
    la, lb = ([r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in "ab")
    assert len(la) == 4 and la == lb and all(np.isfinite(la))


def test_dali_s_webdataset_reader_reads_the_shards_as_written(tmp_path):
    """The shards are plain WebDataset: DALI's fn.readers.webdataset (a CPU pipeline) reads every sample's
    members with the bytes fasttrain's reader reads, in file order. Training does not read through it
    (docs/data.md says why: it cannot follow the one global order nor seek to a position)."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    root = tmp_path / "syn"
    ls.write_synthetic(root, 10, captions=2, shard_size=4, pooled=6)
    index = ShardIndex(root)
    keys = ["latent.npy", "states.npy", "mask.npy", "pooled.npy", "txt"]

    @pipeline_def(batch_size=10, num_threads=1, device_id=None)
    def pipe():
        return tuple(fn.readers.webdataset(paths=[str(root / n) for n in index.names], ext=keys,
                                           random_shuffle=False))

    p = pipe()
    p.build()
    outs = p.run()
    members = _members(root)
    for i in range(10):
        for k, out in zip(keys, outs):
            assert bytes(np.array(out[i])) == members[f"{i:08d}"][k], (i, k)
