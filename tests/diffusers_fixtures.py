"""Tiny diffusers models saved with `save_pretrained`, for the tests that load them back the way users'
folders are loaded (no hub is reachable here)."""
import torch


def save_tiny_vae(path, seed: int = 0, latent_channels: int = 4, scaling_factor: float = 0.5,
                  shift_factor: float | None = None):
    """An AutoencoderKL: 3×16×16 images ↔ latent_channels×8×8 latents (43.7 k parameters)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                        latent_channels=latent_channels, norm_num_groups=4, sample_size=16,
                        scaling_factor=scaling_factor, shift_factor=shift_factor)
    vae.save_pretrained(str(path))
    return path


TINY_UNET = {"block_out_channels": [16, 32], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
             "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1, "norm_num_groups": 8,
             "attention_head_dim": 8}


def save_tiny_unet(path, in_channels: int = 1, sample_size: int = 8, num_class_embeds: int | None = 11,
                   seed: int = 0):
    """A UNet2DModel (digits-sized by default: 1×8×8, 10 classes and a null row)."""
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    unet = UNet2DModel(sample_size=sample_size, in_channels=in_channels, out_channels=in_channels,
                       num_class_embeds=num_class_embeds, **TINY_UNET)
    unet.save_pretrained(str(path))
    return path


def perturbed_run(src, dst, scale: float = 0.05, seed: int = 0):
    """A copy of a run's last.pt whose model and EMA weights have noise added: a few training steps leave
    adaLN-zero and zero-initialised output layers near 0, where any conversion looks exact."""
    import shutil

    st = torch.load(src / "last.pt", weights_only=True)
    g = torch.Generator().manual_seed(seed)
    for sd in (st["model"], st["ema"]["shadow"]):
        for k, v in sd.items():
            if v.is_floating_point():
                sd[k] = v + scale * torch.randn(v.shape, generator=g)
    dst.mkdir(parents=True)
    for f in ("config.yaml", "metrics.jsonl"):
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    torch.save(st, dst / "last.pt")
    return dst
