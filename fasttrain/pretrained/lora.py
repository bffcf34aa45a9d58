"""LoRA adapters through `peft` on a diffusers backbone (`model.lora.rank > 0`; Hu et al. 2021).

    model.lora.rank=16 model.lora.alpha=16 model.lora.dropout=0 model.lora.target_modules=[to_k,to_q,to_v,to_out.0]

The backbone's diffusers model gets `add_adapter(peft.LoraConfig(...))` (diffusers' PeftAdapterMixin, as
diffusers' train_text_to_image_lora.py does) after its base weights are frozen: W x + (alpha/r) B A x, with
A Gaussian and B zero, so the run starts from the pretrained network exactly. Only the adapter's parameters
require gradients, so the optimizer and the EMA hold the adapter alone (train.py, ema.py).

Checkpoints hold the adapter (and the parameters outside the backbone, e.g. a learned weighting) plus the
base model's identity: the pretrained folder and the sha256 of its weights file (`identity`). The base is
read from the pretrained folder whenever the network is built, also on resume and by `ModelBundle.load`;
a base whose weights changed since the run started is refused in one line (`check`).

While training, the frozen base is held in `model.lora.base_dtype` (auto: bf16 on CUDA, as diffusers'
train_text_to_image_lora.py casts the frozen UNet to the mixed-precision dtype and keeps the adapter in fp32;
fp32 on CPU): `hold_base`. Sampling, evaluation of a checkpoint and export read the base in fp32.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..errors import CheckpointError, InvalidInput, MissingDependency

MARK = "lora_"  # peft's parameter names: ...to_q.lora_A.default.weight
BASE_DTYPES = ("auto", "fp32", "bf16", "fp16")


def peft():
    try:
        import peft as module
    except ImportError:
        raise MissingDependency("model.lora.rank needs the optional package peft (pip install 'fasttrain[lora]')") \
            from None
    return module


def enabled(cfg) -> bool:
    return int(cfg.model.lora.rank) > 0


@contextlib.contextmanager
def base_weights():
    """Inside: pretrained weights are read even where a checkpoint provides the rest (a LoRA checkpoint
    does not hold the base)."""
    from ..models import _PRETRAINED

    token = _PRETRAINED.set(True)
    try:
        yield
    finally:
        _PRETRAINED.reset(token)


def _weights_hash(folder: Path) -> str:
    from . import file_hashes
    from .model_folders import weights_file

    return file_hashes.sha256([weights_file(folder)])


def apply(net, cfg) -> None:
    """Freeze the backbone's diffusers model and add the adapter (module docstring); records the base's
    identity on the backbone (`lora_base`)."""
    lc, args = cfg.model.lora, cfg.model.args
    backbone = getattr(net, "net", net)
    if cfg.model.name != "diffusers" or not hasattr(backbone, "model"):
        raise InvalidInput(f"model.lora.rank={lc.rank}: LoRA applies to diffusers backbones (model.name=diffusers with "
                           f"model.args.pretrained), not model.name={cfg.model.name}")
    if not args.get("pretrained"):
        raise InvalidInput(f"model.lora.rank={lc.rank}: LoRA adapts a pretrained network; set model.args.pretrained")
    folder = Path(args["pretrained"]) / (args.get("subfolder") or "")
    model = backbone.model
    model.requires_grad_(False)
    rank = int(lc.rank)
    config = peft().LoraConfig(r=rank, lora_alpha=float(lc.alpha if lc.alpha is not None else rank),
                               lora_dropout=float(lc.dropout), init_lora_weights="gaussian",
                               target_modules=list(lc.target_modules))
    try:
        if hasattr(model, "add_adapter"):  # diffusers' PeftAdapterMixin (UNet2DConditionModel, transformers)
            model.add_adapter(config)
        else:  # UNet2DModel has no mixin: peft's own injection, the same layers
            peft().inject_adapter_in_model(config, model)
    except ValueError as e:  # no module matches
        first = str(e).strip().splitlines()[0][:160]
        raise InvalidInput(f"model.lora.target_modules={list(lc.target_modules)}: {first}") from None
    backbone.lora_base = {"path": str(folder.resolve()), "pipeline": str(Path(args["pretrained"]).resolve()),
                          "sha256": _weights_hash(folder)}


def base_dtype(cfg, device) -> torch.dtype:
    """The dtype a run holds its frozen LoRA base in while training (`model.lora.base_dtype`); one-line
    errors for a setting that cannot apply."""
    name, device = cfg.model.lora.base_dtype, torch.device(device)
    if not enabled(cfg):
        if name != "auto":
            raise InvalidInput(f"model.lora.base_dtype={name} sets the dtype of a LoRA run's frozen base; this run has "
                               f"no adapter (model.lora.rank=0)")
        return torch.float32
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise InvalidInput("model.lora.base_dtype=fp16 needs CUDA (on CPU hold the base in bf16 or fp32)")
    from ..parallel.precision import DTYPES

    return DTYPES[name]


def hold_base(net, dtype: torch.dtype) -> None:
    """Cast the frozen base (the diffusers model's parameters that do not train, and its floating buffers)
    to `dtype`, as diffusers' cast_training_params leaves only the trained parameters in fp32: half the
    base's memory in bf16. The backbone then casts its inputs to `dtype` and its output back
    (DiffusersBackbone.compute_dtype), so the step, in-run sampling and autocast see one dtype; peft adds
    the fp32 adapter's branch to the base layer's output in the base's dtype (peft's LoraLayer forward)."""
    if dtype == torch.float32:
        return
    backbone = getattr(net, "net", net)
    for module in backbone.model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, name, b.to(dtype))
    backbone.compute_dtype = dtype


def identity(net) -> dict | None:
    """The base model's identity a LoRA run's checkpoint records (None: not a LoRA run)."""
    return next((m.lora_base for m in net.modules() if getattr(m, "lora_base", None)), None)


def check(recorded: dict | None, net, where) -> None:
    """Refuse a base model whose weights are not the recorded ones (one line)."""
    mine = identity(net)
    if recorded is None and mine is None:
        return
    if (recorded is None) != (mine is None):
        raise CheckpointError(f"{where}: the checkpoint is {'not ' if recorded is None else ''}a LoRA run's and the "
                              f"configured model {'has' if mine is not None else 'has no'} adapter")
    if recorded["sha256"] != mine["sha256"]:
        raise CheckpointError(f"{where}: the base model {mine['path']} is not the one this LoRA run was trained on "
                              f"(its weights' sha256 differs from the recorded {recorded['sha256'][:12]}…); a LoRA "
                              f"checkpoint holds the adapter only")


def is_adapter_only(net) -> bool:
    return identity(net) is not None


def checkpoint_view(net, state: dict) -> dict:
    """What a LoRA run's checkpoint keeps of a model state dict: the trainable parameters (the adapter and
    anything outside the frozen base)."""
    if not is_adapter_only(net):
        return state
    from ..optim.ema import clean_name

    keep = {clean_name(k) for k, p in net.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if clean_name(k) in keep or MARK in k}


def completed(net, state: dict) -> dict:
    """A LoRA checkpoint's state dict filled with the base weights the network already holds."""
    if not is_adapter_only(net):
        return state
    return {**net.state_dict(), **state}


def loadable(recorded: dict | None, net, state: dict, where, full: bool = True) -> dict:
    """A checkpoint's model state as `net` loads it: a LoRA run's base checked against the one its checkpoint
    records (`check`), and a whole (not sharded) adapter-only state filled with the base weights the network
    already holds (`completed`). Every reader of checkpoints (the bundle, the resume) loads through this."""
    check(recorded, net, where)
    return completed(net, state) if full else state


def seed_dropout(cfg, seed: int) -> None:
    """peft's LoRA dropout draws from torch's global stream: a LoRA run with dropout seeds it per rank once
    its set-up is done (the checkpoint's per-rank streams then hold it: train_state.RankRNG)."""
    if enabled(cfg) and cfg.model.lora.dropout > 0:
        torch.manual_seed(seed)


def adapter_state(unet) -> dict:
    """diffusers' LoRA layers of a peft-adapted UNet (get_peft_model_state_dict), for save_lora_weights."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(unet)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """The model with its adapter folded into the base weights (W + alpha/r · B A, peft's merge) and the
    peft layers replaced by their base layers: a stock diffusers model."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge()
    recurse_remove_peft_layers(model)
    if hasattr(model, "peft_config"):  # diffusers' mixin: no adapter left to name
        del model.peft_config
    if hasattr(model, "_hf_peft_config_loaded"):
        model._hf_peft_config_loaded = False
    return model
