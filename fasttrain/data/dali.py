"""NVIDIA DALI pipelines (the `dali` data backend): image folders and .npy latent folders.

Decoding runs in DALI's worker threads: on a GPU machine images are decoded by nvJPEG (DALI's 'mixed' device) and
batches arrive on the GPU; without one the pipeline is CPU-only (`device_id=None`: DALI 2.4 treats
its old CPU_ONLY_DEVICE_ID as a GPU request). Order and sharding are explicit, so that they are exact
and resumable: each epoch is a permutation of the file list drawn from (seed, epoch); rank r of W
takes every W-th file of it (all ranks get the same count, the remainder is dropped); pipelines read
this rank's files in that order from the saved position, with `random_shuffle=False`; flips and
random crop positions are drawn per sample from (seed, epoch) too and fed through fn.external_source,
so a resumed run repeats them. The last batch of an epoch follows
`last_batch`: drop (training default), partial, or pad (repeat the last sample).

Images: fn.readers.file → fn.decoders.image (EXIF orientation applied, alpha dropped, 16-bit files
scaled to 8 bits: the values Pillow gives the torch backend, images.py) → fn.resize (shorter side) →
fn.crop_mirror_normalize (centre or random crop, random flip, [-1, 1], CHW). Latents: fn.readers.numpy,
with the labels from the manifest fed in the same order through fn.external_source (readers.numpy
has no labels).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, InvalidInput
from .order import Position, augment_table, epoch_order

LAST_BATCH = ("drop", "partial", "pad")


def available() -> bool:
    try:
        import nvidia.dali
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _batches(values: np.ndarray, batch_size: int, dtype):
    """Per-sample values as the batches an external_source feeds: padded like the reader pads its last
    batch (repeating the last sample)."""
    values = np.concatenate([values, np.repeat(values[-1:], -len(values) % batch_size, axis=0)])
    for i in range(0, len(values), batch_size):
        yield [np.asarray(v, dtype=dtype).reshape(-1) for v in values[i:i + batch_size]]


def _image_pipeline(root, files, labels, aug, batch_size, image_size, channels, num_threads, device_id,
                    random_crop: bool, flip: bool):
    """aug: [n, 3] per-sample (mirror, crop_x, crop_y), drawn from (seed, epoch) by the caller so
    that a resumed epoch repeats them exactly; sources that would be constant are left out."""
    from nvidia.dali import fn, pipeline_def, types

    gpu = device_id is not None

    def source(col, dtype):
        return fn.squeeze(fn.external_source(source=_batches(aug[:, col].astype(dtype), batch_size, dtype),
                                             batch=True), axes=0)

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id, prefetch_queue_depth=2)
    def pipe():
        data, y = fn.readers.file(file_root=root, files=files, labels=labels, random_shuffle=False,
                                  pad_last_batch=True, name="Reader")
        mirror = source(0, np.int32) if flip else 0
        px, py = (source(1, np.float32), source(2, np.float32)) if random_crop else (0.5, 0.5)
        img = fn.decoders.image(data, device='mixed' if gpu else "cpu",  # 'mixed': nvJPEG, host + GPU
                                output_type=types.RGB if channels == 3 else types.GRAY)
        img = fn.resize(img, resize_shorter=image_size, antialias=True)
        img = fn.crop_mirror_normalize(img, crop=(image_size, image_size), crop_pos_x=px, crop_pos_y=py,
                                       mirror=mirror, dtype=types.FLOAT, output_layout="CHW",
                                       mean=[127.5] * channels, std=[127.5] * channels)
        return img, (y.gpu() if gpu else y)

    return pipe()


def _latent_pipeline(root, files, labels, batch_size, num_threads, device_id):
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id)
    def pipe():
        x = fn.readers.numpy(file_root=root, files=files, random_shuffle=False, pad_last_batch=True, name="Reader")
        y = fn.external_source(source=_batches(np.asarray(labels), batch_size, np.int64), batch=True)
        if device_id is not None:
            x, y = x.gpu(), y.gpu()
        return x, y

    return pipe()


class DaliStream(Position):
    """Infinite stream of (x, labels) batches with `state_dict()` = (epoch, position in this rank's
    shard), the same interface and the same epoch-crossing semantics as the in-memory stream.

    A pipeline is built over a chunk of consecutive epochs (at least `chunk` files, cut to whole
    batches) so that pipeline construction stays off the hot path; `epoch_batches()` reads exactly one
    epoch with the `last_batch` policy instead."""

    def __init__(self, kind: str, root: str, files: list, batch_size: int, *, image_size: int = 0, channels: int = 3,
                 seed: int = 0, rank: int = 0, world_size: int = 1, device="cpu", num_threads: int = 2,
                 crop: str = "center", flip: bool = True, last_batch: str = "drop", chunk: int = 8192):
        if not available():
            raise InvalidInput("data.backend=dali needs NVIDIA DALI: pip install 'fasttrain[dali]'")
        if last_batch not in LAST_BATCH:
            raise ValueError(f"last_batch must be one of {', '.join(LAST_BATCH)}, got {last_batch!r}")
        if kind not in ("images", "latents"):
            raise ValueError(f"unknown DALI data kind {kind!r}")
        self.kind, self.root, self.files = kind, str(root), [(str(f), int(y)) for f, y in files]
        self.per_rank = len(self.files) // world_size
        if self.per_rank < batch_size:
            raise DataError(f"data.batch_size {batch_size} is larger than one rank's shard "
                             f"({len(self.files)} files over {world_size} ranks)")
        self.batch_size, self.image_size, self.channels = batch_size, image_size, channels
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = torch.device(device)
        self.num_threads, self.crop, self.flip, self.last_batch, self.chunk = num_threads, crop, flip, last_batch, chunk
        self.epoch, self.pos, self._it = 0, 0, None

    def epoch_files(self, epoch: int) -> list[tuple[str, int]]:
        return [self.files[i] for i in epoch_order(len(self.files), self.seed, epoch, self.rank,
                                                   self.world_size).tolist()]

    def _augment(self, epoch: int) -> np.ndarray:
        return augment_table(self.per_rank, self.seed, epoch, self.rank, self.flip, self.crop == "random").numpy()

    def _pipeline(self, items: list[tuple[str, int]], aug: np.ndarray, policy: str):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        names, labels = [f for f, _ in items], [y for _, y in items]
        device_id = (self.device.index or 0) if self.device.type == "cuda" else None
        if self.kind == "images":
            pipe = _image_pipeline(self.root, names, labels, aug, self.batch_size, self.image_size, self.channels,
                                   self.num_threads, device_id, self.crop == "random", self.flip)
        else:
            pipe = _latent_pipeline(self.root, names, labels, self.batch_size, self.num_threads, device_id)
        p = {"drop": LastBatchPolicy.DROP, "partial": LastBatchPolicy.PARTIAL, "pad": LastBatchPolicy.FILL}[policy]
        return DALIGenericIterator(pipe, ["x", "y"], reader_name="Reader", last_batch_policy=p)

    def _convert(self, out):
        b = out[0]
        return b["x"].to(self.device), b["y"].view(-1).long().to(self.device)

    def _start_chunk(self):
        items, augs, epoch, pos = [], [], self.epoch, self.pos
        while len(items) < max(self.chunk, self.batch_size):
            items += self.epoch_files(epoch)[pos:]
            augs.append(self._augment(epoch)[pos:])
            epoch, pos = epoch + 1, 0
        keep = len(items) // self.batch_size * self.batch_size  # whole batches; the rest opens the next chunk
        self._it = self._pipeline(items[:keep], np.concatenate(augs)[:keep], "drop")

    def __iter__(self):
        return self

    def __next__(self):
        for _ in range(2):
            try:
                if self._it is None:
                    self._start_chunk()  # DALI runs its first batch in the iterator's constructor
                x, y = self._convert(next(self._it))
            except StopIteration:
                self._it = None
                continue
            except RuntimeError as e:  # DALI reports only "Critical error in pipeline": name the file
                raise DataError(self._diagnose(e)) from None
            self.pos += x.shape[0]
            while self.pos >= self.per_rank:
                self.epoch, self.pos = self.epoch + 1, self.pos - self.per_rank
            return x, y
        raise RuntimeError("the DALI pipeline produced no batch")

    def _diagnose(self, err: Exception) -> str:
        """DALI says only "Critical error in pipeline": find the file of the failing chunk and say why
        (an image that no longer decodes, checked with PIL; a latent that is unreadable, not [C, S, S]
        floats, not finite, or of another shape, dtype or byte order than the chunk's first)."""
        from .manifest import check_image, check_latent

        items = self.epoch_files(self.epoch)[self.pos:self.pos + max(self.chunk, 4 * self.batch_size)]
        first = None
        for rel, _ in items:
            path = Path(self.root) / rel
            if self.kind == "images":
                ok, reason, _, _ = check_image(path)
            else:
                ok, reason, shape, dtype = check_latent(path)
                if ok and first is None:
                    first = (shape, dtype, rel)
                elif ok and (shape, dtype) != first[:2]:
                    ok, reason = False, (f"shape {list(shape)}, dtype {np.dtype(dtype)} ({dtype}) differs from "
                                         f"{first[2]}'s {list(first[0])}, {np.dtype(first[1])} ({first[1]})")
            if not ok:
                return f"cannot read {path}: {reason} (run `fasttrain data prepare {self.root}` again)"
        said = str(err).strip().splitlines()
        why = said[0][:160] if said and said[0].strip(" :") != "Critical error in pipeline" else "DALI gave no reason"
        return f"the DALI pipeline failed near epoch {self.epoch}, position {self.pos}: {why}"

    def epoch_batches(self):
        """The rest of the current epoch with the `last_batch` policy; the stream then stands at the
        start of the next epoch."""
        it = self._pipeline(self.epoch_files(self.epoch)[self.pos:], self._augment(self.epoch)[self.pos:],
                            self.last_batch)
        for out in it:
            yield self._convert(out)
        self.epoch, self.pos, self._it = self.epoch + 1, 0, None

    def _restart(self):
        self._it = None
