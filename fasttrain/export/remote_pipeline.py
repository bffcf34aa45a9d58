"""A diffusers pipeline for models trained with fasttrain that no stock pipeline can drive (class-
conditional UNets, pixel DiTs, class tables other than ImageNet's 1000, per-channel latent
normalisation, rectified flow). `fasttrain export RUN --to diffusers OUT` copies this file into OUT as
pipeline.py; it needs torch and diffusers only, not fasttrain:

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(OUT, trust_remote_code=True)   # model_index.json names this class
    images = pipe(class_labels=[1, 7], num_inference_steps=50, guidance_scale=1.0,
                  generator=torch.Generator().manual_seed(0)).images

(`trust_remote_code=True` is diffusers' consent to run this file; read it first.) It follows the
diffusers protocol, so any compatible scheduler swaps in (`pipe.scheduler = X.from_config(
pipe.scheduler.config)`): the scheduler's own timesteps (`set_timesteps`; flow schedulers that take
sigmas get 1 … 1/n, as diffusers' SD3 pipeline passes them), `init_noise_sigma`, `scale_model_input`,
`eta` and the generator where the scheduler's `step` takes them, noise from `randn_tensor` (a CPU
generator works with a GPU pipeline and gives the same images), `num_images_per_prompt`,
`callback_on_step_end`, `id2label` names (`pipe.labels`, `get_label_ids`, as DiTPipeline), and
`save_pretrained` writes a folder that loads again (this file and its class name kept).

What it adds to a stock pipeline's loop, each from the `fasttrain` entry of model_index.json:
  * class labels and classifier-free guidance (Ho & Salimans 2022, Eq. 6) on the network's output (at
    fixed x_t every prediction type is affine in x̂0, so this equals guidance on x̂0), with the null
    label `null_label`;
  * for pixel models, x̂0 clipped to [-1, 1] and the output recomputed from it before the scheduler
    steps (fasttrain's sampling; DDIMScheduler alone would clip x̂0 but keep the unclipped ε);
  * rectified flow: the scheduler's timestep σ·T is fasttrain's t + 1 (σ_t = (t+1)/T), so the network
    gets t = σ·T − 1;
  * latents: fasttrain's per-channel normalisation undone before the VAE decodes, z = x/scale + shift
    (DiTPipeline would divide by `scaling_factor` only);
  * DiTs exported from checkpoints before fasttrain's format 4 (`timestep_frequencies: fasttrain`):
    their timestep frequencies exp(−ln(10⁴)·k/128), set in every block on loading
    (`use_fasttrain_timestep_frequencies`; a transformer loaded alone needs the same call).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor


def use_fasttrain_timestep_frequencies(transformer):
    """fasttrain's legacy (and the original DiT's) timestep frequencies in a DiTTransformer2DModel."""
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer


class FasttrainPipeline(DiffusionPipeline):
    _optional_components = ["transformer", "unet", "vae"]
    model_cpu_offload_seq = "transformer->unet->vae"
    _callback_tensor_inputs = ["latents"]

    def __init__(self, scheduler, transformer=None, unet=None, vae=None, fasttrain: dict | None = None,
                 id2label: dict | None = None):
        super().__init__()
        self.register_modules(scheduler=scheduler, transformer=transformer, unet=unet, vae=vae)
        self.register_to_config(fasttrain=dict(fasttrain or {}), id2label=dict(id2label or {}))
        if transformer is not None and self.settings.get("timestep_frequencies") == "fasttrain":
            use_fasttrain_timestep_frequencies(transformer)
        self.image_processor = VaeImageProcessor(do_resize=False)
        self.labels = {}  # label name → class id, as DiTPipeline
        for key, value in (id2label or {}).items():
            for name in str(value).split(","):
                self.labels[name.strip()] = int(key)

    @property
    def settings(self) -> dict:
        return self.config.fasttrain

    @property
    def network(self):
        return self.transformer if self.transformer is not None else self.unet

    def get_label_ids(self, label: str | list[str]) -> list[int]:
        """Class names (id2label) → class ids."""
        names = [label] if isinstance(label, str) else list(label)
        missing = [n for n in names if n not in self.labels]
        if missing:
            raise ValueError(f"unknown label {missing[0]!r}; the labels are {sorted(self.labels)}")
        return [self.labels[n] for n in names]

    # -- the network's output at (x, t) -----------------------------------------------------------------
    def _alpha_sigma(self, t) -> tuple[float, float]:
        """(α_t, σ_t) of x_t = α_t·x0 + σ_t·ε at the scheduler's timestep t (VP: its ᾱ table)."""
        if self.settings.get("schedule") == "flow":
            s = float(t) / self.settings["T"]
            return 1.0 - s, s
        abar = float(self.scheduler.alphas_cumprod[int(round(float(t)))])
        return abar**0.5, (1 - abar) ** 0.5

    def _clip(self, out: torch.Tensor, x: torch.Tensor, t) -> torch.Tensor:
        """The output with its x̂0 clipped to [-clip, clip] (pixel models), in the prediction's own terms."""
        clip, kind = self.settings.get("clip"), self.settings.get("prediction")
        if not clip:
            return out
        a, s = self._alpha_sigma(t)
        if kind == "flow":  # u = ε − x0, x = (1 − σ)·x0 + σ·ε
            x0 = (x - s * out).clamp(-clip, clip)
            return (x - x0) / s
        x0 = {"eps": lambda: (x - s * out) / a, "x0": lambda: out, "v": lambda: a * x - s * out}[kind]()
        x0 = x0.clamp(-clip, clip)
        eps = (x - a * x0) / s
        return {"eps": eps, "x0": x0, "v": a * eps - s * x0}[kind]

    def predict(self, x: torch.Tensor, t, class_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The network's output at the scheduler's timestep t, with fasttrain's labels (None: the null label)."""
        null, c = self.settings.get("null_label"), self.settings["channels"]
        t_model = float(t)
        if self.settings.get("schedule") == "flow":  # the scheduler's σ·T, shifted → fasttrain's t (s_t = (t+1)/T)
            k, sig = float(self.settings.get("flow_shift", 1.0)), float(t) / self.settings["T"]
            t_model = (sig / (k - (k - 1) * sig)) * self.settings["T"] - 1 if k != 1.0 else float(t) - 1
        tt = torch.full((x.shape[0],), t_model, device=x.device)
        if null is None:
            return self.network(x, tt).sample[:, :c]
        y = torch.full_like(tt, null, dtype=torch.long) if class_labels is None else class_labels.to(x.device)
        return self.network(x, tt, class_labels=y).sample[:, :c]  # a learned-Σ half is not used

    def guided(self, x: torch.Tensor, t, labels: torch.Tensor | None, guidance: float) -> torch.Tensor:
        """Classifier-free guidance on the output, then the pixel models' clipping."""
        if labels is None or guidance == 1.0:
            out = self.predict(x, t, labels)
        else:
            null = torch.full_like(labels, self.settings["null_label"])
            cond, uncond = self.predict(torch.cat([x, x]), t, torch.cat([labels, null])).chunk(2)
            out = uncond + guidance * (cond - uncond)
        return self._clip(out, x, t)

    # -- the diffusers protocol ---------------------------------------------------------------------------
    def _timesteps(self, steps: int, device):
        if self.settings.get("schedule") == "flow" and \
                "sigmas" in inspect.signature(self.scheduler.set_timesteps).parameters:
            self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), device=device)
        else:
            self.scheduler.set_timesteps(steps, device=device)
        return self.scheduler.timesteps

    def _step_kwargs(self, generator, eta: float) -> dict:
        takes = set(inspect.signature(self.scheduler.step).parameters)
        return {k: v for k, v in (("eta", eta), ("generator", generator)) if k in takes}

    def _labels(self, class_labels, device) -> torch.Tensor | None:
        if class_labels is None:
            return None
        if not self.settings.get("num_classes"):
            raise ValueError("this model is unconditional: pass no class_labels")
        if isinstance(class_labels, str) or (isinstance(class_labels, (list, tuple)) and class_labels
                                             and isinstance(class_labels[0], str)):
            class_labels = self.get_label_ids(class_labels)
        labels = torch.as_tensor(class_labels, dtype=torch.long, device=device).reshape(-1)
        if bool(((labels < 0) | (labels >= self.settings["num_classes"])).any()):
            raise ValueError(f"class_labels must lie in [0, {self.settings['num_classes']})")
        return labels

    @torch.no_grad()
    def __call__(self, class_labels=None, batch_size: int | None = None, num_images_per_prompt: int = 1,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None, eta: float = 0.0,
                 generator: torch.Generator | list[torch.Generator] | None = None,
                 latents: torch.Tensor | None = None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end=None, callback_on_step_end_tensor_inputs: list[str] = ("latents",)):
        """Images for `class_labels` (ids, or names from id2label; None: unconditional, `batch_size` of
        them), `num_images_per_prompt` each; defaults from the run (its steps and guidance scale)."""
        f = self.settings
        steps = num_inference_steps or f.get("steps", 50)
        guidance = f.get("guidance", 1.0) if guidance_scale is None else guidance_scale
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        bad = [k for k in callback_on_step_end_tensor_inputs if k not in self._callback_tensor_inputs]
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs takes {self._callback_tensor_inputs}, not {bad}")
        device = self._execution_device
        labels = self._labels(class_labels, device)
        if labels is not None:
            labels = labels.repeat_interleave(num_images_per_prompt)
        n = len(labels) if labels is not None else (batch_size or 1) * num_images_per_prompt
        shape = (n, f["channels"], f["image_size"], f["image_size"])
        dtype = self.network.dtype
        latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype) if latents is None \
            else latents.to(device, dtype)
        timesteps = self._timesteps(steps, device)
        latents = latents * getattr(self.scheduler, "init_noise_sigma", 1.0)  # flow schedulers have neither
        scale = getattr(self.scheduler, "scale_model_input", lambda sample, t: sample)
        extra = self._step_kwargs(generator, eta)
        for i, t in enumerate(self.progress_bar(timesteps)):
            x = scale(latents, t)
            out = self.guided(x, t, labels, guidance)
            latents = self.scheduler.step(out, t, latents, **extra).prev_sample
            if callback_on_step_end is not None:
                tensors = {"latents": latents}  # _callback_tensor_inputs
                tensors = {k: tensors[k] for k in callback_on_step_end_tensor_inputs}
                latents = callback_on_step_end(self, i, t, tensors).pop("latents", latents)
        if output_type == "latent":
            images = latents
        else:
            x = latents
            if self.vae is not None:  # fasttrain's normalisation undone: z = x/scale + shift per channel
                scale = torch.tensor(f["latent_scale"], device=device, dtype=x.dtype).view(1, -1, 1, 1)
                shift = torch.tensor(f["latent_shift"], device=device, dtype=x.dtype).view(1, -1, 1, 1)
                x = self.vae.decode((x / scale + shift).to(self.vae.dtype)).sample
            images = self.image_processor.postprocess(x.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs):
        """diffusers' save, then this file and its class name kept, so that the folder loads again with
        trust_remote_code=True (diffusers would name the class alone and drop the file). push_to_hub:
        save, then upload the folder with huggingface_hub."""
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("repo_id", "token", "private", "commit_message", "create_pr")
               if k in kwargs}
        super().save_pretrained(save_directory, **kwargs)
        out = Path(save_directory)
        here = Path(inspect.getfile(type(self)))
        if here.resolve() != (out / "pipeline.py").resolve():
            shutil.copyfile(here, out / "pipeline.py")
        index = json.loads((out / "model_index.json").read_text())
        index["_class_name"] = ["pipeline", type(self).__name__]
        (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        card = Path(self.config.get("_name_or_path") or "") / "README.md"
        if card.is_file() and card.resolve() != (out / "README.md").resolve():
            shutil.copyfile(card, out / "README.md")  # the export's model card travels with it
        if push:
            from huggingface_hub import create_repo, upload_folder

            repo = create_repo(hub.get("repo_id", out.name), exist_ok=True, private=hub.get("private"),
                               token=hub.get("token")).repo_id
            upload_folder(repo_id=repo, folder_path=str(out), token=hub.get("token"),
                          commit_message=hub.get("commit_message"), create_pr=hub.get("create_pr", False))
