"""fasttrain backbones → diffusers models, weight for weight (for `fasttrain export`, export/dispatch.py).

    name, model, frequencies, null = to_diffusers(backbone)   # ("transformer" | "unet", an eval-mode model, ...)

DiT (models/dit.py) → DiTTransformer2DModel, exactly: diffusers keeps a time/label embedding per block
(and the final layer uses block 0's), so the shared one is copied into every block; a LayerNorm eps
of 1e-6 (`norm_eps`), the MLP at 4× width. A DiT of `convention=diffusers` (new runs) has diffusers'
timestep frequencies and position embedding, so that is all. A `legacy` DiT (checkpoints before
format 4) needs two more bridges, and its export is not the stock class:
  * position embedding: legacy is [sincos(row), sincos(column)] (`meshgrid(..., indexing="ij")`),
    diffusers' [sincos(column), sincos(row)] (MAE's layout), rebuilt from its config, not stored. The
    residual stream is re-based by σ, the swap of the two halves of the hidden dimension (an
    involution): every write into the stream gets its rows permuted, every read its columns, every
    adaLN chunk is permuted within itself; LayerNorms without affine parameters are invariant.
  * timestep frequencies: diffusers hard-codes k/(half−1) (`downscale_freq_shift=1`) where legacy
    (and the original DiT) use k/half: no weight or config expresses this, so the model is returned
    with the shift set to 0 in each block and the pipeline sets it on loading (export/remote_pipeline.py).
UNet (models/unet.py) → UNet2DModel, exactly where diffusers can hold it: one GroupNorm group count
for every layer (diffusers has one `norm_num_groups`: `convention=diffusers`, new runs, and the ADM
presets under both conventions; legacy unet_tiny/unet_small use min(32, channels/4) per layer and do
not map), one head size for all attention layers, ADM's scale-shift norm
(`resnet_time_scale_shift="scale_shift"`, with `attn_norm_num_groups` set, or the mid-block attention
would have no GroupNorm); the layers are matched in execution order.
diffusers backbones (models/diffusers_backbone.py) are already diffusers models.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import InvalidInput


# -- DiT -----------------------------------------------------------------------------------------------
def dit_config(dit) -> dict:
    hidden, blocks = dit.x_embed.out_channels, dit.blocks
    ratio = blocks[0].mlp[0].out_features / hidden
    if ratio != 4:
        raise InvalidInput(f"the DiT's mlp_ratio is {ratio:g}: diffusers' DiTTransformer2DModel has its MLP at 4× "
                           f"the width, fixed")
    return dict(num_attention_heads=blocks[0].heads, attention_head_dim=hidden // blocks[0].heads,
                in_channels=dit.in_channels, out_channels=dit.out_channels, num_layers=len(blocks),
                sample_size=dit.image_size, patch_size=dit.patch, num_embeds_ada_norm=dit.embed.num_classes,
                norm_eps=1e-6, activation_fn="gelu-approximate", attention_bias=True, dropout=0.0,
                norm_type="ada_norm_zero", norm_elementwise_affine=False)


def dit_state_dict(sd: dict, depth: int, hidden: int, swap: bool = False) -> dict:
    """fasttrain DiT weights → DiTTransformer2DModel weights (`swap`, legacy DiTs: σ, the half swap of
    the hidden dimension)."""
    half = torch.arange(hidden // 2)
    sw = torch.cat([half + hidden // 2, half]) if swap else torch.arange(hidden)

    def rows(w):
        return w[sw]

    def cols(w):
        return w[:, sw]

    def chunked(w, n):  # each adaLN output chunk lives in the stream's basis
        return torch.cat([c[sw] for c in w.chunk(n, 0)])

    table = sd.get("embed.label.weight", torch.zeros(1, hidden))  # unconditional: one zero row, label 0
    out = {"pos_embed.proj.weight": rows(sd["x_embed.weight"]), "pos_embed.proj.bias": rows(sd["x_embed.bias"])}
    for i in range(depth):
        b, o = f"blocks.{i}.", f"transformer_blocks.{i}."
        e = o + "norm1.emb."
        for k in ("weight", "bias"):
            out[f"{e}timestep_embedder.linear_1.{k}"] = sd[f"embed.mlp.0.{k}"]
            out[f"{e}timestep_embedder.linear_2.{k}"] = sd[f"embed.mlp.2.{k}"]
            out[f"{o}norm1.linear.{k}"] = chunked(sd[f"{b}ada.1.{k}"], 6)
            out[f"{o}attn1.to_out.0.{k}"] = rows(sd[f"{b}proj.{k}"])
            out[f"{o}ff.net.2.{k}"] = rows(sd[f"{b}mlp.2.{k}"])
        out[f"{e}class_embedder.embedding_table.weight"] = table
        for name, w, bias in zip("qkv", sd[f"{b}qkv.weight"].chunk(3, 0), sd[f"{b}qkv.bias"].chunk(3, 0)):
            out[f"{o}attn1.to_{name}.weight"], out[f"{o}attn1.to_{name}.bias"] = cols(w), bias
        out[f"{o}ff.net.0.proj.weight"] = cols(sd[f"{b}mlp.0.weight"])
        out[f"{o}ff.net.0.proj.bias"] = sd[f"{b}mlp.0.bias"]
    out["proj_out_1.weight"] = chunked(sd["final_ada.1.weight"], 2)
    out["proj_out_1.bias"] = chunked(sd["final_ada.1.bias"], 2)
    out["proj_out_2.weight"], out["proj_out_2.bias"] = cols(sd["final.weight"]), sd["final.bias"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# -- UNet ----------------------------------------------------------------------------------------------
def unet_refusal(unet) -> str | None:
    """Why this UNet has no exact UNet2DModel (None if it has one)."""
    from ..models.unet import AttnBlock

    groups = sorted({m.num_groups for m in unet.modules() if isinstance(m, nn.GroupNorm)})
    if len(groups) > 1:
        return (f"its GroupNorms use {'/'.join(map(str, groups))} groups by layer (model.args.convention=legacy: "
                f"min(32, channels/4), fasttrain's UNets before checkpoint format 4), diffusers' UNet2DModel one "
                f"norm_num_groups for all: train with convention=diffusers (new runs' default) or an adm_* preset")
    heads = {m.qkv.in_channels // m.heads for m in unet.modules() if isinstance(m, AttnBlock)}
    if len(heads) > 1:
        return (f"its attention layers have head sizes {sorted(heads)}, diffusers' UNet2DModel one "
                f"attention_head_dim (set model.args.head_channels)")
    return None


def unet_config(unet, args: dict) -> dict:
    """UNet2DModel's config for a fasttrain UNet built with `args` (the preset's arguments and overrides)."""
    from ..models.unet import AttnBlock

    ch, mult, size = unet.inp.out_channels, list(args["ch_mult"]), unet.image_size
    if mult[0] != 1:  # diffusers' sinusoid has block_out_channels[0] features, fasttrain's ch
        raise InvalidInput(f"this UNet cannot be exported to diffusers: model.args.ch_mult starts with {mult[0]}; "
                           f"UNet2DModel embeds timesteps with as many features as its first level has channels")
    attn = [size // 2**i in args["attn_resolutions"] for i in range(len(mult))]
    groups = next(m.num_groups for m in unet.modules() if isinstance(m, nn.GroupNorm))
    head = next((m.qkv.in_channels // m.heads for m in unet.modules() if isinstance(m, AttnBlock)), None)
    classes = unet.embed.num_classes
    return dict(sample_size=size, in_channels=unet.in_channels, out_channels=unet.out[2].out_channels,
                block_out_channels=[ch * m for m in mult], layers_per_block=args["num_res_blocks"],
                down_block_types=["AttnDownBlock2D" if a else "DownBlock2D" for a in attn],
                up_block_types=["AttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attn)],
                attention_head_dim=head, norm_num_groups=groups, attn_norm_num_groups=groups, norm_eps=1e-5,
                resnet_time_scale_shift="scale_shift", flip_sin_to_cos=True, freq_shift=0, act_fn="silu",
                dropout=float(args.get("dropout", 0.0)), num_class_embeds=classes + 1 if classes else None,
                downsample_type="conv", upsample_type="conv", time_embedding_type="positional")


def unet_state_dict(unet, hf) -> dict:
    """fasttrain UNet weights → UNet2DModel weights, walking both networks in execution order."""
    from ..models.unet import AttnBlock, ResBlock

    src, out = unet.state_dict(), {}

    def put(dst, prefix, pairs):
        for d, s in pairs:
            for suf in ("weight", "bias"):
                k = f"{prefix}{s}.{suf}" if s else f"{prefix}{suf}"
                if k in src:
                    w = src[k]
                    out[f"{dst}{d}.{suf}" if d else f"{dst}{suf}"] = w.squeeze(-1) if w.dim() == 3 else w  # Conv1d(k=1)

    def res(dst, s):
        put(dst, s, [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb.1"),
                     ("norm2", "out_norm"), ("conv2", "out_layers.2"), ("conv_shortcut", "skip")])

    def attn(dst, s):
        put(dst, s, [("group_norm", "norm"), ("to_out.0", "proj")])
        for n, w, b in zip("qkv", src[s + "qkv.weight"].squeeze(-1).chunk(3), src[s + "qkv.bias"].chunk(3)):
            out[f"{dst}to_{n}.weight"], out[f"{dst}to_{n}.bias"] = w, b

    put("", "", [("time_embedding.linear_1", "embed.mlp.0"), ("time_embedding.linear_2", "embed.mlp.2"),
                 ("conv_in", "inp"), ("conv_norm_out", "out.0"), ("conv_out", "out.2")])
    if "embed.label.weight" in src:
        out["class_embedding.weight"] = src["embed.label.weight"]

    def walk(stages, prefix):
        return iter([(f"{prefix}{i}.{j}.", m) for i, st in enumerate(stages) for j, m in enumerate(st)
                     if not isinstance(m, nn.Upsample)])

    for blocks, stages, kind in ((hf.down_blocks, walk(unet.down, "down."), "down"),
                                 (hf.up_blocks, walk(unet.up, "up."), "up")):
        for level, blk in enumerate(blocks):
            for j in range(len(blk.resnets)):
                name, m = next(stages)
                assert isinstance(m, ResBlock), name
                res(f"{kind}_blocks.{level}.resnets.{j}.", name)
                if getattr(blk, "attentions", None):
                    name, m = next(stages)
                    assert isinstance(m, AttnBlock), name
                    attn(f"{kind}_blocks.{level}.attentions.{j}.", name)
            sampler = blk.downsamplers if kind == "down" else blk.upsamplers
            if sampler:
                name, m = next(stages)
                assert isinstance(m, nn.Conv2d), name
                put(f"{kind}_blocks.{level}.{kind}samplers.0.conv.", name, [("", "")])
    res("mid_block.resnets.0.", "mid.0.")
    attn("mid_block.attentions.0.", "mid.1.")
    res("mid_block.resnets.1.", "mid.2.")
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# -- any backbone --------------------------------------------------------------------------------------
def to_diffusers(backbone: nn.Module, model_args: dict | None = None):
    """(component name, diffusers model in eval mode with the backbone's weights, timestep frequencies
    "diffusers" (the stock class) | "fasttrain" (a legacy DiT's), null label or None); InvalidInput
    naming why where none exists."""
    from .. import optional
    from ..models.diffusers_backbone import DiffusersBackbone
    from ..models.dit import DiT
    from ..models.unet import UNet

    diffusers = optional.diffusers("export --to diffusers")
    if isinstance(backbone, DiffusersBackbone):
        m = copy.deepcopy(backbone.model).float().eval()
        if getattr(backbone, "lora_base", None):  # a LoRA run (lora.py): the adapter folded into the stock model
            from ..pretrained.lora import merged

            m = merged(m)
        return ("transformer" if backbone.is_dit else "unet"), m, "diffusers", backbone.null_row
    if isinstance(backbone, DiT):
        cfg = dit_config(backbone)
        m = diffusers.DiTTransformer2DModel(**cfg)
        hidden, legacy = backbone.x_embed.out_channels, backbone.convention == "legacy"
        m.load_state_dict(dit_state_dict(backbone.state_dict(), len(backbone.blocks), hidden, swap=legacy),
                          strict=True)
        m = m.float().eval()
        if legacy:
            from .remote_pipeline import use_fasttrain_timestep_frequencies  # the one the exported pipeline runs

            m = use_fasttrain_timestep_frequencies(m)
        return "transformer", m, "fasttrain" if legacy else "diffusers", backbone.embed.num_classes
    if isinstance(backbone, UNet):
        why = unet_refusal(backbone)
        if why:
            raise InvalidInput(f"this UNet cannot be exported to diffusers: {why}")
        m = diffusers.UNet2DModel(**unet_config(backbone, model_args or {}))
        m.load_state_dict(unet_state_dict(backbone, m), strict=True)
        classes = backbone.embed.num_classes
        return "unet", m.float().eval(), "diffusers", classes if classes else None
    raise InvalidInput(f"a {type(backbone).__name__} has no diffusers counterpart (export handles DiT, the ADM "
                       f"UNets and diffusers backbones)")
