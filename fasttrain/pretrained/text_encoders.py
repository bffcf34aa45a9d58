"""Text encoders of the Stable Diffusion family, loaded from a local pipeline folder through `transformers`
(never downloaded), and the prompt → per-token states / mask / pooled vector their pipelines compute.

    enc = TextEncoders.load("sd-pipeline", clip_skip=None)     # tokenizer/, text_encoder/ [, _2, _3]
    out = enc.encode(["a photo of a cat", ""])                 # {"states", "mask", "pooled"} on the CPU
    enc.identity()                                             # what a cache and a checkpoint record

Families, told apart by the subfolders a pipeline folder holds (diffusers' pipelines' `encode_prompt`):
  sd1   tokenizer/ + text_encoder/ (CLIPTextModel; SD 1.x and 2.x). Without clip_skip the last hidden state
        (final layer norm applied); with clip_skip k, hidden_states[-(k+1)] through the final layer norm
        (StableDiffusionPipeline.encode_prompt).
  sdxl  the pair: CLIPTextModel + CLIPTextModelWithProjection. Each one's hidden_states[-(k+2)] (k = clip_skip,
        0 without: the penultimate layer, no final norm), concatenated on features; pooled = the second's
        text_embeds (StableDiffusionXLPipeline.encode_prompt).
  sd3   CLIP-L + CLIP-G (both with projection) as SDXL, their states concatenated and zero-padded to T5's width,
        then T5's last hidden state appended along the sequence; pooled = both CLIP text_embeds concatenated
        (StableDiffusion3Pipeline.encode_prompt). Without text_encoder_3, T5's part is zeros, as there.
  flux  text_encoder/ (CLIPTextModel: its pooled output only) + text_encoder_2/ (T5EncoderModel): states = T5's
        last hidden state at 512 tokens, pooled = CLIP's pooler_output (FluxPipeline.encode_prompt; its
        max_sequence_length default 512, diffusers' train_dreambooth_lora_flux.py --max_sequence_length 512).
Prompts longer than a tokenizer's `model_max_length` are truncated (as the pipelines do), counted, and
warned about once per encoder set. `tiny_clip` builds a small CLIP tokenizer + encoder from a word list
(tests, the digits-text demo: no weights can be downloaded here).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..errors import DataError, InvalidInput, MissingDependency, MissingFile
from .model_folders import TRANSFORMERS_WEIGHT_FILES, load_model

FAMILIES = ("sd1", "sdxl", "sd3", "flux")
T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default
FLUX_T5_LENGTH = 512  # FluxPipeline's max_sequence_length default


def transformers():
    try:
        import transformers as module
    except ImportError:
        raise MissingDependency("text encoders need the optional package transformers "
                                "(pip install 'fasttrain[text]')") from None
    module.logging.set_verbosity_error()
    module.utils.logging.disable_progress_bar()
    return module


def family_of(folder: str | Path) -> str:
    """Which family a pipeline folder's text encoders are (module docstring), or a one-line error; a
    folder whose model_index.json names an encoder it does not hold is refused (`declared`)."""
    root = Path(folder)
    if not root.is_dir():
        raise MissingFile(f"text encoder folder {str(folder)!r} does not exist")
    if not (root / "text_encoder" / "config.json").is_file() or not (root / "tokenizer").is_dir():
        raise MissingFile(f"{root} holds no text encoder (a pipeline folder with tokenizer/ and text_encoder/)")
    declared(root)
    if (root / "text_encoder_3").is_dir() or (root / "tokenizer_3").is_dir():
        return "sd3"
    if (root / "text_encoder_2").is_dir():
        if _class(root / "text_encoder_2") == "T5EncoderModel":  # Flux: CLIP-L (pooled) + T5 (states)
            return "flux"
        return "sd3" if _class(root / "text_encoder") == "CLIPTextModelWithProjection" else "sdxl"
    return "sd1"


# the encoders each pipeline class needs (diffusers' StableDiffusionXLPipeline and StableDiffusion3Pipeline
# take them as required components; SD3's T5 may be dropped: model_index.json then says [null, null])
NEEDS = {"StableDiffusionXLPipeline": ("_2",), "StableDiffusionXLImg2ImgPipeline": ("_2",),
         "StableDiffusion3Pipeline": ("_2", "_3")}


def declared(root: Path) -> None:
    """Refuse a pipeline folder missing a text encoder or tokenizer its model_index.json names, or that its
    pipeline class needs (SDXL's text_encoder_2, SD3's text_encoder_2 and _3): the family would be guessed
    from what is left (an SDXL folder without its second encoder encodes as SD 1.x, at the wrong width)."""
    from .model_folders import read_config

    if not (root / "model_index.json").is_file():
        return
    index = read_config(root, "model_index.json")
    cls = index.get("_class_name")
    for sub in ("_2", "_3"):
        entry = index.get(f"text_encoder{sub}")
        named = isinstance(entry, list) and len(entry) == 2 and entry[1] is not None
        needed = sub in NEEDS.get(cls, ()) and (entry is None or named)  # [null, null]: dropped on purpose
        for part in (f"text_encoder{sub}", f"tokenizer{sub}"):
            if (named or needed) and not (root / part).is_dir():
                why = f"its model_index.json names {part}" if named else f"{cls} needs {part}"
                raise MissingFile(f"{root} holds no {part}/ and {why}: the pipeline folder is incomplete (copy it "
                                  f"again)")


def _tokenizer(tf, root: Path, sub: str):
    """A pipeline's tokenizer subfolder; a damaged one (a cut-off vocab or tokenizer.json, a missing file)
    is one line naming it."""
    try:
        return tf.AutoTokenizer.from_pretrained(str(root), subfolder=sub, local_files_only=True)
    except Exception as e:  # tokenizers and transformers raise many types for a damaged folder
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise DataError(f"{root / sub}: the tokenizer cannot be loaded ({type(e).__name__}: {first[:120]}); the "
                        f"folder is damaged (copy it again)") from None


def _check_vocabulary(tok, enc, root: Path, sub: str) -> None:
    """The tokenizer's ids must index the encoder's embedding table: a tokenizer of another model (more
    tokens than rows) would fail on the first prompt with an index error deep inside torch."""
    rows = enc.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise DataError(f"{root}/tokenizer{sub} has {len(tok)} tokens but text_encoder{sub}'s embedding table "
                        f"{rows} rows: the tokenizer is not this encoder's (ids beyond its table); use the pipeline's "
                        f"own tokenizer")


def _class(path: Path) -> str:
    try:
        return (json.loads((path / "config.json").read_text()).get("architectures") or [""])[0]
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path / 'config.json'} cannot be read ({type(e).__name__})") from None


def _hash_folder(path: Path) -> str:
    """sha256 of a subfolder's config and weight files (two fine-tunes of one encoder share a config)."""
    from . import file_hashes

    return file_hashes.sha256(sorted(p for pat in ("config.json", "*.safetensors", "*.bin") for p in path.glob(pat)),
                              names=True)


class TextEncoders:
    """A family's tokenizers and frozen encoders (eval mode, no gradients), and its prompt encoding."""

    def __init__(self, family: str, folder: Path, tokenizers: list, encoders: list, clip_skip: int | None,
                 device="cpu"):
        self.family, self.folder, self.tokenizers, self.encoders = family, folder, tokenizers, encoders
        self.clip_skip, self.device, self.warned, self.truncated = clip_skip, torch.device(device), False, 0
        self.t5_width: int | None = None  # SD3 without T5: the transformer's joint_attention_dim (the caller's)

    @classmethod
    def load(cls, folder: str | Path, clip_skip: int | None = None, device="cpu") -> TextEncoders:
        tf = transformers()
        root = Path(folder)
        family = family_of(root)
        if clip_skip is not None and clip_skip < 0:
            raise InvalidInput(f"clip_skip must be >= 0, got {clip_skip}")
        subs = {"sd1": ("", ), "sdxl": ("", "_2"), "sd3": ("", "_2", "_3"), "flux": ("", "_2")}[family]
        classes = {"sd1": (tf.CLIPTextModel,), "sdxl": (tf.CLIPTextModel, tf.CLIPTextModelWithProjection),
                   "sd3": (tf.CLIPTextModelWithProjection, tf.CLIPTextModelWithProjection, tf.T5EncoderModel),
                   "flux": (tf.CLIPTextModel, tf.T5EncoderModel)}[family]
        toks, encs = [], []
        for sub, klass in zip(subs, classes):
            if sub == "_3" and not (root / "text_encoder_3").is_dir():
                toks.append(None)
                encs.append(None)  # SD3 without T5: zeros in its place (StableDiffusion3Pipeline)
                continue
            tok = _tokenizer(tf, root, f"tokenizer{sub}")
            enc = load_model(klass, root, f"text_encoder{sub}", what="text encoder",
                             weight_files=TRANSFORMERS_WEIGHT_FILES)
            _check_vocabulary(tok, enc, root, sub)
            toks.append(tok)
            encs.append(enc.eval().requires_grad_(False).to(device))
        return cls(family, root, toks, encs, clip_skip, device)

    # -- identity --------------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What a cache and a checkpoint record: folder, family, clip_skip and each encoder's hash."""
        subs = [f"text_encoder{s}" for s in ("", "_2", "_3")][:len(self.encoders)]
        return {"path": str(self.folder.resolve()), "family": self.family, "clip_skip": self.clip_skip,
                "sha256": {s: _hash_folder(self.folder / s) for s, e in zip(subs, self.encoders) if e is not None}}

    def check(self, record: dict, what: str) -> None:
        """Refuse encoders that are not the ones `record` (an identity) names: one line saying which part."""
        mine = self.identity()
        for key in ("family", "clip_skip"):
            if record.get(key) != mine[key]:
                raise DataError(f"{self.folder}: its text encoders are not those of {what} ({key} {mine[key]!r}, "
                                f"recorded {record.get(key)!r})")
        for sub, h in (record.get("sha256") or {}).items():
            if mine["sha256"].get(sub) != h:
                raise DataError(f"{self.folder}: {sub} is not the text encoder of {what} (its weights differ)")

    # -- encoding --------------------------------------------------------------------------------------
    def _ids(self, tok, prompts: list[str], length: int | None = None):
        length = length or tok.model_max_length
        full = tok(prompts, truncation=False, add_special_tokens=True).input_ids
        long = sum(len(ids) > length for ids in full)
        if long:
            self.truncated += long
            if not self.warned:
                self.warned = True
                print(f"fasttrain: {long} prompt(s) are longer than the tokenizer's {length} tokens and are truncated "
                      f"(e.g. {prompts[next(i for i, ids in enumerate(full) if len(ids) > length)][:60]!r})",
                      file=sys.stderr)
        out = tok(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        return out.input_ids.to(self.device), out.attention_mask.to(self.device)

    def _clip(self, i: int, prompts: list[str], penultimate: bool):
        ids, mask = self._ids(self.tokenizers[i], prompts)
        states, pooled = clip_states(self.encoders[i], ids, penultimate, self.clip_skip)
        return states, mask, pooled

    def clip_ids(self, prompts: list[str]) -> list[torch.Tensor]:
        """The token ids [N, L] of `prompts` for each CLIP encoder of an SD 1.x/2.x or SDXL family (what
        `states_of` reads; text_lora.py's live tables hold them)."""
        return [self._ids(tok, prompts)[0] for tok in self.tokenizers]

    def states_of(self, ids: list[torch.Tensor], encoders=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(states, pooled) of SD 1.x/2.x's or SDXL's CLIP encoders (`encoders`: these, or their adapted copies,
        text_lora.py) on token ids `ids` (`clip_ids`): the same operations as `encode`."""
        encoders = self.encoders if encoders is None else encoders
        if self.family == "sd1":
            return clip_states(encoders[0], ids[0], False, self.clip_skip)
        s1, _ = clip_states(encoders[0], ids[0], True, self.clip_skip)
        s2, p2 = clip_states(encoders[1], ids[1], True, self.clip_skip)
        return torch.cat([s1, s2], -1), p2

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 64) -> dict:
        """{"states" [N, L, D], "mask" [N, L] bool, "pooled" [N, P] or None} in float32 on the CPU."""
        parts = [self._encode(list(prompts[i:i + batch_size])) for i in range(0, len(prompts), batch_size)]
        pooled = None if parts[0]["pooled"] is None else torch.cat([p["pooled"] for p in parts])
        return {"states": torch.cat([p["states"] for p in parts]), "mask": torch.cat([p["mask"] for p in parts]),
                "pooled": pooled}

    def _encode(self, prompts: list[str]) -> dict:
        if self.family in ("sd1", "sdxl"):
            ids = [self._ids(tok, prompts) for tok in self.tokenizers]
            s, pooled = self.states_of([i for i, _ in ids])
            return {"states": s.float().cpu(), "mask": ids[0][1].bool().cpu(),
                    "pooled": None if pooled is None else pooled.float().cpu()}
        if self.family == "flux":  # FluxPipeline._get_clip_prompt_embeds (pooler_output), _get_t5_prompt_embeds
            ids, _ = self._ids(self.tokenizers[0], prompts)
            pooled = self.encoders[0](ids).pooler_output
            ids, mask = self._ids(self.tokenizers[1], prompts, FLUX_T5_LENGTH)
            states = self.encoders[1](ids)[0]
            return {"states": states.float().cpu(), "mask": mask.bool().cpu(), "pooled": pooled.float().cpu()}
        (s1, m1, p1), (s2, _, p2) = self._clip(0, prompts, True), self._clip(1, prompts, True)
        clip = torch.cat([s1, s2], -1)
        pooled = torch.cat([p1, p2], -1)
        if self.encoders[2] is None:
            width = clip.shape[-1] if self.t5_width is None else self.t5_width
            t5 = torch.zeros(len(prompts), T5_LENGTH, width, device=clip.device)
            t5_mask = torch.zeros(len(prompts), T5_LENGTH, dtype=torch.long, device=clip.device)
        else:
            ids, t5_mask = self._ids(self.tokenizers[2], prompts, T5_LENGTH)
            t5 = self.encoders[2](ids)[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        states = torch.cat([clip, t5], -2)
        return {"states": states.float().cpu(), "mask": torch.cat([m1, t5_mask], -1).bool().cpu(),
                "pooled": pooled.float().cpu()}


def clip_states(encoder, ids: torch.Tensor, penultimate: bool, clip_skip: int | None):
    """(states, pooled) of one CLIP encoder on token ids: SD 1.x/2.x's (not `penultimate`: the last hidden state,
    or with clip_skip k hidden_states[-(k+1)] through the final layer norm; no pooled vector) or SDXL's and SD3's
    (hidden_states[-(k+2)], no final norm; pooled = text_embeds of a CLIPTextModelWithProjection)."""
    out = encoder(ids, output_hidden_states=True)
    k = clip_skip or 0
    if not penultimate:  # SD 1.x/2.x
        if not k:
            return out[0], None
        norm = getattr(encoder, "text_model", encoder).final_layer_norm  # transformers 4 / 5
        return norm(out.hidden_states[-(k + 1)]), None
    pooled = out.text_embeds if hasattr(out, "text_embeds") else out[1]
    return out.hidden_states[-(k + 2)], pooled


def tiny_clip(folder: str | Path, words: list[str], width: int = 32, layers: int = 2, heads: int = 2,
              max_length: int = 16, projection: int | None = None, seed: int = 0, subfolder: str = "") -> Path:
    """A small CLIP tokenizer (byte-pair merges that spell each of `words`, single characters for the rest)
    and a randomly initialised CLIPTextModel (CLIPTextModelWithProjection with `projection`), saved as a
    pipeline's tokenizer{subfolder}/ and text_encoder{subfolder}/ under `folder`."""
    tf = transformers()
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,'-":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    merges: dict[tuple[str, str], None] = {}
    for w in words:
        toks = list(w[:-1]) + [w[-1] + "</w>"]
        while len(toks) > 1:
            merges[(toks[0], toks[1])] = None
            toks = [toks[0] + toks[1]] + toks[2:]
            vocab.setdefault(toks[0], len(vocab))
    root = Path(folder)
    tok = tf.CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=max_length)
    tok.save_pretrained(str(root / f"tokenizer{subfolder}"))
    cfg = tf.CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_length,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1, projection_dim=projection or width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (tf.CLIPTextModelWithProjection if projection else tf.CLIPTextModel)(cfg)
    model.save_pretrained(str(root / f"text_encoder{subfolder}"))
    return root
