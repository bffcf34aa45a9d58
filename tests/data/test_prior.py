"""DreamBooth prior preservation (data.prior, fasttrain/data/prior.py): instance latents under one prompt
paired with class latents under another, batches mixed and the loss reduced as diffusers'
train_dreambooth_lora.py does (checked against a port of its loss at equal noise and timesteps), exact
resume, LoRA and full fine-tuning, and the refusals as one line naming the key."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from text_fixtures import save_sd1
from text_runs import TRAIN

from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.data import build_data
from fasttrain.errors import ConfigError, DataError

INSTANCE, CLASS = "a photo of red dog", "a photo of a dog"


def images(folder: Path, n: int, rgb, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(n):
        arr = (np.array(rgb, np.float32) * rng.uniform(0.6, 1.0, (16, 16, 1))).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"{k}.png")
    return folder


def prepare(src: Path, pipe: Path, out: Path, prompt: str) -> Path:
    assert main(["data", "prepare", str(src), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--prompt", prompt, "--latents-out", str(out), "--image-size", "16",
                 "--batch-size", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prior")
    pipe = save_sd1(root / "pipe")
    inst = prepare(images(root / "dog", 3, (200, 40, 40), 0), pipe, root / "dog-lat", INSTANCE)
    cls = prepare(images(root / "dogs", 5, (90, 90, 90), 1), pipe, root / "dogs-lat", CLASS)
    return {"root": root, "pipe": pipe, "inst": inst, "cls": cls}


def run_args(folders, *extra):
    return TRAIN + [f"data.root={folders['inst']}", f"model.args.pretrained={folders['pipe']}",
                    f"data.prior.root={folders['cls']}", "data.batch_size=2", "sample.num=0"] + list(extra)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_prepare_with_one_prompt_encodes_it_for_every_image(folders):
    m = json.loads((folders["inst"] / "fasttrain-manifest.json").read_text())
    assert m["text"]["captions"] == 3 and m["text"]["prompts"] == [INSTANCE] * 3
    saved = torch.load(folders["inst"] / "text-embeddings.pt", weights_only=True)
    assert saved["counts"].tolist() == [1, 1, 1]
    assert torch.equal(saved["states"][0], saved["states"][2]) and not torch.equal(saved["states"][0],
                                                                                   saved["states"][3])


def test_batches_pair_instance_and_class_latents_as_diffusers(folders):
    cfg = load_config("default", run_args(folders, "data.prior.weight=0.25"))
    stream, info = build_data(cfg.data, seed=0)
    assert info.size == 5 and info.loss_weights  # max(3 instance, 5 class) items, as DreamBoothDataset
    table = info.text_table
    assert table.rows == 3 + 5 + 1 and table.empty == 8 and table.counts.tolist() == [1] * 8
    seen_inst, seen_cls = set(), set()
    for _ in range(5):
        x, y, w = next(stream)
        assert x.shape == (4, 4, 8, 8) and w.shape == (4, 1, 8, 8)
        assert (y[:2] < 3).all() and (y[2:] >= 3).all()  # the instance half, then the class half
        assert torch.equal(w[:2], torch.full_like(w[:2], 2.0)) and torch.equal(w[2:], torch.full_like(w[2:], 0.5))
        seen_inst |= set(y[:2].tolist())
        seen_cls |= set(y[2:].tolist())
    assert seen_inst == {0, 1, 2} and seen_cls == {3, 4, 5, 6, 7}
    # the class rows encode the class prompt, the instance rows the instance prompt
    assert torch.equal(table.states[3], table.states[7]) and not torch.equal(table.states[0], table.states[3])
    cfg = load_config("default", run_args(folders, "data.prior.num_images=2"))
    _, info = build_data(cfg.data, seed=0)
    assert info.size == 3 and info.text_table.rows == 3 + 2 + 1


# -- the loss against diffusers' train_dreambooth_lora.py -------------------------------------------------
TINY = dict(batch=4, size=8, width=16, length=8, channels=(16, 32), captions=8)


@pytest.mark.parametrize("weight,prediction", [(1.0, "eps"), (0.3, "v")])
def test_loss_equals_the_dreambooth_scripts_at_equal_noise(weight, prediction):
    """fasttrain's step with the prior's weights on the loss op, and the script's chunked loss (bench/
    t2i_loops.py: L1315-1327), fed the same x0, ε and t: the same loss curve and the same UNet."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from t2i_loops import PeerLoop, Setup, batch_rows, equal_noise_run

    setup = Setup(prediction=prediction, prior_loss_weight=weight, **TINY)
    ours, theirs, agree, (ft, _, start) = equal_noise_run(setup, 3, "cpu", "torch")
    assert len(set(ours)) == 3
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 2e-6 * abs(b), (ours, theirs)
    assert agree["moved_norm"] > 0 and agree["rel_norm"] < 1e-3, agree
    # the comparison can fail: the plain mean (no prior weights) is another loss at the same noise
    plain = PeerLoop(Setup(prediction=prediction, **TINY), "cpu", start)
    rows = batch_rows(setup, 0, "cpu")
    fresh = equal_noise_run(setup, 1, "cpu", "torch")[3][0]
    t, eps = fresh.peek(rows)
    other = float(plain.step(rows, noise=eps, timesteps=t))
    assert abs(other - ours[0]) > 1e-3 * abs(ours[0])


# -- training -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["model.lora.rank=2", "optim.lr=1e-2"],
                                   ["model.lora.rank=2", "optim.lr=1e-2", "model.lora.text_encoder=true"]],
                         ids=["full", "lora", "lora+text_encoder"])
def test_prior_runs_train_and_resume_exactly(folders, tmp_path, extra):
    if extra:
        pytest.importorskip("peft")
    args = run_args(folders, "data.prior.weight=0.5", *extra)
    assert main(["train", f"run_dir={tmp_path / 'a'}", "train.steps=4"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=2"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=4", "--resume"] + args) == 0
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 4 and la == lb and len(set(la)) == 4
    sa, sb = (torch.load(tmp_path / x / "last.pt", weights_only=True)["model"] for x in "ab")
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    # the class half counts: another prior weight is another loss curve on the same batches and noise
    assert main(["train", f"run_dir={tmp_path / 'c'}", "train.steps=1"] + args[:-len(extra) or None]
                + ["data.prior.weight=2.0"] + extra) == 0
    assert losses(tmp_path / "c")[0] != la[0]


def test_prior_runs_with_the_adaptive_sampler_and_accumulation(folders, tmp_path):
    """The paired batches (x, y, weight) through gradient accumulation and a learned sampler's look-ahead."""
    assert main(["train", f"run_dir={tmp_path / 'r'}", "train.steps=2", "diffusion.sampler=adaptive",
                 "diffusion.stats_every=1", "train.grad_accum=2"] + run_args(folders)) == 0
    assert len(losses(tmp_path / "r")) == 2


def test_instance_masks_multiply_the_prior_weights():
    from fasttrain.data.prior import PriorBatches

    class Inner:
        epoch, pos = 0, 0

        def __next__(self):
            x = torch.randn(2, 8, 4, 4)
            m = torch.rand(2, 1, 4, 4)
            self.last = m
            return x, torch.tensor([0, 1]), m, x + 1, torch.tensor([2, 3])

    inner = Inner()
    x, y, w = next(PriorBatches(inner, 0.25, masked=True))
    assert x.shape == (4, 8, 4, 4) and y.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(w[:2], 2 * inner.last)
    torch.testing.assert_close(w[2:], torch.full((2, 1, 4, 4), 0.5))


# -- refusals ---------------------------------------------------------------------------------------------
def _error(folders, tmp_path, capsys, *extra) -> str:
    assert main(["train", f"run_dir={tmp_path / 'r'}", "train.steps=1"] + run_args(folders, *extra)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1
    return err[-1]


def test_bad_prior_settings_are_one_line_naming_the_key(folders, tmp_path, capsys):
    assert "data.prior.root" in _error(folders, tmp_path, capsys, f"data.prior.root={tmp_path / 'none'}")
    assert "data.prior.num_images" in _error(folders, tmp_path, capsys, "data.prior.num_images=0")
    assert "data.prior.weight" in _error(folders, tmp_path, capsys, "data.prior.weight=-1")
    assert "data.prior.root" in _error(folders, tmp_path, capsys, f"data.prior.root={folders['inst']}")
    assert "data.prior.root" in _error(folders, tmp_path, capsys, "data.backend=dali")
    with pytest.raises(ConfigError, match="data.prior.root.*captioned_latents"):
        load_config("default", ["data.name=latents", f"data.root={folders['inst']}",
                                f"data.prior.root={folders['cls']}"])
    plain = tmp_path / "plain"
    plain.mkdir()
    np.save(plain / "a.npy", np.zeros((8, 8, 8), np.float32))
    err = _error(folders, tmp_path, capsys, f"data.prior.root={plain}")
    assert "data.prior.root" in err and "--prompt" in err


def test_class_latents_of_other_encoders_or_sizes_are_refused(folders, tmp_path, capsys):
    other = save_sd1(tmp_path / "other", seed=5)
    lat = prepare(images(tmp_path / "c", 2, (50, 50, 50), 3), other, tmp_path / "c-lat", CLASS)
    err = _error(folders, tmp_path, capsys, f"data.prior.root={lat}")
    assert "data.prior.root" in err and ("VAE" in err or "text encoders" in err)
    big = tmp_path / "big-lat"
    assert main(["data", "prepare", str(images(tmp_path / "b", 2, (50, 50, 50), 4)), "--vae", str(folders["pipe"]),
                 "--vae-subfolder", "vae", "--text-encoders", str(folders["pipe"]), "--prompt", CLASS,
                 "--latents-out", str(big), "--image-size", "32"]) == 0
    err = _error(folders, tmp_path, capsys, f"data.prior.root={big}")
    assert "data.prior.root" in err and "image size" in err


def test_prepare_prompt_needs_text_encoders_and_text(folders, tmp_path, capsys):
    src = images(tmp_path / "i", 1, (1, 2, 3), 0)
    assert main(["data", "prepare", str(src), "--vae", str(folders["pipe"]), "--vae-subfolder", "vae", "--prompt",
                 INSTANCE, "--latents-out", str(tmp_path / "o")]) != 0
    assert "--text-encoders" in capsys.readouterr().err
    assert main(["data", "prepare", str(src), "--vae", str(folders["pipe"]), "--vae-subfolder", "vae",
                 "--text-encoders", str(folders["pipe"]), "--prompt", " ", "--latents-out", str(tmp_path / "o")]) != 0
    assert "--prompt" in capsys.readouterr().err


def test_mixed_prediction_refuses_the_prior(folders):
    args = [a for a in run_args(folders) if not a.startswith("model.args.pretrained")]
    unet = ("{block_out_channels: [16, 32], down_block_types: [CrossAttnDownBlock2D, DownBlock2D], up_block_types: "
            "[UpBlock2D, CrossAttnUpBlock2D], layers_per_block: 1, norm_num_groups: 8, attention_head_dim: 8}")
    with pytest.raises(ConfigError, match="data.prior.root"):
        load_config("default", args + [f"model.args.config={unet}", "diffusion.prediction=mixed"])


def test_class_folder_with_unreadable_embeddings_count_is_refused(folders, tmp_path):
    import shutil

    lat = tmp_path / "cut"
    shutil.copytree(folders["cls"], lat)
    m = json.loads((lat / "fasttrain-manifest.json").read_text())
    m["files"] = m["files"][:2]
    (lat / "fasttrain-manifest.json").write_text(json.dumps(m))
    cfg = load_config("default", run_args({**folders, "cls": lat}))
    with pytest.raises(DataError, match="data.prior.root"):
        build_data(cfg.data, seed=0)


def test_an_sdxl_prior_run_joins_the_micro_conditions(tmp_path):
    """SDXL: pooled vectors and each image's micro-conditions joined with the class folder's."""
    from text_fixtures import save_sdxl

    pipe = save_sdxl(tmp_path / "xl")
    inst = prepare(images(tmp_path / "i", 2, (200, 40, 40), 0), pipe, tmp_path / "i-lat", INSTANCE)
    cls = prepare(images(tmp_path / "c", 3, (90, 90, 90), 1), pipe, tmp_path / "c-lat", CLASS)
    folders = {"inst": inst, "cls": cls, "pipe": pipe}
    cfg = load_config("default", run_args(folders))
    _, info = build_data(cfg.data, seed=0)
    t = info.text_table
    assert t.rows == 2 + 3 + 1 and t.pooled.shape[0] == t.rows and t.time_ids.shape == (t.rows, 6)
    assert main(["train", f"run_dir={tmp_path / 'r'}", "train.steps=2"] + run_args(folders)) == 0
    assert len(losses(tmp_path / "r")) == 2


def test_the_docs_dreambooth_example_runs_as_written(tmp_path, monkeypatch):
    """docs/text-to-image.md's worked example: its Python, then each fasttrain command through the CLI."""
    import shlex

    pytest.importorskip("peft")
    text = (Path(__file__).parents[2] / "docs" / "text-to-image.md").read_text()
    section = text[text.index("## DreamBooth"):text.index("## Flag table")]
    start = section.index("```bash\n") + len("```bash\n")
    code = section[start:section.index("```\n", start)]
    first, rest = code.split("\n", 1)
    assert "save_sd1(Path('tiny-sd'))" in first
    monkeypatch.chdir(tmp_path)
    save_sd1(tmp_path / "tiny-sd")
    py, rest = rest.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)
    exec(py, {})
    ran = []
    for line in rest.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "fasttrain"
        extra = ["train.threads=1", "train.progress=false"] if argv[1] == "train" else []
        assert main(argv[1:] + extra) == 0, line
        ran.append(argv[1])
    assert ran == ["data", "data", "data", "train", "sample", "export"]
    assert len(list((tmp_path / "dog-class").glob("class-*.png"))) == 6
    rows = [json.loads(r) for r in (tmp_path / "runs" / "dreambooth" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 10
    assert len(list((tmp_path / "sks-dog-samples").glob("0000*.png"))) == 4
    assert (tmp_path / "dreambooth-lora" / "pytorch_lora_weights.safetensors").is_file()


def test_instance_images_without_their_prompt_are_refused(folders, tmp_path):
    """An instance folder prepared with --allow-empty-captions and no --prompt: no instance prompt."""
    bare = tmp_path / "bare-lat"
    assert main(["data", "prepare", str(images(tmp_path / "bare", 2, (9, 9, 9), 5)), "--vae", str(folders["pipe"]),
                 "--vae-subfolder", "vae", "--text-encoders", str(folders["pipe"]), "--allow-empty-captions",
                 "--latents-out", str(bare), "--image-size", "16"]) == 0
    cfg = load_config("default", run_args({**folders, "inst": bare}))
    with pytest.raises(DataError, match="data.prior.root.*2 instance caption.*--prompt"):
        build_data(cfg.data, seed=0)
