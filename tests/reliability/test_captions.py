"""Class 2: captions and the text encoders. A caption file that is empty, blank or not UTF-8; a
metadata.jsonl that is malformed, names missing files or lacks the caption column; a tokenizer larger than
its encoder's table; a pipeline folder missing the encoders its class needs (SDXL's text_encoder_2, SD3's
text_encoder_3); a damaged config.json, safetensors or tokenizer; all refused in one line by `data prepare`
BEFORE any latent is written. Captions longer than the tokenizer: truncated, warned once with the count;
`sample --prompt` empty: one line; a 10 000-character prompt: truncated and warned; `--text-encoders`
that are not the run's: one line."""
import json
import shutil

import pytest
from common import files, one_line
from text_fixtures import save_sd1, save_sdxl, write_captioned

from fasttrain.cli import main

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return save_sd1(tmp_path_factory.mktemp("captions") / "sd1")


def _prepare(images, pipe, out):
    return main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(out), "--image-size", "16", "--batch-size", "4"])


def _rows(images, **change):
    rows = [json.loads(x) for x in (images / "metadata.jsonl").read_text().splitlines()]
    return [{**r, **change} for r in rows]


def _caption_damage(images, how):
    if how == "empty file":
        (images / "red0.txt").write_text("")
    elif how == "blank file":
        (images / "red0.txt").write_text("  \n\t\n")
    elif how == "latin-1 file":
        (images / "red0.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    elif how == "malformed jsonl":
        with open(images / "metadata.jsonl", "a") as f:
            f.write("{oops\n")
    elif how == "jsonl naming a missing file":
        with open(images / "metadata.jsonl", "a") as f:
            f.write(json.dumps({"file_name": "ghost.png", "text": "a ghost"}) + "\n")
    elif how == "jsonl without the caption column":
        rows = [{"file_name": r["file_name"], "caption": r["text"]} for r in _rows(images)]
        (images / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")


CAPTIONS = {"empty file": "1 of 8 images have no .txt caption beside it (e.g. red0.png)",
            "blank file": "1 of 8 images have no .txt caption beside it (e.g. red0.png)",
            "latin-1 file": "red0.txt: not UTF-8 text (byte 3)",
            "malformed jsonl": "metadata.jsonl line 9: not a JSON object",
            "jsonl naming a missing file": "1 row(s) name files that are not in",
            "jsonl without the caption column": "no row has a 'text' column (its columns: caption)"}


@pytest.mark.parametrize("how", list(CAPTIONS))
def test_bad_captions_are_one_line_and_no_latent_is_written(sd1, tmp_path, capsys, how):
    images = write_captioned(tmp_path / "img", metadata="jsonl" in how)
    _caption_damage(images, how)
    capsys.readouterr()
    assert _prepare(images, sd1, tmp_path / "lat") == 1
    one_line(capsys, CAPTIONS[how], notes=True)
    assert not (tmp_path / "lat").exists()


def _encoder_damage(pipe, how):
    te = pipe / "text_encoder"
    if how == "cut-off config.json":
        text = (te / "config.json").read_text()
        (te / "config.json").write_text(text[: len(text) // 2])
    elif how == "truncated safetensors":
        w = te / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif how == "cut-off tokenizer":
        t = pipe / "tokenizer" / "tokenizer.json"
        t.write_text(t.read_text()[:50])
    elif how == "tokenizer of a larger vocabulary":
        from safetensors.torch import load_file, save_file

        w = load_file(te / "model.safetensors")
        k = next(k for k in w if "token_embedding" in k)
        w[k] = w[k][:20].clone()
        save_file(w, te / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((te / "config.json").read_text())
        (te / "config.json").write_text(json.dumps({**cfg, "vocab_size": 20}))


ENCODERS = {"cut-off config.json": "text_encoder/config.json is not valid JSON",
            "truncated safetensors": "model.safetensors cannot be loaded by CLIPTextModel.from_pretrained",
            "cut-off tokenizer": "tokenizer: the tokenizer cannot be loaded",
            "tokenizer of a larger vocabulary": "tokens but text_encoder's embedding table 20 rows"}


@pytest.mark.parametrize("how", list(ENCODERS))
def test_damaged_text_encoders_are_one_line_before_any_latent(sd1, tmp_path, capsys, how):
    pipe = tmp_path / "pipe"
    shutil.copytree(sd1, pipe)
    _encoder_damage(pipe, how)
    capsys.readouterr()
    assert _prepare(write_captioned(tmp_path / "img"), pipe, tmp_path / "lat") == 1
    one_line(capsys, ENCODERS[how], str(pipe), notes=True)
    assert not (tmp_path / "lat").exists()


def test_a_pipeline_missing_the_encoders_its_class_needs(tmp_path, capsys):
    from text_fixtures import save_sd3

    xl = save_sdxl(tmp_path / "xl")
    shutil.rmtree(xl / "text_encoder_2")
    sd3 = save_sd3(tmp_path / "sd3")
    shutil.rmtree(sd3 / "text_encoder_3")
    images = write_captioned(tmp_path / "img", n=1)
    capsys.readouterr()
    for pipe, needle in ((xl, "StableDiffusionXLPipeline needs text_encoder_2"),
                         (sd3, "StableDiffusion3Pipeline needs text_encoder_3")):
        assert _prepare(images, pipe, tmp_path / "lat") == 1
        one_line(capsys, f"{pipe} holds no", needle, notes=True)
    assert not (tmp_path / "lat").exists()
    # a folder saved without T5 on purpose (model_index.json: [null, null]) encodes with zeros in its place
    index = json.loads((sd3 / "model_index.json").read_text())
    (sd3 / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None],
                                                      "tokenizer_3": [None, None]}))
    shutil.rmtree(sd3 / "tokenizer_3")
    assert _prepare(images, sd3, tmp_path / "lat") == 0


def test_long_captions_and_prompts_are_counted_and_hostile_prompts_refused(sd1, tmp_path, capsys):
    images = write_captioned(tmp_path / "img", n=2)
    for k in range(2):
        (images / f"red{k}.txt").write_text("a red square " * 20)  # beyond the tokenizer's 12 tokens
    capsys.readouterr()
    assert _prepare(images, sd1, tmp_path / "lat") == 0
    out = capsys.readouterr()
    assert out.err.count("are longer than the tokenizer's 12 tokens") == 1 and "2 prompt(s)" in out.err
    assert "2 truncated to the tokenizer's length" in out.out
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "data.name=captioned_latents", f"data.root={tmp_path / 'lat'}",
                 "data.batch_size=2", "model.name=diffusers", "model.args.class_name=UNet2DConditionModel",
                 "model.args.subfolder=unet", f"model.args.pretrained={sd1}", "train.steps=1", "sample.num=0",
                 "eval.num_samples=0", "eval.bpd=false", "train.progress=false", "train.threads=1"]) == 0
    base = ["sample", "--ckpt", str(run), "--n", "1", "--steps", "2"]
    capsys.readouterr()
    assert main(base + ["--out", str(tmp_path / "s0"), "--prompt", "  "]) == 1
    one_line(capsys, "--prompt: 1 of 1 prompt(s) are empty")
    assert main(base + ["--out", str(tmp_path / "s1"), "--prompt", "a red square " * 770]) == 0  # 10 010 characters
    assert capsys.readouterr().err.count("1 prompt(s) are longer than the tokenizer's 12 tokens") == 1
    other = save_sd1(tmp_path / "other", seed=1)
    assert main(base + ["--out", str(tmp_path / "s2"), "--text-encoders", str(other), "--prompt", "a cat"]) == 1
    one_line(capsys, "text_encoder is not the text encoder of this run")
    assert files(tmp_path / "s0") == [] and files(tmp_path / "s2") == []
