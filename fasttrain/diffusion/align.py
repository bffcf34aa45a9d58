"""Representation alignment (REPA: Yu et al. 2024, "Representation Alignment for Generation: Training
Diffusion Transformers Is Easier Than You Think", arXiv 2410.06940; official code sihyun-yu/REPA): an MLP
head maps the tokens of one intermediate block of the network to the patch features of a frozen pretrained
encoder of the clean image, and the negative cosine similarity between the two, averaged over tokens and
images, is added to the diffusion loss with weight λ (REPA Eq. 8; loss.py `proj_loss`, train.py
`loss_mean + proj_loss_mean * proj_coeff`, defaults λ = 0.5, block 8, head width 2048).

    diffusion.align.encoder=FOLDER|module:function  diffusion.align.depth=8  diffusion.align.weight=0.5

How it sits in fasttrain:
  - the head (REPA models/sit.py `build_mlp`: Linear, SiLU, Linear, SiLU, Linear) is the network's
    `align_head` submodule (`attach_head`, from bundle.build_network): trained, sharded, averaged and
    checkpointed like every other weight; generation and export never call it;
  - the block is the `depth`-th of the backbone's `feature_blocks()` (its `repeated_blocks()` where it declares
    no other list: DiT's transformer blocks, the UNet's stages; diffusers UNets' down, mid and up blocks). Model
    files hold no training logic: a forward hook on that block keeps its output, a forward hook on the network
    (its root, where FSDP2 has gathered the head's parameters) applies the head, both registered before the
    network is parallelised so that they run before FSDP's own hooks;
  - a block's output as tokens: [B, N, C] as it is (DiT), a feature map [B, C, h, w] as its h·w positions
    (UNets); where the token grid differs from the encoder's patch grid, the head's output is resized to the
    encoder's grid (bilinear, as U-REPA, Tian et al. 2025, upsamples U-Net features after the head);
  - the targets: computed once per image and kept on the device for resident data (no augmentation: the
    same image always gives the same target; `diffusion.align.targets=auto`), else by the encoder in the
    step, on the step's clean images;
  - the loss is added in the step (step.py) to the diffusion loss of any prediction type, weighting and
    timestep sampler; the statistics, the logged loss and what samplers learn from stay the diffusion
    loss's; the alignment loss is logged on its own (`align/loss`, periodic/align_log.py).
"""
from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput

KEY = "diffusion.align"
MAX_CACHE_BYTES = 2 << 30  # targets kept on the device up to this size; beyond it they are computed in the step


def projector(hidden: int, width: int, out: int) -> nn.Sequential:
    """REPA's head (models/sit.py `build_mlp`)."""
    return nn.Sequential(nn.Linear(hidden, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                         nn.Linear(width, out))


def feature_blocks(backbone: nn.Module) -> list[nn.Module]:
    declared = getattr(backbone, "feature_blocks", None)
    return list(declared() if declared is not None else backbone.repeated_blocks())


def as_tokens(out) -> tuple[torch.Tensor, tuple[int, int]]:
    """A block's output as ([B, N, C] tokens, their (h, w) grid): a tuple's first element (diffusers' down
    blocks return (hidden states, skips)); a feature map's positions; tokens of a square grid."""
    h = out[0] if isinstance(out, (tuple, list)) else out
    if h.ndim == 4:
        return h.flatten(2).transpose(1, 2), (h.shape[2], h.shape[3])
    if h.ndim == 3:
        side = math.isqrt(h.shape[1])
        if side * side != h.shape[1]:
            raise InvalidInput(f"{KEY}.depth: the block gives {h.shape[1]} tokens, not a square grid")
        return h, (side, side)
    raise InvalidInput(f"{KEY}.depth: the block gives a tensor of shape {tuple(h.shape)}, not tokens or a feature map")


def repa_loss(pred: torch.Tensor, grid: tuple[int, int], target: torch.Tensor) -> torch.Tensor:
    """−cos(head tokens, encoder tokens), averaged over tokens and images (REPA loss.py): `pred` [B, N, D]
    on `grid`, `target` [B, M, D] on a square grid (pred resized to it where N ≠ M), in float32."""
    pred, target = pred.float(), target.float()
    if pred.shape[1] != target.shape[1]:
        side = math.isqrt(target.shape[1])
        if side * side != target.shape[1]:
            raise InvalidInput(f"{KEY}.encoder: its {target.shape[1]} patch tokens are not a square grid, and the "
                               f"block's {pred.shape[1]} tokens would have to be resized to them")
        b, _, d = pred.shape
        m = pred.transpose(1, 2).reshape(b, d, *grid)
        pred = F.interpolate(m, size=(side, side), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
    return -(F.normalize(pred, dim=-1) * F.normalize(target, dim=-1)).sum(-1).mean()


def block_width(name: str, depth: int, x_shape: tuple, build_kwargs: dict) -> tuple[int, tuple[int, int]]:
    """(channels, token grid) of the `depth`-th feature block's output, by a forward on the meta device (no
    weights, no compute), so that the head is built to the network before any real forward."""
    from ..models import build_model, weights_from_checkpoint

    seen = {}

    def keep(mod, args, out) -> None:  # a hook that returns nothing leaves the output as it is
        seen.setdefault("out", as_tokens(out))

    with torch.device("meta"), weights_from_checkpoint():
        m = build_model(name, **build_kwargs)
        blocks = feature_blocks(m)
        if not blocks:
            raise InvalidInput(f"bad value for '{KEY}.encoder': model {name} with these model.args declares no blocks "
                               f"to align (SD3's joint blocks mix text and image tokens)")
        if not 1 <= depth <= len(blocks):
            raise InvalidInput(f"bad value for '{KEY}.depth': {depth} (model {name} has {len(blocks)} blocks to "
                               f"align: 1 to {len(blocks)})")
        blocks[depth - 1].register_forward_hook(keep)
        m(torch.empty(x_shape), torch.zeros(x_shape[0], dtype=torch.long))
    tokens, grid = seen["out"]
    return int(tokens.shape[-1]), grid


def attach_head(net: nn.Module, a, name: str, x_shape: tuple, build_kwargs: dict) -> None:
    """The network's `align_head` (module docstring), sized by `block_width` and `a.encoder_dim`."""
    if a.encoder_dim is None:
        raise InvalidInput(f"{KEY}.encoder_dim is unset: the run's config was not completed (configure.py)")
    width, _ = block_width(name, a.depth, x_shape, build_kwargs)
    net.align_head = projector(width, a.projector_dim, a.encoder_dim)


def check_config(cfg) -> None:
    """At configure time (configure.py): alignment needs pixel images (the encoder reads them); the encoder
    loads, and its feature width fills `encoder_dim` (checked against a given one)."""
    from ..data import data_kind
    from ..pretrained import encoders

    a = cfg.diffusion.align
    if a.encoder is None:
        return
    kind = data_kind(cfg.data.name)
    if not (kind.traits.images and kind.traits.pixels):
        raise InvalidInput(f"bad value for '{KEY}.encoder': {a.encoder!r} (alignment reads the clean images, and "
                           f"data.name={cfg.data.name} has no pixels: VAE latents would need their images' "
                           f"features cached when they are encoded, which fasttrain does not do yet)")
    enc = encoder(a)
    _, dim = encoders.probe(enc, kind.channels(cfg.data), cfg.data.image_size)
    if a.encoder_dim is not None and a.encoder_dim != dim:
        raise InvalidInput(f"bad value for '{KEY}.encoder_dim': {a.encoder_dim} (the encoder gives {dim} features)")
    a.encoder_dim = dim


_ENCODERS: dict = {}


def encoder(a):
    """The frozen encoder of `a` (loaded once per process: configure and the trainer share it)."""
    from ..pretrained import encoders

    key = (a.encoder, a.encoder_size)
    if key not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[key] = encoders.load(a.encoder, a.encoder_size)
    return _ENCODERS[key]


class CachedTargets:
    """A resident stream whose batches are its `x[idx], y[idx]` (data/memory.py), with each batch's targets
    `table[idx]` queued for the step's alignment loss; the rest is the stream's (position, checkpoint state)."""

    def __init__(self, stream, table: torch.Tensor, queue: deque):
        self.stream, self.table, self.queue = stream, table, queue

    def __iter__(self):
        return self

    def __next__(self):
        idx = self.stream.next_indices()
        self.queue.append(self.table[idx])
        return self.stream.x[idx], self.stream.y[idx]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.queue.clear()
        self.stream.load_state_dict(state)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class Alignment:
    """The training side (module docstring): hooks on the network (unwrapped, before parallelize), the frozen
    encoder, the targets, the loss, its log sums on the device."""

    def __init__(self, a, net: nn.Module, device):
        self.weight, self.mode = float(a.weight), a.targets
        self.head = net.align_head
        self.encoder = encoder(a).to(device)
        block = feature_blocks(net.net)[a.depth - 1]
        self._kept, self.tokens = None, None
        self.handles = [block.register_forward_hook(self._keep), net.register_forward_hook(self._project)]
        self.queue: deque = deque()
        self.cached = False
        self.sum = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)

    def _keep(self, module, args, out) -> None:
        if module.training and torch.is_grad_enabled():  # a training forward (not sampling, not a no-grad probe)
            self._kept = out

    def _project(self, module, args, out) -> None:
        if self._kept is not None:
            tokens, grid = as_tokens(self._kept)
            self._kept = None
            self.tokens = (self.head(tokens), grid)

    def cache(self, stream):
        """`stream` with its targets computed once per image (targets=auto, a resident stream whose table fits
        MAX_CACHE_BYTES), else `stream` as it is (the targets then come from the encoder in the step)."""
        if self.mode != "auto" or not (hasattr(stream, "next_indices") and hasattr(stream, "x")):
            return stream
        x = stream.x
        n_tok, dim = self.encoder(x[:1]).shape[1:]
        if len(x) * n_tok * dim * 4 > MAX_CACHE_BYTES:
            return stream
        table = torch.cat([self.encoder(x[i:i + 256]).float() for i in range(0, len(x), 256)])
        self.cached = True
        return CachedTargets(stream, table, self.queue)

    def targets(self, x0: torch.Tensor) -> torch.Tensor:
        if self.cached:
            if not self.queue:
                raise RuntimeError("alignment: a batch arrived without its cached targets (read through the stream)")
            return self.queue.popleft()
        return self.encoder(x0)

    def loss(self, x0: torch.Tensor) -> torch.Tensor:
        """λ · REPA's loss of the forward just run on x0's noised images (a device scalar)."""
        if self.tokens is None:
            raise RuntimeError("alignment: no tokens from the network's forward (its hooked block did not run)")
        (pred, grid), self.tokens = self.tokens, None
        value = repa_loss(pred, grid, self.targets(x0))
        self.sum += value.detach().double()
        self.count += 1
        return self.weight * value

    def metrics(self) -> dict:
        """The mean alignment loss (−cos) since the last call, and resets it (the log action; a host read)."""
        from ..parallel import distributed as dist_utils

        s, c = dist_utils.mean_across_ranks(torch.stack([self.sum, self.count])).tolist()
        self.sum.zero_()
        self.count.zero_()
        return {"align/loss": s / c} if c else {}
