"""Text-to-image (issue 31, core): captions, cached text encodings, text-conditioned UNet2DConditionModel
backbones (SD 1.x- and SDXL-shaped pipelines built and saved locally), prompts at sampling time, and the
refusals (SD3 on uncaptioned data, shuffle_caption without live encoding, an SDXL UNet without
micro-conditions, encoders that are not the run's)."""
import json

import pytest
import torch
from text_fixtures import CAPTIONS, UNET, save_sd1, save_sdxl, write_captioned
from text_runs import TRAIN
from text_runs import prepare as _prepare

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.conditioning import TextCaptions, TextTable
from fasttrain.configure import load_config
from fasttrain.data.captions import captions_for
from fasttrain.errors import DataError, InvalidInput
from fasttrain.pretrained.text_encoders import TextEncoders, tiny_clip
from fasttrain.train import train

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd1")
    pipe = save_sd1(root / "pipe")
    return {"root": root, "pipe": pipe, "lat": _prepare(root, pipe)}


# -- captions -----------------------------------------------------------------------------------------------
def test_captions_from_txt_files_and_metadata_jsonl(tmp_path):
    txt = write_captioned(tmp_path / "a", n=2)
    files = ["red0.png", "blue1.png"]
    assert captions_for(txt, files) == [CAPTIONS["red"], CAPTIONS["blue"]]  # lines = alternatives
    meta = write_captioned(tmp_path / "b", n=2, metadata=True)
    assert captions_for(meta, files) == [CAPTIONS["red"], CAPTIONS["blue"]]
    (txt / "blue1.txt").write_text("\n  \n")  # empty: no caption
    with pytest.raises(DataError, match=r"1 of 2 images have no .txt caption.*blue1.png.*allow_empty_captions"):
        captions_for(txt, files)
    assert captions_for(txt, files, allow_empty=True, say=lambda s: None)[1] == [""]
    (txt / "blue1.txt").write_bytes(b"caf\xe9 latin-1")
    with pytest.raises(DataError, match=r"blue1.txt: not UTF-8"):
        captions_for(txt, files)


# -- text encoders --------------------------------------------------------------------------------------------
def test_sd1_encoding_clip_skip_and_truncation(tmp_path, capsys):
    from transformers import CLIPTextModel, CLIPTokenizer

    tiny_clip(tmp_path, ["a", "cat"], width=32, max_length=6)
    enc = TextEncoders.load(tmp_path)
    out = enc.encode(["a cat", "a cat a cat a cat a cat"])
    tok = CLIPTokenizer.from_pretrained(tmp_path / "tokenizer")
    model = CLIPTextModel.from_pretrained(tmp_path / "text_encoder")
    ids = tok(["a cat"], padding="max_length", max_length=6, return_tensors="pt").input_ids
    with torch.no_grad():
        h = model(ids, output_hidden_states=True)
        torch.testing.assert_close(out["states"][:1], h.last_hidden_state)
        skipped = TextEncoders.load(tmp_path, clip_skip=1).encode(["a cat"])["states"]
        torch.testing.assert_close(skipped, model.final_layer_norm(h.hidden_states[-2]))  # diffusers' clip_skip
    assert out["states"].shape == (2, 6, 32) and out["pooled"] is None and out["mask"][0].sum() == 4
    assert enc.truncated == 1 and capsys.readouterr().err.count("truncated") == 1
    enc.encode(["a cat a cat a cat a cat"])
    assert enc.truncated == 2 and "truncated" not in capsys.readouterr().err  # warned once


def test_sdxl_pair_concatenates_states_and_pools_the_second(tmp_path):
    pipe = save_sdxl(tmp_path / "xl")
    enc = TextEncoders.load(pipe)
    out = enc.encode(["a red square", ""])
    assert enc.family == "sdxl" and out["states"].shape == (2, 12, 48) and out["pooled"].shape == (2, 24)
    with torch.no_grad():
        ids = enc.tokenizers[1](["a red square"], padding="max_length", max_length=12, return_tensors="pt").input_ids
        second = enc.encoders[1](ids, output_hidden_states=True)
    torch.testing.assert_close(out["pooled"][:1], second.text_embeds)
    torch.testing.assert_close(out["states"][:1, :, 32:], second.hidden_states[-2])  # penultimate, no final norm


# -- conditioning ----------------------------------------------------------------------------------------------
def test_caption_draws_and_dropout_keep_the_micro_conditions():
    states = torch.arange(4.0)[:, None, None].expand(4, 2, 3).clone()  # rows 0..2 captions, 3 the empty prompt
    time_ids = torch.arange(24.0).view(4, 6)
    table = TextTable(states, torch.ones(4, 2, dtype=torch.bool), None, time_ids, 3, torch.tensor([0, 2]),
                      torch.tensor([2, 1]))
    group = torch.tensor([0] * 200 + [1] * 200)
    codes = TextCaptions(table, 0.0, torch.Generator().manual_seed(0))(group)
    assert set(codes[:200].tolist()) == {0, 1} and set(codes[200:].tolist()) == {2}  # one of the group's captions
    dropped = TextCaptions(table, 1.0, torch.Generator().manual_seed(0))(group)
    assert (dropped >= 4).all()
    g = table.gather(dropped[:3], 3, torch.float32)
    assert (g["states"] == 3).all()  # the empty prompt's encoding
    torch.testing.assert_close(g["time_ids"], time_ids[dropped[:3] % 4])  # the image's own micro-conditions
    some = TextCaptions(table, 0.5, torch.Generator().manual_seed(0))(group)
    assert 0.4 < (some >= 4).float().mean() < 0.6


# -- SD 1.x-shaped: prepare, train, resume exactly, sample with prompts ------------------------------------------
def test_sd1_prepare_records_both_identities(sd1):
    m = json.loads((sd1["lat"] / "fasttrain-manifest.json").read_text())
    assert m["latents"]["vae"]["class"] == "AutoencoderKL" and m["text"]["family"] == "sd1"
    assert m["text"]["captions"] == 12 and m["text"]["width"] == 32 and m["text"]["length"] == 12
    assert set(m["text"]["encoders"]["sha256"]) == {"text_encoder"}
    saved = torch.load(sd1["lat"] / "text-embeddings.pt", weights_only=True)
    assert saved["states"].dtype == torch.float16 and saved["states"].shape == (13, 12, 32)  # + the empty prompt
    assert saved["counts"].tolist() == [1, 1, 1, 1, 2, 2, 2, 2]  # blue first (sorted files), red two lines


def test_sd1_train_resume_exactly_and_sample_with_prompts(sd1, tmp_path):
    common = TRAIN + [f"data.root={sd1['lat']}", f"model.args.pretrained={sd1['pipe']}"]
    train(load_config("default", [f"run_dir={tmp_path / 'a'}", "train.steps=6"] + common))
    train(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=3"] + common))
    train(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=6"] + common, resume=True), resume=True)
    loss = [[r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
             if "loss" in r] for x in "ab"]
    assert len(loss[0]) == 6 and loss[0] == loss[1]
    sa, sb = (torch.load(tmp_path / x / "last.pt", weights_only=True)["model"] for x in "ab")
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    b = ModelBundle.load(tmp_path / "a", device="cpu")
    assert b.spec.text["family"] == "sd1" and b.cfg.diffusion.schedule == "scaled_linear"  # the pipeline's scheduler
    x1 = b.generate(2, prompts=["a red square"], steps=2, guidance=3.0)
    x2 = b.generate(2, prompts=["a blue circle"], steps=2, guidance=3.0)
    assert x1.shape == (2, 4, 8, 8) and not torch.equal(x1, x2)  # the prompt reaches the network
    out = tmp_path / "s"
    assert main(["sample", "--ckpt", str(tmp_path / "a"), "--n", "2", "--steps", "2", "--prompt", "a red square",
                 "--negative-prompt", "a blue circle", "--guidance", "2", "--out", str(out)]) == 0
    assert (out / "00001.png").is_file()


def test_sample_refuses_text_encoders_that_are_not_the_runs(sd1, tmp_path, capsys):
    run = tmp_path / "run"
    train(load_config("default", [f"run_dir={run}", "train.steps=1", "sample.num=0", f"data.root={sd1['lat']}",
                                  f"model.args.pretrained={sd1['pipe']}"] + TRAIN))
    other = tiny_clip(tmp_path / "other", ["a", "cat"], width=32, max_length=12, seed=5)
    assert main(["sample", "--ckpt", str(run), "--n", "1", "--steps", "1", "--text-encoders", str(other),
                 "--out", str(tmp_path / "s")]) == 1
    assert "text_encoder is not the text encoder of this run" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(run), "--n", "1", "--label", "1", "--out", str(tmp_path / "s2")]) == 1
    assert "conditioned on text (use --prompt)" in capsys.readouterr().err


# -- SDXL-shaped: the pair, pooled vector and micro-conditions -------------------------------------------------
def test_sdxl_prepare_train_and_sample(tmp_path):
    pipe = save_sdxl(tmp_path / "xl")
    lat = _prepare(tmp_path, pipe, "xl-lat")
    m = json.loads((lat / "fasttrain-manifest.json").read_text())["text"]
    assert m["family"] == "sdxl" and m["pooled"] == 24 and m["micro"] and m["width"] == 48
    saved = torch.load(lat / "text-embeddings.pt", weights_only=True)
    assert saved["time_ids"][0].tolist() == [20, 24, 0, 2, 16, 16]  # h 20, w 24 → 16×19, centre crop at x 2
    run = tmp_path / "run"
    train(load_config("default", [f"run_dir={run}", "train.steps=2", f"data.root={lat}",
                                  f"model.args.pretrained={pipe}"] + TRAIN))
    b = ModelBundle.load(run, device="cpu")
    x = b.generate(2, prompts=["a red square", "a blue circle"], steps=2, guidance=2.0)
    assert torch.isfinite(x).all() and x.shape == (2, 4, 8, 8)
    assert b.prompts.table(["a red square"]).time_ids[0].tolist() == [16, 16, 0, 0, 16, 16]  # uncropped, trained size


def test_sdxl_unet_without_micro_conditions_is_refused(sd1, tmp_path):
    xl = save_sdxl(tmp_path / "xl")
    cfg = load_config("default", [f"run_dir={tmp_path / 'r'}", "train.steps=1", f"data.root={sd1['lat']}",
                                  f"model.args.pretrained={xl}"] + TRAIN)
    with pytest.raises(InvalidInput, match="SDXL's.*needs the pooled text vector.*no pooled vector"):
        train(cfg)


# -- refusals ------------------------------------------------------------------------------------------------
def test_sd3_without_captions_and_shuffle_caption_are_refused_with_the_reason(sd1, tmp_path):
    # SD3 itself trains since part B2 (tests/export/test_sd3.py); on uncaptioned data it is a text network's refusal
    with pytest.raises(InvalidInput, match="'SD3Transformer2DModel' is conditioned on text, and data.name=digits"):
        load_config("default", [f"run_dir={tmp_path}", "model.name=diffusers",
                                "model.args.class_name=SD3Transformer2DModel"])
    with pytest.raises(InvalidInput, match="shuffle_caption=true needs the text encoder run live"):
        load_config("default", [f"run_dir={tmp_path}", f"data.root={sd1['lat']}", "data.shuffle_caption=true",
                                f"model.args.pretrained={sd1['pipe']}"] + TRAIN)


def test_prepare_refuses_uncaptioned_images_and_other_encoders(sd1, tmp_path, capsys):
    images = write_captioned(tmp_path / "img", n=2)
    (images / "red1.txt").unlink()
    args = ["data", "prepare", str(images), "--vae", str(sd1["pipe"]), "--vae-subfolder", "vae", "--text-encoders",
            str(sd1["pipe"]), "--latents-out", str(tmp_path / "lat"), "--image-size", "16"]
    assert main(args) == 1
    assert "1 of 4 images have no .txt caption beside it (e.g. red1.png)" in capsys.readouterr().err
    assert main(args + ["--allow-empty-captions"]) == 0
    other = tiny_clip(tmp_path / "other", ["a"], width=32, max_length=12, seed=3)
    args[args.index("--text-encoders") + 1] = str(other)
    assert main(args + ["--allow-empty-captions"]) == 1
    assert "holds text embeddings of other text encoders" in capsys.readouterr().err


# -- the CPU demo's data ---------------------------------------------------------------------------------------
DEMO = ["train.threads=1", "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false"]


def test_digits_text_trains_samples_by_prompt_and_reports_the_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train(load_config("digits-text", [f"run_dir={run}", "train.steps=3"] + DEMO + [
        "sample.num=6", "sample.steps=2", "sample.prompts=[a handwritten two,the digit nine]",
        "eval.num_samples=20", "eval.steps=2"]))
    b = ModelBundle.load(run, device="cpu")
    assert b.spec.text["prompts"][7] == "a handwritten seven" and b.spec.num_classes == 0
    x = b.generate(2, prompts=["the digit three"], steps=2, guidance=2.0)
    assert x.shape == (2, 1, 8, 8)
    ev = json.loads((run / "summary.json").read_text())["eval"]
    assert 0 <= ev["digits_label_agreement"] <= 1  # the classifier against the prompts' digits
    assert json.loads((run / "sample-prompts.json").read_text())["columns"] == ["a handwritten two", "the digit nine"]
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "One column per prompt" in page and "<li>the digit nine</li>" in page


@pytest.mark.parametrize("over", [
    ["diffusion.sampler=adaptive", "diffusion.sampler_args.every=2", "diagnostics.interference_every=2",
     "diagnostics.buckets=2"],
    ["diffusion.prediction=mixed", "diffusion.mixed.gate=timestep", "diffusion.stats_every=2"],
    ["diffusion.noise.immiscible=assignment", "diffusion.noise.offset=0.05", "diffusion.prediction=v",
     "diffusion.loss.type=huber", "diffusion.sampler=logit_normal"],
    ["diffusion.schedule=flow", "diffusion.prediction=flow", "diffusion.weighting=constant", "data.batch_size=8",
     "train.grad_accum=2"],
])
def test_text_runs_compose_with_strategies_and_resume_exactly(tmp_path, monkeypatch, over):
    """The caption code travels where labels travel: look-ahead probes, the adaptive sampler's batches,
    the interference probes, immiscible assignment, micro-batches; a resumed run continues bit for bit."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    common = DEMO + ["train.log_every=1", "train.ckpt_every=0", "data.batch_size=8"] + over
    train(load_config("digits-text", [f"run_dir={tmp_path / 'a'}", "train.steps=4"] + common))
    train(load_config("digits-text", [f"run_dir={tmp_path / 'b'}", "train.steps=2"] + common))
    train(load_config("digits-text", [f"run_dir={tmp_path / 'b'}", "train.steps=4"] + common, resume=True),
          resume=True)
    la, lb = ([r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in "ab")
    assert len(la) == 4 and la == lb and all(v == v for v in la)


# -- the pipeline's scheduler, per-block AC and compile, FLOPs ---------------------------------------------------
def test_a_v_model_pipeline_trains_as_v_and_a_contradiction_is_one_line(sd1, tmp_path):
    pipe = save_sd1(tmp_path / "sd2", prediction="v_prediction")  # an SD 2-style v-model
    common = [f"run_dir={tmp_path / 'r'}", f"data.root={sd1['lat']}", f"model.args.pretrained={pipe}"] + TRAIN
    assert load_config("default", common).diffusion.prediction == "v"
    with pytest.raises(InvalidInput, match="diffusion.prediction.*eps.*v"):
        load_config("default", common + ["diffusion.prediction=eps"])


@pytest.mark.parametrize("parallel", [["parallel.ac=full"]])  # parallel.compile=blocks also matches: 3 min cold
def test_text_unet_under_activation_checkpointing_matches_eager(sd1, tmp_path, parallel):
    common = ["train.steps=2", f"data.root={sd1['lat']}", f"model.args.pretrained={sd1['pipe']}"] + TRAIN
    train(load_config("default", [f"run_dir={tmp_path / 'eager'}"] + common))
    train(load_config("default", [f"run_dir={tmp_path / 'wrapped'}"] + common + parallel))
    la, lb = ([r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in ("eager", "wrapped"))
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-6)


def test_forward_flops_of_a_text_unet(sd1):
    from fasttrain.models import forward_flops

    text = json.loads((sd1["lat"] / "fasttrain-manifest.json").read_text())["text"]
    flops = forward_flops("diffusers", in_channels=4, image_size=8, class_name="UNet2DConditionModel",
                          config={**UNET, "cross_attention_dim": 32}, text=text)
    assert flops > 0


def test_sd3_text_encoders_pad_clip_to_t5_and_append_its_states(tmp_path):
    """SD3's CLIP pair (both with projection) without text_encoder_3: T5's part is zeros, as in
    StableDiffusion3Pipeline; pooled = both CLIP text_embeds."""
    tiny_clip(tmp_path, ["a", "cat"], width=16, max_length=8, projection=8)
    tiny_clip(tmp_path, ["a", "cat"], width=24, max_length=8, projection=12, seed=1, subfolder="_2")
    enc = TextEncoders.load(tmp_path)
    enc.t5_width = 64  # the transformer's joint_attention_dim
    out = enc.encode(["a cat"])
    assert enc.family == "sd3" and out["states"].shape == (1, 8 + 256, 64) and out["pooled"].shape == (1, 20)
    assert (out["states"][:, 8:] == 0).all() and (out["states"][:, :8, 40:] == 0).all()
    assert out["states"][:, :8, :40].abs().sum() > 0


def test_sd3_text_encoders_with_t5(tmp_path):
    from text_fixtures import save_tiny_t5

    tiny_clip(tmp_path, ["a", "cat"], width=16, max_length=8, projection=8)
    tiny_clip(tmp_path, ["a", "cat"], width=24, max_length=8, projection=12, seed=1, subfolder="_2")
    save_tiny_t5(tmp_path, width=64)
    enc = TextEncoders.load(tmp_path)
    out = enc.encode(["a cat"])
    assert enc.family == "sd3" and out["states"].shape == (1, 8 + 256, 64) and set(enc.identity()["sha256"]) == {
        "text_encoder", "text_encoder_2", "text_encoder_3"}
    with torch.no_grad():
        ids = enc.tokenizers[2](["a cat"], padding="max_length", max_length=256, truncation=True,
                                return_tensors="pt").input_ids
        torch.testing.assert_close(out["states"][:, 8:], enc.encoders[2](ids)[0])  # T5's states follow CLIP's
    assert out["mask"][0, 8:].sum() == 3  # "▁a", "▁cat", "</s>"
