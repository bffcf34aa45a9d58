"""Tiny Stable-Diffusion-shaped pipeline folders built and saved locally (random weights, tokenizers built
from a word list: no hub is reachable here): an SD 1.x-shaped one (CLIP + UNet2DConditionModel + VAE) and an
SDXL-shaped one (the CLIP pair, the UNet's text_time embedding), and captioned image folders."""
import json

import numpy as np
import torch
from diffusers_fixtures import save_tiny_vae
from PIL import Image

from fasttrain.pretrained.text_encoders import tiny_clip

WORDS = ["a", "red", "blue", "square", "circle", "photo", "of", "cat", "dog"]
UNET = {"block_out_channels": [16, 32], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 1, "norm_num_groups": 8,
        "attention_head_dim": 8, "sample_size": 8}


def save_sd1(path, seed: int = 0, prediction: str = "epsilon"):
    """tokenizer/, text_encoder/ (CLIP width 32), vae/ (3×16×16 ↔ 4×8×8), unet/, scheduler/, model_index.json."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    tiny_clip(path, WORDS, width=32, max_length=12, seed=seed)
    save_tiny_vae(path / "vae", seed=seed)
    torch.manual_seed(seed)
    UNet2DConditionModel(in_channels=4, out_channels=4, cross_attention_dim=32, **UNET).save_pretrained(path / "unet")
    DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                  prediction_type=prediction).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    return path


def save_sdxl(path, seed: int = 0):
    """The SDXL pair (CLIP 32 + CLIP-with-projection 16, pooled 24: states 48 wide), a VAE and a UNet with
    addition_embed_type text_time (pooled 24 + 6 × 8 micro-condition features)."""
    from diffusers import UNet2DConditionModel

    tiny_clip(path, WORDS, width=32, max_length=12, seed=seed)
    tiny_clip(path, WORDS, width=16, max_length=12, projection=24, seed=seed + 1, subfolder="_2")
    save_tiny_vae(path / "vae", seed=seed)
    torch.manual_seed(seed)
    UNet2DConditionModel(in_channels=4, out_channels=4, cross_attention_dim=48, addition_embed_type="text_time",
                         addition_time_embed_dim=8, projection_class_embeddings_input_dim=24 + 6 * 8,
                         **UNET).save_pretrained(path / "unet")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    return path


CAPTIONS = {"red": ["a red square", "a photo of a red square"], "blue": ["a blue circle"]}


def write_captioned(root, n: int = 4, size=(20, 24), metadata: bool = False):
    """n red and n blue images with .txt captions beside them (red: two lines, two alternatives), or a
    diffusers metadata.jsonl (`metadata`)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for colour, rgb in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        for k in range(n):
            arr = np.zeros(size + (3,), np.uint8) + np.array(rgb, np.uint8)
            arr[k % size[0]] = 128  # images differ
            name = f"{colour}{k}.png"
            Image.fromarray(arr).save(root / name)
            if metadata:
                rows.append({"file_name": name, "text": CAPTIONS[colour]})
            else:
                (root / name).with_suffix(".txt").write_text("\n".join(CAPTIONS[colour]) + "\n")
    if metadata:
        (root / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def save_tiny_t5(path, words=WORDS, width: int = 64, seed: int = 0, subfolder: str = "_3"):
    """tokenizer_3/ (a unigram T5 tokenizer of `words` and single letters) and text_encoder_3/ (a
    2-layer T5EncoderModel of width `width`), as an SD3 pipeline holds them (Flux: `subfolder` "_2")."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -1.0) for w in words]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz▁"]
    T5Tokenizer(vocab=vocab, extra_ids=0).save_pretrained(str(path / f"tokenizer{subfolder}"))
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=len(vocab), d_model=width, d_kv=16, d_ff=2 * width, num_layers=2, num_heads=4)
    T5EncoderModel(cfg).save_pretrained(str(path / f"text_encoder{subfolder}"))
    return path


SD3 = {"sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 2,
       "attention_head_dim": 8, "num_attention_heads": 2, "caption_projection_dim": 16, "pos_embed_max_size": 8}


def save_sd3(path, seed: int = 0, shift: float = 3.0):
    """An SD3-shaped pipeline: CLIP-L/G-shaped pair (widths 16 and 24, projections 8 and 12: pooled 20), a T5 of
    width 64 (joint_attention_dim), a VAE, a 2-block SD3Transformer2DModel and SD3's scheduler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    tiny_clip(path, WORDS, width=16, max_length=12, projection=8, seed=seed)
    tiny_clip(path, WORDS, width=24, max_length=12, projection=12, seed=seed + 1, subfolder="_2")
    save_tiny_t5(path, width=64, seed=seed)
    save_tiny_vae(path / "vae", seed=seed, scaling_factor=1.5, shift_factor=0.1)  # SD3's VAE shifts, then scales
    torch.manual_seed(seed)
    SD3Transformer2DModel(joint_attention_dim=64, pooled_projection_dim=20, **SD3).save_pretrained(
        path / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=shift).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    return path
