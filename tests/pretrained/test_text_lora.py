"""Text-encoder LoRA and caption shuffling (issue 44 item 3; pretrained/text_lora.py) on tiny SD 1.x- and
SDXL-shaped pipelines with tag captions: with a zero adapter the live encoding is the cached one; the adapters
train at their own learning rate and resume exactly, shuffled captions included; the shuffle is sd-scripts'
process_caption and is drawn from the caption draw's generator; the diffusers-format export applied by
load_lora_weights changes the stock text encoders as fasttrain's adapted ones, the kohya file as the diffusers
one; the refusals are one line naming the key."""
import json
import random
import shutil

import pytest
import torch
from text_fixtures import save_sd1, save_sdxl, write_captioned
from text_runs import PROMPTS, TRAIN, same_samples

from fasttrain.cli import main
from fasttrain.conditioning import TextCaptions
from fasttrain.configure import load_config
from fasttrain.errors import DataError, InvalidInput
from fasttrain.pretrained import text_lora
from fasttrain.pretrained.text_encoders import TextEncoders
from fasttrain.train import Trainer, train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

TAGS = {"red": "cat, red, square, photo", "blue": "dog, blue, circle, a photo, of"}
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "model.lora.text_encoder=true",
        "optim.text_encoder_lr=5e-3"]
SHUFFLE = ["data.shuffle_caption=true", "data.keep_tokens=1"]


def prepare_tags(root, pipe, name="lat"):
    """A captioned folder whose captions are comma-separated tags (sd-scripts' style), prepared with `pipe`."""
    images = write_captioned(root / f"img-{name}", n=2)
    for txt in images.glob("*.txt"):
        txt.write_text(TAGS["red" if txt.name.startswith("red") else "blue"] + "\n")
    out = root / name
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(out), "--image-size", "16", "--batch-size", "4"]) == 0
    return out


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    root = tmp_path_factory.mktemp("telora")
    pipe = save_sd1(root / "pipe")
    return {"pipe": pipe, "lat": prepare_tags(root, pipe)}


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    root = tmp_path_factory.mktemp("telora-xl")
    pipe = save_sdxl(root / "pipe")
    return {"pipe": pipe, "lat": prepare_tags(root, pipe)}


def _cfg(data, run, steps, extra=(), resume=False):
    return load_config("default", [f"run_dir={run}", f"train.steps={steps}", "sample.num=0", f"data.root={data['lat']}",
                                   f"model.args.pretrained={data['pipe']}"] + TRAIN + LORA + list(extra),
                       resume=resume)


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# -- the shuffle -------------------------------------------------------------------------------------------------
def process_caption(caption: str, shuffle: bool, keep_tokens: int) -> str:
    """sd-scripts library/train_util.py BaseDataset.process_caption's tag path (no keep_tokens_separator, tag
    dropout or token warm-up), ported: python's global random shuffles the tags after the kept ones."""
    tokens = [t.strip() for t in caption.strip().split(",")]
    fixed_tokens = []
    flex_tokens = tokens[:]
    if keep_tokens > 0:
        fixed_tokens = flex_tokens[:keep_tokens]
        flex_tokens = tokens[keep_tokens:]
    if shuffle:
        random.shuffle(flex_tokens)
    return ", ".join(fixed_tokens + flex_tokens)


def test_shuffle_tags_is_sd_scripts_process_caption():
    captions = ["1girl, solo, red hair, smile, outdoors", " cat ,dog,  bird , ", "one tag", "a, b, c, d, e, f, g"]
    seen = set()
    for caption in captions:
        for keep in (0, 1, 2, 10):
            for seed in range(20):
                random.seed(seed)
                want = process_caption(caption, True, keep)
                got = text_lora.shuffle_tags(caption, keep, random.Random(seed))
                assert got == want
                tags = [t.strip() for t in caption.strip().split(",")]
                assert got.split(", ")[:keep] == tags[:keep] and sorted(got.split(", ")) == sorted(tags)
                seen.add((caption, got))
    assert len({g for c, g in seen if c == captions[0]}) > 10  # it does shuffle


def test_the_shuffle_is_drawn_from_the_caption_generator_and_rewrites_the_drawn_rows(sd1):
    enc = TextEncoders.load(sd1["pipe"])
    live = text_lora.LiveEncoders(enc)
    caps = [TAGS["blue"], TAGS["red"], "cat, dog"]
    table = text_lora.table(live, caps, [1, 2], None)
    before = [t.clone() for t in table.ids]
    group = torch.tensor([0, 1, 0, 1])

    def draw(seed):
        t = text_lora.table(live, caps, [1, 2], None)
        codes = TextCaptions(t, 0.0, torch.Generator().manual_seed(seed), keep_tokens=1)(group)
        return codes, t

    codes, t = draw(0)
    g = torch.Generator().manual_seed(0)  # the draws, replayed: the caption draw's, then one seed per sample
    u = torch.rand((2, 4), generator=g)
    seeds = torch.randint(0, 2**62, (4,), generator=g).tolist()
    offsets, counts = torch.tensor([0, 1, 0, 1]), torch.tensor([1, 2, 1, 2])
    rows = offsets + (u[0] * counts).long().clamp_max(counts - 1)
    assert codes.tolist() == rows.tolist()
    for r, s in zip(rows.tolist(), seeds):  # (an image twice in a batch: the last draw's order)
        want = text_lora.shuffle_tags(caps[r], 1, random.Random(s))
        assert want.split(", ")[0] == caps[r].split(", ")[0]  # keep_tokens=1: the first tag stays
    last = {r: s for r, s in zip(rows.tolist(), seeds)}
    for r, s in last.items():
        want_ids = enc.clip_ids([text_lora.shuffle_tags(caps[r], 1, random.Random(s))])[0][0]
        assert torch.equal(t.ids[0][r], want_ids)
    untouched = sorted(set(range(4)) - set(last))  # rows not drawn and the empty row keep their ids
    assert all(torch.equal(t.ids[0][r], before[0][r]) for r in untouched)
    assert all(torch.equal(a, b) for a, b in zip(draw(0)[1].ids, t.ids))  # seeded
    others = [draw(s)[1].ids[0] for s in range(1, 6)]
    assert any(not torch.equal(o, t.ids[0]) for o in others)


# -- live encoding -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_live_encoding_with_zero_adapters_is_the_cached_encoding(family, sd1, sdxl, tmp_path):
    data = sd1 if family == "sd1" else sdxl
    t = Trainer(_cfg(data, tmp_path / "run", 1))
    try:
        table = t.model.net.text_table
        live = text_lora.live_of(t.model)
        assert isinstance(table, text_lora.LiveTable) and live is not None and len(live.encoders) == (
            1 if family == "sd1" else 2)
        saved = torch.load(data["lat"] / "text-embeddings.pt", weights_only=True)
        n = table.rows
        with torch.no_grad():
            states, pooled = live(table.gather(torch.arange(n - 1), n - 1, torch.float32)["ids"])
            empty, _ = live(table.gather(None, 1, torch.float32)["ids"])
        assert torch.equal(states.half(), saved["states"][:-1]) and torch.equal(empty.half(), saved["states"][-1:])
        ref = TextEncoders.load(data["pipe"]).encode(table.texts)  # the cache's encoder, in float32
        assert torch.equal(states, ref["states"][:-1])
        if family == "sdxl":
            assert torch.equal(pooled.half(), saved["pooled"][:-1]) and torch.equal(pooled, ref["pooled"][:-1])
        else:
            assert pooled is None
        groups = [p["params"] for p in t.opt.param_groups]
        te = [g for g in t.opt.param_groups if g.get("text_encoder")]
        assert len(groups) == 2 and len(te) == 1 and te[0]["initial_lr"] == 5e-3
        assert t.opt.param_groups[0]["initial_lr"] == 1e-2
        names = {id(p): n for n, p in t.model.named_parameters()}
        assert all("text_encoders." in names[id(p)] and "lora_" in names[id(p)] for p in te[0]["params"])
    finally:
        t.close()


# -- training and resuming ---------------------------------------------------------------------------------------
def test_sd1_text_encoder_lora_with_shuffled_tags_trains_and_resumes_exactly(sd1, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(sd1, a, 4, SHUFFLE))
    train(_cfg(sd1, b, 2, SHUFFLE))
    train(_cfg(sd1, b, 4, SHUFFLE, resume=True), resume=True)
    assert len(_losses(a)) == 4 and _losses(a) == _losses(b)
    sa, sb = (torch.load(x / "last.pt", weights_only=True) for x in (a, b))
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=0, atol=0)
    te = {k: v for k, v in sa["model"].items() if "text_encoders." in k}
    assert te and all("lora_" in k for k in te)  # the adapter alone, no base weights
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in te.items())  # the encoder's adapter moved
    assert set(sa["ema"]["shadow"]) == set(sa["model"])  # the EMA holds it too
    from fasttrain.bundle import ModelBundle

    bundle = ModelBundle.load(a, device="cpu")
    assert isinstance(bundle.prompts.table(["cat, red"]), text_lora.LiveTable)  # sampling runs the adapted encoders
    x = bundle.generate(2, prompts=["cat, red, square"], steps=2, guidance=2.0)
    assert x.shape == (2, 4, 8, 8) and torch.isfinite(x).all()


# -- exports -----------------------------------------------------------------------------------------------------
def _encode(pipe, prompts, xl: bool):
    with torch.no_grad():
        if not xl:
            return pipe.encode_prompt(prompts, "cpu", 1, False)[0], None
        out = pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False)
    return out[0], out[2]


def _close(a, b):
    return float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


def _exports_apply_the_adapters(run, pipe_folder, tmp_path, cls, xl: bool):
    """export --to diffusers (the adapters merged; its samples fasttrain's), and --to lora / --to kohya applied by
    load_lora_weights to the stock base pipeline: the text encoders' outputs are the merged ones to 1e-5 (and
    differ from the base's), and the kohya file's latents are the diffusers file's."""
    full = tmp_path / "full"
    assert main(["export", str(run), "--to", "diffusers", str(full)]) == 0  # encode_prompt checked against ours
    same_samples(run, full, cls)  # fasttrain's samples, with its adapted encoders
    subs = ("unet", "text_encoder") + (("text_encoder_2",) if xl else ())
    base = tmp_path / "base"  # the stock pipeline the run started from (with the run's scheduler)
    shutil.copytree(full, base, ignore=shutil.ignore_patterns(*subs))
    for sub in subs:
        shutil.copytree(pipe_folder / sub, base / sub)
    lora_dir, kohya_dir = tmp_path / "lora", tmp_path / "kohya"
    assert main(["export", str(run), "--to", "lora", str(lora_dir)]) == 0
    assert main(["export", str(run), "--to", "kohya", str(kohya_dir)]) == 0
    kohya_file = next(kohya_dir.glob("*.safetensors"))
    from safetensors.torch import load_file

    keys = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    assert any(k.startswith("text_encoder.") for k in keys)
    assert any(k.startswith("text_encoder_2.") for k in keys) == xl
    kohya = load_file(str(kohya_file))
    assert all(f"{k.rsplit('.', 2)[0]}.alpha" in kohya for k in kohya if k.endswith("lora_down.weight"))

    plain, stock = cls.from_pretrained(base), cls.from_pretrained(full)  # stock: the merged encoders
    with_lora, with_kohya = cls.from_pretrained(base), cls.from_pretrained(base)
    with_lora.load_lora_weights(str(lora_dir))
    with_kohya.load_lora_weights(str(kohya_file))
    (s0, _), (s1, p1) = _encode(plain, PROMPTS, xl), _encode(stock, PROMPTS, xl)
    assert float((s1 - s0).abs().max()) > 1e-4  # the adapters change the encoding
    for pipe in (with_lora, with_kohya):
        s, p = _encode(pipe, PROMPTS, xl)
        assert _close(s, s1) and (p is None) == (not xl) and (p is None or _close(p, p1))

    def latents(pipe):
        return pipe(PROMPTS, num_inference_steps=3, guidance_scale=3.0, height=16, width=16, output_type="latent",
                    generator=[torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]).images

    assert _close(latents(with_kohya), latents(with_lora))
    return kohya


def test_sdxl_text_encoder_lora_resumes_and_both_exports_apply_it_in_diffusers(sdxl, tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    train(_cfg(sdxl, run, 3, SHUFFLE))
    train(_cfg(sdxl, other, 2, SHUFFLE))
    train(_cfg(sdxl, other, 3, SHUFFLE, resume=True), resume=True)
    assert len(_losses(run)) == 3 and _losses(run) == _losses(other)
    kohya = _exports_apply_the_adapters(run, sdxl["pipe"], tmp_path, diffusers.StableDiffusionXLPipeline, xl=True)
    assert any(k.startswith("lora_te1_") for k in kohya) and any(k.startswith("lora_te2_") for k in kohya)


def test_sd1_exports_apply_the_text_encoder_adapter_and_the_kohya_file_names_it_lora_te(sd1, tmp_path):
    run = tmp_path / "run"
    train(_cfg(sd1, run, 2))
    kohya = _exports_apply_the_adapters(run, sd1["pipe"], tmp_path, diffusers.StableDiffusionPipeline, xl=False)
    te = sorted({k.split(".")[0] for k in kohya if k.startswith("lora_te_")})
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in te and len(te) == 4 * 2  # 4 targets × 2 layers
    assert not any(k.startswith(("lora_te1_", "lora_te2_")) for k in kohya)


# -- refusals ----------------------------------------------------------------------------------------------------
def test_refusals_name_the_key(sd1, tmp_path):
    base = [f"run_dir={tmp_path / 'r'}", f"data.root={sd1['lat']}", f"model.args.pretrained={sd1['pipe']}"] + TRAIN
    with pytest.raises(InvalidInput, match=r"'data.shuffle_caption'.*needs the text encoder run live"):
        load_config("default", base + ["data.shuffle_caption=true"])
    with pytest.raises(InvalidInput, match=r"'data.keep_tokens': 2 \(.*data.shuffle_caption=true"):
        load_config("default", base + LORA + ["data.keep_tokens=2"])
    with pytest.raises(InvalidInput, match=r"'model.lora.text_encoder': True \(needs model.lora.rank > 0"):
        load_config("default", base + ["model.lora.text_encoder=true"])
    with pytest.raises(InvalidInput, match=r"'optim.text_encoder_lr': 0.001 \(the text encoders train only"):
        load_config("default", base + ["optim.text_encoder_lr=1e-3"])
    with pytest.raises(InvalidInput, match=r"'model.lora.text_encoder': True \(text-encoder LoRA is for SD 1.x/2.x"):
        load_config("default", [f"run_dir={tmp_path / 'f'}", "data.name=captioned_latents", f"data.root={sd1['lat']}",
                                "model.name=diffusers", "model.args.class_name=SD3Transformer2DModel",
                                "diffusion.schedule=flow", "diffusion.prediction=flow",
                                "model.args.config={sample_size: 8}"] + LORA)
    with pytest.raises(InvalidInput, match=r"'model.lora.text_encoder_targets': \['fc9'\] match no module"):
        train(_cfg(sd1, tmp_path / "t", 1, ["model.lora.text_encoder_targets=[fc9]"]))
    old = tmp_path / "old"  # a folder prepared before the captions' text was kept
    shutil.copytree(sd1["lat"], old)
    saved = torch.load(old / "text-embeddings.pt", weights_only=True)
    del saved["captions"]
    torch.save(saved, old / "text-embeddings.pt")
    with pytest.raises(DataError, match=r"'model.lora.text_encoder': True \(.*not the captions' text.*data prepare"):
        train(_cfg({"lat": old, "pipe": sd1["pipe"]}, tmp_path / "o", 1))
