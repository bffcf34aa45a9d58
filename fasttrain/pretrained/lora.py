"""LoRA adapters through `peft` on a diffusers backbone (`model.lora.rank > 0`; Hu et al. 2021).

    model.lora.rank=16 model.lora.alpha=16 model.lora.dropout=0 model.lora.target_modules=[to_k,to_q,to_v,to_out.0]

The backbone's diffusers model gets `add_adapter(peft.LoraConfig(...))` (diffusers' PeftAdapterMixin, as
diffusers' train_text_to_image_lora.py does) after its base weights are frozen: W x + (alpha/r) B A x, with
A Gaussian and B zero, so the run starts from the pretrained network exactly. Only the adapter's parameters
require gradients, so the optimizer and the EMA hold the adapter alone (train.py, ema.py).

`model.lora.init=FILE` starts the adapter from a LoRA file (diffusers' or kohya's format; lora_file.py), its rank,
alpha and adapted modules checked against the config; the checkpoint records the file's identity.

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


def _matches(name: str, targets: list[str]) -> bool:
    """peft's rule for a list of target names: the module's full name, or its last dotted parts."""
    return any(name == t or name.endswith("." + t) for t in targets)


def check_targets(model: torch.nn.Module, lc) -> None:
    """The adapter fits the network (one line naming the key, before anything is built or written): its
    target modules match some layer, every matched layer is one LoRA adapts (linear, convolution,
    embedding: peft's LoRA layers), and the rank is at most the smallest width it adapts (a rank above
    min(in, out) adds parameters and no expressiveness: B A of rank r spans at most min(in, out))."""
    targets = list(lc.target_modules)
    matched = [(n, m) for n, m in model.named_modules() if n and _matches(n, targets)]
    if not matched:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise InvalidInput(f"bad value for 'model.lora.target_modules': {targets} match no module of the network "
                           f"(its linear layers are named {', '.join(linear[:8])}{' ...' if len(linear) > 8 else ''})")
    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    for n, m in matched:
        if not isinstance(m, kinds):
            raise InvalidInput(f"bad value for 'model.lora.target_modules': {n} is a {type(m).__name__}, not a "
                               f"linear, convolution or embedding layer that LoRA adapts")

    def widths(m):
        if isinstance(m, torch.nn.Linear):
            return m.in_features, m.out_features
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings, m.embedding_dim
        return m.in_channels, m.out_channels

    n, m = min(matched, key=lambda nm: min(widths(nm[1])))
    a, b = widths(m)
    if int(lc.rank) > min(a, b):
        raise InvalidInput(f"bad value for 'model.lora.rank': {int(lc.rank)} (at most {min(a, b)}: the adapted layer "
                           f"{n} is {a} → {b}, and a rank above its smaller width adds no expressiveness)")


def check_config(cfg) -> None:
    """A LoRA run's settings at configuration: a pretrained diffusers backbone, and an adapter that fits it
    (`check_targets` on the network built on the meta device from the architecture configure.py completed)."""
    from ..config import plain

    lc, args = cfg.model.lora, plain(cfg.model.args)
    if cfg.model.name != "diffusers":
        raise InvalidInput(f"bad value for 'model.lora.rank': {lc.rank} (LoRA applies to diffusers backbones: "
                           f"model.name=diffusers with model.args.pretrained, not model.name={cfg.model.name})")
    if not args.get("pretrained"):
        raise InvalidInput(f"bad value for 'model.lora.rank': {lc.rank} (LoRA adapts a pretrained network; set "
                           f"model.args.pretrained)")
    from ..models.diffusers_backbone import construct

    check_targets(construct(args.get("class_name", "UNet2DModel"), args.get("config") or {}, meta=True), lc)


def apply(net, cfg, init: bool = True) -> None:
    """Freeze the backbone's diffusers model and add the adapter (module docstring); records the base's
    identity on the backbone (`lora_base`). With model.lora.init and `init` (a new run, not one whose
    checkpoint holds the adapter), the adapter starts from that LoRA file (lora_file.py)."""
    lc, args = cfg.model.lora, cfg.model.args
    backbone = getattr(net, "net", net)
    if cfg.model.name != "diffusers" or not hasattr(backbone, "model"):
        raise InvalidInput(f"model.lora.rank={lc.rank}: LoRA applies to diffusers backbones (model.name=diffusers with "
                           f"model.args.pretrained), not model.name={cfg.model.name}")
    if not args.get("pretrained"):
        raise InvalidInput(f"model.lora.rank={lc.rank}: LoRA adapts a pretrained network; set model.args.pretrained")
    folder = Path(args["pretrained"]) / (args.get("subfolder") or "")
    model = backbone.model
    check_targets(model, lc)
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
    if lc.get("init") and init:  # sd-scripts' --network_weights: continue from a LoRA file
        from .lora_file import load_into

        backbone.lora_base["init"] = load_into(model, lc, str(lc.init))


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
    text = getattr(backbone, "text_encoders", None)  # text-encoder LoRA's frozen encoders too (text_lora.py)
    for module in [*backbone.model.modules(), *(text.modules() if text is not None else ())]:
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
