"""The optimizer: AdamW, skipping non-finite steps on the device, and optimizer settings that change on
resume.

torch's fused AdamW (CPU and CUDA) takes a `found_inf` device scalar (the GradScaler protocol): where it
is 1 the kernel leaves weights, moments and step count untouched, so a non-finite step is skipped with
no host sync. apex's FusedAdam (`optim.impl=apex`) has no such input: there the gradients are zeroed
instead, which skips the gradient but not Adam's momentum.
"""
from __future__ import annotations

import torch

from ..errors import InvalidInput


def make_optimizer(params, o, device: torch.device) -> torch.optim.Optimizer:
    kw = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    if o.impl == "apex" or (o.impl == "auto" and device.type == "cuda"):
        try:
            from apex.optimizers import FusedAdam

            return FusedAdam(params, adam_w_mode=True, **kw)
        except ImportError:
            if o.impl == "apex":
                raise InvalidInput("optim.impl=apex but apex is not installed") from None
    return torch.optim.AdamW(params, fused=True, **kw)


def skip_if_not_finite(opt: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """Arrange for the next `opt.step()` to be a no-op where `finite` (a device bool scalar) is False."""
    if getattr(opt, "_step_supports_amp_scaling", False) and isinstance(opt, torch.optim.AdamW):
        opt.grad_scale = None
        opt.found_inf = (~finite).float()
        return
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if grads:  # zero, not NaN·0: torch.where also clears the non-finite entries
        torch._foreach_copy_(grads, [torch.where(finite, g, torch.zeros_like(g)) for g in grads])


def apply_optimizer_config(opt, sched, old: dict, new: dict) -> list[str]:
    """Apply learning rate, betas and weight decay of the current config to a resumed optimizer (its
    state holds the checkpoint's); returns the keys that changed."""
    changed = [f"optim.{k}" for k in ("lr", "betas", "weight_decay", "warmup_steps", "text_encoder_lr")
               if old.get(k) != new.get(k)]
    for g in opt.param_groups:
        g["betas"], g["weight_decay"] = tuple(new["betas"]), new["weight_decay"]
    te = new.get("text_encoder_lr")  # text-encoder LoRA's group (pretrained/text_lora.py): its own rate
    sched.base_lrs = [te if g.get("text_encoder") and te is not None else new["lr"] for g in opt.param_groups]
    factor = sched.lr_lambdas[0](sched.last_epoch)
    for g, base in zip(opt.param_groups, sched.base_lrs):
        g["lr"] = base * factor  # what the scheduler would have set at this step
    sched._last_lr = [g["lr"] for g in opt.param_groups]
    return changed
