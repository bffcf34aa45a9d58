"""DiT (Peebles & Xie 2023): patchify → transformer blocks with adaLN-zero → unpatchify.
Attention goes through `scaled_dot_product_attention`.

`convention` (model.args.convention) fixes the two choices that carry no weights:
  diffusers  what diffusers' DiTTransformer2DModel hard-codes: timestep frequencies
             exp(−ln(10⁴)·k/127) (`downscale_freq_shift=1`) and the position embedding
             [sincos(column), sincos(row)] (`get_2d_sincos_pos_embed`, MAE's layout), so that an export
             is the stock class weight for weight (convert.py). New runs.
  legacy     the original DiT code's exp(−ln(10⁴)·k/128) and [sincos(row), sincos(column)]: fasttrain's
             DiTs before checkpoint format 4 (checkpoint/formats.py records it in their config).
The null label is `num_classes`, the last row of the class table, as in DiTTransformer2DModel
(DiTPipeline hard-codes 1000: the null label of a 1000-class model)."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidInput
from . import register
from .layers import TimeLabelEmbedding


def _modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


CONVENTIONS = ("diffusers", "legacy")


def sincos_pos_embed(dim: int, grid: int, convention: str = "diffusers", grid_w: int | None = None) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embedding [grid·grid_w, dim] (MAE / DiT; grid_w defaults to grid);
    tokens in row-major order, the first half of the features encodes the column (diffusers, MAE) or the
    row (legacy)."""
    def one_d(d, pos):
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
        out = pos.reshape(-1)[:, None] * omega[None]
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    gy, gx = torch.meshgrid(torch.arange(grid, dtype=torch.float64),
                            torch.arange(grid if grid_w is None else grid_w, dtype=torch.float64), indexing="ij")
    first, second = (gx, gy) if convention == "diffusers" else (gy, gx)
    return torch.cat([one_d(dim // 2, first), one_d(dim // 2, second)], dim=1).float()


def attention(q, k, v):
    """SDPA, or xformers' memory-efficient kernel where it is installed and usable (CUDA, half precision)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _xops is not None:
        return _xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v)


try:  # optional extra: its C++/CUDA build must match the installed torch (platform.md §5)
    import xformers.ops as _xops
except Exception:  # ImportError, or an extension built for another torch
    _xops = None


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, int(hidden * mlp_ratio)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(hidden * mlp_ratio), hidden))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        nn.init.zeros_(self.ada[-1].weight)  # adaLN-zero: every block starts as the identity
        nn.init.zeros_(self.ada[-1].bias)

    def forward(self, x, c):
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=1)
        B, N, D = x.shape
        q, k, v = self.qkv(_modulate(self.norm1(x), s1, sc1)).view(B, N, 3, self.heads,
                                                                   D // self.heads).permute(2, 0, 3, 1, 4)
        h = attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + g1[:, None] * self.proj(h)
        return x + g2[:, None] * self.mlp(_modulate(self.norm2(x), s2, sc2))


def check_sizes(image_size: int, patch: int = 2, hidden: int = 384, heads: int = 6, convention: str = "diffusers",
                **_) -> None:
    """The DiT's structural needs, checked before it is built (configure.py)."""
    if convention not in CONVENTIONS:
        raise InvalidInput(f"model.args.convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
    if image_size % patch:
        raise InvalidInput(f"image_size {image_size} is not divisible by patch {patch} (model.args.patch)")
    if hidden % heads:
        raise InvalidInput(f"model.args.hidden {hidden} is not divisible by model.args.heads {heads}")


class DiT(nn.Module):
    def __init__(self, in_channels: int = 4, image_size: int = 32, patch: int = 2, hidden: int = 384,
                 depth: int = 12, heads: int = 6, mlp_ratio: float = 4.0, num_classes: int = 0,
                 out_channels: int | None = None, convention: str = "diffusers"):
        super().__init__()
        check_sizes(image_size, patch, hidden, heads, convention)
        self.in_channels, self.image_size, self.patch, self.convention = in_channels, image_size, patch, convention
        self.out_channels = out_channels or in_channels
        self.grid = image_size // patch
        self.x_embed = nn.Conv2d(in_channels, hidden, patch, stride=patch)
        self.register_buffer("pos", sincos_pos_embed(hidden, self.grid, convention)[None], persistent=False)
        self.embed = TimeLabelEmbedding(256, hidden, num_classes, freq_shift=1 if convention == "diffusers" else 0)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, mlp_ratio) for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.final = nn.Linear(hidden, patch * patch * self.out_channels)
        for m in (self.final_ada[-1], self.final):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)
        w = self.x_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.normal_(self.embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.embed.mlp[2].weight, std=0.02)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        B, p = x.shape[0], self.patch
        gh, gw = x.shape[-2] // p, x.shape[-1] // p
        pos = self.pos
        if (gh, gw) != (self.grid, self.grid):  # an aspect-ratio bucket (data/buckets.py): the embedding of its grid
            pos = sincos_pos_embed(pos.shape[-1], gh, self.convention, gw)[None].to(pos.device)
        h = self.x_embed(x).flatten(2).transpose(1, 2)
        h = h + pos.to(h.dtype)
        c = self.embed(t, y)
        for blk in self.blocks:
            h = blk(h, c)
        shift, scale = self.final_ada(c).chunk(2, dim=1)
        h = self.final(_modulate(self.final_norm(h), shift, scale))
        C = self.out_channels
        return h.view(B, gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, gh * p, gw * p)

    def repeated_blocks(self) -> list[nn.Module]:
        """The units parallel/wrap.py checkpoints, compiles and shards one by one: the transformer blocks."""
        return list(self.blocks)


DIT_SIZES = {"s": (384, 12, 6), "b": (768, 12, 12), "l": (1024, 24, 16), "xl": (1152, 28, 16)}  # hidden, depth, heads


def _preset(name: str, **args) -> None:
    # checkpoints before format 4 record convention=legacy (checkpoint/formats.py); a resume keeps it
    register(name, check=check_sizes, recorded=("convention",))(partial(DiT, **args))


_preset("dit_tiny", patch=2, hidden=128, depth=4, heads=4)  # CPU preset
for _size, (_h, _d, _n) in DIT_SIZES.items():  # Peebles & Xie 2023, Table 1: dit_s2 … dit_xl8
    for _p in (2, 4, 8):
        _preset(f"dit_{_size}{_p}", patch=_p, hidden=_h, depth=_d, heads=_n)
