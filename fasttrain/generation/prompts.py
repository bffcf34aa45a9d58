"""A text run's prompts (`RunPrompts`): its text encoders, loaded on first use from the recorded folder (or
`folder`, `--text-encoders`) and checked against the recorded identity, and the prompt tables sampling
conditions on (conditioning.TextTable), as each pipeline's `encode_prompt` makes them."""
from __future__ import annotations

import torch

from ..data import data_kind
from ..data.captioned import table_of
from ..errors import InvalidInput


class RunPrompts:
    def __init__(self, spec, device, folder: str | None = None):
        self.spec, self.device, self.folder, self._encoders = spec, torch.device(device), folder, None
        self.live = None  # a text-encoder LoRA run's adapted encoders (pretrained/text_lora.py), set by the bundle

    @property
    def encoders(self):
        """The run's text encoders (text_encoders.TextEncoders), checked against the recorded identity."""
        if self._encoders is None:
            from ..pretrained.text_encoders import TextEncoders

            rec = self.spec.text["encoders"]
            folder = self.folder or data_kind(self.spec.name).text_encoders(rec)
            enc = TextEncoders.load(folder, rec.get("clip_skip"), self.device)
            enc.check(rec, "this run")
            self._encoders = enc
        return self._encoders

    @staticmethod
    def sample_args(sample) -> dict:
        """generate()'s prompt arguments from a run's `sample` section."""
        return {"prompts": list(sample.prompts) or None, "negative_prompt": sample.negative_prompt}

    def table(self, prompts: list[str], negative: str = ""):
        """The encodings of `prompts` and, last, of `negative` (guidance's unconditional side) as a
        TextTable whose rows are the prompts (time_ids: SDXL's micro-conditions of an uncropped image of
        the training size)."""
        if not prompts:
            raise InvalidInput("a text-conditioned model samples from prompts: give at least one (--prompt)")
        time_ids = None
        if self.spec.text.get("micro"):
            lat = self.spec.latents or {}  # the images' side the latents were encoded at (data prepare --image-size)
            side = lat.get("image_size") or self.spec.image_size * int((lat.get("vae") or {}).get("downsample", 8))
            time_ids = torch.tensor([[side, side, 0, 0, side, side]], dtype=torch.float32).repeat(len(prompts), 1)
        if self.live is not None:  # the adapted encoders run in the network's forward on these prompts' ids
            from ..pretrained.text_lora import prompt_table

            return prompt_table(self.live, list(prompts), negative, time_ids).to(self.device)
        e = self.encoders.encode(list(prompts) + [negative])
        return table_of(e, [1] * len(prompts), time_ids).to(self.device)
