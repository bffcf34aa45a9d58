"""`fasttrain export RUN --to kohya OUT`: a LoRA run's adapter as one `.safetensors` in kohya-ss/sd-scripts'
layout (pretrained/kohya.py: lora_unet_… / lora_te…_ names, lora_down / lora_up and a per-module alpha), the
file ComfyUI, AUTOMATIC1111/Forge and sd-scripts load, and diffusers' load_lora_weights reads too
(loaders/lora_conversion_utils.py). SD 1.x/2.x, SDXL (sd-scripts' SGM block names) and Flux (BFL names, fused
qkv) runs.

    OUT/<run name>.safetensors   the tensors, and sd-scripts' metadata: ss_network_module, ss_network_dim,
                                 ss_network_alpha, ss_base_model_version, ss_training_comment

The text encoders' adapters join the file under lora_te (SD 1.x/2.x) or lora_te1 / lora_te2 (SDXL) where a run
trains them (model.lora.text_encoder, pretrained/text_lora.py), with the UNet's rank and alpha.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InvalidInput
from ..pretrained import lora, text_lora
from ..pretrained.lora_file import family_of, kohya_tensors

# ss_base_model_version as sd-scripts' train_network.py writes it (sd_v1 / sd_v2 / sdxl_base_v1-0 / flux1)
VERSIONS = {"sd1": "sd_v1", "sdxl": "sdxl_base_v1-0", "flux": "flux1"}
MODULES = {"sd1": "networks.lora", "sdxl": "networks.lora", "flux": "networks.lora_flux"}


def export_kohya(run: str, out: Path, b, ema: bool) -> dict:
    """Write OUT/<run name>.safetensors for the LoRA run `b`."""
    from safetensors.torch import save_file

    from .common import written_whole

    if not lora.identity(b.net):
        raise InvalidInput(f"{run} was not trained with LoRA (model.lora.rank=0): it has no adapter to export "
                           f"in kohya's format")
    model = b.net.net.model
    family = family_of(model)
    live = text_lora.live_of(b.net)  # text-encoder LoRA: its adapters join the file under lora_te…
    with b.averaged(ema):
        tensors = kohya_tensors(model, list(enumerate(live.encoders)) if live is not None else ())
    cfg = model.peft_config["default"]
    version = VERSIONS[family]
    if family == "sd1" and int(model.config.get("cross_attention_dim") or 768) == 1024:
        version = "sd_v2"
    meta = {"ss_network_module": MODULES[family], "ss_network_dim": str(int(cfg.r)),
            "ss_network_alpha": str(float(cfg.lora_alpha)), "ss_base_model_version": version,
            "ss_v2": str(version == "sd_v2"),
            "ss_training_comment": f"fasttrain run {Path(run).resolve().name} step {b.step} "
                                   f"({'EMA' if ema else 'raw'} weights)"}
    folder = Path(run).resolve()
    if folder.is_file() or folder.name == "dcp":  # RUN/last.pt, RUN/dcp: named after RUN
        folder = folder.parent
    name = f"{folder.name or 'lora'}.safetensors"
    path = out / name
    with written_whole(out) as whole:
        save_file(tensors, str(whole / name), metadata=meta)
    return {"out": str(path), "pipeline": f"kohya ({family})", "network": "LoRA", "scheduler": "-", "vae": False,
            "max_abs_diff": 0.0, "step": b.step, "weights": "ema" if ema else "raw", "remote_code": False,
            "base": lora.identity(b.net)["pipeline"], "tensors": len(tensors)}
