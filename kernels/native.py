"""The native backend: C++ (CPU) and CUDA C++ implementations of the noise kernel and the loss kernel
in `fasttrain._C`.

`fasttrain._C` is built by CMakeLists.txt during `pip install` where a compiler is present; without
it fasttrain runs on the `torch` backend (the PyTorch reference math). The extension registers the
operators `fasttrain_C::noise`, `fasttrain_C::noise_std` and `fasttrain_C::loss` for CPU (and CUDA where
it was compiled with nvcc), and `fasttrain_C::mixed_loss` for CPU only (the Triton kernel is the mixed loss's GPU path);
the custom ops of noise.py, diffusion_loss.py and mixed_loss.py call them for backend="native", so
autograd, `register_fake` and torch.compile see the same operators as on every other backend.
"""
from __future__ import annotations

import warnings

import torch

_LOADED: bool | None = None
_ERROR = ""


def _load() -> bool:
    global _LOADED, _ERROR
    if _LOADED is None:
        try:
            from fasttrain import _C  # noqa: F401  (registers torch.ops.fasttrain_C.*)

            _LOADED = True
        except ImportError as e:
            _LOADED, _ERROR = False, f"fasttrain._C is not built ({e})"
            # The install said so too, but pip hides build output; one line here, once per process.
            warnings.warn(f"{_ERROR}: the CPU diffusion math runs on the torch backend (the PyTorch reference) "
                          "(reinstall with a C++ compiler and CMake to build it, README)", stacklevel=3)
    return _LOADED


def available(device) -> bool:
    if not _load():
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and bool(torch.ops.fasttrain_C.has_cuda())


def why_not(device) -> str:
    if not _load():
        return _ERROR
    return f"fasttrain._C was built without CUDA support, so it cannot run on {torch.device(device).type}"


# The noise options reach every op as (spec, table, rows, mean, std) (kernels/noise_spec.py: an empty
# `spec` list is the plain stream) and the loss shape as (kind, c table) (kernels/loss_shape.py).
def noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec, table, rows, mean, std):
    return tuple(torch.ops.fasttrain_C.noise(x0, t, alpha, sigma, eps, seed, offset, out_dtype, write_eps, spec, table,
                                             rows, mean, std))


def noise_std(x0, seed, offset, spec, table, rows, mean):
    """The pyramid noise's global std (float32 0-d): torch_ref_noise_std.reference_std."""
    return torch.ops.fasttrain_C.noise_std(x0, seed, offset, spec, table, rows, mean)


def loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs, spec, table, rows, mean, std, kind,
         c_table, mask=None):
    """`mask`: the loss's per-pixel weight (diffusion_loss.check_mask), or None."""
    return tuple(torch.ops.fasttrain_C.loss(pred, x0, t, weight, iw, coef, pivots, bins, eps, seed, offset, needs,
                                            spec, table, rows, mean, std, kind, c_table, mask))


def mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset, spec, table, rows, mean, std, kind,
               c_table):
    """(mean, per, raw, weighted, x0_error, grad, gate grad): torch_ref_mixed_loss.loss_and_grad, CPU tensors."""
    return tuple(torch.ops.fasttrain_C.mixed_loss(out, x0, t, weight, iw, tab, gate, pivots, bins, eps, seed, offset,
                                                  spec, table, rows, mean, std, kind, c_table))
