"""Loss masks (`data.mask`, data/masks.py; sd-scripts' --masked_loss / --alpha_mask): the alpha channel or a
NAME.mask.png beside each image, through the image's own resize, crop, flip and bucket; on the latent grid by
area interpolation, cached by `data prepare --vae --mask`; bad masks as one-line errors or counted warnings;
the objective's masked loss against sd-scripts' apply_masked_loss math written out here; training with masks
on folders, buckets, latents and a LoRA run, every timestep strategy, resuming exactly."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fasttrain import diffusion as fd
from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data.buckets import BucketImages, bucket_table
from fasttrain.data.folder import ImageFolderDataset
from fasttrain.data.manifest import build_manifest
from fasttrain.data.masks import latent_mask_file, mask_file, to_grid
from fasttrain.errors import DataError

sys.path.insert(0, str(Path(__file__).parents[1]))


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_masked(root, n=8, size=(20, 28), mode="alpha"):
    """Flat folder of n images whose grey level equals their mask (RGB = alpha, or the mask file's value):
    a ramp left to right plus the file's index, so a flip, a crop and a resize show in the mask the same
    as in the image. Alpha: RGBA PNGs; file: RGB PNGs with NAME.mask.png beside them."""
    root.mkdir(parents=True, exist_ok=True)
    h, w = size
    for i in range(n):
        v = np.clip(np.arange(w)[None, :] * (220 // w) + 3 * i, 0, 255).astype(np.uint8).repeat(h, 0)
        v[: h // 3] = 0  # a masked-out band: the mask is not all ones
        p = root / f"{i:03d}.png"
        if mode == "alpha":
            Image.fromarray(np.stack([v, v, v, v], -1), "RGBA").save(p)
        else:
            Image.fromarray(np.stack([v, v, v], -1), "RGB").save(p)
            Image.fromarray(v, "L").save(mask_file(p))
    return root


@pytest.mark.parametrize("mode", ["alpha", "file"])
def test_a_mask_follows_its_images_resize_crop_and_flip(tmp_path, mode):
    root = write_masked(tmp_path / "m", mode=mode)
    m = build_manifest(root)
    assert all(".mask." not in f for f, _ in m["files"]) and len(m["files"]) == 8  # masks are not data
    ds = ImageFolderDataset(str(root), 16, 3, manifest=m, mask=mode)
    for item in ((2, 0.0, 0.5, 0.5), (2, 1.0, 0.5, 0.5), (5, 1.0, 0.0, 1.0), (5, 0.0, 1.0, 0.0)):
        x, _, mk = ds[item]
        assert mk.shape == (1, 16, 16) and 0 < float(mk.mean()) < 1
        torch.testing.assert_close((x[:1] + 1) / 2, mk, atol=1e-6, rtol=0)  # the same operations on the same values
    flipped, plain = ds[(3, 1.0, 0.5, 0.5)][2], ds[(3, 0.0, 0.5, 0.5)][2]
    assert torch.equal(flipped, torch.flip(plain, [-1])) and not torch.equal(flipped, plain)
    wide = write_masked(tmp_path / "w", n=2, size=(12, 36), mode=mode)  # to the 24×8 bucket
    files = [tuple(f) for f in build_manifest(wide)["files"]]
    table = bucket_table(str(wide), files, {"base": 16, "min": 8, "max": 32, "steps": 8})
    bi = BucketImages(str(wide), files, table, 3, mask=mode)
    x, _, mk = bi[(1, 1.0, 0.3, 0.6)]
    assert mk.shape[1:] == x.shape[1:] and mk.shape[1] != mk.shape[2]  # a non-square bucket
    torch.testing.assert_close((x[:1] + 1) / 2, mk, atol=1e-6, rtol=0)
    assert torch.equal(bi[(1, 1.0, 0.3, 0.6)][2], torch.flip(bi[(1, 0.0, 0.3, 0.6)][2], [-1]))


def error_line(capsys) -> str:
    """The one error line (the folder check's notes may come before it) and nothing after it."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [i for i, line in enumerate(err) if line.startswith("fasttrain: error:")]
    assert len(errors) == 1 and errors[0] == len(err) - 1, err
    return err[-1]


def test_bad_masks_are_one_line_errors_or_counted_warnings(tmp_path, capsys):
    root = write_masked(tmp_path / "f", n=6, mode="file")
    base = ["data.name=folder", f"data.root={root}", "data.image_size=8", "data.batch_size=2", "train.steps=1",
            "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "model.args.ch=8",
            "train.threads=1", "data.mask=file", "data.backend=torch"]
    mask_file(root / "001.png").unlink()
    assert main(["train", f"run_dir={tmp_path / 'r1'}"] + base) == 1
    err = error_line(capsys)
    assert "001.mask.png is missing" in err
    Image.new("L", (5, 5), 255).save(mask_file(root / "001.png"))
    assert main(["train", f"run_dir={tmp_path / 'r2'}"] + base) == 1
    assert "001.mask.png is 5×5, its image 001.png is 28×20" in error_line(capsys)
    mask_file(root / "001.png").write_bytes(b"\x89PNG not a png")
    assert main(["train", f"run_dir={tmp_path / 'r3'}"] + base) == 1
    assert "cannot decode the mask" in capsys.readouterr().err
    Image.new("L", (28, 20), 0).save(mask_file(root / "001.png"))  # all zero: trains, counted
    Image.new("L", (28, 20), 0).save(mask_file(root / "004.png"))
    assert main(["train", f"run_dir={tmp_path / 'r4'}"] + base) == 0
    assert "data.mask=file: 2 image(s) have an all-zero mask" in capsys.readouterr().err
    alpha = write_masked(tmp_path / "a", n=4, mode="file")  # RGB images: no alpha channel
    assert main(["train", f"run_dir={tmp_path / 'r5'}"] + base[:1] + [f"data.root={alpha}"] + base[2:-2]
                + ["data.mask=alpha", "data.backend=torch"]) == 0
    assert "data.mask=alpha: 4 image(s) have no alpha channel: trained everywhere" in capsys.readouterr().err
    assert main(["train", f"run_dir={tmp_path / 'r6'}", "data.mask=alpha"]) == 2  # digits: no masks
    err = error_line(capsys)
    assert "data.mask" in err and "not data.name=digits" in err
    assert main(["train", f"run_dir={tmp_path / 'r7'}", "diffusion.prediction=mixed"] + base) == 2
    assert "takes no per-pixel weight" in capsys.readouterr().err


def test_the_objectives_masked_loss_is_sd_scripts_masked_loss(tmp_path):
    """sd-scripts (library/custom_train_functions.py apply_masked_loss, train_network.py), written out: the
    alpha mask at image resolution, F.interpolate(mask[:, None], size=latent (h, w), mode="area"), the loss
    mse(pred, target, reduction="none") · mask, mean over all but the batch, · the timestep weight, batch mean.
    fasttrain's objective at the same t and noise, given masks.to_grid of the same alpha, gives that loss and
    its gradient, and records the masked loss in the statistics."""
    g = torch.Generator().manual_seed(0)
    B, C, h, w = 3, 4, 5, 7
    alpha = torch.rand(B, 2 * h, 2 * w, generator=g)  # the images' alpha / 255 (a VAE downsampling by 2)
    alpha[:, :3] = 0.0
    x0 = torch.randn(B, C, h, w, generator=g)
    net = torch.nn.Conv2d(C, C, 3, padding=1)
    seen = {}

    def model(x_t, t):
        seen["x_t"] = x_t
        return net(x_t)

    sched = fd.schedule("linear", T=100)
    obj = fd.DiffusionObjective(sched, "eps", "min_snr", backend="torch")
    t = torch.tensor([3, 40, 97])
    loss, info = obj(model, x0, t=t, mask=to_grid(alpha[:, None], (h, w)))
    loss.backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    a, s = sched.alpha.float()[t].view(-1, 1, 1, 1), sched.sigma.float()[t].view(-1, 1, 1, 1)
    eps = (seen["x_t"] - a * x0) / s  # the noise the objective drew
    mask_image = F.interpolate(alpha.unsqueeze(1), size=(h, w), mode="area")
    ref = F.mse_loss(net(seen["x_t"]), eps, reduction="none") * mask_image
    per = ref.mean(dim=list(range(1, ref.ndim)))
    wt = fd.loss_weight("min_snr", sched, prediction="eps").float()[t]
    (per * wt).mean().backward()
    torch.testing.assert_close(loss, (per * wt).mean().detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(info["raw"], per.detach(), rtol=1e-4, atol=1e-6)
    for u, v in zip(ours, net.parameters()):
        torch.testing.assert_close(u, v.grad, rtol=1e-4, atol=1e-6)
    unmasked, _ = obj(model, x0, t=t)
    assert not torch.allclose(unmasked, loss)


COMMON = ["data.name=folder", "data.image_size=8", "data.batch_size=2", "train.progress=false", "sample.num=2",
          "sample.steps=2", "eval.num_samples=0", "eval.bpd=false", "model.args.ch=8", "train.threads=1",
          "train.log_every=1", "train.ckpt_every=0", "data.backend=torch"]


def losses(run):
    return [r["loss"] for r in read_jsonl(Path(run) / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("extra", [[], ["data.buckets=true", "data.min_bucket_reso=8", "data.max_bucket_reso=16",
                                        "data.bucket_reso_steps=8", "data.crop=random"]], ids=["square", "buckets"])
def test_masked_training_resumes_exactly(tmp_path, extra):
    root = write_masked(tmp_path / "m")
    args = COMMON + [f"data.root={root}", "data.mask=alpha"] + extra
    assert main(["train", f"run_dir={tmp_path / 'a'}", "train.steps=4"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=2"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=4", "--resume"] + args) == 0
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 4 and la == lb
    assert main(["train", f"run_dir={tmp_path / 'c'}", "train.steps=4"] + args[:-len(extra) - 1 or None]
                + ["data.mask=none"] + extra) == 0
    assert losses(tmp_path / "c") != la  # the mask acted


@pytest.mark.parametrize("sampler", ["uniform", "stratified", "logit_normal", "loss_second_moment", "adaptive"])
def test_masked_training_with_every_timestep_strategy(tmp_path, sampler):
    root = write_masked(tmp_path / "m", n=4)
    extra = ["diffusion.sampler_args={history: 2, uniform_prob: 0.5}"] if sampler == "loss_second_moment" else []
    assert main(["train", f"run_dir={tmp_path / 'r'}", "train.steps=3", f"diffusion.sampler={sampler}",
                 "diffusion.stats_every=1", f"data.root={root}", "data.mask=alpha"] + COMMON + extra) == 0
    assert len(losses(tmp_path / "r")) == 3


@pytest.fixture(scope="module")
def vae_latents(tmp_path_factory):
    pytest.importorskip("diffusers")
    from diffusers_fixtures import save_tiny_vae

    root = tmp_path_factory.mktemp("masklat")
    imgs, vae = write_masked(root / "imgs", n=6, size=(16, 16)), save_tiny_vae(root / "vae")
    old = root / "old"  # a folder prepared without masks (as before they existed)
    assert main(["data", "prepare", str(imgs), "--vae", str(vae), "--latents-out", str(old), "--image-size", "16"]) == 0
    lat = root / "lat"
    assert main(["data", "prepare", str(imgs), "--vae", str(vae), "--latents-out", str(lat), "--image-size", "16",
                 "--mask", "alpha"]) == 0
    return imgs, vae, old, lat


def test_prepare_caches_masks_on_the_latent_grid(vae_latents, tmp_path, capsys):
    imgs, vae, old, lat = vae_latents
    m = json.loads((lat / "fasttrain-manifest.json").read_text())
    assert m["latents"]["mask"] == {"mode": "alpha", "resize": "area", "no_alpha": 0, "all_zero": 0}
    assert all(".mask." not in f for f, _ in m["files"]) and len(m["files"]) == 6
    for rel, _ in m["files"]:
        got = np.load(latent_mask_file(lat / rel))
        a = np.asarray(Image.open(imgs / Path(rel).with_suffix(".png")), dtype=np.float32)[..., 3] / 255
        want = F.interpolate(torch.from_numpy(a)[None, None], size=(8, 8), mode="area")[0]  # sd-scripts' resize
        assert got.shape == (1, 8, 8)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)
    s, _ = build_data(DataConfig(name="latents", root=str(lat), batch_size=2, mask="alpha"), seed=0)
    x, y, mk = next(s)
    assert x.shape == (2, 4, 8, 8) and mk.shape == (2, 1, 8, 8)
    s, _ = build_data(DataConfig(name="latents", root=str(old), batch_size=2), seed=0)  # old cache, masks off
    assert len(next(s)) == 2
    with pytest.raises(DataError, match="prepared without loss masks: run `fasttrain data prepare IMAGES"):
        build_data(DataConfig(name="latents", root=str(old), batch_size=2, mask="alpha"), seed=0)
    with pytest.raises(DataError, match="holds the masks of data.mask=alpha"):
        build_data(DataConfig(name="latents", root=str(lat), batch_size=2, mask="file"), seed=0)
    gone = latent_mask_file(lat / m["files"][2][0])
    keep = gone.read_bytes()
    gone.unlink()
    try:
        with pytest.raises(DataError, match=f"{gone.name} is missing"):
            build_data(DataConfig(name="latents", root=str(lat), batch_size=2, mask="alpha"), seed=0)
    finally:
        gone.write_bytes(keep)
    capsys.readouterr()
    assert main(["data", "prepare", str(imgs), "--mask", "alpha"]) == 1
    assert "--mask writes loss masks beside VAE latents" in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "data.name=latents", f"data.root={lat}", "data.mask=alpha",
                 "train.steps=2"] + COMMON[2:]) == 0
    assert len(losses(run)) == 2


def test_masked_lora_run_resumes_exactly(tmp_path):
    """A LoRA run on captioned latents prepared with masks (NAME.mask.png beside each image)."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from text_fixtures import save_sd1, write_captioned
    from text_runs import TRAIN

    pipe = save_sd1(tmp_path / "pipe")
    imgs = write_captioned(tmp_path / "img", n=2, size=(16, 16))
    for p in imgs.glob("*.png"):
        if not p.name.endswith(".mask.png"):
            v = np.zeros((16, 16), np.uint8)
            v[:, 4:] = 255
            Image.fromarray(v).save(mask_file(p))
    lat = tmp_path / "lat"
    assert main(["data", "prepare", str(imgs), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(lat), "--image-size", "16", "--batch-size", "4",
                 "--mask", "file"]) == 0
    args = [f"data.root={lat}", f"model.args.pretrained={pipe}", "data.mask=file", "model.lora.rank=2",
            "optim.lr=1e-2", "sample.num=0"] + TRAIN
    assert main(["train", f"run_dir={tmp_path / 'a'}", "train.steps=4"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=2"] + args) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=4", "--resume"] + args) == 0
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 4 and la == lb


def test_shard_kinds_take_no_masks(tmp_path, capsys):
    """Shards (pixel or captioned latent) carry no loss masks: asking for one is a one-line refusal, in training
    and in `data prepare --shards` with encoders."""
    root = write_masked(tmp_path / "f", n=4, mode="file")
    from fasttrain.data.kinds import data_kind
    from fasttrain.errors import InvalidInput

    for kind in ("shards", "captioned_shards", "bucket_latents"):
        with pytest.raises(InvalidInput, match=f"bad value for 'data.mask'.*not data.name={kind}"):
            data_kind(kind).check(DataConfig(name=kind, root=str(root), mask="file"))
    assert main(["train", f"run_dir={tmp_path / 'r'}", "data.name=shards", f"data.root={root}", "data.mask=file"]) == 2
    assert "not data.name=shards" in error_line(capsys)
    assert main(["data", "prepare", str(root), "--vae", str(tmp_path / "v"), "--text-encoders", str(tmp_path / "t"),
                 "--shards", str(tmp_path / "s"), "--mask", "file"]) != 0
    assert "--mask is not stored in captioned shards" in capsys.readouterr().err
