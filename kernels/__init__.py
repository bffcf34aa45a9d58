"""fasttrain.kernels: the per-step diffusion math, independent of the rest of fasttrain.

One op per module, each a `torch.library` custom op with its autograd rule and every backend:
`noise` (x_t; `fasttrain::noise`), `diffusion_loss` (loss, gradient written in the forward pass and
the statistics scatter; `fasttrain::diffusion_loss`), `mixed_loss` (the same for mixed prediction:
several heads and a gate; `fasttrain::mixed_loss`). Their backends: `triton_noise`,
`triton_diffusion_loss`, `triton_mixed_loss` (Triton kernels, imported on first use; `triton_shared`
holds what they share), `native` (the C++/CUDA ops of fasttrain._C, sources in csrc/), and the PyTorch
reference math `torch_ref` (noise and diffusion loss) and `torch_ref_mixed_loss`: the test oracles and
the `torch` backend. `backend` chooses among them; `philox` is the one noise stream every backend
draws, `bins` the per-timestep statistics bins the loss ops scatter into. Nothing here imports
`fasttrain.diffusion`.
"""
from . import bins, philox, torch_ref, torch_ref_mixed_loss
from .bins import TimestepBins

__all__ = ["bins", "philox", "torch_ref", "torch_ref_mixed_loss", "TimestepBins"]
