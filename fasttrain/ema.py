"""Exponential moving average of the weights that works on plain, DDP and FSDP2 models alike.

The average lives as shadow tensors beside the parameters (DTensor shards under FSDP2, so it is
sharded too and costs 1/world of the memory); `applied(model)` swaps it into the live model for
sampling and evaluation, so no second (sharded) model has to be built. Warm-up as in the digits
recipe: decay_n = min(decay, (1 + n)/(10 + n)), computed on the device from a device counter.
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


def trained(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the optimizer updates (all of them but a LoRA run's frozen base, lora.py): the ones
    the EMA averages."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.999, warmup: bool = True):
        self.decay, self.warmup = decay, warmup
        self.names = [clean_name(n) for n, _ in trained(model)]
        self.shadow = [p.detach().clone() for _, p in trained(model)]
        # the update count lives on the device: the decay of each update is computed there, so an update
        # never syncs with the host and a captured CUDA graph replays it as it is (graphs.py)
        self.count = torch.zeros((), dtype=torch.int64, device=self.shadow[0].device if self.shadow else "cpu")

    @property
    def n(self) -> int:
        """Updates so far (a host read: for checkpoints, logs and tests)."""
        return int(self.count)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.n) / (10 + self.n)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, model: nn.Module, applied: torch.Tensor | None = None) -> None:
        """One EMA step with decay_n = min(decay, (1 + n)/(10 + n)) (warm-up) or `decay`. `applied` (a
        device 0/1 scalar) is 0 for an optimizer step that was skipped, which leaves the average
        unchanged; the count moves on either way. No host sync."""
        _reshard(model)
        params = [p.detach() for _, p in trained(model)]
        if self.count.device != self.shadow[0].device:
            self.count = self.count.to(self.shadow[0].device)
        c = self.count.double()
        w = 1 - (torch.clamp((1 + c) / (10 + c), max=self.decay) if self.warmup else torch.full_like(c, self.decay))
        if applied is not None:
            w = applied.to(w.dtype) * w
        # _foreach_lerp_ would read a tensor weight on the host (its Scalar overload): sub, mul, add
        delta = torch._foreach_sub(params, self.shadow)
        torch._foreach_mul_(delta, w.to(self.shadow[0].dtype))
        torch._foreach_add_(self.shadow, delta)
        self.count += 1

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """Inside the block the model holds the averaged weights; the trained ones come back after."""
        _reshard(model)
        params = [p for _, p in trained(model)]
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
        self.count.fill_(int(state["n"]))
        with torch.no_grad():
            for name, s in zip(self.names, self.shadow):
                src = state["shadow"][name]
                if hasattr(s, "device_mesh") and not hasattr(src, "device_mesh"):  # full tensor → FSDP shard
                    from torch.distributed.tensor import distribute_tensor

                    src = distribute_tensor(src.to(s.device), s.device_mesh, s.placements)
                s.copy_(src)
