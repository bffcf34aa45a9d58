"""Text-encoder LoRA for SD 1.x/2.x and SDXL runs (`model.lora.text_encoder=true`; diffusers'
train_dreambooth_lora[_sdxl].py --train_text_encoder, sd-scripts' train_network.py without
--network_train_unet_only), and the caption shuffling it makes possible (`data.shuffle_caption`,
`data.keep_tokens`; sd-scripts' --shuffle_caption / --keep_tokens).

    model.lora.rank=8 model.lora.text_encoder=true optim.text_encoder_lr=5e-5 data.shuffle_caption=true

The run's CLIP encoders (the ones its captions were encoded with at `data prepare`, from the recorded folder and
checked against the recorded hashes) get peft adapters on `model.lora.text_encoder_targets` (default q_proj,
k_proj, v_proj, out_proj, as diffusers' scripts), with the UNet's rank, alpha and dropout, and become a submodule of
the text-conditioned backbone (`LiveEncoders`, `backbone.text_encoders`): the optimizer (its own parameter group,
`optim.text_encoder_lr`), the EMA, checkpoints (the adapter only; the base is read from the folder), the frozen
base's dtype (lora.hold_base), autocast and FSDP (the backbone's root unit) treat it as part of the network.

The cached table of encodings is replaced by a `LiveTable` of token ids (every caption of every image, tokenized
once by the pipeline's tokenizers, and the empty prompt's), with the same condition codes (conditioning.py): the
backbone gathers a batch's ids and runs the adapted encoders in the step (text_encoders.TextEncoders.states_of,
the operations `data prepare` encoded the cache with: with a zero adapter the live states equal the cached ones,
to the cache's fp16). With `data.shuffle_caption`, every caption drawn is shuffled before it is encoded
(`shuffle_tags`: sd-scripts' process_caption), its order seeded by a draw from the caption draw's generator (the
run's "labels" stream, in the checkpoint: a resumed run shuffles as the uninterrupted one) and its row's ids
rewritten in place (an image twice in one micro-batch gets one order). Sampling and export encode prompts with the
adapted encoders (`prompt_table`; export merges them into stock text encoders, or writes their LoRA layers).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import DataError, InvalidInput

KEY = "model.lora.text_encoder"
FAMILIES = ("sd1", "sdxl")


def enabled(cfg) -> bool:
    return bool(cfg.model.lora.get("text_encoder", False)) and int(cfg.model.lora.rank) > 0


def shuffle_tags(caption: str, keep_tokens: int, rng: random.Random) -> str:
    """sd-scripts' process_caption with shuffle_caption (no keep_tokens_separator, tag dropout or token warm-up):
    the caption split at commas into stripped tags, the first `keep_tokens` kept in place, the rest shuffled by
    `rng`, joined with ", "."""
    tags = [t.strip() for t in caption.strip().split(",")]
    fixed, flex = tags[:keep_tokens], tags[keep_tokens:]
    rng.shuffle(flex)
    return ", ".join(fixed + flex)


class LiveEncoders(nn.Module):
    """The run's adapted CLIP encoders as a module of the network; `tokens` (not a module) tokenizes."""

    def __init__(self, encoders):
        super().__init__()
        from .text_encoders import TextEncoders

        self.encoders = nn.ModuleList(encoders.encoders)
        self.tokens = TextEncoders(encoders.family, encoders.folder, encoders.tokenizers, [], encoders.clip_skip)
        self.family = encoders.family

    def forward(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.tokens.states_of(ids, self.encoders)

    def text_encoders(self):
        """A text_encoders.TextEncoders over these encoders (export's encode_prompt check)."""
        from .text_encoders import TextEncoders

        t = self.tokens
        return TextEncoders(t.family, t.folder, t.tokenizers, list(self.encoders), t.clip_skip)


def live_of(net: nn.Module) -> LiveEncoders | None:
    return next((m for m in net.modules() if isinstance(m, LiveEncoders)), None)


@dataclass
class LiveTable:
    """conditioning.TextTable's rows as token ids for the live encoders: `ids` one [N, L] per tokenizer, `texts`
    the rows' captions (for the shuffle), `time_ids`, `empty`, `offsets`, `counts` as there."""
    ids: list
    time_ids: torch.Tensor | None
    empty: int
    offsets: torch.Tensor
    counts: torch.Tensor
    texts: list
    tokens: object
    per_batch: bool = False

    @property
    def rows(self) -> int:
        return self.ids[0].shape[0]

    def to(self, device) -> LiveTable:
        mv = (lambda t: None if t is None else t.to(device))
        return LiveTable([mv(i) for i in self.ids], mv(self.time_ids), self.empty, mv(self.offsets),
                         mv(self.counts), self.texts, self.tokens, self.per_batch)

    def gather(self, code: torch.Tensor | None, batch: int, dtype: torch.dtype) -> dict:
        """The ids of condition codes `code` (conditioning.TextTable.gather's codes) and their time_ids."""
        n = self.rows
        if code is None:
            code = torch.full((batch,), self.empty + n, dtype=torch.long, device=self.ids[0].device)
        row = code % n
        text = torch.where(code >= n, torch.full_like(code, self.empty), row)
        return {"ids": [i[text] for i in self.ids],
                "time_ids": None if self.time_ids is None else self.time_ids[row].to(dtype)}

    def shuffle(self, rows: list[int], seeds: list[int], keep_tokens: int) -> None:
        """Rewrite the ids of `rows` with their captions' tags shuffled (`shuffle_tags`, one seed per row)."""
        caps = [shuffle_tags(self.texts[r], keep_tokens, random.Random(s)) for r, s in zip(rows, seeds)]
        index = torch.tensor(rows, dtype=torch.long, device=self.ids[0].device)
        for table, new in zip(self.ids, self.tokens.clip_ids(caps)):
            table.index_copy_(0, index, new.to(table.device))


def table(live: LiveEncoders, captions: list[str], counts: list[int], time_ids: torch.Tensor | None,
          negative: str = "") -> LiveTable:
    """A LiveTable of `captions` (every group's, in order) and, last, the empty row (`negative`: "" in training,
    guidance's negative prompt when sampling); `time_ids` one row per row, the empty row's included."""
    c = torch.tensor(counts, dtype=torch.long)
    texts = list(captions) + [negative]
    return LiveTable(live.tokens.clip_ids(texts), time_ids, len(texts) - 1, torch.cumsum(c, 0) - c, c, texts,
                     live.tokens)


def run_table(net: nn.Module, cached, captions: list | None, where: str) -> LiveTable:
    """The training table of a text-encoder LoRA run from its data's cached table (`cached`: conditioning.TextTable,
    its groups and time_ids) and the captions' text (DataInfo.captions)."""
    if captions is None and getattr(cached, "per_batch", False):
        raise DataError(f"bad value for '{KEY}': True (captioned shards carry caption encodings, not the captions' "
                        f"text the live encoders read: train on a captioned_latents folder from `fasttrain data "
                        f"prepare`)")
    if captions is None:
        raise DataError(f"bad value for '{KEY}': True ({where} holds the caption encodings but not the captions' "
                        f"text the live encoders read: prepare it again with `fasttrain data prepare IMAGES --vae PIPE "
                        f"--text-encoders PIPE`)")
    flat = [c for group in captions for c in group]
    counts = [len(g) for g in captions]
    if counts != cached.counts.tolist():
        raise DataError(f"{where}: its captions ({len(flat)}) are not those of its encodings; prepare it again")
    return table(live_of(net), flat, counts, cached.time_ids)


def apply(net: nn.Module, cfg, spec) -> None:
    """Add the adapters to the run's text encoders and make them the backbone's `text_encoders` (module
    docstring); one line for a run it does not apply to."""
    from ..data import data_kind
    from . import lora
    from .text_encoders import TextEncoders

    lc = cfg.model.lora
    text = spec.text
    if text is None:
        raise InvalidInput(f"bad value for '{KEY}': True (the data are not captioned: there is no text encoder)")
    if text["family"] not in FAMILIES:
        raise InvalidInput(f"bad value for '{KEY}': True (text-encoder LoRA is for SD 1.x/2.x and SDXL's CLIP "
                           f"encoders; this run's are {text['family']}'s)")
    rec = text["encoders"]
    enc = TextEncoders.load(data_kind(spec.name).text_encoders(rec), rec.get("clip_skip"), "cpu")
    enc.check(rec, "this run's data")
    rank = int(lc.rank)
    targets = SimpleNamespace(rank=rank, target_modules=list(lc.text_encoder_targets))  # check_targets' view
    config = lora.peft().LoraConfig(r=rank, lora_alpha=float(lc.alpha if lc.alpha is not None else rank),
                                    lora_dropout=float(lc.dropout), init_lora_weights="gaussian",
                                    target_modules=list(lc.text_encoder_targets))
    for e in enc.encoders:
        try:
            lora.check_targets(e, targets)
        except InvalidInput as err:  # the UNet's key names in its message: the text encoders' instead
            raise InvalidInput(str(err).replace("model.lora.target_modules", "model.lora.text_encoder_targets")
                               .replace("of the network", "of the text encoder")) from None
        e.requires_grad_(False)
        lora.peft().inject_adapter_in_model(config, e)
    _freeze_unused(enc)
    backbone = getattr(net, "net", net)
    backbone.text_encoders = LiveEncoders(enc)


def _freeze_unused(enc) -> None:
    """Freeze the adapters of the layers whose output the run never reads (SD 1.x/2.x with clip_skip k: the last
    k layers; SDXL's first encoder: the last k + 1, as its states are the penultimate layer's and it gives no
    pooled vector): they get no gradient and no optimizer state, so they stay zero (B = 0), as in diffusers' and
    sd-scripts' runs, and the checkpoint's optimizer state covers every parameter that trains."""
    import re

    k = enc.clip_skip or 0
    for index, e in enumerate(enc.encoders):
        layers = e.config.num_hidden_layers
        used = layers - k if enc.family == "sd1" else layers - k - 1 if index == 0 else layers
        for name, p in e.named_parameters():
            m = re.search(r"encoder\.layers\.(\d+)\.", name)
            if "lora_" in name and m and int(m.group(1)) >= used:
                p.requires_grad_(False)


def parameter_groups(model: nn.Module, o) -> list:
    """The optimizer's parameter groups: the trainable parameters outside the text encoders at optim.lr, and,
    with text-encoder LoRA, its adapter at optim.text_encoder_lr (or optim.lr) marked `text_encoder`."""
    rest, te = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (te if "text_encoders." in name else rest).append(p)
    if not te:
        return rest
    lr = o.text_encoder_lr if o.get("text_encoder_lr") is not None else o.lr
    return [{"params": rest}, {"params": te, "lr": lr, "text_encoder": True}]


def prompt_table(live: LiveEncoders, prompts: list[str], negative: str, time_ids: torch.Tensor | None) -> LiveTable:
    """Sampling's prompt table for the adapted encoders (generation/prompts.RunPrompts.table's rows): the
    prompts, then `negative`; `time_ids` one row per prompt."""
    if time_ids is not None:
        time_ids = torch.cat([time_ids.float(), torch.zeros(1, time_ids.shape[1])])
    return table(live, list(prompts), [1] * len(prompts), time_ids, negative)


def adapter_state(encoder: nn.Module) -> dict:
    """peft's LoRA layers of an adapted text encoder (get_peft_model_state_dict: ...q_proj.lora_A.weight), the
    names diffusers' save_lora_weights takes as text_encoder_lora_layers (train_dreambooth_lora.py)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(encoder)


def adapter_config(encoder: nn.Module) -> dict:
    """The adapter's LoraConfig as a dict (the metadata diffusers keeps with the weights: rank, alpha)."""
    return encoder.peft_config["default"].to_dict()
