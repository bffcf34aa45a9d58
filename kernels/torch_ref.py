"""The PyTorch reference math of the noise op and the diffusion loss op in one namespace (the oracles
tests and users compare with). Each op's reference lives in its own file, beside the op:
torch_ref_noise.py (noise, with the noise options' ε), torch_ref_diffusion_loss.py (target, loss,
gradient), torch_ref_mixed_loss.py and torch_ref_noise_std.py."""
from .torch_ref_diffusion_loss import loss, loss_and_grad, target, threshold
from .torch_ref_noise import column, noise

__all__ = ["column", "noise", "target", "threshold", "loss", "loss_and_grad"]
