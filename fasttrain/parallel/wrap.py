"""`parallelize(model, ...)`: activation checkpointing → per-block torch.compile → FSDP2 (or DDP).

One pure function in torchtitan's order: checkpoint each repeated block (the model's
`repeated_blocks()`; a model that declares none cannot be checkpointed, compiled per block or
sharded per block, and says so), compile each block with `fullgraph=True` (the repeated structure compiles once and
stays free of graph breaks at FSDP's hooks), then `fully_shard` every block and finally the root with
a mixed-precision policy (bf16 parameters, fp32 gradient reduction). Model files contain no
distributed code; this module only rewraps their blocks. Data parallelism without sharding uses the
composable `replicate` (DDP's engine without a wrapper), so the model object never changes type and
parameter names carry no `module.` prefix.
"""
from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DeviceError, InvalidInput

STRATEGIES = ("none", "ddp", "fsdp")
AC_MODES = ("none", "full", "selective")
COMPILE = ("none", "blocks", "model")
COMPILE_MODES = ("default", "max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units; a loud error for a model that does not declare them."""
    fn = getattr(model, "repeated_blocks", None)
    if fn is None:
        raise ValueError(f"{type(model).__name__} declares no repeated_blocks(): per-block activation "
                         f"checkpointing, compile and sharding need them")
    units = list(fn())
    if not units:
        raise ValueError(f"{type(model).__name__}.repeated_blocks() is empty")
    return units


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for key, child in parent.named_children():
            if child is old:
                parent.register_module(key, new)  # ModuleList keys are "0", "1", ...: setattr works for both
                return
    raise ValueError("block not found in the model")


def _selective_policy():
    """Save the outputs of matmuls and attention (recompute the cheap pointwise ops), as torchtitan's
    default selective AC does."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.convolution.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
           torch.ops.aten._scaled_dot_product_efficient_attention.default,
           torch.ops.aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "none":
        return
    for b in model_blocks(model):
        kw = {"context_fn": _selective_policy()} if mode == "selective" else {}
        _replace(model, b, checkpoint_wrapper(b, preserve_rng_state=True, **kw))


def apply_compile(model: nn.Module, what: str = "blocks", mode: str = "default") -> None:
    """`blocks`: each repeated block with fullgraph=True (torchtitan: compiles once per distinct
    block, no graph breaks at FSDP's hooks); `model`: the whole forward. In place (`Module.compile`),
    so the object and its parameter names stay the same for checkpoints."""
    if what == "none":
        return
    kw = {} if mode == "default" else {"mode": mode}
    if what == "model":
        model.compile(**kw)
        return
    units = model_blocks(model)
    # Blocks of different structure (a UNet's stages), each in training and in sampling mode, are
    # separate graphs of one code object: dynamo's default limit of 8 would turn into a hard error
    # under fullgraph=True.
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 4 * len(units) + 8))
    for b in units:
        b.compile(fullgraph=True, **kw)


def apply_fsdp(model: nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    units = model_blocks(model)
    for i, b in enumerate(units):
        # the last block is needed again right away by backward: keep it gathered (torchtitan)
        fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize(model: nn.Module, strategy: str = "none", ac: str = "none", compile: str = "none",
                precision: str = "fp32", device: torch.device | str = "cpu", compile_mode: str = "default",
                channels_last: bool = False) -> nn.Module:
    """Apply AC, compile and data parallelism (in torchtitan's order); returns the model to train, the
    same object wrapped in place. `precision` is the resolved name (precision.py): FSDP takes it as
    its parameter dtype, the other strategies autocast in the trainer."""
    for value, allowed, key in ((strategy, STRATEGIES, "parallel.strategy"), (ac, AC_MODES, "parallel.ac"),
                                (compile, COMPILE, "parallel.compile"), (compile_mode, COMPILE_MODES,
                                                                         "parallel.compile_mode")):
        if value not in allowed:
            raise InvalidInput(f"bad value for '{key}': {value!r} (choose from {', '.join(allowed)})")
    device = torch.device(device)
    if channels_last and strategy == "fsdp":
        # FSDP2 shards contiguous parameters only (NotImplementedError on NHWC weights): the default
        # preset sets channels_last for one process, and under torchrun it stays off, said once
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print("fasttrain: parallel.channels_last kept off: FSDP shards contiguous parameters only",
                  file=sys.stderr)
    elif channels_last:  # NHWC convolutions (tensor cores; oneDNN on CPU): parameters only, inputs follow
        model.to(memory_format=torch.channels_last)
    apply_ac(model, ac)
    apply_compile(model, compile, compile_mode)
    if strategy == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise DeviceError(f"parallel.strategy={strategy} needs torch.distributed initialised (launch with torchrun)")
    if strategy == "ddp":
        from torch.distributed._composable.replicate import replicate

        replicate(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model
    from torch.distributed.device_mesh import init_device_mesh

    # an explicit mesh on the data's device: with a default mesh gloo groups have segfaulted on GPU machines
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    apply_fsdp(model, mesh, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision))
    return model
