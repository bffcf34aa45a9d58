"""Process-group set-up for torchrun launches (one process per GPU, or per CPU slot with gloo)."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes in the environment (nothing to do without it):
    NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    return DistInfo(rank, world, local)


def all_gather_objects(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def mean_across_ranks(x: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def shutdown(code: int = 0) -> None:
    """Leave the process group and exit. gloo's teardown can abort after all work is done (seen
    with torch 2.14 on CPU): flush and leave with os._exit, after a barrier so no rank is still communicating."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense bf16 FLOP/s


def device_peak_flops() -> float | None:
    """Dense bf16 peak of this GPU (for MFU), or None where unknown (CPUs included)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), None)
