"""Pretrained parts read from local folders: `vae.py` (a diffusers AutoencoderKL), `text_encoders.py`
(CLIP / T5 through transformers), `lora.py` (LoRA adapters through peft), `text_lora.py` (LoRA on SD/SDXL's
CLIP encoders, run live in the step; caption shuffling), `kohya.py` (sd-scripts' LoRA
key names), `lora_file.py` (LoRA files of either format ↔ an adapter; `model.lora.init`), `scheduler_config.py` (a
pipeline's scheduler ↔ the run's schedule), `model_folders.py` (diffusers model folders on disk) and
`file_hashes.py` (their files' digests); for representation alignment `encoders.py` (frozen image
encoders: a transformers AutoModel folder or module:function) and `digits_encoder.py` (the digits' own)."""
