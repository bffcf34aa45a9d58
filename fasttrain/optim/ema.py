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


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that FSDP2 made shardable (those with `reshard`): none for a plain or DDP model."""
    return [m for m in model.modules() if type(m).__name__.startswith("FSDP") and hasattr(m, "reshard")]


def _reshard(modules: list[nn.Module]) -> None:
    """FSDP2 keeps some blocks gathered after a forward without backward (reshard_after_forward=False):
    bring every parameter back to its sharded DTensor form before touching it."""
    for m in modules:
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
        self._walked: tuple | None = None  # (model, its FSDP modules, its parameters): see _walk

    def _walk(self, model: nn.Module) -> tuple[list[torch.Tensor], list[nn.Module]]:
        """The model's FSDP modules, resharded, then its parameters: found once per model, since walking
        the module tree (model.modules(), model.parameters()) on every update was a per-step cost of its
        own on small CPU models (issue 35). The parameters are listed after the reshard (FSDP2 registers
        its sharded parameters back then), and listed again when the first one is no longer the model's
        (a wrapper replaced them). They are the trained ones (`trained`: not a LoRA run's frozen base)."""
        w = self._walked
        if w is None or w[0] is not model:
            w = self._walked = (model, fsdp_modules(model), None, None)
        _reshard(w[1])
        first = next(model.parameters(), None)
        if w[2] is None or first is not w[3]:
            w = self._walked = (model, w[1], [p for _, p in trained(model)], first)
        return w[2], w[1]

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
        params, _ = self._walk(model)  # (no_grad: the parameters are read as they are, without detached copies)
        if self.count.device != self.shadow[0].device:
            self.count = self.count.to(self.shadow[0].device)
        c = self.count.double()
        w = 1 - (torch.clamp((1 + c) / (10 + c), max=self.decay) if self.warmup else torch.full_like(c, self.decay))
        if applied is not None:
            w = applied.to(w.dtype) * w
        w = w.to(self.shadow[0].dtype)
        if self.shadow[0].device.type == "cpu" and not hasattr(self.shadow[0], "device_mesh"):
            # shadow += w·(param − shadow) in one pass per tensor (lerp with a device weight per tensor): on a
            # CPU the foreach ops are per-tensor loops, and three of them cost 3x (issue 35: 0.9 → 0.3 ms)
            torch._foreach_lerp_(self.shadow, params, [w] * len(self.shadow))
        else:
            # _foreach_lerp_'s Scalar overload would read a tensor weight on the host, and its per-tensor
            # weight lists leave CUDA's multi-tensor kernels: sub, mul, add
            delta = torch._foreach_sub(params, self.shadow)
            torch._foreach_mul_(delta, w)
            torch._foreach_add_(self.shadow, delta)
        self.count += 1

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """Inside the block the model holds the averaged weights; the trained ones come back after."""
        params, fsdp = self._walk(model)
        with torch.no_grad():
            for p, s in zip(params, self.shadow):
                tmp = p.detach().clone()
                p.detach().copy_(s)
                s.copy_(tmp)
        try:
            yield model
        finally:
            _reshard(fsdp)
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
