"""Model registry: name → factory. Models take (x_t, t, y=None) and return the prediction (any number
of output channels: `out_channels`), and declare their repeated blocks (`repeated_blocks()`), which
parallel/wrap.py checkpoints, compiles and shards. A model family is one module of this package that
registers its presets (`@register` / `register(name)(factory)`); every module here is imported below:
`unet.py` (ADM-style UNets), `dit.py` (DiT), `mlp.py` (2-D points), `diffusers_backbone.py` (diffusers'
UNet2DModel, DiTTransformer2DModel, UNet2DConditionModel, SD3Transformer2DModel), `layers.py` (what
they share: timestep and class embeddings)."""
from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from ..errors import InvalidInput
from ..registry import Registry, discover

# check(image_size, **args): sizes, before building; complete(args) -> args: what a factory would read
# from elsewhere (a pretrained folder's architecture) written into the run's config (configure.py);
# recorded: the arguments a checkpoint's config records that a resumed run takes from it when the
# command line does not give them (a convention older checkpoints used, a pretrained architecture);
# text(args) -> bool: whether the network these arguments build is conditioned on text (captioned data);
# flow(args) -> bool: whether it trains on the flow schedule only, taking its σ table (`flow_sigma`: SD3)
MODELS = Registry("model", defaults={"check": None, "complete": None, "recorded": (), "text": None, "flow": None})
register = MODELS.register

# False while a model is built to receive a checkpoint's weights: a factory that would read pretrained
# weights (models/diffusers_backbone.py) builds from the config alone, so the folder may be gone.
_PRETRAINED = contextvars.ContextVar("fasttrain_load_pretrained", default=True)


@contextlib.contextmanager
def weights_from_checkpoint():
    """Models built in this block get their weights from a checkpoint: factories skip pretrained weights."""
    token = _PRETRAINED.set(False)
    try:
        yield
    finally:
        _PRETRAINED.reset(token)


def load_pretrained() -> bool:
    """Whether a factory should read its pretrained weights (not inside `weights_from_checkpoint`)."""
    return _PRETRAINED.get()


discover(__name__)  # unet.py, dit.py, mlp.py, ... register their presets


def is_image_model(name: str) -> bool:
    return "image_size" in MODELS.args(name)


def build_model(name: str, *, in_channels: int, image_size: int | None = None, num_classes: int = 0,
                **overrides) -> nn.Module:
    """A model of the registry, for data of `in_channels` (and square `image_size`) and `num_classes`."""
    MODELS.check_args(name, overrides, where="model.args")
    kwargs = dict(in_channels=in_channels, num_classes=num_classes, **overrides)
    if is_image_model(name):
        if image_size is None:
            raise InvalidInput(f"model {name!r} is an image model; the data are not images (choose model.name=mlp)")
        kwargs["image_size"] = image_size
    elif image_size is not None:
        raise InvalidInput(f"model {name!r} takes flat vectors; the data are {image_size}×{image_size} images")
    return MODELS.get(name)(**kwargs)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops(name: str, *, in_channels: int, image_size: int | None = None, num_classes: int = 0, **kw) -> int:
    """Forward FLOPs for one image (a multiply-add counts 2), counted by torch's FlopCounterMode on
    the meta device, so that XL models cost no memory. Training is about 3× this."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"), weights_from_checkpoint():  # no pretrained weights onto the meta device
        m = build_model(name, in_channels=in_channels, image_size=image_size, num_classes=num_classes, **kw)
        shape = (1, in_channels) + ((image_size, image_size) if image_size else ())
        x, t = torch.empty(shape), torch.zeros(1, dtype=torch.long)
        counter = FlopCounterMode(display=False)
        with counter:
            m(x, t)
    return counter.get_total_flops()


def param_count(name: str, **kw) -> int:
    with torch.device("meta"), weights_from_checkpoint():
        return count_params(build_model(name, **kw))
