"""fasttrain.kernels: the per-step diffusion math, independent of the rest of fasttrain.

One op per module, each a `torch.library` custom op with its autograd rule and every backend:
`noise` (x_t; `fasttrain::noise`), `diffusion_loss` (loss, gradient written in the forward pass and
the statistics scatter; `fasttrain::diffusion_loss`), `mixed_loss` (the same for mixed prediction:
several heads and a gate; `fasttrain::mixed_loss`), `noise_std` (the pyramid noise's std;
`fasttrain::noise_std`). Their backends: `triton_noise`, `triton_diffusion_loss`, `triton_mixed_loss`,
`triton_noise_spec` (Triton kernels, imported on first use; `triton_shared` holds what they share),
`native` (the C++/CUDA ops of fasttrain._C, sources in csrc/), and the PyTorch reference math of each
op, `torch_ref_noise`, `torch_ref_diffusion_loss`, `torch_ref_mixed_loss`, `torch_ref_noise_std` (the
test oracles and the `torch` backend; `torch_ref` gathers the noise and diffusion loss ones).
`noise_spec` is the noise options as every op receives them and `noise_prepare` a step's spec (the
pyramid's std reduced by `noise_std`); `loss_shape` the loss shapes; `backend` chooses among the
backends (once, by the caller); `philox` is the one noise stream every backend draws, `bins` the
per-timestep statistics bins the loss ops scatter into. The AOT check compiles every Triton
specialisation without a GPU: `aot` (the tool), `aot_specs` (the vocabulary the Triton modules'
`specializations(aot)` are written in, passed in by the tool), `aot_inspect` (reading the PTX); no op
imports them. Nothing here imports `fasttrain.diffusion`."""
from . import bins, philox, torch_ref, torch_ref_mixed_loss
from .bins import TimestepBins

__all__ = ["bins", "philox", "torch_ref", "torch_ref_mixed_loss", "TimestepBins"]
