"""What a batch conditions the network on, and its dropout for classifier-free guidance (Ho & Salimans
2022, §3.2: the conditional and the unconditional model are one network, trained by replacing the
condition with a null condition at random).

The step (step.py) hands every micro-batch's condition to its `conditioning` part before the objective
sees it: `ClassLabels` replaces a class label by the null label `num_classes` with probability p,
`Unconditional` gives None (the data's labels are ignored). Each draws from its own generator (seeds.py:
"labels", per rank), so that how many random numbers the timestep sampler takes does not change which
labels are dropped, and the reverse. Another kind of condition (text: per-token states, a mask, a pooled
vector, micro-conditions) is `TextCaptions`, with the same call (below).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .errors import InvalidInput


class Unconditional:
    """The network is not conditioned: whatever labels the data carry, the step passes None."""

    def __call__(self, y: torch.Tensor | None) -> None:
        return None


class ClassLabels:
    """Class labels with dropout to the null label `num_classes` (p = model.label_dropout)."""

    def __init__(self, num_classes: int, p: float, generator: torch.Generator):
        self.num_classes, self.p, self.generator = int(num_classes), float(p), generator

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        drop = torch.rand(y.shape, generator=self.generator, device=y.device) < self.p
        return torch.where(drop, torch.full_like(y, self.num_classes), y)


def for_data(spec, label_dropout: float, generator: torch.Generator, table=None, caption_dropout: float = 0.0,
             keep_tokens: int | None = None):
    """The conditioning of a run on data `spec` (bundle.DataSpec): what its data kind declares it
    conditions on (data/kinds.py, `Traits.conditioning`); captions where the data are captioned (`table`:
    their cached encodings), class labels where the run has classes (0 when the model is not
    class-conditional), else none. `keep_tokens` (not None): the captions' tags are shuffled, that many kept
    in place (data.shuffle_caption; `table` a live one, pretrained/text_lora.py)."""
    if spec.traits.conditioning == "text":
        return TextCaptions(table, caption_dropout, generator, keep_tokens)
    if spec.traits.conditioning == "class" and spec.num_classes:
        return ClassLabels(spec.num_classes, label_dropout, generator)
    return Unconditional()


# -- text -----------------------------------------------------------------------------------------------
# A text run's batches carry, in place of a class label, the index of the caption GROUP of each image (an
# image's captions in a captioned folder; a class's phrasings in the digits demo). Its condition stays one
# Long per sample all the way through the step: after dropout it is the ROW of the chosen caption's cached
# encoding in the run's `TextTable`, plus `rows` when the caption was dropped (then the states, mask and
# pooled vector are the empty prompt's, and the micro-conditions still the image's own row's, as diffusers'
# SDXL script keeps time_ids when it empties a prompt). The network gathers the encodings from the table
# (`TextTable.gather`). Because the condition is a Long tensor, everything that carries labels (look-ahead
# probes, the adaptive sampler's batches, the interference diagnostic, CUDA graphs) carries it unchanged.


@dataclass
class TextTable:
    """Cached text encodings on the training device: `states` [N, L, D] (per-token hidden states), `mask`
    [N, L] (the tokenizer's attention mask), `pooled` [N, P] (SDXL, SD3) or None, `time_ids` [N, 6]
    (SDXL's original size, crop top-left, target size per row) or None; `empty` the row of the empty
    prompt ("" encoded by the same encoders: the unconditional model, Ho & Salimans 2022); `offsets`,
    `counts` [G] the rows of each caption group (an image's alternative captions). `per_batch`: the rows
    are those of the step's batches only, rewritten in place as batches arrive (data/latent_shards.py:
    captioned shards carry their encodings), so a code is valid within its own step alone."""
    states: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None
    time_ids: torch.Tensor | None
    empty: int
    offsets: torch.Tensor
    counts: torch.Tensor
    per_batch: bool = False

    @property
    def rows(self) -> int:
        return self.states.shape[0]

    def to(self, device) -> TextTable:
        mv = (lambda t: None if t is None else t.to(device))
        return TextTable(mv(self.states), mv(self.mask), mv(self.pooled), mv(self.time_ids), self.empty,
                         mv(self.offsets), mv(self.counts), self.per_batch)

    def gather(self, code: torch.Tensor | None, batch: int, dtype: torch.dtype) -> dict:
        """The network's text inputs for condition codes `code` [B] (None: the empty prompt for all `batch`):
        encoder_hidden_states, encoder_attention_mask, pooled and time_ids, in `dtype`."""
        n = self.rows
        if code is None:
            code = torch.full((batch,), self.empty + n, dtype=torch.long, device=self.states.device)
        row = code % n
        text = torch.where(code >= n, torch.full_like(code, self.empty), row)
        out = {"states": self.states[text].to(dtype), "mask": self.mask[text]}
        out["pooled"] = None if self.pooled is None else self.pooled[text].to(dtype)
        out["time_ids"] = None if self.time_ids is None else self.time_ids[row].to(dtype)
        return out


class TextCaptions:
    """Caption groups → condition codes: one caption drawn per read among the group's alternatives
    (sd-scripts: several lines of a caption file, one per epoch), dropped to the empty prompt with
    probability p (`data.caption_dropout`; diffusers' proportion_empty_prompts, sd-scripts'
    caption_dropout_rate). Both draws come from the run's "labels" generator (seeds.py). With `keep_tokens`
    (data.shuffle_caption; a live table of token ids, pretrained/text_lora.py), one more draw from it seeds
    each drawn caption's tag order, and the table's rows are rewritten with the shuffled captions' ids (a
    host round trip per micro-batch: such a step is not captured in a CUDA graph)."""

    def __init__(self, table: TextTable, p: float, generator: torch.Generator, keep_tokens: int | None = None):
        self.offsets, self.counts, self.rows = table.offsets, table.counts, table.rows
        self.p, self.generator = float(p), generator
        self.table, self.keep_tokens = table, keep_tokens

    def __call__(self, group: torch.Tensor) -> torch.Tensor:
        u = torch.rand((2,) + group.shape, generator=self.generator, device=group.device)
        counts = self.counts[group]
        row = self.offsets[group] + (u[0] * counts).long().clamp_max(counts - 1)
        if self.keep_tokens is not None:
            seeds = torch.randint(0, 2**62, group.shape, generator=self.generator, device=group.device)
            self.table.shuffle(row.tolist(), seeds.tolist(), self.keep_tokens)
        return torch.where(u[1] < self.p, row + self.rows, row)


def attach(net: torch.nn.Module, table: TextTable | None) -> TextTable | None:
    """Give the text-conditioned backbone inside `net` the table it gathers from; returns the one it had."""
    for m in net.modules():
        if hasattr(m, "text_table"):
            old, m.text_table = m.text_table, table
            return old
    raise InvalidInput("this network takes no text condition (model.name=diffusers with a UNet2DConditionModel)")


@contextlib.contextmanager
def using(net: torch.nn.Module, table: TextTable):
    """`net` gathers from `table` inside the block (sampling with prompts), its own table afterwards."""
    old = attach(net, table)
    try:
        yield
    finally:
        attach(net, old)
