"""fasttrain's Flux LoRA step and diffusers' examples/dreambooth/train_dreambooth_lora_flux.py step, side by side
on the same tiny FluxTransformer2DModel, the same cached latents and text encodings, the same batches and the
same optimizer settings (bench/peer_text_to_image.py --model flux runs them; t2i_loops.py holds the SD pair):

  Peer       the script's training step ported line by line (huggingface/diffusers at
             58eb52c0803ea9af3abec60841c2a093bdf1f951, 2026-08-23; the line numbers below are that file's). One
             process, so accelerate's wrappers are the plain calls (`accelerator.backward(loss)` is
             `loss.backward()`). Deliberate differences, the same for both loops: the latents are cached (the
             script's --cache_latents, with the posterior's sample drawn once), the prompts' T5 states and CLIP
             pooled vectors are cached (its compute_text_embeddings without --train_text_encoder), batches are
             indexed from tensors, and no prior preservation (--with_prior_preservation off: its default).
  Fasttrain  fasttrain's own step (fasttrain/step.py `train_step`) on the network as the trainer builds it: a
             `Denoiser` around the Flux backbone (models/flux.py: packing, position ids, σ time input, guidance),
             the caption codes gathered from a `TextTable`, its fused noise and loss ops.

The adapter both loops train is the script's: `LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
target_modules=<its 12 default modules>)` added with `transformer.add_adapter` (L1256-1281), added once to
fasttrain's transformer and copied into the peer's, so both start from the same A. `equal_noise_run` feeds both
the same x0, ε and t (fasttrain's: t from its sampler's generator, ε from its counter-based stream, handed to the
peer in place of `torch.randn_like` (L1761) and of the index the script draws (L1766-1774)).

The script's `--weighting_scheme` is one flag for the density and the weight (L543-547, L1766-1817):
logit_normal / mode draw t from that density with weight 1, sigma_sqrt / cosmap draw t uniformly and weight the
velocity MSE. fasttrain: diffusion.sampler=logit_normal | mode | uniform with diffusion.weighting=simple |
flow_sigma_sqrt | flow_cosmap (diffusion/flow_weighting.py). The script's u indexes the scheduler's timesteps,
which descend (index i is σ of (T − i)/T); fasttrain's t ascends (σ of (t + 1)/T): index i = T − 1 − t.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fasttrain import diffusion as fd
from fasttrain.conditioning import TextCaptions, TextTable, attach
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.kernels import philox
from fasttrain.models import build_model
from fasttrain.step import Generators, StepParts, train_step

# the script's --lora_layers default (L1255-1270)
TARGETS = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
           "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
           "ff_context.net.2"]
# --weighting_scheme → (fasttrain's sampler, its weighting)
SCHEMES = {"none": ("uniform", "simple"), "sigma_sqrt": ("uniform", "flow_sigma_sqrt"),
           "cosmap": ("uniform", "flow_cosmap"), "logit_normal": ("logit_normal", "simple"), "mode": ("mode", "simple")}


@dataclass(frozen=True)
class Setup:
    """The shared problem: a FluxTransformer2DModel (`layers` double + `single` single blocks, `heads` heads of
    `head_dim`), `captions` cached latents [16, size, size] and T5 states [length, width] + CLIP pooled [pooled],
    batches of `batch`, the scheduler static (`shift`) or FLUX.1-dev's dynamic one (`dynamic`: trained unshifted)."""
    batch: int = 4
    size: int = 16
    width: int = 32          # joint_attention_dim: T5's width (FLUX.1: 4096)
    length: int = 32         # T5 tokens per caption (FLUX.1 pipelines: 512)
    pooled: int = 24         # pooled_projection_dim: CLIP-L's width (768)
    heads: int = 2
    head_dim: int = 16
    layers: int = 1
    single: int = 1
    captions: int = 16
    scheme: str = "none"     # --weighting_scheme
    guidance_embeds: bool = True
    guidance: float = 3.5    # --guidance_scale (L497-501)
    shift: float = 3.0
    dynamic: bool = True     # use_dynamic_shifting: the scheduler's training sigmas unshifted
    rank: int = 4            # --rank, --lora_alpha (L375-386)
    alpha: float = 4.0
    lr: float = 1e-4         # --learning_rate (L490-494)
    seed: int = 0

    def flux_config(self) -> dict:
        return {"patch_size": 1, "in_channels": 64, "num_layers": self.layers, "num_single_layers": self.single,
                "attention_head_dim": self.head_dim, "num_attention_heads": self.heads,
                "joint_attention_dim": self.width, "pooled_projection_dim": self.pooled,
                "guidance_embeds": self.guidance_embeds,
                "axes_dims_rope": [self.head_dim - 4 * (self.head_dim // 6), 2 * (self.head_dim // 6),
                                   2 * (self.head_dim // 6)]}

    def scheduler_config(self) -> dict:
        return {"num_train_timesteps": 1000, "shift": self.shift, "use_dynamic_shifting": self.dynamic}

    @property
    def train_shift(self) -> float:
        return 1.0 if self.dynamic else self.shift


def cached_data(setup: Setup, device) -> tuple[torch.Tensor, TextTable]:
    """Latents ~ N(0, 1) (a VAE's normalised latents), fp16 T5 states and CLIP pooled vectors as `data prepare`
    caches them, plus the empty prompt's row (zeros) that fasttrain's table needs."""
    g = torch.Generator().manual_seed(setup.seed + 1)
    n = setup.captions
    latents = torch.randn(n, 16, setup.size, setup.size, generator=g)
    states = torch.randn(n + 1, setup.length, setup.width, generator=g).half()
    pooled = torch.randn(n + 1, setup.pooled, generator=g).half()
    states[-1], pooled[-1] = 0, 0
    table = TextTable(states=states, mask=torch.ones(n + 1, setup.length, dtype=torch.bool), pooled=pooled,
                      time_ids=None, empty=n, offsets=torch.arange(n), counts=torch.ones(n, dtype=torch.long))
    return latents.to(device), table.to(device)


def batch_rows(setup: Setup, step: int, device) -> torch.Tensor:
    per_epoch = setup.captions // setup.batch
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(setup.captions, generator=torch.Generator().manual_seed(setup.seed + 100 + epoch))
    return perm[k * setup.batch:(k + 1) * setup.batch].to(device)


def adamw(params, setup: Setup) -> torch.optim.AdamW:
    """L1428-1435 with the script's defaults: betas (0.9, 0.999) (L575-579), weight decay 1e-4 (L588), eps 1e-8."""
    return torch.optim.AdamW(params, lr=setup.lr, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)


def lora_config(setup: Setup):
    from peft import LoraConfig

    return LoraConfig(r=setup.rank, lora_alpha=setup.alpha, lora_dropout=0.0, init_lora_weights="gaussian",
                      target_modules=TARGETS)                                       # L1275-1281


class FasttrainLoop:
    """fasttrain's step: caption codes → TextCaptions (no dropout: the script has none) → the objective (its
    sampler and weighting for the scheme, fused noise and loss ops) → backward, clip 1.0, AdamW."""

    def __init__(self, setup: Setup, device, backend: str = "auto"):
        self.setup, self.device = setup, torch.device(device)
        self.latents, self.table = cached_data(setup, device)
        torch.manual_seed(setup.seed)
        sched = fd.schedule("flow", T=1000, shift=setup.train_shift)
        net = build_model("diffusers", in_channels=16, image_size=setup.size, class_name="FluxTransformer2DModel",
                          config=setup.flux_config(), flow_sigma=sched.sigma,
                          text={"width": setup.width, "length": setup.length, "pooled": setup.pooled},
                          guidance=setup.guidance if setup.guidance_embeds else None)
        net.model.requires_grad_(False)                                              # L1218
        net.model.add_adapter(lora_config(setup))
        self.model = Denoiser(net, PredictionOutput("flow", sched), sched).to(device)
        attach(self.model, self.table)
        sampler, weighting = SCHEMES[setup.scheme]
        self.objective = fd.DiffusionObjective(sched, "flow", weighting, sampler, backend=backend,
                                               output=self.model.output).to(device)
        gens = Generators(torch.Generator(device).manual_seed(setup.seed + 2),
                          torch.Generator(device).manual_seed(setup.seed + 3))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.parts = StepParts(self.model, self.objective, adamw(params, setup), gens,
                               conditioning=TextCaptions(self.table, 0.0, gens.labels), grad_clip=1.0)
        self.i = 0

    @property
    def transformer(self) -> torch.nn.Module:
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
        loss, _ = train_step(self.parts, [(self.latents[rows], rows)], step=self.i)
        self.i += 1
        return loss


class PeerLoop:
    """train_dreambooth_lora_flux.py's step, L1701-1860, on its own copy of the same adapted transformer."""

    def __init__(self, setup: Setup, device, transformer: torch.nn.Module):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.optimization import get_scheduler

        self.setup, self.device = setup, torch.device(device)
        self.latents, table = cached_data(setup, device)
        self.states, self.pooled = table.states, table.pooled
        self.transformer = copy.deepcopy(transformer).to(device)
        self.transformer.train()                                                      # L1690
        self.noise_scheduler_copy = FlowMatchEulerDiscreteScheduler(**setup.scheduler_config())  # L1202-1205
        params = [p for p in self.transformer.parameters() if p.requires_grad]       # L1386
        self.optimizer = adamw(params, setup)
        self.lr_scheduler = get_scheduler("constant", optimizer=self.optimizer)      # L1580-1587, default L517-523

    def get_sigmas(self, timesteps, n_dim=4, dtype=torch.float32):                    # L1678-1686
        sigmas = self.noise_scheduler_copy.sigmas.to(device=self.device, dtype=dtype)
        schedule_timesteps = self.noise_scheduler_copy.timesteps.to(self.device)
        timesteps = timesteps.to(self.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def step(self, rows: torch.Tensor, noise: torch.Tensor | None = None,
             indices: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step; `noise`, `indices` replace the script's draws (equal-noise runs)."""
        from diffusers import FluxPipeline
        from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

        setup, sched = self.setup, self.noise_scheduler_copy
        prompt_embeds = self.states[rows].float()                                    # L1707: cached here
        pooled_prompt_embeds = self.pooled[rows].float()
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=self.device)        # L1066 (encode_prompt)
        model_input = self.latents[rows]             # L1743-1749: cached, (z − shift_factor)·scaling_factor
        vae_scale_factor = 8                                                          # L1751: FLUX.1's VAE
        latent_image_ids = FluxPipeline._prepare_latent_image_ids(                    # L1753-1759
            model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, self.device,
            model_input.dtype)
        if noise is None:
            noise = torch.randn_like(model_input)                                     # L1761
        bsz = model_input.shape[0]
        if indices is None:                                                           # L1766-1773
            u = compute_density_for_timestep_sampling(weighting_scheme=setup.scheme, batch_size=bsz, logit_mean=0.0,
                                                      logit_std=1.0, mode_scale=1.29)
            indices = (u * sched.config.num_train_timesteps).long()
        timesteps = sched.timesteps[indices].to(device=model_input.device)            # L1774
        sigmas = self.get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)  # L1778
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise            # L1779
        packed_noisy_model_input = FluxPipeline._pack_latents(                       # L1781-1787
            noisy_model_input, batch_size=model_input.shape[0], num_channels_latents=model_input.shape[1],
            height=model_input.shape[2], width=model_input.shape[3])
        if self.transformer.config.guidance_embeds:                                  # L1790-1794
            guidance = torch.tensor([setup.guidance], device=self.device)
            guidance = guidance.expand(model_input.shape[0])
        else:
            guidance = None
        model_pred = self.transformer(                                               # L1797-1807
            hidden_states=packed_noisy_model_input, timestep=timesteps / 1000, guidance=guidance,
            pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds, txt_ids=text_ids,
            img_ids=latent_image_ids, return_dict=False)[0]
        model_pred = FluxPipeline._unpack_latents(                                   # L1808-1813
            model_pred, height=model_input.shape[2] * vae_scale_factor,
            width=model_input.shape[3] * vae_scale_factor, vae_scale_factor=vae_scale_factor)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=setup.scheme, sigmas=sigmas)  # L1817
        target = noise - model_input                                                 # L1820
        loss = torch.mean(                                                           # L1838-1842
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
        loss = loss.mean()
        loss.backward()                                                              # L1848
        torch.nn.utils.clip_grad_norm_(                                              # L1849-1855
            [p for p in self.transformer.parameters() if p.requires_grad], 1.0)
        self.optimizer.step()                                                        # L1857-1859
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        return loss.detach()


def equal_noise_run(setup: Setup, steps: int, device="cpu", backend: str = "torch"):
    """Both loops for `steps` steps on the same batches, the peer given fasttrain's t (as its index T − 1 − t)
    and ε. Returns (fasttrain losses, peer losses, the adapters' agreement, (fasttrain loop, peer loop, the
    transformer both started from))."""
    ft = FasttrainLoop(setup, device, backend)
    peer = PeerLoop(setup, device, ft.transformer)
    start = copy.deepcopy(ft.transformer)
    ours, theirs = [], []
    for k in range(steps):
        rows = batch_rows(setup, k, device)
        t, eps = ft.peek(rows)
        theirs.append(float(peer.step(rows, noise=eps, indices=ft.objective.T - 1 - t)))
        ours.append(float(ft.step(rows)))
    return ours, theirs, adapter_agreement(ft.transformer, peer.transformer, start), (ft, peer, start)


@torch.no_grad()
def adapter_agreement(a: torch.nn.Module, b: torch.nn.Module, start: torch.nn.Module) -> dict:
    """t2i_loops.weight_agreement's measures over the trained (adapter) parameters: the largest |a − b|, and
    ‖a − b‖ relative to ‖a − start‖ (what training moved)."""
    names = [n for n, p in a.named_parameters() if p.requires_grad]
    pa, pb, p0 = (dict(m.named_parameters()) for m in (a, b, start))
    diff = torch.stack([(pa[n] - pb[n]).norm() for n in names]).norm()
    moved = torch.stack([(pa[n] - p0[n]).norm() for n in names]).norm()
    return {"max_abs": max(float((pa[n] - pb[n]).abs().max()) for n in names), "rel_norm": float(diff / moved),
            "moved_norm": float(moved), "tensors": len(names)}
