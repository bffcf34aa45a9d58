"""Exports of a run (`fasttrain export`): `dispatch.py` chooses the exporter (`export_diffusers`) and writes
fasttrain's own pipeline kinds; `common.py` (what every exporter shares: the folder written whole, the
run's scheduler); `stable_diffusion.py` (stock SD / SDXL pipelines, LoRA weights), `sd3.py`
(StableDiffusion3Pipeline), `convert.py` (fasttrain DiT/UNet weights → diffusers classes),
`remote_pipeline.py` (the pipeline file shipped where no stock pipeline fits), `model_card.py` (the
export's README)."""


def __getattr__(name: str):
    # `fasttrain.export` was one module before 0.3 (dispatch.py now): its names stay reachable here
    import importlib

    if not name.startswith("__"):
        module = importlib.import_module(f"{__name__}.dispatch")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
