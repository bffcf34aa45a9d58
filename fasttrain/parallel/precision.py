"""Mixed precision for every parallel strategy (`parallel.precision`).

  fp32   everything in float32
  bf16   the model's forward and backward in bfloat16: autocast with one process or DDP (the
         weights, their gradients and the optimizer state stay float32), FSDP2's
         MixedPrecisionPolicy (bf16 compute copies of the sharded float32 weights, float32 reductions)
  fp16   autocast to float16 with a gradient scaler (one process or DDP, on CUDA)
  auto   bf16 on CUDA, fp32 on CPU

Whatever the model computes in, the fused kernels take its output as it is and reduce in float32;
the EMA, the per-timestep statistics and every checkpointed weight stay float32. The model's input
x_t is written by the noise kernel directly in the compute dtype (half the bytes of a float32 copy).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import InvalidInput

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str               # fp32 | bf16 | fp16 (resolved)
    device_type: str
    autocast: bool          # autocast around the forward (one process, DDP)
    fsdp_policy: bool       # FSDP2's MixedPrecisionPolicy instead

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def scaler(self) -> bool:
        return self.name == "fp16"

    def context(self, cache: bool = True):
        """The autocast region of the model's forward (a no-op where precision is fp32 or FSDP's);
        `cache=False` inside CUDA-graph capture (autocast's cache of cast weights must not outlive it)."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=cache)

    @property
    def input_dtype(self) -> torch.dtype:
        """What the noise kernel writes x_t in: the dtype the model's first layer computes in."""
        return self.dtype if (self.autocast or self.fsdp_policy) else torch.float32


def resolve(name: str, device: torch.device, strategy: str) -> Precision:
    """The precision for a device and a (resolved) strategy; a one-line error for what cannot run."""
    if name not in PRECISIONS:
        raise InvalidInput(f"bad value for 'parallel.precision': {name!r} (choose from {', '.join(PRECISIONS)})")
    device = torch.device(device)
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "fp16" and device.type != "cuda":
        raise InvalidInput("parallel.precision=fp16 needs CUDA (on CPU autocast computes in bf16: use bf16)")
    if name == "fp16" and strategy == "fsdp":
        raise InvalidInput("parallel.precision=fp16 with parallel.strategy=fsdp is not supported (use bf16, which "
                         "needs no gradient scaler)")
    half = name != "fp32"
    return Precision(name, device.type, autocast=half and strategy != "fsdp", fsdp_policy=half and strategy == "fsdp")
