"""Exponential moving average of the weights that works on plain, DDP and FSDP2 models alike.

The average lives as shadow tensors beside the parameters (DTensor shards under FSDP2, so it is
sharded too and costs 1/world of the memory); `applied(model)` swaps it into the live model for
sampling and evaluation, so no second (sharded) model has to be built. Warm-up as in the digits
recipe: decay_n = min(decay, (1 + n)/(10 + n)).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def clean_name(name: str) -> str:
    """Parameter names without activation-checkpoint, compile or DDP wrapper prefixes, so that a run
    resumed with another parallel setup finds its averages."""
    for part in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name[len("module."):] if name.startswith("module.") else name


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps some blocks gathered after a forward without backward (reshard_after_forward=False):
    bring every parameter back to its sharded DTensor form before touching it."""
    for m in model.modules():
        if type(m).__name__.startswith("FSDP") and hasattr(m, "reshard"):
            m.reshard()


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.999, warmup: bool = True):
        self.decay, self.warmup, self.n = decay, warmup, 0
        self.names = [clean_name(n) for n, _ in model.named_parameters()]
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.n) / (10 + self.n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, applied: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> None:
        """One EMA step. `applied` (a device 0/1 scalar) is 0 for an optimizer step that was skipped,
        which then leaves the average unchanged without a host sync. `weight` (a device scalar,
        1 - decay) is given by a captured CUDA graph, which counts `n` itself."""
        _reshard(model)
        params = [p.detach() for p in model.parameters()]
        w = 1 - self.current_decay() if weight is None else weight
        if applied is None and not isinstance(w, torch.Tensor):
            torch._foreach_lerp_(self.shadow, params, w)
        else:  # a device weight: _foreach_lerp_ would read it on the host (its Scalar overload)
            if applied is not None:
                w = applied.to(self.shadow[0].dtype) * w
            delta = torch._foreach_sub(params, self.shadow)
            torch._foreach_mul_(delta, w)
            torch._foreach_add_(self.shadow, delta)
        if weight is None:
            self.n += 1

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """Inside the block the model holds the averaged weights; the trained ones come back after."""
        _reshard(model)
        params = [p for p in model.parameters()]
        with torch.no_grad():
            for p, s in zip(params, self.shadow):
                tmp = p.detach().clone()
                p.detach().copy_(s)
                s.copy_(tmp)
        try:
            yield model
        finally:
            _reshard(model)
            with torch.no_grad():
                for p, s in zip(params, self.shadow):
                    tmp = p.detach().clone()
                    p.detach().copy_(s)
                    s.copy_(tmp)

    def state_dict(self) -> dict:
        return {"n": self.n, "shadow": dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])
        with torch.no_grad():
            for name, s in zip(self.names, self.shadow):
                src = state["shadow"][name]
                if hasattr(s, "device_mesh") and not hasattr(src, "device_mesh"):  # full tensor → FSDP shard
                    from torch.distributed.tensor import distribute_tensor

                    src = distribute_tensor(src.to(s.device), s.device_mesh, s.placements)
                s.copy_(src)
