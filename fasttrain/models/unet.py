"""ADM-style UNet (Dhariwal & Nichol 2021): residual blocks with scale-shift norm, self-attention at
chosen resolutions, channel multipliers per level. Small presets for CPU live in the registry."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput
from . import register
from .layers import TimeLabelEmbedding, zero_module


def _norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, ch // 4) if ch >= 8 else 1, ch)


class ResBlock(nn.Module):
    """GN → SiLU → conv → GN·(1 + scale) + shift (ADM "use_scale_shift_norm") → SiLU → dropout → conv."""

    def __init__(self, cin: int, cout: int, emb_dim: int, dropout: float = 0.0):
        super().__init__()
        self.in_layers = nn.Sequential(_norm(cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1))
        self.emb = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, 2 * cout))
        self.out_norm = _norm(cout)
        self.out_layers = nn.Sequential(nn.SiLU(), nn.Dropout(dropout), zero_module(nn.Conv2d(cout, cout, 3,
                                                                                              padding=1)))
        self.skip = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        scale, shift = self.emb(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.out_layers(self.out_norm(h) * (1 + scale) + shift)
        return self.skip(x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = _norm(ch)
        self.qkv = nn.Conv1d(ch, 3 * ch, 1)
        self.proj = zero_module(nn.Conv1d(ch, ch, 1))

    def forward(self, x, emb=None):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x).view(B, C, H * W)).view(B, 3, self.heads, C // self.heads, H * W).unbind(1)
        h = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.proj(h.transpose(-1, -2).reshape(B, C, H * W)).view(B, C, H, W)


class EmbSequential(nn.ModuleList):
    """Layers applied in turn, the residual blocks also receiving the embedding. Each one is a unit
    that parallel.py may checkpoint, compile or shard (a plain ModuleList has no forward)."""

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


def check_sizes(image_size: int, ch_mult=(1, 2, 2), attn_resolutions=(16,), **_) -> None:
    """The UNet's structural needs, checked before it is built (configure.py): level lists of positive
    integers, and an image size it can halve len(ch_mult) − 1 times."""
    _check_int_list("ch_mult", ch_mult, empty_ok=False)
    _check_int_list("attn_resolutions", attn_resolutions, empty_ok=True)
    f = 2 ** (len(ch_mult) - 1)
    if image_size % f:
        raise InvalidInput(f"the UNet halves the image size {len(ch_mult) - 1} times (model.args.ch_mult): "
                           f"it must be a multiple of {f}")


class UNet(nn.Module):
    def __init__(self, in_channels: int = 3, image_size: int = 32, ch: int = 64, ch_mult=(1, 2, 2),
                 num_res_blocks: int = 2, attn_resolutions=(16,), heads: int = 4, head_channels: int = 0,
                 dropout: float = 0.0, num_classes: int = 0, out_channels: int | None = None):
        super().__init__()
        _check_int_list("ch_mult", ch_mult, empty_ok=False)
        _check_int_list("attn_resolutions", attn_resolutions, empty_ok=True)  # those the image never has: unused
        self.in_channels, self.image_size = in_channels, image_size
        emb_dim = 4 * ch

        def attn(c):  # ADM: a fixed number of channels per head when head_channels is set
            return AttnBlock(c, c // head_channels if head_channels else heads)

        self.embed = TimeLabelEmbedding(ch, emb_dim, num_classes)
        self.inp = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down, skips, cur, res = nn.ModuleList(), [ch], ch, image_size
        for level, mult in enumerate(ch_mult):
            for _ in range(num_res_blocks):
                blocks = [ResBlock(cur, ch * mult, emb_dim, dropout)]
                cur = ch * mult
                if res in attn_resolutions:
                    blocks.append(attn(cur))
                self.down.append(EmbSequential(blocks))
                skips.append(cur)
            if level != len(ch_mult) - 1:
                self.down.append(EmbSequential([nn.Conv2d(cur, cur, 3, stride=2, padding=1)]))
                skips.append(cur)
                res //= 2
        self.mid = EmbSequential([ResBlock(cur, cur, emb_dim, dropout), attn(cur), ResBlock(cur, cur, emb_dim,
                                                                                            dropout)])
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(ch_mult))):
            for i in range(num_res_blocks + 1):
                blocks = [ResBlock(cur + skips.pop(), ch * mult, emb_dim, dropout)]
                cur = ch * mult
                if res in attn_resolutions:
                    blocks.append(attn(cur))
                if level and i == num_res_blocks:
                    blocks.append(nn.Upsample(scale_factor=2, mode="nearest"))
                    blocks.append(nn.Conv2d(cur, cur, 3, padding=1))
                    res *= 2
                self.up.append(EmbSequential(blocks))
        self.out = nn.Sequential(_norm(cur), nn.SiLU(), zero_module(nn.Conv2d(cur, out_channels or in_channels, 3,
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
        """The units parallel.py checkpoints, compiles and shards one by one: every stage."""
        return [*self.down, self.mid, *self.up]


# CPU presets: the 8×8 digits recipe and friends
register("unet_tiny", check=check_sizes)(partial(UNet, ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(4,),
                                                 heads=4))
register("unet_small", check=check_sizes)(partial(UNet, ch=64, ch_mult=(1, 2, 2), num_res_blocks=2,
                                                  attn_resolutions=(8,), heads=4))
# ADM (Dhariwal & Nichol 2021, Table 14 / iDDPM): CIFAR-10 32², ImageNet 64², 256² (64 channels per head)
register("adm_32", check=check_sizes)(partial(UNet, ch=128, ch_mult=(1, 2, 2, 2), num_res_blocks=3,
                                              attn_resolutions=(16, 8),
                           head_channels=64, dropout=0.1))
register("adm_64", check=check_sizes)(partial(UNet, ch=192, ch_mult=(1, 2, 3, 4), num_res_blocks=3,
                                              attn_resolutions=(32, 16, 8),
                           head_channels=64, dropout=0.1))
register("adm_256", check=check_sizes)(partial(UNet, ch=256, ch_mult=(1, 1, 2, 2, 4, 4), num_res_blocks=2,
                                               attn_resolutions=(32, 16, 8),
                            head_channels=64))
