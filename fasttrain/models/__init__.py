"""Model registry: name → factory. Models take (x_t, t, y=None) and return the prediction."""
from __future__ import annotations

import inspect
from functools import partial

from torch import nn

from .dit import DiT
from .mlp import MLPDenoiser
from .unet import UNet

MODELS = {
    # ~0.3M parameters: the 8×8 digits recipe (shared/research/digits-recipe.md).
    "unet_tiny": partial(UNet, ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,), heads=4),
    "unet_small": partial(UNet, ch=64, ch_mult=(1, 2, 2), num_res_blocks=2, attn_resolutions=(8,), heads=4),
    "dit_tiny": partial(DiT, patch=2, hidden=128, depth=4, heads=4),
    "mlp": MLPDenoiser,
}


def model_args(name: str) -> tuple[str, ...]:
    """Keyword arguments a registry entry accepts (for config validation)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    fn = MODELS[name]
    target = fn.func if isinstance(fn, partial) else fn
    return tuple(p for p in inspect.signature(target).parameters if p != "self")


def build_model(name: str, *, in_channels: int, image_size: int | None = None, num_classes: int = 0,
                **overrides) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    unknown = sorted(set(overrides) - set(model_args(name)))
    if unknown:
        raise ValueError(f"model {name!r} got unknown argument {unknown[0]!r} (it takes: {', '.join(model_args(name))})")
    kwargs = dict(in_channels=in_channels, num_classes=num_classes, **overrides)
    if name != "mlp":
        kwargs["image_size"] = image_size
    return MODELS[name](**kwargs)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
