"""DreamBooth class images from the base (`fasttrain data class-images`, generation/class_images.py): image
i is the stock pipeline's image from torch.Generator().manual_seed(seed + i); an interrupted run continues
with the images an uninterrupted one makes; the folder's own images count; other settings into the same
folder, an empty prompt or a missing pipeline are one-line errors."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from text_fixtures import save_sd1

from fasttrain.cli import main

PROMPT = "a photo of a dog"


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return save_sd1(tmp_path_factory.mktemp("base") / "pipe")


def make(pipe, out, num, *extra) -> int:
    return main(["data", "class-images", str(pipe), "--prompt", PROMPT, "--num-images", str(num), "--out", str(out),
                 "--image-size", "16", "--steps", "4", "--seed", "7", "--spacing", "trailing", *extra])


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path)).astype(np.int16)


def test_class_image_i_is_the_stock_pipelines_image_of_seed_plus_i(pipe, tmp_path):
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from fasttrain.export.common import scheduler_for
    from fasttrain.generation.class_images import base_bundle

    out = tmp_path / "cls"
    assert make(pipe, out, 3, "--batch-size", "2") == 0
    assert sorted(p.name for p in out.glob("class-*.png")) == [f"class-0000{i}.png" for i in range(3)]
    assert (out / "class-00001.txt").read_text().strip() == PROMPT  # the caption data prepare reads
    b = base_bundle(pipe, 16, "cpu")
    b.cfg.sample.spacing = "trailing"
    scheduler, note = scheduler_for(b)  # the DDIM scheduler fasttrain's ddim solver equals (export/common.py)
    assert note is None and scheduler.config.timestep_spacing == "trailing"
    stock = StableDiffusionPipeline(vae=AutoencoderKL.from_pretrained(pipe / "vae"),
                                    text_encoder=CLIPTextModel.from_pretrained(pipe / "text_encoder"),
                                    tokenizer=CLIPTokenizer.from_pretrained(pipe / "tokenizer"),
                                    unet=UNet2DConditionModel.from_pretrained(pipe / "unet"), scheduler=scheduler,
                                    safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    theirs = stock([PROMPT] * 3, num_inference_steps=4, guidance_scale=7.5, height=16, width=16, output_type="np",
                   generator=[torch.Generator().manual_seed(7 + i) for i in range(3)]).images
    theirs = np.round(theirs * 255).astype(np.int16)
    for i in range(3):
        ours = pixels(out / f"class-0000{i}.png")
        assert ours.shape == theirs[i].shape and np.abs(ours - theirs[i]).max() <= 1  # uint8 rounding
    assert np.abs(pixels(out / "class-00000.png") - pixels(out / "class-00001.png")).max() > 1  # seeds differ


def test_an_interrupted_generation_continues_as_an_uninterrupted_one(pipe, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert make(pipe, whole, 4) == 0
    assert make(pipe, cut, 4, "--batch-size", "3") == 0
    for i in (1, 3):  # as if stopped: image 1 never written, image 3 lost with its temporary file
        (cut / f"class-0000{i}.png").unlink()
    before = (cut / "class-00002.png").stat().st_mtime_ns
    assert make(pipe, cut, 4) == 0
    assert (cut / "class-00002.png").stat().st_mtime_ns == before  # kept, not made again
    for i in range(4):
        assert np.array_equal(pixels(whole / f"class-0000{i}.png"), pixels(cut / f"class-0000{i}.png"))


def test_the_folders_own_images_count_and_other_settings_are_refused(pipe, tmp_path, capsys):
    out = tmp_path / "cls"
    out.mkdir()
    for k in range(2):
        Image.fromarray(np.full((16, 16, 3), 40 * k, np.uint8)).save(out / f"mine{k}.jpg")
    assert make(pipe, out, 3) == 0
    assert sorted(p.name for p in out.glob("class-*.png")) == ["class-00000.png"]
    assert "2 of its own" in capsys.readouterr().out
    assert json.loads((out / "class-images.json").read_text())["seed"] == 7
    assert make(pipe, out, 3, "--seed", "8") == 0  # nothing to make: the folder is full
    assert make(pipe, out, 5, "--seed", "8") != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "seed" in err[-1] and "--out" in err[-1] and "7" in err[-1]
    assert make(pipe, tmp_path / "x", 2, "--prompt", " ") != 0
    assert "--prompt" in capsys.readouterr().err
    assert main(["data", "class-images", str(tmp_path / "nope"), "--prompt", PROMPT, "--num-images", "1", "--out",
                 str(tmp_path / "y")]) != 0
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_other_pipeline_families_make_class_images(tmp_path, family):
    from flux_fixtures import save_flux
    from text_fixtures import save_sdxl

    base = (save_sdxl if family == "sdxl" else save_flux)(tmp_path / family)
    assert make(base, tmp_path / "a", 2) == 0
    record = json.loads((tmp_path / "a" / "class-images.json").read_text())
    assert record["prompt"] == PROMPT and record["seed"] == 7
    a0, a1 = pixels(tmp_path / "a" / "class-00000.png"), pixels(tmp_path / "a" / "class-00001.png")
    assert a0.shape == (16, 16, 3) and np.abs(a0 - a1).max() > 1  # each image its own seed
    assert make(base, tmp_path / "b", 1, "--seed", "8") == 0  # seed 8's image 0 is seed 7's image 1
    assert np.array_equal(pixels(tmp_path / "b" / "class-00000.png"), a1)
