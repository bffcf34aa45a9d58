"""Model registry: name → factory. Models take (x_t, t, y=None) and return the prediction."""
from __future__ import annotations

import inspect
from functools import partial

from torch import nn

import torch

from .dit import DIT_SIZES, DiT
from .mlp import MLPDenoiser
from .unet import UNet, unet_blocks

MODELS = {
    # CPU presets: the 8×8 digits recipe (shared/research/digits-recipe.md) and friends
    "unet_tiny": partial(UNet, ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,), heads=4),
    "unet_small": partial(UNet, ch=64, ch_mult=(1, 2, 2), num_res_blocks=2, attn_resolutions=(8,), heads=4),
    "dit_tiny": partial(DiT, patch=2, hidden=128, depth=4, heads=4),
    "mlp": MLPDenoiser,
    # ADM (Dhariwal & Nichol 2021, Table 14 / iDDPM): CIFAR-10 32², ImageNet 64², 256² (64 channels per head)
    "adm_32": partial(UNet, ch=128, ch_mult=(1, 2, 2, 2), num_res_blocks=3, attn_resolutions=(16, 8),
                      head_channels=64, dropout=0.1),
    "adm_64": partial(UNet, ch=192, ch_mult=(1, 2, 3, 4), num_res_blocks=3, attn_resolutions=(32, 16, 8),
                      head_channels=64, dropout=0.1),
    "adm_256": partial(UNet, ch=256, ch_mult=(1, 1, 2, 2, 4, 4), num_res_blocks=2, attn_resolutions=(32, 16, 8),
                       head_channels=64),
}
# DiT family (Peebles & Xie 2023, Table 1): dit_s2 … dit_xl8
for _size, (_h, _d, _n) in DIT_SIZES.items():
    for _p in (2, 4, 8):
        MODELS[f"dit_{_size}{_p}"] = partial(DiT, patch=_p, hidden=_h, depth=_d, heads=_n)


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


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units that parallel.py checkpoints, compiles and shards one by one."""
    if isinstance(model, DiT):
        return list(model.blocks)
    if isinstance(model, UNet):
        return unet_blocks(model)
    return []


def forward_flops(name: str, *, in_channels: int, image_size: int | None = None, num_classes: int = 0, **kw) -> int:
    """Forward FLOPs for one image (a multiply-add counts 2), counted by torch's FlopCounterMode on
    the meta device, so that XL models cost no memory. Training is about 3× this."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        m = build_model(name, in_channels=in_channels, image_size=image_size, num_classes=num_classes, **kw)
        shape = (1, in_channels) + ((image_size, image_size) if image_size else ())
        x, t = torch.empty(shape), torch.zeros(1, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with counter:
            m(x, t)
    return counter.get_total_flops()


def param_count(name: str, **kw) -> int:
    with torch.device("meta"):
        return count_params(build_model(name, **kw))
