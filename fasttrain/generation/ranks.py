"""A large generated set split across ranks by image index, resumable: FID-50K as DiT's `sample_ddp.py`
and EDM2's `generate_images.py` run it, with EDM2's rule that every image has its own seed.

The set of n images is cut into chunks of `chunk` consecutive indices; chunk k belongs to rank k mod W.
Image i draws all its noise from its own generator seeded with seed + i (bundle.generate's
`first_image`; EDM2's generate_images.py gives image i the seed i), and its class from its index
(balanced: i mod classes, or the one `--label`), so the set does not depend on W; and since a chunk is
the same batch whatever W is, the images are equal bit for bit on 1 or 8 processes of one device type.
Uneven counts need no padding (DiT pads n up to a multiple of the global batch and drops the rest): the
last chunk is short and ranks may hold one chunk more.

Each finished chunk is one file in FOLDER/chunks/ (written under a temporary name, then renamed), holding
what the command's `sink` keeps of it: images as uint8 (`sample`), Inception features (`eval`). A rerun
with the same settings (FOLDER/sampling.json) skips the chunks on disk, so a killed run continues where
it stopped, on any number of ranks; other settings are refused, naming the key. FOLDER must be on a file
system every rank sees (as DiT's sample_ddp.py assumes): rank 0 reads the chunks back at the end.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidInput, WriteError

RECORD = "sampling.json"


@dataclass(frozen=True)
class SampleSettings:
    """What determines the set (with the checkpoint's step): recorded in FOLDER/sampling.json."""
    n: int
    seed: int = 0
    steps: int = 50
    solver: str = "ddim"
    spacing: str | None = None
    eta: float | None = None
    guidance: float = 1.0
    label: int | None = None  # None: balanced classes (i mod classes) for a conditional model
    ema: bool = True
    chunk: int = 256
    prompts: tuple[str, ...] | None = None  # text runs: image i is of prompts[i mod len] (None: the run's own)
    negative_prompt: str | None = None

    def __post_init__(self):
        if self.n < 1 or self.chunk < 1:
            raise InvalidInput(f"the number of samples and the chunk size must be >= 1, got {self.n} and {self.chunk}")


def chunks(n: int, chunk: int, rank: int = 0, world: int = 1) -> list[tuple[int, int, int]]:
    """(k, first index, end index) of the chunks rank `rank` of `world` generates."""
    return [(k, lo, min(lo + chunk, n)) for k, lo in enumerate(range(0, n, chunk)) if k % world == rank]


def labels_for(lo: int, hi: int, classes: int, label: int | None) -> torch.Tensor | None:
    """The classes of images lo..hi-1: none (unconditional), the one given, or balanced by index."""
    if not classes:
        return None
    return torch.full((hi - lo,), label) if label is not None else torch.arange(lo, hi) % classes


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1], [N, C, H, W] → uint8 [N, H, W, 3] (grey repeated), rounded as torchvision's
    save_image and DiT's sample_ddp.py round (127.5·x + 128, truncated): the PNGs and the .npz agree."""
    u = (x.detach().float().cpu().clamp(-1, 1) * 127.5 + 128).clamp(0, 255).to(torch.uint8)
    if u.shape[1] == 1:
        u = u.expand(-1, 3, -1, -1)
    return u.permute(0, 2, 3, 1).contiguous()


class ChunkStore:
    """FOLDER/chunks/NNNNNN.pt, one per finished chunk; a file is there only once it is complete."""

    def __init__(self, folder):
        self.dir = Path(folder) / "chunks"

    def path(self, k: int) -> Path:
        return self.dir / f"{k:06d}.pt"

    def done(self, k: int) -> bool:
        return self.path(k).is_file()

    def save(self, k: int, item: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{k:06d}.pt.tmp{os.getpid()}"
        torch.save(item, tmp)
        os.replace(tmp, self.path(k))  # atomic: a killed run leaves a stray .tmp, never a half chunk

    def load(self, k: int) -> dict:
        return torch.load(self.path(k), map_location="cpu", weights_only=True)

    def read_all(self, n: int, chunk: int):
        """Every chunk of the set in index order (rank 0 at the end); a missing one is an error."""
        for k, lo, hi in chunks(n, chunk):
            if not self.done(k):
                raise InvalidInput(f"chunk {self.path(k)} (images {lo}..{hi - 1}) is missing: run the command again "
                                   f"to generate it")
            yield self.load(k)


def record_of(settings: SampleSettings, bundle, extra: dict | None = None) -> dict:
    """sampling.json's content, as it reads back (tuples as lists)."""
    return json.loads(json.dumps({**asdict(settings), "step": int(bundle.step), **(extra or {})}))


def claim(folder, record: dict, holds: Callable[[Path], str | None] | None = None) -> int:
    """Make FOLDER this set's: a new folder gets sampling.json; one holding the same settings continues
    (returns the chunks already there); other settings, or samples without a record, are refused, one line
    naming the first differing key. `holds(folder)` describes samples already there ("--out X already holds
    samples (00000.png, 3 files)") or gives None. Every rank checks before rank 0 writes: all refuse alike."""
    folder = Path(folder)
    path = folder / RECORD
    there = (holds(folder) if holds is not None else None) or f"{folder} already holds samples"
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise InvalidInput(f"{path} is not a sampling record: choose an empty folder (nothing was overwritten)") \
                from None
        if old != record:
            diff = next((k for k in sorted(set(old) | set(record)) if old.get(k) != record.get(k)), "?")
            raise InvalidInput(f"{there} of other settings ({diff}: {old.get(diff)!r} there, {record.get(diff)!r} "
                               f"now): rerun with the same settings to continue, or choose an empty folder (nothing "
                               f"was overwritten)")
    elif holds is not None and holds(folder):
        raise InvalidInput(f"{there}: choose an empty folder (nothing was overwritten)")
    _barrier()
    if _rank() == 0 and not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, path)
    _barrier()
    store = ChunkStore(folder)
    return sum(store.done(k) for k, _, _ in chunks(record["n"], record["chunk"]))


def generate_set(bundle, s: SampleSettings, folder, sink: Callable[[torch.Tensor, int, dict], dict],
                 progress: bool = False) -> int:
    """Generate this rank's missing chunks of the set into FOLDER/chunks (claim first). `sink(x, lo,
    item)` turns a chunk's samples (first index lo) into what is kept; `item` already holds `labels`.
    Returns the number of images this rank generated now; ends at a barrier, so rank 0 may read all."""
    store = ChunkStore(folder)
    classes = bundle.spec.num_classes
    made = 0
    todo = [c for c in chunks(s.n, s.chunk, _rank(), _world()) if not store.done(c[0])]
    for k, lo, hi in todo:
        labels = labels_for(lo, hi, classes, s.label)
        x = bundle.generate(hi - lo, labels, seed=s.seed, steps=s.steps, solver=s.solver, guidance=s.guidance,
                            ema=s.ema, eta=s.eta, spacing=s.spacing, first_image=lo, chunk=max(s.chunk, hi - lo),
                            progress=progress, **_prompts(s))
        item = {"lo": lo, "hi": hi, "labels": labels}
        item.update(sink(x, lo, item))
        store.save(k, item)
        made += hi - lo
    _barrier()
    return made


def _prompts(s: SampleSettings) -> dict:
    """generate()'s prompt arguments of a text run's settings (none: the run's own sample.prompts)."""
    out = {} if s.prompts is None else {"prompts": list(s.prompts)}
    return out if s.negative_prompt is None else {**out, "negative_prompt": s.negative_prompt}


def write_adm_npz(path, items, n: int, shape_hwc: tuple[int, int, int], classes: int) -> Path:
    """ADM's evaluation-suite layout (guided-diffusion evaluations/evaluator.py, and DiT's sample_ddp.py):
    arr_0 uint8 [N, H, W, 3]; arr_1 int64 [N] the class labels of a conditional model. Streamed chunk by
    chunk into the (uncompressed, zip64) archive, so 50K images never sit in memory at once."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        _write_npz(tmp, items, n, shape_hwc, classes)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, a folder gone read-only: no partial .npz is left
        tmp.unlink(missing_ok=True)
        raise WriteError(f"--npz {path}: writing failed ({e.strerror or e}); nothing was written (the samples "
                         f"are kept: run the command again to write it)") from None
    return path


def _write_npz(tmp: Path, items, n: int, shape_hwc: tuple[int, int, int], classes: int) -> None:
    import zipfile

    labels = []
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open("arr_0.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                                                      "fortran_order": False, "shape": (n, *shape_hwc)})
            for item in items:
                f.write(item["images"].numpy().tobytes())
                if classes:
                    labels.append(item["labels"].numpy().astype(np.int64))
        if classes:
            with zf.open("arr_1.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.concatenate(labels))


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()
