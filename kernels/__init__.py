"""fasttrain.kernels: the per-step diffusion math.

`reference` holds the contracts in plain PyTorch: the test oracle and the CPU backend. The fused
Triton kernels (noise injection, loss + gradient + per-timestep scatter) implement the same contracts.
"""
from . import reference

__all__ = ["reference"]
