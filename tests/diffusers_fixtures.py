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


DIT = {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2}  # a DiTTransformer2DModel
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


def fake_run(path, overrides, latents: dict | None = None, scale: float = 0.05, seed: int = 0, classes: int = 10):
    """A run folder whose last.pt holds a freshly built network of the config `overrides` (digits-shaped
    1×8×8 data, or the 4×8×8 latents of the record `latents`; `classes` classes unless the config
    says model.class_conditional=false), its weights moved off the zero
    initialisation by `scale`·N(0, 1), without training: for the tests that export or load many
    configurations."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from fasttrain import checkpoint as ckpt
    from fasttrain.bundle import DataSpec, build_network
    from fasttrain.configure import load_config
    from fasttrain.optim.ema import clean_name

    cfg = load_config("default", [f"run_dir={path}"] + list(overrides))
    classes = classes if cfg.model.class_conditional else 0
    names = [f"class {i}" for i in range(classes)] if classes else None
    spec = (DataSpec("latents", latents["channels"], 8, classes, 0.1, latents, names) if latents
            else DataSpec("digits", 1, 8, classes, 0.1, None, names))
    torch.manual_seed(seed)
    net = build_network(cfg, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    shadow = {clean_name(n): p.detach().clone() for n, p in net.named_parameters()}
    state = {"format": ckpt.FORMAT, "config": OmegaConf.to_container(cfg), "data_spec": asdict(spec),
             "model": net.state_dict(), "ema": {"n": 1, "shadow": shadow},
             "train": {"step": 1, "images": 4, "skipped": 0}}
    ckpt.save_file(path / "last.pt", state)
    return path
