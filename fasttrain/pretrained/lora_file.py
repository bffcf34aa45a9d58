"""LoRA files ↔ a run's peft adapter: the kohya/webui file `export --to kohya` writes, and starting a run from
a LoRA file of either format (`model.lora.init=FILE`).

    tensors = kohya_tensors(unet_or_transformer, text_encoders=[...])   # sd-scripts' names (kohya.py)
    load_into(model, cfg.model.lora, FILE)                                # a fresh adapter takes the file's weights

Formats read: diffusers' (`pytorch_lora_weights.safetensors`: unet.… / transformer.… keys in peft's lora_A/lora_B
or diffusers' lora.down/lora.up spelling, the adapter's r and lora_alpha in the file's lora_adapter_metadata
where save_lora_weights wrote it, else alpha = rank as diffusers' load_lora_weights assumes), and sd-scripts'
(lora_unet_… keys with lora_down/lora_up and .alpha; kohya.py). Checked against the config, one line each:
every module's rank is model.lora.rank, its scale alpha/rank is model.lora.alpha / rank, and the modules the
file adapts are the ones model.lora.target_modules adapts in this network (a kohya file's fused Flux modules
split into diffusers' parts first). The text encoders' modules are refused while the run trains none (the
family of a kohya file's names: lora_te…). Which layout a denoiser has (`family_of`): Flux for a
FluxTransformer2DModel, SDXL for a UNet2DConditionModel with the text_time embedding, SD 1.x/2.x otherwise.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import InvalidInput, MissingFile
from . import kohya


def family_of(model: torch.nn.Module) -> str:
    name = type(model).__name__
    if name == "FluxTransformer2DModel":
        return "flux"
    if name == "UNet2DConditionModel":
        return "sdxl" if model.config.get("addition_embed_type") == "text_time" else "sd1"
    raise InvalidInput(f"kohya LoRA files are written for SD 1.x/2.x, SDXL and Flux networks, not a {name}")


def _layers(model: torch.nn.Module):
    """(name, module) of the model's Linear/Conv2d layers, peft's wrappers counted as the layer they wrap."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, m in model.named_modules():
        if ".lora_" in f".{name}" or name.endswith("base_layer") or ".base_layer." in name:
            continue
        if isinstance(m, (BaseTunerLayer, torch.nn.Linear, torch.nn.Conv2d)):
            yield name, m


def adapted(model: torch.nn.Module) -> set[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def targets_of(model: torch.nn.Module, family: str, text_index: int | None = None) -> dict[str, kohya.Target]:
    """Every layer of `model` that has a place in sd-scripts' layout → its Target (`text_index`: the model is
    text encoder `text_index` of the pipeline, else the denoiser)."""
    out = {}
    for name, _ in _layers(model):
        try:
            out[name] = (kohya.text_target(family, text_index, name) if text_index is not None
                         else kohya.denoiser_target(family, name, model.config))
        except InvalidInput:
            continue
    return out


def _rank_alpha(model) -> tuple[int, float]:
    cfg = model.peft_config["default"]
    if cfg.rank_pattern or cfg.alpha_pattern:
        raise InvalidInput("kohya LoRA files are written for one rank and alpha per adapter (no rank_pattern)")
    return int(cfg.r), float(cfg.lora_alpha)


def _model_tensors(model, family: str, text_index: int | None) -> dict:
    from peft.utils import get_peft_model_state_dict

    targets = targets_of(model, family, text_index)
    missing = sorted(adapted(model) - set(targets))
    if missing:  # raises with the module's name
        (kohya.text_target(family, text_index, missing[0]) if text_index is not None
         else kohya.denoiser_target(family, missing[0], model.config))
    rank, alpha = _rank_alpha(model)
    return kohya.to_kohya(targets, get_peft_model_state_dict(model), rank, alpha, kohya.fused_widths(targets, model))


def kohya_tensors(denoiser: torch.nn.Module, text_encoders: list | tuple = ()) -> dict:
    """The kohya dict of a peft-adapted denoiser and of the pipeline's text encoders that carry an adapter
    (`text_encoders`: (index, model) pairs, index 0 for text_encoder, 1 for text_encoder_2, ...)."""
    family = family_of(denoiser)
    out = _model_tensors(denoiser, family, None)
    for index, model in text_encoders:
        out.update(_model_tensors(model, family, index))
    return out


# -- reading ------------------------------------------------------------------------------------------------
def read(path: str | Path) -> tuple[dict, dict]:
    """(tensors, safetensors metadata) of a LoRA file (a folder: its pytorch_lora_weights.safetensors)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if p.is_dir():
        p = p / "pytorch_lora_weights.safetensors"
    if not p.is_file():
        raise MissingFile(f"model.lora.init: {path} is not a LoRA file (a .safetensors file, or a folder holding "
                          f"pytorch_lora_weights.safetensors)")
    try:
        with safe_open(str(p), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise InvalidInput(f"model.lora.init: {p} cannot be read as safetensors ({str(e)[:120]})") from None


def is_kohya(tensors: dict) -> bool:
    return any(k.endswith(".lora_down.weight") for k in tensors)


def _diffusers_modules(tensors: dict, meta: dict, prefix: str, where: str) -> dict:
    """{module: (A, B, scale)} of a diffusers-format file's `prefix` part (unet / transformer)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    state = convert_unet_state_dict_to_peft(own)
    info = json.loads(meta.get("lora_adapter_metadata") or "{}")
    out = {}
    for k, a in state.items():
        m = re.match(r"(.*)\.lora_A(?:\.default)?\.weight$", k)
        if m is None:
            continue
        b = state.get(f"{m.group(1)}.lora_B.weight", state.get(f"{m.group(1)}.lora_B.default.weight"))
        if b is None:
            raise InvalidInput(f"{where}: {m.group(1)} has a lora_A and no lora_B")
        rank = int(info.get(f"{prefix}.r", a.shape[0]))
        alpha = float(info.get(f"{prefix}.lora_alpha", rank))  # no metadata: alpha = rank (load_lora_weights')
        out[m.group(1)] = (a.float(), b.float(), alpha / rank)
    return out


def modules_of(model: torch.nn.Module, tensors: dict, meta: dict, where: str) -> dict:
    """{module: (A, B, scale)} that the file gives the denoiser `model` (either format; module docstring)."""
    if is_kohya(tensors):
        family = family_of(model)
        text = sorted({k.split("_", 2)[1] for k in tensors if k.startswith("lora_te")})
        if text:
            raise InvalidInput(f"{where}: the file adapts the text encoders ({', '.join('lora_' + t for t in text)} "
                               f"keys), and this run trains no text-encoder adapter")
        own = {k: v for k, v in tensors.items() if k.startswith(kohya.DENOISER_PREFIX + "_")}
        targets = targets_of(model, family)
        return kohya.from_kohya(own, targets, kohya.fused_widths(targets, model), where)
    prefixes = sorted({k.split(".", 1)[0] for k in tensors})
    denoiser = [p for p in prefixes if p in ("unet", "transformer")]
    others = [p for p in prefixes if p not in ("unet", "transformer")]
    if others:
        raise InvalidInput(f"{where}: the file adapts {', '.join(others)} (keys {others[0]}.…), and this run trains "
                           f"an adapter on its {'transformer' if 'transformer' in denoiser else 'UNet'} alone")
    if not denoiser:
        raise InvalidInput(f"{where}: no LoRA weights in it (diffusers' unet.… / transformer.… keys, or sd-scripts' "
                           f"lora_unet_… keys)")
    return _diffusers_modules(tensors, meta, denoiser[0], where)


@torch.no_grad()
def load_into(model: torch.nn.Module, lc, path: str) -> dict:
    """Give the peft adapter of `model` (just added, model.lora.* = `lc`) the LoRA file's weights, after the
    checks of the module docstring; returns the file's identity (path, format, sha256) for the checkpoint."""
    from . import file_hashes

    where = f"model.lora.init={path}"
    tensors, meta = read(path)
    modules = modules_of(model, tensors, meta, where)
    rank, alpha = _rank_alpha(model)
    mine = adapted(model)
    extra, missing = sorted(set(modules) - mine), sorted(mine - set(modules))
    if extra:
        raise InvalidInput(f"{where}: the file adapts {extra[0]}, which model.lora.target_modules="
                           f"{list(lc.target_modules)} does not ({len(extra)} such module(s); set the file's targets)")
    if missing:
        raise InvalidInput(f"{where}: model.lora.target_modules={list(lc.target_modules)} adapts {missing[0]}, which "
                           f"the file does not ({len(missing)} such module(s); set the file's targets)")
    for name, (a, b, scale) in sorted(modules.items()):
        layer = model.get_submodule(name)
        if a.shape[0] != rank:
            raise InvalidInput(f"{where}: {name} has rank {a.shape[0]}, model.lora.rank is {rank}")
        if abs(scale - alpha / rank) > 1e-6 * (alpha / rank):
            raise InvalidInput(f"{where}: {name} is scaled by alpha/rank = {scale:g} (alpha {scale * rank:g}), "
                               f"model.lora.alpha={alpha:g} scales by {alpha / rank:g}")
        for part, value in (("lora_A", a), ("lora_B", b)):
            w = getattr(layer, part)["default"].weight
            if tuple(w.shape) != tuple(value.shape):
                raise InvalidInput(f"{where}: {name}.{part} is {tuple(value.shape)}, this network's {tuple(w.shape)} "
                                   f"(a LoRA of another model)")
            w.copy_(value.to(w.dtype))
    p = Path(path)
    p = p / "pytorch_lora_weights.safetensors" if p.is_dir() else p
    return {"path": str(p.resolve()), "format": "kohya" if is_kohya(tensors) else "diffusers",
            "sha256": file_hashes.sha256([p])}
