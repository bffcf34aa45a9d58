"""ADM-style UNet (Dhariwal & Nichol 2021): residual blocks with scale-shift norm, self-attention at
chosen resolutions, channel multipliers per level. Small presets for CPU live in the registry.

GroupNorm groups (model.args.convention, model.args.norm_groups):
  diffusers  one group count for every layer, as UNet2DModel's `norm_num_groups`, so that an export is
             the stock class (convert.py): `norm_groups`, by default min(32, ch/4) rounded down to a
             divisor of ch (every width is a multiple of ch, so it divides them all). New runs.
  legacy     min(32, channels/4) per layer: fasttrain's UNets before checkpoint format 4
             (checkpoint/formats.py records it in their config); not expressible in UNet2DModel.
The presets whose widths are all >= 128 (adm_*) have 32 groups everywhere under both."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput
from . import register
from .layers import TimeLabelEmbedding, zero_module

CONVENTIONS = ("diffusers", "legacy")


def default_norm_groups(ch: int) -> int:
    """min(32, ch/4), rounded down to a divisor of the base width ch."""
    top = max(1, min(32, ch // 4))
    return next(g for g in range(top, 0, -1) if ch % g == 0)


def group_norms(ch: int, norm_groups: int = 0, convention: str = "diffusers"):
    """The UNet's GroupNorm factory, width → nn.GroupNorm, for the convention (module docstring)."""
    if convention == "legacy":
        def make(c: int) -> nn.GroupNorm:
            g = min(32, c // 4) if c >= 8 else 1
            if c % g:
                raise InvalidInput(f"model.args.ch={ch}: a layer of {c} channels cannot be split into {g} GroupNorm "
                                   f"groups (convention=legacy: min(32, channels/4) per layer); choose another ch "
                                   f"or convention=diffusers")
            return nn.GroupNorm(g, c)
        return make
    groups = norm_groups or default_norm_groups(ch)
    return lambda c: nn.GroupNorm(groups, c)


class ResBlock(nn.Module):
    """GN → SiLU → conv → GN·(1 + scale) + shift (ADM "use_scale_shift_norm") → SiLU → dropout → conv."""

    def __init__(self, cin: int, cout: int, emb_dim: int, norm, dropout: float = 0.0):
        super().__init__()
        self.in_layers = nn.Sequential(norm(cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
        self.emb = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, 2 * cout))
        self.out_norm = norm(cout)
        self.out_layers = nn.Sequential(nn.SiLU(), nn.Dropout(dropout), zero_module(nn.Conv2d(cout, cout, 3,
                                                                                              padding=1)))
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        scale, shift = self.emb(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers(self.out_norm(h) * (1 + scale) + shift)
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch: int, heads: int, norm):
        super().__init__()
        self.heads = heads
        self.norm = norm(ch)
        self.qkv = nn.Conv1d(ch, 3 * ch, 1)
        self.proj = zero_module(nn.Conv1d(ch, ch, 1))

    def forward(self, x, emb=None):
        # The 1x1 projections as matmuls over the channel dimension (F.linear on the Conv1d weights, so the
        # parameters and the checkpoint keys stay those of a Conv1d): on a CPU a width-1 convolution goes
        # through oneDNN's convolution at several times a matmul's cost for these small sizes (issue 35,
        # bench/results/default-breakdown-cpu.md), and tokens-last is the layout attention wants anyway.
        B, C, H, W = x.shape
        tokens = self.norm(x).view(B, C, H * W).transpose(1, 2)                      # [B, HW, C]
        qkv = F.linear(tokens, self.qkv.weight.squeeze(-1), self.qkv.bias)          # channels (3, heads, d)
        q, k, v = qkv.view(B, H * W, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        h = F.scaled_dot_product_attention(q, k, v)                                  # [B, heads, HW, d]
        out = F.linear(h.transpose(1, 2).reshape(B, H * W, C), self.proj.weight.squeeze(-1), self.proj.bias)
        return x + out.transpose(1, 2).reshape(B, C, H, W)

    def forward_conv(self, x, emb=None):
        """The same block through its Conv1d layers (the reference the matmul form is tested against)."""
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x).view(B, C, H * W)).view(B, 3, self.heads, C // self.heads, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(h.transpose(-1, -2).reshape(B, C, H * W)).view(B, C, H, W)


class EmbSequential(nn.ModuleList):
    """Layers applied in turn, the residual blocks also receiving the embedding. Each one is a unit
    that parallel/wrap.py may checkpoint, compile or shard (a plain ModuleList has no forward)."""

    def forward(self, h, emb):
        for b in self:
            h = b(h, emb) if isinstance(b, (ResBlock, AttnBlock)) else b(h)
        return h


def _check_int_list(name: str, values, empty_ok: bool) -> None:
    """Level lists the loops below would misread end in one line (a ValueError, named as the config key)."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) and (empty_ok or len(values))
    if not ok:
        need = "a list of positive integers" if empty_ok else "a non-empty list of positive integers"
        raise InvalidInput(f"model.args.{name} must be {need}, got {list(values)!r}")


def _check_groups(ch: int, norm_groups: int, convention: str) -> None:
    if convention not in CONVENTIONS:
        raise InvalidInput(f"model.args.convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
    if not isinstance(ch, int) or isinstance(ch, bool) or ch < 1:
        raise InvalidInput(f"model.args.ch must be a positive integer, got {ch!r}")
    if norm_groups < 0 or (norm_groups and ch % norm_groups):
        raise InvalidInput(f"model.args.norm_groups={norm_groups} must divide model.args.ch={ch} (every GroupNorm "
                           f"of the UNet has that many groups; 0 = min(32, ch/4) rounded to a divisor)")
    if norm_groups and convention == "legacy":
        raise InvalidInput("model.args.norm_groups: convention=legacy sets the groups per layer; leave norm_groups 0")


def check_sizes(image_size: int, ch_mult=(1, 2, 2), attn_resolutions=(16,), **args) -> None:
    """The UNet's structural needs, checked before it is built (configure.py): level lists of positive
    integers, an image size it can halve len(ch_mult) − 1 times, group and head counts that divide the
    widths (a network of these arguments built on the meta device: its layers check themselves)."""
    _check_int_list("ch_mult", ch_mult, empty_ok=False)
    _check_int_list("attn_resolutions", attn_resolutions, empty_ok=True)
    f = 2 ** (len(ch_mult) - 1)
    if image_size % f:
        raise InvalidInput(f"the UNet halves the image size {len(ch_mult) - 1} times (model.args.ch_mult): "
                           f"it must be a multiple of {f}")
    if {"ch", "num_res_blocks"} <= set(args):  # all of the factory's arguments (registry.check passes them)
        with torch.device("meta"):
            UNet(image_size=image_size, ch_mult=ch_mult, attn_resolutions=attn_resolutions, **args)


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, image_size: int = 32, ch: int = 64, ch_mult=(1, 2, 2),
                 num_res_blocks: int = 2, attn_resolutions=(16,), heads: int = 4, head_channels: int = 0,
                 dropout: float = 0.0, num_classes: int = 0, out_channels: int | None = None, norm_groups: int = 0,
                 convention: str = "diffusers"):
        super().__init__()
        _check_int_list("ch_mult", ch_mult, empty_ok=False)
        _check_int_list("attn_resolutions", attn_resolutions, empty_ok=True)  # those the image never has: unused
        _check_groups(ch, norm_groups, convention)
        self.in_channels, self.image_size = in_channels, image_size
        emb_dim = 4 * ch
        norm = group_norms(ch, norm_groups, convention)

        def attn(c):  # ADM: a fixed number of channels per head when head_channels is set
            n = c // head_channels if head_channels else heads
            if n < 1 or c % n or (head_channels and c % head_channels):
                key = f"head_channels={head_channels}" if head_channels else f"heads={heads}"
                raise InvalidInput(f"model.args.{key}: an attention layer of {c} channels cannot be split into "
                                   f"{'heads of that size' if head_channels else 'that many heads'}")
            return AttnBlock(c, n, norm)

        def res(cin, cout):
            return ResBlock(cin, cout, emb_dim, norm, dropout)

        self.embed = TimeLabelEmbedding(ch, emb_dim, num_classes)
        self.inp = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down, skips, cur, size = nn.ModuleList(), [ch], ch, image_size
        for level, mult in enumerate(ch_mult):
            for _ in range(num_res_blocks):
                blocks = [res(cur, ch * mult)]
                cur = ch * mult
                if size in attn_resolutions:
                    blocks.append(attn(cur))
                self.down.append(EmbSequential(blocks))
                skips.append(cur)
            if level != len(ch_mult) - 1:
                self.down.append(EmbSequential([nn.Conv2d(cur, cur, 3, stride=2, padding=1)]))
                skips.append(cur)
                size //= 2
        self.mid = EmbSequential([res(cur, cur), attn(cur), res(cur, cur)])
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(ch_mult))):
            for i in range(num_res_blocks + 1):
                blocks = [res(cur + skips.pop(), ch * mult)]
                cur = ch * mult
                if size in attn_resolutions:
                    blocks.append(attn(cur))
                if level and i == num_res_blocks:
                    blocks.append(nn.Upsample(scale_factor=2, mode="nearest"))
                    blocks.append(nn.Conv2d(cur, cur, 3, padding=1))
                    size *= 2
                self.up.append(EmbSequential(blocks))
        self.out = nn.Sequential(norm(cur), nn.SiLU(), zero_module(nn.Conv2d(cur, out_channels or in_channels, 3,
                                                                              padding=1)))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embed(t, y)
        h = self.inp(x)
        hs = [h]
        for stage in self.down:
            h = stage(h, emb)
            hs.append(h)
        h = self.mid(h, emb)
        for stage in self.up:
            h = stage(torch.cat([h, hs.pop()], dim=1), emb)
        return self.out(h)

    def repeated_blocks(self) -> list[nn.Module]:
        """The units parallel/wrap.py checkpoints, compiles and shards one by one: every stage."""
        return [*self.down, self.mid, *self.up]



def _preset(name: str, **args) -> None:
    # checkpoints before format 4 record convention=legacy (checkpoint/formats.py); a resume keeps it
    register(name, check=check_sizes, recorded=("convention",))(partial(UNet, **args))


# CPU presets: the 8×8 digits recipe and friends
_preset("unet_tiny", ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,), heads=4)
_preset("unet_small", ch=64, ch_mult=(1, 2, 2), num_res_blocks=2, attn_resolutions=(8,), heads=4)
# ADM (Dhariwal & Nichol 2021, Table 14 / iDDPM): CIFAR-10 32², ImageNet 64², 256² (64 channels per head)
_preset("adm_32", ch=128, ch_mult=(1, 2, 2, 2), num_res_blocks=3, attn_resolutions=(16, 8), head_channels=64,
        dropout=0.1)
_preset("adm_64", ch=192, ch_mult=(1, 2, 3, 4), num_res_blocks=3, attn_resolutions=(32, 16, 8), head_channels=64,
        dropout=0.1)
_preset("adm_256", ch=256, ch_mult=(1, 1, 2, 2, 4, 4), num_res_blocks=2, attn_resolutions=(32, 16, 8),
        head_channels=64)
