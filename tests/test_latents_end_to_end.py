"""Latent diffusion end to end with a tiny saved AutoencoderKL: `data prepare --vae` encodes an image
folder, a DiT trains on the latents, and with the training data deleted `sample` writes decoded PNGs,
`eval` computes FID of the decoded images against the image folder, `report` shows decoded samples;
the same run exported with `export --to diffusers` runs in diffusers with equal outputs."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from diffusers_fixtures import perturbed_run, save_tiny_vae

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main

sys.path.insert(0, str(Path(__file__).parent / "data"))
from folder_fixtures import write_images

pytest.importorskip("diffusers")

TRAIN = ["data.name=latents", "data.batch_size=4", "train.steps=4", "train.threads=1", "train.progress=false",
         "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2",
         "sample.num=4", "sample.steps=3", "eval.num_samples=0", "eval.bpd_samples=4", "eval.bpd_timesteps=2",
         "optim.warmup_steps=1"]


@pytest.fixture(scope="module")
def latent_run(tmp_path_factory):
    """An image folder (with a corrupt file), a saved VAE, its latents and a DiT run on them."""
    root = tmp_path_factory.mktemp("latent_run")
    images, vae, lat, run = root / "images", root / "vae", root / "latents", root / "run"
    write_images(images, n_per_class=6, corrupt=1)
    save_tiny_vae(vae)
    assert main(["data", "prepare", str(images), "--vae", str(vae), "--latents-out", str(lat),
                 "--image-size", "16", "--batch-size", "5"]) == 0
    assert main(["train", f"run_dir={run}", f"data.root={lat}"] + TRAIN) == 0
    return {"images": images, "vae": vae, "latents": lat, "run": run, "root": root}


def test_encode_train_then_sample_evaluate_and_report_without_the_data(latent_run, capsys):
    images, vae, run, root = latent_run["images"], latent_run["vae"], latent_run["run"], latent_run["root"]
    m = json.loads((latent_run["latents"] / "fasttrain-manifest.json").read_text())
    info = m["latents"]
    assert m["num_files"] == 12 and m["sizes"] == {"[8, 8, 8]": 12} and info["posterior"] == "mean_std"
    assert info["vae"]["scaling_factor"] == 0.5 and info["skipped_images"][0][0] == "cat/broken0.jpg"
    spec = ModelBundle.load(run, device="cpu").spec
    assert spec.shape == (4, 8, 8) and spec.latents["norm"] == "vae" and spec.latents["posterior"]
    assert spec.latents["vae"]["weights_sha256"] == info["vae"]["weights_sha256"]
    assert (run / "samples-decoded.png").is_file()  # training decoded its samples too

    ref = root / "ref"
    shutil.copytree(images, ref)
    shutil.rmtree(latent_run["latents"])  # the training data are gone, and the images they came from
    shutil.rmtree(images)
    out = root / "samples"
    assert main(["sample", "--ckpt", str(run), "--n", "6", "--steps", "3", "--out", str(out)]) == 0
    from PIL import Image

    with Image.open(out / "00005.png") as im:
        assert im.size == (16, 16) and im.mode == "RGB"  # decoded by the VAE, not a latent channel
    assert (out / "grid.png").is_file() and torch.load(out / "samples.pt").shape == (6, 4, 8, 8)

    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--n", "8", "--steps", "3", "--ref", str(ref),
                 "--extractor", "fasttrain-digits"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert ev["fid"] > 0 and ev["kid"] == ev["kid"] and "bpd" not in ev  # no latents left for bits/dim
    assert main(["eval", "--ckpt", str(run), "--n", "8", "--steps", "3", "--extractor", "fasttrain-digits"]) == 1
    assert "pass --ref" in capsys.readouterr().err

    (run / "samples-decoded.png").unlink()
    assert main(["report", str(run)]) == 0  # decodes RUN/samples.pt again
    assert (run / "samples-decoded.png").is_file() and "decoded by the VAE" in (run / "report.html").read_text()

    moved = root / "vae-moved"
    vae.rename(moved)
    try:
        capsys.readouterr()
        assert main(["sample", "--ckpt", str(run), "--n", "2", "--steps", "2", "--out", str(root / "s2")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(vae) in err[0] and "--vae" in err[0]
        assert main(["sample", "--ckpt", str(run), "--n", "2", "--steps", "2", "--out", str(root / "s3"),
                     "--vae", str(moved)]) == 0
        assert (root / "s3" / "00001.png").is_file()
    finally:
        moved.rename(vae)


def test_export_to_diffusers_gives_equal_outputs(latent_run, tmp_path):
    from diffusers import DiffusionPipeline

    from fasttrain.diffusion.solvers import ddim

    run = perturbed_run(latent_run["run"], tmp_path / "run")  # weights far from their zero initialisation
    out = tmp_path / "export"
    assert main(["export", str(run), "--to", "diffusers", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model_index.json", "pipeline.py", "scheduler",
                                                      "transformer", "vae"]
    pipe = DiffusionPipeline.from_pretrained(str(out), trust_remote_code=True)
    b = ModelBundle.load(run, device="cpu")
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0, 400, 999]), torch.tensor([0, 1, 2])
    with b.averaged() as net, torch.no_grad():  # the EMA network, fp32, null label 2 included
        ours, theirs = net(x, t, y), pipe.transformer(x, t, class_labels=y).sample
    assert ours.abs().max() > 0.1 and (ours - theirs).abs().max() <= 1e-5

    # one sampling step: diffusers' scheduler (DDIMScheduler, trailing: 749 → 499) against fasttrain's DDIM step
    pipe.scheduler.set_timesteps(4)
    assert pipe.scheduler.timesteps.tolist() == [999, 749, 499, 249]
    ts = [749, 499]
    with torch.no_grad():
        step = pipe.scheduler.step(pipe.transformer(x, torch.full((3,), ts[0]), class_labels=y).sample, ts[0], x)
    seen = {}

    def denoise(x_t, t):
        seen[t] = x_t
        with b.averaged():
            return b.solver_fn(y)(x_t, t)

    ddim(denoise, x, ts, b.schedule)
    torch.testing.assert_close(step.prev_sample, seen[ts[1]], rtol=0, atol=1e-5 * float(x.abs().max()))

    # the whole pipeline (guidance, the spacing, decoding) against bundle.generate + the VAE, for one seed
    labels, n = torch.tensor([1, 0]), 2
    z = b.generate(n, labels, seed=5, steps=4, guidance=2.0)
    got = pipe(class_labels=[1, 0], num_inference_steps=4, guidance_scale=2.0,
               generator=torch.Generator().manual_seed(5), output_type="pt").images
    torch.testing.assert_close(got, b.decode(z) * 0.5 + 0.5, rtol=0, atol=1e-5)
