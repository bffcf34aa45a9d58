"""The two text-to-image training loops that bench/peer_text_to_image.py puts side by side, on the same
tiny Stable-Diffusion UNet, the same cached latents and text embeddings, the same batches and the same
optimizer settings:

  Peer       diffusers' examples/text_to_image/train_text_to_image.py, its training step ported line by
             line (huggingface/diffusers at 58eb52c0803ea9af3abec60841c2a093bdf1f951, 2026-08-23; the
             line numbers below are that file's). Single process, so accelerate's wrappers are the plain
             calls: `accelerator.backward(loss)` is `loss.backward()`, `gather` of one process the tensor.
             Two deliberate differences, the same for both loops: the latents and the text encoder's
             hidden states are cached (the script runs the VAE and the text encoder every step, L967-968
             and L993), and the batch is indexed from tensors instead of a DataLoader. With
             `prior_loss_weight` (DreamBooth prior preservation) the loss is that of
             examples/dreambooth/train_dreambooth_lora.py (L1315-1327 at the same commit; its step is the
             same up to the loss): each batch's first half is the instance rows, its second the class rows
             (its collate_fn), and loss = mse(first half) + prior_loss_weight · mse(second half).
  Fasttrain  fasttrain's own step (fasttrain/step.py `train_step`) on the network as the trainer builds it
             (bundle.py: a `Denoiser` around the diffusers backbone), the caption codes gathered from a
             `TextTable` of the same embeddings (conditioning.py), its fused noise and loss ops.

`equal_noise_run` feeds both the same x0, ε and t (fasttrain's: t from its sampler's generator, ε from its
counter-based stream at the objective's offset, handed to the peer in place of `torch.randn_like` and
`torch.randint`) and returns both loss curves and both networks, which agree to float32 rounding
(tests/bench/test_peer_text_to_image.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fasttrain import diffusion as fd
from fasttrain.conditioning import TextCaptions, TextTable, attach
from fasttrain.data.prior import halves
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.kernels import philox
from fasttrain.models import build_model
from fasttrain.optim.ema import EMA
from fasttrain.step import Generators, StepParts, train_step

PREDICTION = {"eps": "epsilon", "v": "v_prediction"}  # fasttrain's name → the diffusers scheduler's


@dataclass(frozen=True)
class Setup:
    """The shared problem: an SD-shaped UNet2DConditionModel (two levels, cross-attention in the outer one),
    `captions` cached latents [4, size, size] and text states [length, width], batches of `batch`."""
    batch: int = 8
    size: int = 16
    width: int = 32        # cross_attention_dim: the text encoder's width (SD 1.x: 768)
    length: int = 77       # tokens per caption, CLIP's padded length as SD caches it
    channels: tuple = (32, 64)
    captions: int = 64
    prediction: str = "eps"
    snr_gamma: float | None = None   # None: plain MSE (the script's default); else Min-SNR-γ both sides
    lr: float = 1e-4                 # the script's defaults: L334-337, L410-414
    use_ema: bool = False
    seed: int = 0
    prior_loss_weight: float | None = None  # DreamBooth: each batch's first half instance, second half class rows

    def unet_config(self) -> dict:
        return {"block_out_channels": list(self.channels), "layers_per_block": 1, "norm_num_groups": 8,
                "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "attention_head_dim": 8,
                "sample_size": self.size, "in_channels": 4, "out_channels": 4, "cross_attention_dim": self.width}


def cached_data(setup: Setup, device) -> tuple[torch.Tensor, TextTable]:
    """Latents ~ N(0, 1) (a VAE's scaled latents are about unit variance) and fp16 text states, as
    `data prepare` caches them, plus the empty prompt's row (zeros) that fasttrain's table needs."""
    g = torch.Generator().manual_seed(setup.seed + 1)
    latents = torch.randn(setup.captions, 4, setup.size, setup.size, generator=g)
    states = torch.randn(setup.captions + 1, setup.length, setup.width, generator=g).half()
    states[-1] = 0
    n = setup.captions
    table = TextTable(states=states, mask=torch.ones(n + 1, setup.length, dtype=torch.long), pooled=None,
                      time_ids=None, empty=n, offsets=torch.arange(n), counts=torch.ones(n, dtype=torch.long))
    return latents.to(device), table.to(device)


def batch_rows(setup: Setup, step: int, device) -> torch.Tensor:
    """The caption rows of step `step` (a fixed permutation per epoch): both loops read these."""
    per_epoch = setup.captions // setup.batch
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(setup.captions, generator=torch.Generator().manual_seed(setup.seed + 100 + epoch))
    return perm[k * setup.batch:(k + 1) * setup.batch].to(device)


def adamw(params, setup: Setup) -> torch.optim.AdamW:
    """L722-730 with the script's defaults (L410-413): betas (0.9, 0.999), weight decay 1e-2, eps 1e-8."""
    return torch.optim.AdamW(params, lr=setup.lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)


class FasttrainLoop:
    """fasttrain's step: caption codes → TextCaptions (no dropout: the script has none) → the objective
    (uniform t, fused noise and loss ops, per-timestep statistics) → backward, clip 1.0, AdamW, EMA."""

    def __init__(self, setup: Setup, device, backend: str = "auto"):
        self.setup, self.device = setup, torch.device(device)
        self.latents, self.table = cached_data(setup, device)
        torch.manual_seed(setup.seed)
        sched = fd.schedule("scaled_linear", T=1000)  # SD's betas: √β linear in 0.00085…0.012
        net = build_model("diffusers", in_channels=4, image_size=setup.size, class_name="UNet2DConditionModel",
                          config=setup.unet_config(), text={"width": setup.width, "length": setup.length})
        self.model = Denoiser(net, PredictionOutput(setup.prediction, sched), sched).to(device)
        attach(self.model, self.table)
        weighting, wargs = ("simple", None) if setup.snr_gamma is None else ("min_snr", {"gamma": setup.snr_gamma})
        self.objective = fd.DiffusionObjective(sched, setup.prediction, weighting, "uniform", weighting_args=wargs,
                                               backend=backend, output=self.model.output).to(device)
        gens = Generators(torch.Generator(device).manual_seed(setup.seed + 2),
                          torch.Generator(device).manual_seed(setup.seed + 3))
        ema = EMA(self.model, decay=0.9999) if setup.use_ema else None  # EMAModel's default decay
        prior = setup.prior_loss_weight is not None  # the prior's weights ride on the loss op's mask (data/prior.py)
        self.parts = StepParts(self.model, self.objective, adamw(self.model.parameters(), setup), gens, ema=ema,
                               conditioning=TextCaptions(self.table, 0.0, gens.labels), grad_clip=1.0, masked=prior)
        self.weights = None
        if prior:
            w = halves(setup.batch // 2, setup.prior_loss_weight, self.device)
            self.weights = w.expand(setup.batch, 1, setup.size, setup.size).contiguous()
        self.i = 0

    @property
    def unet(self) -> torch.nn.Module:
        return self.model.net.model

    def peek(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The t and ε the next step will draw, without drawing them (for the peer at equal noise)."""
        x0 = self.latents[rows]
        g = torch.Generator(self.device)
        g.set_state(self.parts.generators.timesteps.get_state())
        t, _ = self.objective.sampler.sample(x0.shape[0], g, x0)
        eps = philox.randn(x0.shape, self.objective.seed, self.objective.offset.clone(), self.device)
        return t, eps

    def step(self, rows: torch.Tensor) -> torch.Tensor:
        batch = (self.latents[rows], rows) + (() if self.weights is None else (self.weights,))
        loss, _ = train_step(self.parts, [batch], step=self.i)
        self.i += 1
        return loss


class PeerLoop:
    """diffusers' train_text_to_image.py step, L966-1058, on its own copy of the same UNet."""

    def __init__(self, setup: Setup, device, unet: torch.nn.Module):
        from diffusers import DDPMScheduler
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel

        self.setup, self.device = setup, torch.device(device)
        self.latents, table = cached_data(setup, device)
        self.states = table.states
        self.unet = copy.deepcopy(unet).to(device)
        self.unet.train()                                                          # L631
        # the SD 1.x pipeline's scheduler config: scaled_linear betas 0.00085…0.012, 1000 steps
        self.scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                       beta_end=0.012, prediction_type=PREDICTION[setup.prediction])
        self.optimizer = adamw(self.unet.parameters(), setup)                     # L722-730
        self.lr_scheduler = get_scheduler("constant", optimizer=self.optimizer)   # L856-861, default L346-348
        self.ema = EMAModel(self.unet.parameters()) if setup.use_ema else None     # L638-643 (decay 0.9999)
        self.train_loss = 0.0

    def step(self, rows: torch.Tensor, noise: torch.Tensor | None = None,
             timesteps: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step; `noise`, `timesteps` replace the script's draws (equal-noise runs)."""
        setup, sched = self.setup, self.scheduler
        latents = self.latents[rows]                               # L967-968: the VAE's latents, cached here
        if noise is None:
            noise = torch.randn_like(latents)                      # L972 (noise_offset 0: L973-977 skipped)
        bsz = latents.shape[0]
        if timesteps is None:                                      # L982-983
            timesteps = torch.randint(0, sched.config.num_train_timesteps, (bsz,), device=latents.device)
            timesteps = timesteps.long()
        noisy_latents = sched.add_noise(latents, noise, timesteps)  # L990
        encoder_hidden_states = self.states[rows].float()          # L993: the text encoder's output, cached here
        if sched.config.prediction_type == "epsilon":              # L1000-1005
            target = noise
        else:
            target = sched.get_velocity(latents, noise, timesteps)
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]  # L1020
        if setup.prior_loss_weight is not None:                    # train_dreambooth_lora.py L1315-1327
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
            loss = loss + setup.prior_loss_weight * prior_loss
        elif setup.snr_gamma is None:                              # L1022-1023
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:                                                      # L1024-1039: Min-SNR-γ (Hang et al. 2023, §3.4)
            from diffusers.training_utils import compute_snr

            snr = compute_snr(sched, timesteps)
            mse_loss_weights = torch.stack([snr, setup.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
            if sched.config.prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            elif sched.config.prediction_type == "v_prediction":
                mse_loss_weights = mse_loss_weights / (snr + 1)
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        avg_loss = loss.repeat(bsz).mean()                         # L1042: gather of one process
        self.train_loss += avg_loss.item()                         # L1043: a host sync every step, as there
        loss.backward()                                            # L1046
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), 1.0)  # L1048, --max_grad_norm default 1.0 (L414)
        self.optimizer.step()                                      # L1049-1051
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        if self.ema is not None:                                   # L1055-1058
            self.ema.step(self.unet.parameters())
        return loss.detach()


def equal_noise_run(setup: Setup, steps: int, device="cpu", backend: str = "torch"):
    """Both loops for `steps` steps on the same batches, the peer given fasttrain's t and ε. Returns
    (fasttrain losses, peer losses, `weight_agreement` of the two UNets, (fasttrain loop, peer loop, the
    UNet both started from))."""
    ft = FasttrainLoop(setup, device, backend)
    peer = PeerLoop(setup, device, ft.unet)
    start = copy.deepcopy(ft.unet)
    ours, theirs = [], []
    for k in range(steps):
        rows = batch_rows(setup, k, device)
        t, eps = ft.peek(rows)
        theirs.append(float(peer.step(rows, noise=eps, timesteps=t)))
        ours.append(float(ft.step(rows)))
    return ours, theirs, weight_agreement(ft.unet, peer.unet, start), (ft, peer, start)


@torch.no_grad()
def weight_agreement(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> dict:
    """How far apart two networks trained from `start` are: the largest elementwise |a − b|, and the norm
    of a − b relative to the norm of what training changed (a − start). Adam divides each gradient by its
    own running RMS, so a parameter whose gradient is ~0 moves by up to lr in either direction on a
    rounding difference: the relative norm is the measure of agreement, the max is reported beside it."""
    pa, pb, p0 = (list(m.parameters()) for m in (a, b, start))
    diff = torch.stack([(x - y).norm() for x, y in zip(pa, pb)]).norm()
    moved = torch.stack([(x - z).norm() for x, z in zip(pa, p0)]).norm()
    return {"max_abs": max(float((x - y).abs().max()) for x, y in zip(pa, pb)),
            "rel_norm": float(diff / moved), "moved_norm": float(moved)}
