"""Backend choice and what the ops share: the names, the lazy Triton import, the loss kernels'
workspace and the noise counter offset.

Backends: "triton" (compiled Triton kernels on CUDA tensors), "native" (the C++/CUDA ops of
`fasttrain._C`, native.py), "interpret" (the same Triton kernels in the Triton interpreter on CPU
tensors: tests), "torch" (the PyTorch reference math, torch_ref_<op>.py), "auto" (triton on CUDA,
native on CPU where it is built, else torch). A caller decides once (`resolve_backend`) and passes the
concrete name to every op; an impossible choice is `BackendUnavailable`.

Triton is imported only when a Triton backend is first used: the ops import their kernel modules
(triton_noise.py, triton_diffusion_loss.py, triton_mixed_loss.py) inside the op, after `resolve_backend`, so
choosing the interpreter is explicit: `interpret` (or TRITON_INTERPRET=1 in the environment) before
anything imports triton. Importing fasttrain changes no global state.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

from . import native

BACKENDS = ("auto", "triton", "native", "interpret", "torch")


class BackendUnavailable(ValueError):
    """A backend that cannot run on the given device (or an unknown name), in one line. The one error
    of the choice, so that a caller can translate it where it decides the backend (fasttrain does at
    set-up, before a run folder is touched: diffusion/objective.py, `kernel_backend`)."""


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend for tensors on `device`; BackendUnavailable when it cannot run there."""
    if backend not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        if device.type == "cuda" and has_triton():
            return "triton"
        return "native" if native.available(device) else "torch"
    if backend == "triton" and (device.type != "cuda" or not has_triton()):
        raise BackendUnavailable("backend 'triton' needs CUDA tensors and triton; use 'interpret' on CPU")
    if backend == "native" and not native.available(device):
        raise BackendUnavailable(f"backend 'native' is not available for {device.type} tensors: "
                                 f"{native.why_not(device)}")
    if backend == "interpret":
        if not has_triton():
            raise BackendUnavailable("backend 'interpret' needs triton installed")
        if device.type != "cpu":
            raise BackendUnavailable("backend 'interpret' runs on CPU tensors")
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"  # must precede the import (triton jits tl.rand at import)
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailable("backend 'interpret' must be chosen before triton is imported "
                                     "(set TRITON_INTERPRET=1 in the environment)")
    return backend


_WORKSPACES: dict = {}


def workspace(B: int, device: torch.device, width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton loss kernel's accumulators: [(B + 1)·width] fp32 sums and [B + 1] int32 tile counters,
    per (device, stream, B, width). Zeroed once here; every launch of a loss kernel leaves them zeroed
    again (triton_diffusion_loss.py, triton_mixed_loss.py), so there is no memset launch and no call order."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, B, width)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.zeros((B + 1) * width, dtype=torch.float32, device=device),
                            torch.zeros(B + 1, dtype=torch.int32, device=device))
    return _WORKSPACES[key]


def as_offset(offset, device) -> torch.Tensor:
    """The noise counter offset as an int64 0-d tensor on the data's device (the kernels read it there,
    so a captured graph can advance it in place)."""
    if isinstance(offset, torch.Tensor):
        return offset.reshape(())
    return torch.tensor(int(offset), dtype=torch.int64, device=device)
