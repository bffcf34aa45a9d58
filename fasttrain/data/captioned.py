"""Captioned data kinds: their batches carry each image's caption GROUP (its alternative captions), and
their `DataInfo.text_table` the cached encodings the network gathers (conditioning.py), and `DataInfo.captions`
the captions' text, which a text-encoder LoRA run encodes again in every step (pretrained/text_lora.py);
otherwise training never runs a text encoder.

  captioned_latents  a latents folder written by `fasttrain data prepare IMAGES --vae PIPE --text-encoders
                     PIPE` (encode.py for the latents, `encode_captions` here for the text): every caption
                     of every image encoded once, stored in fp16 in `text-embeddings.pt` beside the
                     latents, with the encoders' identity in the manifest's "text" section.
  captioned_digits   the CPU demo (preset digits-text): sklearn's digits, each class with several
                     phrasings ("a handwritten seven", "the digit seven", ...), encoded by a tiny CLIP text
                     encoder built from the phrasings' words with fixed random weights (text_encoders.tiny_clip)
                     and saved in a cache folder, so `fasttrain sample --prompt` can load it again.
The run's text record (`DataInfo.text`, then the checkpoint's data spec) holds the encoders' identity and
the shapes the network is built for: width, length, pooled width, micro-conditions.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..conditioning import TextTable
from ..errors import DataError
from .builtin import Digits, digits
from .kinds import DataInfo, Placement, Traits, register
from .latent_folder import LatentFolder
from .manifest import MANIFEST
from .memory import MemoryStream

EMBEDDINGS = "text-embeddings.pt"


# -- the table and the record ----------------------------------------------------------------------------
def table_of(enc: dict, counts: list[int], time_ids: torch.Tensor | None = None) -> TextTable:
    """A TextTable from the encodings of every caption (group by group) followed by the empty prompt's."""
    n = sum(counts)
    c = torch.tensor(counts, dtype=torch.long)
    offsets = torch.cumsum(c, 0) - c
    rows_time = None
    if time_ids is not None:  # one per group → one per row (and the empty row's: zeros, never read)
        rows_time = torch.cat([time_ids.float().repeat_interleave(c, 0), torch.zeros(1, time_ids.shape[1])])
    return TextTable(enc["states"], enc["mask"].bool(), enc["pooled"], rows_time, n, offsets, c)


def record_of(identity: dict, enc: dict, micro: bool, prompts: list[str]) -> dict:
    s = enc["states"]
    return {"encoders": identity, "family": identity["family"], "length": int(s.shape[1]), "width": int(s.shape[2]),
            "pooled": None if enc["pooled"] is None else int(enc["pooled"].shape[1]), "micro": micro,
            "prompts": prompts}


# -- prepare: caption encodings beside the latents --------------------------------------------------------
def _time_ids(root: Path, files: list[str], image_size: int) -> torch.Tensor:
    """SDXL's micro-conditions per image (Podell et al. 2023, §2.2): original (h, w), the top-left of the
    centre crop in the resized image, the target (h, w), as diffusers' train_text_to_image_sdxl.py."""
    from PIL import Image

    out = []
    for rel in files:
        with Image.open(root / rel) as im:
            w, h = im.size
        scale = image_size / min(w, h)
        rw, rh = round(w * scale), round(h * scale)
        out.append([h, w, round((rh - image_size) / 2), round((rw - image_size) / 2), image_size, image_size])
    return torch.tensor(out, dtype=torch.float32)


def caption_job(image_manifest: dict, folder: str, clip_skip: int | None = None, column: str = "text",
                allow_empty: bool = False, device=None, prompt: str | None = None) -> tuple[list[list[str]], object]:
    """(every image's captions, the loaded text encoders): what `encode_captions` needs, read and checked
    before anything is encoded or written (a missing caption or a damaged encoder folder is one line, and
    no latents are left without their captions). `prompt`: every image's one caption instead of its
    caption files (diffusers' DreamBooth --instance_prompt / --class_prompt; data/prior.py)."""
    from ..pretrained.text_encoders import TextEncoders
    from .captions import captions_for

    files = [str(rel) for rel, _ in image_manifest["files"]]
    if prompt is not None:
        caps = [[prompt] for _ in files]
    else:
        caps = captions_for(Path(image_manifest["root"]), files, column, allow_empty)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return caps, TextEncoders.load(folder, clip_skip, device)


def encode_captions(image_manifest: dict, out: str | Path, folder: str, clip_skip: int | None = None,
                    column: str = "text", allow_empty: bool = False, image_size: int = 256, device=None,
                    job=None) -> dict:
    """Encode every caption of the manifest's images (their order is the latents manifest's) with the
    pipeline folder's text encoders (`job`: `caption_job`'s, when the caller checked them first); write
    `text-embeddings.pt` (fp16) and the "text" section of the latents manifest; return that section."""
    root, out = Path(image_manifest["root"]), Path(out)
    files = [str(rel) for rel, _ in image_manifest["files"]]
    caps, enc = job or caption_job(image_manifest, folder, clip_skip, column, allow_empty, device)
    ident = enc.identity()
    mpath = out / MANIFEST
    manifest = json.loads(mpath.read_text())
    old = None
    if (out / EMBEDDINGS).is_file():  # an earlier pass: its encoders must be these
        old = json.loads(torch.load(out / EMBEDDINGS, weights_only=True)["encoders"])
    if old and (old.get("sha256"), old.get("clip_skip")) != (ident["sha256"], ident["clip_skip"]):
        raise DataError(f"--latents-out {out} holds text embeddings of other text encoders ({old.get('path')}): "
                        f"choose another folder or delete {EMBEDDINGS}")
    flat = [c for group in caps for c in group] + [""]
    e = enc.encode(flat)
    micro = enc.family == "sdxl"
    time_ids = _time_ids(root, files, image_size) if micro else None
    pooled = None if e["pooled"] is None else e["pooled"].half()
    data = {"states": e["states"].half(), "mask": e["mask"], "pooled": pooled,
            "counts": torch.tensor([len(c) for c in caps]), "time_ids": time_ids, "encoders": json.dumps(ident),
            "captions": json.dumps(caps)}  # their text: text-encoder LoRA encodes them again in every step
    tmp = out / f".{EMBEDDINGS}.{os.getpid()}.tmp"
    torch.save({k: v for k, v in data.items() if v is not None}, tmp)
    os.replace(tmp, out / EMBEDDINGS)  # whole or absent: a rerun encodes again
    section = {**record_of(ident, e, micro, [c[0] for c in caps[:10]]), "captions": len(flat) - 1,
               "truncated": enc.truncated, "column": column}
    manifest["text"] = section
    mpath.write_text(json.dumps(manifest, indent=1))
    return section


# -- the kinds -----------------------------------------------------------------------------------------------
@register("captioned_latents")
class CaptionedLatents(LatentFolder):
    traits = Traits(images=True, pixels=False, resident=False, needs_root=True, latents=True, sized_by_config=False,
                    conditioning="text")

    prior = True

    def check(self, d) -> None:
        from .prior import check as check_prior

        super().check(d)
        check_prior(d)

    def build(self, d, at: Placement, backend: str):
        from .streamed import check_folder_args, folder_manifest

        check_folder_args(d, self.name)
        m = folder_manifest(d, at)
        section, file = m.get("text"), Path(d.root) / EMBEDDINGS
        if not section or not file.is_file():
            raise DataError(f"{d.root} holds no caption encodings: run `fasttrain data prepare IMAGES --vae PIPE "
                            f"--text-encoders PIPE --latents-out {d.root}`")
        saved = torch.load(file, weights_only=True)
        counts = saved["counts"]
        if len(counts) != len(m["files"]):
            raise DataError(f"{file} encodes {len(counts)} images, {d.root} holds {len(m['files'])}: run "
                            f"`fasttrain data prepare` again")
        # each image's label is its own index: its caption group (conditioning.TextCaptions)
        indexed = {**m, "files": [[rel, i] for i, (rel, _) in enumerate(m["files"])], "classes": []}
        if d.prior.root is not None:  # DreamBooth: paired with class latents (prior.py)
            from .prior import build as paired

            stream, info, saved = paired(self, d, at, indexed, saved, EMBEDDINGS)
            counts = saved["counts"]
        else:
            stream, info = super().build_from(d, at, backend, indexed)
        enc = {"states": saved["states"], "mask": saved["mask"], "pooled": saved.get("pooled")}
        info.text_table = table_of(enc, counts.tolist(), saved.get("time_ids"))
        info.captions = json.loads(saved["captions"]) if "captions" in saved else None  # older folders: none
        info.text = {k: section[k] for k in ("encoders", "family", "length", "width", "pooled", "micro", "prompts")}
        info.num_classes, info.class_names = 0, None
        return stream, info


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = ("a handwritten {}", "the digit {}", "a drawing of a {}", "number {}")


def digit_captions() -> list[list[str]]:
    """Every class's phrasings; the first ("a handwritten seven") is the one evaluation prompts with."""
    return [[p.format(w) for p in PHRASINGS] for w in DIGIT_WORDS]


def digits_encoder_folder() -> Path:
    """Where the demo's tiny text encoder is kept ($XDG_CACHE_HOME or ~/.cache, fasttrain/digits-text-clip)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fasttrain" / "digits-text-clip-v1"


def digits_encoder(folder: Path | None = None) -> Path:
    """The demo's text encoder folder, built once (seeded: the same weights wherever it is built)."""
    from ..pretrained.text_encoders import tiny_clip

    folder = Path(folder or digits_encoder_folder())
    if not (folder / "text_encoder" / "config.json").is_file():
        words = sorted({w for group in digit_captions() for c in group for w in c.split()})
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
        tiny_clip(tmp, words, width=32, layers=2, heads=2, max_length=8, seed=0)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process built it first
            pass
        print(f"fasttrain: built the digits-text demo's tiny text encoder in {folder}", file=sys.stderr)
    return folder


@register("captioned_digits")
class CaptionedDigits(Digits):
    traits = Traits(images=True, pixels=True, resident=True, extractor="fasttrain-digits", conditioning="text")

    def text_encoders(self, record: dict) -> str:
        return str(digits_encoder(Path(record["path"])))  # the demo's: built again where it was if it is gone

    def build(self, d, at: Placement, backend: str):
        from ..pretrained.text_encoders import TextEncoders

        x, y = digits(d.image_size, split=at.split, holdout=d.holdout, seed=0)
        caps = digit_captions()
        enc = TextEncoders.load(digits_encoder(d.root and Path(d.root)))
        e = enc.encode([c for group in caps for c in group] + [""])
        info = DataInfo(1, d.image_size, 0, len(x))
        info.text_table = table_of(e, [len(c) for c in caps])
        info.text = record_of(enc.identity(), e, False, [g[0] for g in caps])
        info.captions = caps
        return MemoryStream(x, y, d.batch_size, at.seed, at.device, at.rank, at.world_size), info
