"""Exports of a run (`fasttrain export`): `dispatch.py` chooses the exporter (`export_diffusers`) and writes
fasttrain's own pipeline kinds; `common.py` (what every exporter shares: the folder written whole, the
run's scheduler); `stable_diffusion.py` (stock SD / SDXL pipelines, LoRA weights), `sd3.py`
(StableDiffusion3Pipeline), `flux.py` (FluxPipeline), `kohya.py` (LoRA weights in sd-scripts' names),
`convert.py` (fasttrain DiT/UNet weights → diffusers classes), `remote_pipeline.py` (the pipeline file
shipped where no stock pipeline fits), `model_card.py` (the export's README)."""


from .. import _names_of

# `fasttrain.export` was one module before 0.3 (dispatch.py now): its names stay reachable here
__getattr__ = _names_of(__name__, "dispatch")
