"""LoRA weights in kohya-ss/sd-scripts' layout (the "kohya" or "webui" format that ComfyUI, AUTOMATIC1111/Forge
and sd-scripts load): one flat state dict of

    {lora_name}.lora_down.weight   [rank, in] (Conv2d: [rank, in, kh, kw])
    {lora_name}.lora_up.weight     [out, rank] (Conv2d: [out, rank, 1, 1])
    {lora_name}.alpha              the scalar alpha: the update is alpha / rank · up · down

with lora_name = prefix + "_" + the module's path in sd-scripts' own model, dots made underscores
(networks/lora.py LoRANetwork.create_modules: `lora_name = prefix + "." + name + "." + child_name`,
`.replace(".", "_")`; networks/lora_flux.py the same). The prefixes: lora_unet (the denoiser: UNet, and Flux's
transformer too, "make ComfyUI compatible"), lora_te (SD 1.x's text encoder), lora_te1 / lora_te2 (SDXL's pair),
lora_te1 / lora_te3 (Flux's CLIP-L / T5). The module paths are those of the models sd-scripts trains:

  sd1   diffusers' UNet2DConditionModel names (sd-scripts' library/original_unet.py keeps them):
        down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q
  sdxl  the SGM/LDM UNet of library/sdxl_original_unet.py: input_blocks / middle_block / output_blocks, each
        a list of [resnet, attention] entries and samplers (`sgm_name`), the resnets' in_layers.2 / emb_layers.1
        / out_layers.3 / skip_connection, conv_in input_blocks.0.0, conv_out out.2, time_embed.0/2, label_emb.0.0/2
  flux  Black Forest Labs' model (library/flux_models.py): double_blocks.i.{img,txt}_{attn.qkv, attn.proj,
        mlp.0, mlp.2, mod.lin}, single_blocks.i.{linear1, linear2, modulation.lin}, img_in, txt_in, time_in,
        vector_in, guidance_in, final_layer. BFL fuses diffusers' to_q/to_k/to_v into one qkv (and the single
        blocks' q, k, v and proj_mlp into linear1): `flux_name`
  text  transformers' CLIP names under text_model. (text_model.encoder.layers.0.self_attn.q_proj)

A fused module's parts (diffusers' separate Linears with their own LoRA each) are written as sd-scripts'
`split_qkv` saves them (lora_flux.py LoRANetwork.state_dict): the parts' downs stacked [P·r, in], the ups
block-diagonal [Σ out, P·r] (a part without an adapter contributes zero blocks). The product is exactly the
parts' updates side by side; the readers (ComfyUI's alpha / mat2.shape[0], diffusers'
_convert_kohya_flux_lora_to_diffusers, sd-scripts' create_network_from_weights) scale it by alpha / (the file's
rank, P·r), so the file's alpha is P·alpha to keep the trained scale alpha / r. (sd-scripts' own split_qkv save
keeps the parts' alpha, lora_flux.py state_dict, so its files read at 1/P of their trained scale there.)
Read back (`from_kohya`), such a module is split into its parts again; a dense fused module of rank r (sd-scripts
without split_qkv: one down shared by the parts) becomes each part's LoRA with that down and its rows of the up.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import InvalidInput

FAMILIES = ("sd1", "sdxl", "flux")
DENOISER_PREFIX = "lora_unet"
# text encoder index (0-based, the pipeline's text_encoder, text_encoder_2, ...) → sd-scripts' prefix
TEXT_PREFIXES = {"sd1": ("lora_te",), "sdxl": ("lora_te1", "lora_te2"), "flux": ("lora_te1", "lora_te3")}


@dataclass(frozen=True)
class Target:
    """Where a diffusers module's LoRA sits in sd-scripts' file: `name` (its lora_name), `part` of `parts`
    (a fused module's; 0 of 1 otherwise)."""
    name: str
    part: int = 0
    parts: int = 1


# -- SDXL: diffusers' UNet2DConditionModel names → the SGM UNet's -----------------------------------------------
RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
          "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
TOP = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
       "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
       "add_embedding.linear_2": "label_emb.0.2"}


def _resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    if head not in RESNET:
        raise KeyError(rest)
    return RESNET[head] + (f".{tail}" if tail else "")


def sgm_name(name: str, config) -> str:
    """The SGM/LDM UNet's path of a diffusers UNet2DConditionModel module (SDXL's layout: input block k of
    down block b and layer l is 1 + b·(L + 1) + l, its downsampler the block after; output blocks (L + 1) per
    up block; entry .0 the resnet, .1 the attention, the sampler last)."""
    if name in TOP:
        return TOP[name]
    layers = config["layers_per_block"]
    if not isinstance(layers, int):
        raise InvalidInput("kohya names for SDXL need one layers_per_block for every block (SDXL's 2)")
    m = re.match(r"(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)(?:\.(.*))?$",
                 name)
    if m:
        kind, b, inner, i, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5) or ""
        if kind == "down_blocks":
            block = 1 + b * (layers + 1) + (layers if inner == "downsamplers" else i)
            if inner == "downsamplers":
                return f"input_blocks.{block}.0.op"
            return f"input_blocks.{block}.{0 if inner == 'resnets' else 1}." + (_resnet(rest) if inner == "resnets"
                                                                                else rest)
        block = b * (layers + 1) + (layers if inner == "upsamplers" else i)
        if inner == "upsamplers":  # after the block's last resnet (and attention, where it has them)
            attn = "CrossAttn" in config["up_block_types"][b] or "Attn" in config["up_block_types"][b]
            return f"output_blocks.{block}.{2 if attn else 1}.conv"
        return f"output_blocks.{block}.{0 if inner == 'resnets' else 1}." + (_resnet(rest) if inner == "resnets"
                                                                             else rest)
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)$", name)
    if m:
        inner, i, rest = m.groups()
        if inner == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{0 if i == '0' else 2}.{_resnet(rest)}"
    raise KeyError(name)


# -- Flux: diffusers' FluxTransformer2DModel names → BFL's ------------------------------------------------------
DOUBLE = {"attn.to_q": ("img_attn.qkv", 0, 3), "attn.to_k": ("img_attn.qkv", 1, 3), "attn.to_v": ("img_attn.qkv", 2, 3),
          "attn.to_out.0": ("img_attn.proj", 0, 1), "ff.net.0.proj": ("img_mlp.0", 0, 1),
          "ff.net.2": ("img_mlp.2", 0, 1), "norm1.linear": ("img_mod.lin", 0, 1),
          "attn.add_q_proj": ("txt_attn.qkv", 0, 3), "attn.add_k_proj": ("txt_attn.qkv", 1, 3),
          "attn.add_v_proj": ("txt_attn.qkv", 2, 3), "attn.to_add_out": ("txt_attn.proj", 0, 1),
          "ff_context.net.0.proj": ("txt_mlp.0", 0, 1), "ff_context.net.2": ("txt_mlp.2", 0, 1),
          "norm1_context.linear": ("txt_mod.lin", 0, 1)}
SINGLE = {"attn.to_q": ("linear1", 0, 4), "attn.to_k": ("linear1", 1, 4), "attn.to_v": ("linear1", 2, 4),
          "proj_mlp": ("linear1", 3, 4), "proj_out": ("linear2", 0, 1), "norm.linear": ("modulation.lin", 0, 1)}
FLUX_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
            "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
            "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
            "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
            "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
            "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
            "time_text_embed.text_embedder.linear_2": "vector_in.out_layer", "proj_out": "final_layer.linear"}
# norm_out.linear ↔ final_layer.adaLN_modulation.1 holds (shift, scale) where diffusers holds (scale, shift): its
# up rows swap (diffusers' swap_scale_shift), a layout this writer does not produce; it is refused


def flux_name(name: str) -> tuple[str, int, int]:
    """(BFL path, part, parts) of a diffusers FluxTransformer2DModel module (module docstring)."""
    m = re.match(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.*)$", name)
    if m:
        table = DOUBLE if m.group(1) == "transformer_blocks" else SINGLE
        block = "double_blocks" if m.group(1) == "transformer_blocks" else "single_blocks"
        if m.group(3) in table:
            path, part, parts = table[m.group(3)]
            return f"{block}.{m.group(2)}.{path}", part, parts
    elif name in FLUX_TOP:
        return FLUX_TOP[name], 0, 1
    raise KeyError(name)


def denoiser_target(family: str, name: str, config) -> Target:
    """sd-scripts' place of the denoiser's module `name` (diffusers' path), or InvalidInput."""
    try:
        if family == "sd1":
            path, part, parts = name, 0, 1
        elif family == "sdxl":
            path, part, parts = sgm_name(name, config), 0, 1
        elif family == "flux":
            path, part, parts = flux_name(name)
        else:
            raise InvalidInput(f"kohya LoRA files are written for SD 1.x/2.x, SDXL and Flux runs, not {family}")
    except KeyError:
        raise InvalidInput(f"the adapted module {name} has no place in sd-scripts' {family} LoRA layout "
                           f"(model.lora.target_modules: adapt attention, MLP or resnet layers)") from None
    return Target(f"{DENOISER_PREFIX}_{path.replace('.', '_')}", part, parts)


def text_target(family: str, index: int, name: str) -> Target:
    """sd-scripts' place of text encoder `index`'s module `name` (transformers' path; transformers 5's
    CLIPTextModel drops the `text_model.` that sd-scripts' names keep)."""
    prefixes = TEXT_PREFIXES.get(family, ())
    if index >= len(prefixes):
        raise InvalidInput(f"text encoder {index + 1} of a {family} run has no prefix in sd-scripts' LoRA layout")
    path = name if name.startswith(("text_model.", "encoder.block", "shared")) or prefixes[index] == "lora_te3" \
        else f"text_model.{name}"
    return Target(f"{prefixes[index]}_{path.replace('.', '_')}")


# -- peft state ↔ the kohya dict --------------------------------------------------------------------------------
def _modules(peft_state: dict) -> dict[str, dict]:
    """peft's get_peft_model_state_dict → {module: {"A": down, "B": up}}."""
    out: dict[str, dict] = {}
    for k, v in peft_state.items():
        m = re.match(r"(.*)\.lora_([AB])\.weight$", k)
        if m is None:
            raise InvalidInput(f"unexpected adapter tensor {k} (only LoRA's lora_A / lora_B weights are written)")
        out.setdefault(m.group(1), {})[m.group(2)] = v.detach().float().clone()  # not a view: EMA swaps back
    return out


def to_kohya(targets: dict[str, Target], peft_state: dict, rank: int, alpha: float, widths: dict[str, int]) -> dict:
    """The kohya dict of one model's adapter: `targets` maps each adapted module to its Target, `widths` the
    output width of every part module a fused target holds (adapted or not: its rows of the up)."""
    groups: dict[str, dict[int, tuple[str, dict]]] = {}
    mods = _modules(peft_state)
    for name, ab in mods.items():
        t = targets[name]
        groups.setdefault(t.name, {})[t.part] = (name, ab)
    out = {}
    for lora_name, parts in sorted(groups.items()):
        any_name, ab = next(iter(parts.values()))
        n = targets[any_name].parts
        if n == 1:
            down, up = ab["A"], ab["B"]
        else:
            sizes = [widths[f"{lora_name}#{i}"] for i in range(n)]
            down = torch.cat([parts[i][1]["A"] if i in parts else torch.zeros_like(ab["A"]) for i in range(n)])
            up = torch.zeros(sum(sizes), n * rank, *ab["B"].shape[2:])
            for i in parts:
                lo = sum(sizes[:i])
                up[lo:lo + sizes[i], i * rank:(i + 1) * rank] = parts[i][1]["B"]
        out[f"{lora_name}.lora_down.weight"] = down.contiguous()
        out[f"{lora_name}.lora_up.weight"] = up.contiguous()
        out[f"{lora_name}.alpha"] = torch.tensor(float(alpha) * n)  # scale alpha/rank kept (module docstring)
    return out


def from_kohya(tensors: dict, targets: dict[str, Target], widths: dict[str, int], where: str) -> dict:
    """{module: (A, B, scale)} of the kohya dict `tensors` for the modules `targets` knows (a fused target split
    into its parts; parts whose down and up rows are zero are left out); InvalidInput for names it does not
    know or a fused module that does not split."""
    by_name: dict[str, list[tuple[int, int, str]]] = {}
    for module, t in targets.items():
        by_name.setdefault(t.name, []).append((t.part, t.parts, module))
    names = sorted({k.split(".", 1)[0] for k in tensors})
    out = {}
    for lora_name in names:
        try:
            down, up = tensors[f"{lora_name}.lora_down.weight"].float(), tensors[f"{lora_name}.lora_up.weight"].float()
        except KeyError:
            raise InvalidInput(f"{where}: {lora_name} has no lora_down/lora_up weight pair (not a LoRA in "
                               f"sd-scripts' layout)") from None
        if lora_name not in by_name:
            raise InvalidInput(f"{where}: {lora_name} names no module of this network (a LoRA of another model, "
                               f"or of modules model.lora.target_modules cannot adapt)")
        rank = down.shape[0]
        alpha = float(tensors[f"{lora_name}.alpha"]) if f"{lora_name}.alpha" in tensors else float(rank)
        members = sorted(by_name[lora_name])
        n = members[0][1]
        if n == 1:
            out[members[0][2]] = (down, up, alpha / rank)
            continue
        sizes = [widths[f"{lora_name}#{i}"] for i in range(n)]
        if up.shape[0] != sum(sizes):
            raise InvalidInput(f"{where}: {lora_name}'s up has {up.shape[0]} rows, this network's fused module "
                               f"{sum(sizes)}")
        module_of = {part: module for part, _, module in members}
        sparse = rank % n == 0 and _block_diagonal(up, sizes, rank // n)
        for i in range(n):
            lo = sum(sizes[:i])
            if sparse:
                r = rank // n
                a, b = down[i * r:(i + 1) * r], up[lo:lo + sizes[i], i * r:(i + 1) * r]
            else:  # dense: one down shared by the parts (sd-scripts without split_qkv)
                a, b = down, up[lo:lo + sizes[i]]
            if not a.any() and not b.any():
                continue  # a part the file leaves unadapted
            if i not in module_of:
                raise InvalidInput(f"{where}: {lora_name} adapts part {i} of a fused module, which this network "
                                   f"has no module for")
            out[module_of[i]] = (a, b, alpha / rank)
    return out


def _block_diagonal(up: torch.Tensor, sizes: list[int], r: int) -> bool:
    lo = 0
    for i, s in enumerate(sizes):
        rows = up[lo:lo + s]
        if rows[:, :i * r].any() or rows[:, (i + 1) * r:].any():
            return False
        lo += s
    return True


def fused_widths(targets: dict[str, Target], model: torch.nn.Module) -> dict[str, int]:
    """The output width of each part of each fused target ("name#part" → out_features), from the model."""
    out = {}
    for name, t in targets.items():
        if t.parts > 1:
            out[f"{t.name}#{t.part}"] = model.get_submodule(name).out_features
    return out
