"""A diffusers pipeline for models trained with fasttrain. `fasttrain export RUN --to diffusers OUT`
copies this file into OUT as pipeline.py; it needs torch and diffusers only, not fasttrain:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(OUT, trust_remote_code=True)   # model_index.json names this class
    images = pipe(class_labels=[1, 7], num_inference_steps=50, guidance_scale=1.0,
                  generator=torch.Generator().manual_seed(0)).images

(`trust_remote_code=True` is diffusers' consent to run this file; read it first.) It reproduces
fasttrain's sampling: the network (a DiTTransformer2DModel or UNet2DModel in OUT/transformer or
OUT/unet), fasttrain's step spacing (`respaced`: T−1 … 0, evenly spaced and rounded; diffusers'
`linspace` spacing gives the same list, but DDIMScheduler steps to t − T//n instead of the next listed
timestep), DDIM (η = 0) as diffusers' first-order DPM-Solver++ on that list (the same update,
Lu et al. 2022, §4.1 / Song et al. 2021, Eq. 12), or the Euler step of rectified flow, classifier-free
guidance on the network's output (Ho & Salimans 2022, Eq. 6: at fixed x_t the prediction types are
affine in it, so this equals guidance on x̂0), clipping x̂0 to [-1, 1] for pixel models, and for latent
models fasttrain's per-channel normalisation undone before the VAE decodes (DiTPipeline would apply
`scaling_factor` only).

The `fasttrain` entry of model_index.json holds what the stock pipelines cannot know: the classes and
the null label, the normalisation, the spacing, the defaults, and `timestep_frequencies`. fasttrain's
DiT embeds t with frequencies exp(−ln(10⁴)·k/128), as the original DiT does; diffusers'
DiTTransformer2DModel hard-codes `downscale_freq_shift=1` (k/127), which no config key changes, so
this pipeline sets it to 0 in every block when it is built (`use_fasttrain_timestep_frequencies`).
A DiTTransformer2DModel loaded alone from OUT/transformer needs the same call.
"""
from __future__ import annotations

import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput


def use_fasttrain_timestep_frequencies(transformer):
    """fasttrain's (and the original DiT's) timestep frequencies in a DiTTransformer2DModel."""
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer


def respaced(T: int, steps: int) -> list[int]:
    """fasttrain's step spacing: `steps` timesteps from T−1 down to 0, evenly spaced and rounded."""
    ts = torch.linspace(T - 1, 0, steps, dtype=torch.float32).round().long().tolist()
    return sorted(set(ts), reverse=True)


class FasttrainPipeline(DiffusionPipeline):
    _optional_components = ["transformer", "unet", "vae"]
    model_cpu_offload_seq = "transformer->unet->vae"

    def __init__(self, scheduler, transformer=None, unet=None, vae=None, fasttrain: dict | None = None):
        super().__init__()
        self.register_modules(scheduler=scheduler, transformer=transformer, unet=unet, vae=vae)
        self.register_to_config(fasttrain=dict(fasttrain or {}))
        if transformer is not None and self.settings.get("timestep_frequencies") == "fasttrain":
            use_fasttrain_timestep_frequencies(transformer)

    @property
    def settings(self) -> dict:
        return self.config.fasttrain

    @property
    def network(self):
        return self.transformer if self.transformer is not None else self.unet

    def predict(self, x: torch.Tensor, t, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The network's output at (x, t) with fasttrain's labels (None: the null label)."""
        null, c = self.settings.get("null_label"), self.settings["channels"]
        tt = torch.full((x.shape[0],), int(t), device=x.device, dtype=torch.long)
        if null is None:
            return self.network(x, tt).sample[:, :c]
        y = torch.full_like(tt, null) if class_labels is None else class_labels.to(x.device)
        return self.network(x, tt, class_labels=y).sample[:, :c]  # a learned-Σ half is not used

    def _guided(self, x, t, labels, guidance: float) -> torch.Tensor:
        if labels is None or guidance == 1.0:
            return self.predict(x, t, labels)
        null = torch.full_like(labels, self.settings["null_label"])
        out = self.predict(torch.cat([x, x]), t, torch.cat([labels, null]))
        cond, uncond = out.chunk(2)
        return uncond + guidance * (cond - uncond)

    def _flow_step(self, u, t_sched, x):
        """fasttrain's rectified-flow Euler step (x̂0 clipped for pixel models: x̂0 = x − σ·u)."""
        if self.settings.get("clip"):
            i = self.scheduler.index_for_timestep(t_sched) if self.scheduler.step_index is None \
                else self.scheduler.step_index
            s = self.scheduler.sigmas[i].to(x.device, x.dtype)
            x0 = (x - s * u).clamp(-self.settings["clip"], self.settings["clip"])
            u = (x - x0) / s
        return self.scheduler.step(u, t_sched, x).prev_sample

    @torch.no_grad()
    def __call__(self, class_labels=None, batch_size: int | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None, output_type: str = "pil", return_dict: bool = True):
        f = self.settings
        steps = num_inference_steps or f.get("steps", 50)
        guidance = f.get("guidance", 1.0) if guidance_scale is None else guidance_scale
        device = self._execution_device
        labels = None
        if class_labels is not None:
            if not f.get("num_classes"):
                raise ValueError("this model is unconditional: pass no class_labels")
            labels = torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)
            if bool(((labels < 0) | (labels >= f["num_classes"])).any()):
                raise ValueError(f"class_labels must lie in [0, {f['num_classes']})")
        n = len(labels) if labels is not None else (batch_size or 1)
        shape = (n, f["channels"], f["image_size"], f["image_size"])
        dtype = next(self.network.parameters()).dtype
        x = torch.randn(shape, generator=generator, device=device, dtype=dtype) if latents is None \
            else latents.to(device, dtype)
        ts = respaced(f["T"], min(steps, f["T"]))
        flow = f.get("schedule") == "flow"
        if flow:  # sigmas (t+1)/T; the scheduler's timestep σ·T is t+1, the network was trained on t
            self.scheduler.set_timesteps(sigmas=[(t + 1) / f["T"] for t in ts], device=device)
        else:
            self.scheduler.set_timesteps(timesteps=ts, device=device)
        for i, t_sched in enumerate(self.progress_bar(self.scheduler.timesteps)):
            out = self._guided(x, ts[i], labels, guidance)
            x = self._flow_step(out, t_sched, x) if flow else self.scheduler.step(out, t_sched, x).prev_sample
        if output_type == "latent":
            images = x
        else:
            if self.vae is not None:  # fasttrain's normalisation undone: z = x/scale + shift per channel
                scale = torch.tensor(f["latent_scale"], device=device, dtype=x.dtype).view(1, -1, 1, 1)
                shift = torch.tensor(f["latent_shift"], device=device, dtype=x.dtype).view(1, -1, 1, 1)
                x = self.vae.decode((x / scale + shift).to(self.vae.dtype)).sample
            images = (x.float() / 2 + 0.5).clamp(0, 1)
            if output_type in ("np", "pil"):
                images = images.cpu().permute(0, 2, 3, 1).numpy()
                if output_type == "pil":
                    images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)
