"""A tiny FLUX.1-shaped pipeline folder built and saved locally (random weights, tokenizers built from a word
list: no hub is reachable here), loaded as a user's local FLUX.1-dev/schnell folder is (FluxPipeline.from_pretrained
works on it): text_encoder/ + tokenizer/ (CLIP-L-shaped CLIPTextModel: its pooled output), text_encoder_2/ +
tokenizer_2/ (T5), vae/ (16 latent channels, shift_factor), transformer/ (FluxTransformer2DModel: 1 double + 1
single block, 2 heads of 16, rope axes 4+6+6), scheduler/ (FlowMatchEulerDiscreteScheduler: FLUX.1-dev's dynamic
shifting, or a static shift as FLUX.1-schnell's), model_index.json."""
import json

import torch
from diffusers_fixtures import save_tiny_vae
from text_fixtures import WORDS, save_tiny_t5

from fasttrain.pretrained.text_encoders import tiny_clip

FLUX = {"patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 24, "axes_dims_rope": [4, 6, 6]}
# FLUX.1-dev's scheduler_config.json: dynamic shifting (the shift 3.0 is unused with it)
DEV_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                 "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def save_flux(path, seed: int = 0, guidance_embeds: bool = True, scheduler: dict | None = None):
    """The folder `path` (see the module docstring); `scheduler`: FlowMatchEulerDiscreteScheduler's config
    (default FLUX.1-dev's)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    tiny_clip(path, WORDS, width=24, max_length=12, seed=seed)  # CLIPTextModel: pooler_output 24 wide
    save_tiny_t5(path, width=32, seed=seed, subfolder="_2")
    save_tiny_vae(path / "vae", seed=seed, latent_channels=16, scaling_factor=1.5, shift_factor=0.1)
    torch.manual_seed(seed)
    FluxTransformer2DModel(guidance_embeds=guidance_embeds, **FLUX).save_pretrained(path / "transformer")
    FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if scheduler is None else scheduler)).save_pretrained(
        path / "scheduler")
    index = {"_class_name": "FluxPipeline", "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer_2": ["transformers", "T5Tokenizer"],
             "transformer": ["diffusers", "FluxTransformer2DModel"], "image_encoder": [None, None],
             "feature_extractor": [None, None]}  # as FluxPipeline.save_pretrained writes it
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path
