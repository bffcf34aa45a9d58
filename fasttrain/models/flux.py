"""Flux (FLUX.1-dev/schnell-shaped `FluxTransformer2DModel`) as a fasttrain backbone:

    model.name=diffusers model.args.class_name=FluxTransformer2DModel model.args.pretrained=PIPE \
        model.args.subfolder=transformer [model.args.guidance=3.5]

on captioned latents prepared with the pipeline's CLIP-L (its pooled vector) and T5 (per-token states). What
the transformer takes, as diffusers' FluxPipeline and examples/dreambooth/train_dreambooth_lora_flux.py give it
(L1748-1806 of that script at diffusers 58eb52c):

  latents    the VAE's (z − shift_factor)·scaling_factor (data.latent_norm=vae), C×h×w, packed into 2×2
             patches: (h/2·w/2) tokens of 4·C features (FluxPipeline._pack_latents; the output unpacked by
             _unpack_latents), so in_channels = 4·C (FLUX.1: 64 for the 16-channel VAE); h and w even
  positions  img_ids (h/2·w/2, 3) = (0, row, column) of each patch (FluxPipeline._prepare_latent_image_ids),
             txt_ids zeros (T5 length, 3) (FluxPipeline.encode_prompt): the rotary embedding's inputs
  time       σ_t, the run's flow noise level (the transformer multiplies it by 1000 itself; the script passes
             `timesteps / 1000` with timesteps = σ·1000, the pipeline likewise)
  text       encoder_hidden_states = T5's states (joint_attention_dim: T5's width), pooled_projections = CLIP's
             pooled vector (pooled_projection_dim)
  guidance   a guidance-distilled transformer (guidance_embeds, FLUX.1-dev) embeds a guidance value: in
             training the script feeds `--guidance_scale` (default 3.5, L497-501 and L1789-1794), here
             model.args.guidance (default the same); at sampling FluxPipeline's `guidance_scale`, here
             sample.embedded_guidance (default: the training value). Classifier-free guidance against a
             negative prompt (sample.guidance) is FluxPipeline's `true_cfg_scale`.

The σ table is a non-persistent buffer rebuilt from the config; sampling with a resolution-dependent shift
(diffusion.dynamic_shift, FLUX.1-dev's `use_dynamic_shifting`) swaps it for the shifted one
(diffusion/dynamic_shift.py). Blocks for activation checkpointing, compile and FSDP: the double-stream
`transformer_blocks` and the single-stream `single_transformer_blocks`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidInput
from .diffusers_backbone import DiffusersBackbone, Kind, _construct_loaded, _fit, check_flow_text, register_kind

CLASS = "FluxTransformer2DModel"
TRAINING_GUIDANCE = 3.5  # train_dreambooth_lora_flux.py --guidance_scale default


def _sizes(image_size: int, cfg: dict) -> None:
    if image_size % 2:
        raise InvalidInput(f"the Flux transformer packs the latents into 2×2 patches: the latent side must be even, "
                           f"got {image_size}")
    if int(cfg.get("patch_size", 1)) != 1:
        raise InvalidInput("model.args.config.patch_size must be 1 for a FluxTransformer2DModel (FLUX.1's: the 2×2 "
                           "packing happens outside the transformer)")


def pack(x: torch.Tensor) -> torch.Tensor:
    """B×C×h×w → B×(h/2·w/2)×4C (FluxPipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """B×(h/2·w/2)×4C → B×C×h×w (FluxPipeline._unpack_latents)."""
    b, _, f = x.shape
    return x.view(b, h // 2, w // 2, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, f // 4, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """(h/2·w/2, 3): (0, row, column) of each 2×2 patch (FluxPipeline._prepare_latent_image_ids)."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3).to(dtype)


class FluxBackbone(DiffusersBackbone):
    """fasttrain's forward(x, t, y) around a FluxTransformer2DModel (module docstring)."""

    def __init__(self, model: nn.Module, text: dict, flow_sigma: torch.Tensor, guidance: float | None):
        super().__init__(model, 0, None, None, text=text)
        here = torch.empty(0).device  # the device being built on (meta when FLOPs are counted)
        self.register_buffer("flow_sigma", flow_sigma.float().to(here), persistent=False)
        self.guidance = guidance  # the embedded guidance value (None: no guidance embedding)

    def use_flow_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """Feed the noise levels `sigma` [T] as the time input from now on (sampling with another shift);
        returns the table it had."""
        old, self.flow_sigma = self.flow_sigma, sigma.float().to(self.flow_sigma.device)
        return old

    def _gather(self, y: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.text_table is None:  # no table (FLOP counting on the meta device): zero states of the right shape
            r = self.text
            return x.new_zeros(x.shape[0], r["length"], r["width"]), x.new_zeros(x.shape[0], r["pooled"])
        g = self.text_table.gather(y, x.shape[0], x.dtype)
        return g["states"], g["pooled"]

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        given = x.dtype
        if self.compute_dtype is not None:  # a LoRA run's base in bf16 (lora.hold_base): its inputs in bf16
            x = x.to(self.compute_dtype)
        b, _, h, w = x.shape
        states, pooled = self._gather(y, x)
        guidance = None
        if self.guidance is not None:  # the pipeline: torch.full([1], guidance_scale, float32).expand(B)
            guidance = torch.full((b,), float(self.guidance), device=x.device, dtype=torch.float32)
        out = self.model(hidden_states=pack(x), timestep=self.flow_sigma[t].to(x.dtype), guidance=guidance,
                         pooled_projections=pooled, encoder_hidden_states=states,
                         txt_ids=x.new_zeros(states.shape[1], 3), img_ids=image_ids(h, w, x.device, x.dtype)).sample
        out = unpack(out, h, w)
        return out.to(given) if self.compute_dtype is not None else out

    def repeated_blocks(self) -> list[nn.Module]:
        return [*self.model.transformer_blocks, *self.model.single_transformer_blocks]


def network(*, in_channels: int, image_size: int, out_channels: int | None, config: dict, pretrained: str,
            subfolder: str, text: dict | None, num_classes: int, flow_sigma: torch.Tensor | None,
            guidance: float | None) -> FluxBackbone:
    """A FluxTransformer2DModel for latents of `in_channels` (module docstring): in/out channels 4·C, the text
    widths the data's, the guidance embedding fed `guidance` (default 3.5) where the model has one."""
    cfg, pre = dict(config), bool(pretrained)
    check_flow_text("a FluxTransformer2DModel", "a Flux pipeline's text encoders: CLIP-L and T5", text, num_classes,
                    flow_sigma)
    if (out_channels or in_channels) != in_channels:
        raise InvalidInput(f"a FluxTransformer2DModel predicts as many channels as it takes ({in_channels}), the "
                           f"prediction needs {out_channels}")
    _fit(cfg, "in_channels", 4 * in_channels, pre or "in_channels" in config, "4 × the latents' channels (2×2 packing)")
    if cfg.get("out_channels") is not None:
        _fit(cfg, "out_channels", 4 * in_channels, True, "4 × the latents' channels (2×2 packing)")
    _fit(cfg, "joint_attention_dim", text["width"], pre or "joint_attention_dim" in config, "T5's width")
    _fit(cfg, "pooled_projection_dim", text["pooled"], pre or "pooled_projection_dim" in config,
         "CLIP's pooled width")
    distilled = bool(cfg.get("guidance_embeds", False))
    if guidance is not None and not distilled:
        raise InvalidInput(f"model.args.guidance={guidance}: this FluxTransformer2DModel has no guidance embedding "
                           f"(guidance_embeds=false, as FLUX.1-schnell): drop it")
    model = _construct_loaded(CLASS, cfg, pre, pretrained, subfolder)
    value = (TRAINING_GUIDANCE if guidance is None else float(guidance)) if distilled else None
    return FluxBackbone(model.train(), text, flow_sigma, value)


register_kind(CLASS, Kind("", _sizes, "transformer", text=True, flow=True, network=network, dynamic_shift=True))
