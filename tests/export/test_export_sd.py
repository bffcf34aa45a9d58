"""Text runs exported as stock StableDiffusionPipeline / StableDiffusionXLPipeline folders (export/stable_diffusion.py):
tiny SD 1.x- and SDXL-shaped pipelines built and saved locally, a short run on each, the export loaded by
diffusers with no remote code, and its samples (prompts, guidance, one generator per image) equal to
fasttrain's."""
import json

import pytest
import torch
from text_fixtures import save_sd1, save_sdxl
from text_runs import PROMPTS, TRAIN
from text_runs import prepare as _prepare
from text_runs import same_samples as _same_samples

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.train import train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")



def _run(tmp_path, pipe, lat, name="run", extra=()):
    run = tmp_path / name
    train(load_config("default", [f"run_dir={run}", "train.steps=3", "sample.num=0", f"data.root={lat}",
                                  f"model.args.pretrained={pipe}", "optim.lr=1e-2"] + TRAIN + list(extra)))
    return run


def test_sd1_export_is_a_stock_pipeline_with_the_same_samples(tmp_path):
    pipe = save_sd1(tmp_path / "pipe")
    run = _run(tmp_path, pipe, _prepare(tmp_path, pipe))
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", "diffusers", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and not (out / "pipeline.py").exists()
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} <= {p.name for p in out.iterdir()}
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
    ours, sd = _same_samples(run, out, diffusers.StableDiffusionPipeline)
    # not a vacuous match: another prompt changes the samples, guidance 1 differs from guidance 3
    ones = ModelBundle.load(run, device="cpu").generate(3, prompts=PROMPTS, steps=4, guidance=1.0, first_image=0,
                                                        spacing="trailing")
    assert float((ones - ours).abs().max()) > 1e-3
    assert "pipeline_tag: text-to-image" in (out / "README.md").read_text()
    images = sd("a red square", num_inference_steps=2, height=16, width=16,
                generator=torch.Generator().manual_seed(0)).images
    assert images[0].size == (16, 16)  # decodes through the exported VAE


def test_sdxl_export_keeps_the_empty_prompt_as_the_unconditional_side(tmp_path):
    pipe = save_sdxl(tmp_path / "xl")
    run = _run(tmp_path, pipe, _prepare(tmp_path, pipe, "xl-lat"))
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", "diffusers", str(out)]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is False
    assert {"text_encoder_2", "tokenizer_2"} <= {p.name for p in out.iterdir()}
    _same_samples(run, out, diffusers.StableDiffusionXLPipeline)


def test_text_export_refusals_are_one_line(tmp_path, capsys):
    pipe = save_sd1(tmp_path / "pipe")
    lat = _prepare(tmp_path, pipe)
    run = _run(tmp_path, pipe, lat, "channel", ["data.latent_norm=channel"])
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "data.latent_norm=channel" in err and "scaling_factor" in err and not (tmp_path / "out").exists()
    # clip_skip: the installed pipeline cannot apply it to transformers 5's CLIPTextModel (no .text_model)
    images = tmp_path / "img-lat"
    skip = tmp_path / "skip-lat"
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--clip-skip", "1", "--latents-out", str(skip), "--image-size", "16"]) == 0
    run = _run(tmp_path, pipe, skip, "skip")
    code = main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")])
    err = capsys.readouterr().err
    if code == 0:  # a diffusers that applies clip_skip here: then its samples must be fasttrain's
        _same_samples(run, tmp_path / "out", diffusers.StableDiffusionPipeline, clip_skip=1)
    else:
        assert "cannot encode prompts as this run did (clip_skip=1" in err and not (tmp_path / "out").exists()
