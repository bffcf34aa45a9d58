"""fasttrain.kernels: the per-step diffusion math, independent of the rest of fasttrain.

`reference` holds the contracts in plain PyTorch (the test oracle and the CPU fallback), `philox` the
one noise stream every backend draws, `bins` the per-timestep statistics bins the loss kernels
scatter into, `ops` the custom ops and backend selection (Triton, native C++/CUDA, interpreter,
reference). Mixed prediction (several heads and a gate) has its own contract, kernel and op:
`mixed_reference`, `triton_mixed`, `ops_mixed`. Nothing here imports `fasttrain.diffusion`.
"""
from . import bins, mixed_reference, philox, reference
from .bins import TimestepBins

__all__ = ["bins", "mixed_reference", "philox", "reference", "TimestepBins"]
