"""The PyTorch reference math of the noise_std op (noise_std.py): the pyramid noise's batch-global
std, the oracle of every other backend and the `torch` backend itself."""
from __future__ import annotations

import torch

from .noise_spec import NoiseSpec
from .torch_ref_noise import pre_std_eps


def reference_std(spec: NoiseSpec, shape, seed: int, offset, device) -> torch.Tensor:
    """float32 0-d: the unbiased std of the pre-division noise over the batch (torch's Tensor.std)."""
    return pre_std_eps(spec, shape, seed, offset, device).std()
