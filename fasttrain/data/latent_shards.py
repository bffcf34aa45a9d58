"""The `captioned_shards` data kind: WebDataset tar shards of VAE latents with their captions' text
encodings, so that a text-to-image run on millions of captions holds on the device only the encodings of
the batches a step trains on (captioned.py's `captioned_latents` keeps every caption's there).

`fasttrain data prepare IMAGES --vae PIPE --text-encoders PIPE --shards OUT [--shard-size N]` writes
OUT/shard-NNNNNN.tar, sample i (key %08d) holding
  latent.npy    [2C, h, w] the posterior mean and std (encode.py's layout), float16
  states.npy    [K, L, D] float16, the per-token states of each of the image's K captions
  mask.npy      [K, L] uint8, the tokenizer's attention mask
  pooled.npy    [K, P] float16 (SDXL, SD3: the pooled vector)
  time_ids.npy  [6] float32 (SDXL's micro-conditions, captioned._time_ids)
  cls           the label (class subfolders)
  txt           the K captions, one a line (for steps that will need the text itself)
and OUT/fasttrain-empty-prompt.safetensors (the empty prompt's encoding: the unconditional model) and the
index (shard_index.py, kind "captioned_latents": per shard count, bytes, sha256, each sample's offset;
the VAE's and encoders' identity, the latents' per-channel statistics, the text shapes). Resumable: the
settings are written first (fasttrain-shards-progress.json) and checked on a rerun; each shard is encoded
and written under a temporary name, then renamed, so a rerun keeps the shards that exist and encodes
the others; the index is written last.

Training (`data.name=captioned_shards data.root=OUT`) reads the samples as every shard kind does
(shard_reader.py: each rank its own samples' bytes, one global order, resume by seeking). Each batch's
encodings arrive with its latents and are written into a device `TextTable` of `per_batch` rows: the
step's batches (`Placement.batches_per_step`, train.grad_accum) × batch × the most captions of a sample,
and the empty prompt's row. The batch's labels are its samples' caption groups in that table, so the
caption draw and the caption dropout (conditioning.TextCaptions) are seeded and drawn as for a
captioned folder, and the network gathers its inputs as it does there. Device memory is the same for
a thousand captions or a billion (bench/caption_memory.py).
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .kinds import DataInfo, DataKind, Placement, Reference, Traits, register
from .shard_index import INDEX, ShardIndex, entry_of, parse_sample, write_index
from .shard_reader import ShardSamples

KIND = "captioned_latents"
PROGRESS, EMPTY = "fasttrain-shards-progress.json", "fasttrain-empty-prompt.safetensors"


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def from_npy(b: bytes) -> np.ndarray:
    return np.load(io.BytesIO(b), allow_pickle=False)


def sample_of(key: int, latent: np.ndarray, states: np.ndarray, mask: np.ndarray, captions: list[str],
              pooled: np.ndarray | None = None, time_ids: np.ndarray | None = None, label: int | None = None) -> dict:
    """One shard sample's members (module docstring)."""
    s = {"__key__": f"{key:08d}", "latent.npy": npy(latent.astype(np.float16)),
         "states.npy": npy(states.astype(np.float16)), "mask.npy": npy(mask.astype(np.uint8)),
         "txt": "\n".join(captions)}
    if pooled is not None:
        s["pooled.npy"] = npy(pooled.astype(np.float16))
    if time_ids is not None:
        s["time_ids.npy"] = npy(np.asarray(time_ids, dtype=np.float32))
    if label is not None:
        s["cls"] = str(int(label))
    return s


def write_shard(path: Path, samples) -> None:
    """The samples into the tar `path`, whole or not at all (a temporary name, then renamed)."""
    from .. import optional

    wds = optional.webdataset("data prepare --shards")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f, wds.TarWriter(f) as w:
        for s in samples:
            w.write(s)
    os.replace(tmp, path)


def save_empty(out: Path, enc: dict) -> None:
    """The empty prompt's encoding (`enc`: states [1, L, D], mask [1, L], pooled [1, P] or None)."""
    from safetensors.torch import save_file

    t = {"states": enc["states"].half().contiguous(), "mask": enc["mask"].to(torch.uint8).contiguous()}
    if enc.get("pooled") is not None:
        t["pooled"] = enc["pooled"].half().contiguous()
    tmp = out / f".{EMPTY}.{os.getpid()}.tmp"
    save_file(t, str(tmp))
    os.replace(tmp, out / EMPTY)


def finish(out: Path, names: list[str], meta: dict) -> dict:
    """The index of the shards `names` in `out`: each shard's entry, and the latents' per-channel
    statistics over every sample (encode.channel_stats's formula: E[z] = E[mean], E[z²] = E[mean² + std²])."""
    entries = [entry_of(out / n) for n in names]
    s1 = s2 = None
    pixels = 0
    for e in entries:
        with open(out / e["name"], "rb") as f:
            for off, size in e["spans"]:
                f.seek(off)
                a = from_npy(parse_sample(f.read(size))["latent.npy"]).astype(np.float64)
                c = a.shape[0] // 2
                mean, std = a[:c], a[c:]
                s1 = mean.sum((1, 2)) + (0 if s1 is None else s1)
                s2 = (mean**2 + std**2).sum((1, 2)) + (0 if s2 is None else s2)
                pixels += mean.shape[1] * mean.shape[2]
    m = s1 / pixels
    first = entries[0]
    with open(out / first["name"], "rb") as f:
        f.seek(first["spans"][0][0])
        shape = list(from_npy(parse_sample(f.read(first["spans"][0][1]))["latent.npy"]).shape)
    latents = {**meta["latents"], "shape": shape, "channel_mean": m.tolist(),
               "channel_std": np.sqrt(np.maximum(s2 / pixels - m**2, 0)).tolist()}
    index = {**meta, "kind": KIND, "shards": entries, "count": sum(e["count"] for e in entries), "latents": latents}
    write_index(out, index)
    return index


def _claim(out: Path, settings: dict) -> None:
    """Refuse a folder that holds shards of other settings; record ours before the first shard."""
    old = None
    if (out / PROGRESS).is_file():
        old = json.loads((out / PROGRESS).read_text())
    elif (out / INDEX).is_file():
        old = json.loads((out / INDEX).read_text()).get("settings")
    if old is None and any(out.glob("shard-*.tar")):
        raise DataError(f"--shards {out} already holds shards that are not captioned latents of this command: "
                        f"choose an empty folder")
    if old is not None and old != settings:
        what = [k for k in settings if old.get(k) != settings[k]]
        raise DataError(f"--shards {out} holds shards of other settings ({', '.join(what)} differ): choose another "
                        f"folder or delete it")
    tmp = out / f".{PROGRESS}.tmp"
    tmp.write_text(json.dumps(settings, indent=1))
    os.replace(tmp, out / PROGRESS)


def prepare_shards(image_manifest: dict, out, vae_folder: str, subfolder: str | None, text_folder: str,
                   clip_skip: int | None = None, column: str = "text", allow_empty: bool = False,
                   image_size: int = 256, batch_size: int = 64, shard_size: int = 1000, device=None,
                   progress: bool = True) -> dict:
    """Encode the manifest's images and captions into captioned latent shards in `out` (module
    docstring), resuming where an earlier pass stopped; returns the index."""
    import hashlib

    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from ..pretrained.text_encoders import TextEncoders
    from ..pretrained.vae import encode, identity, load_vae
    from .captioned import _time_ids, record_of
    from .captions import captions_for
    from .folder import ImageFolderDataset

    root, out = Path(image_manifest["root"]), Path(out)
    files = [(str(rel), int(label)) for rel, label in image_manifest["files"]]
    if not files:
        raise DataError(f"{root} holds no readable images to encode")
    caps = captions_for(root, [rel for rel, _ in files], column, allow_empty)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vae = load_vae(vae_folder, subfolder, device)
    enc = TextEncoders.load(text_folder, clip_skip, device)
    settings = {"source": str(root.resolve()), "image_size": image_size, "shard_size": shard_size,
                "files_sha256": hashlib.sha256(json.dumps(files).encode()).hexdigest(), "column": column,
                "vae": identity(vae, vae_folder, subfolder), "text_encoders": enc.identity()}
    out.mkdir(parents=True, exist_ok=True)
    _claim(out, settings)
    empty = enc.encode([""])
    save_empty(out, empty)
    micro = enc.family == "sdxl"
    kmax = max(len(c) for c in caps)
    names = [f"shard-{k:06d}.tar" for k in range((len(files) + shard_size - 1) // shard_size)]
    done = sum((out / n).is_file() for n in names)
    bar = tqdm(total=len(files), initial=min(len(files), done * shard_size), desc="encoding shards", unit="image",
               disable=not progress)
    for k, name in enumerate(names):
        if (out / name).is_file():  # written whole by an earlier pass
            continue
        lo = k * shard_size
        part = files[lo:lo + shard_size]
        ds = ImageFolderDataset(str(root), image_size, vae.config.in_channels, files=part)
        latents = []
        for x, _ in DataLoader(ds, batch_size=batch_size):
            mean, std = encode(vae, x.to(device))
            latents.append(torch.cat([mean, std], 1).cpu().numpy())
        lat = np.concatenate(latents)
        flat = [c for group in caps[lo:lo + len(part)] for c in group]
        e = enc.encode(flat)
        tids = _time_ids(root, [rel for rel, _ in part], image_size).numpy() if micro else None
        samples, row = [], 0
        for j, (_, label) in enumerate(part):
            group = caps[lo + j]
            r = slice(row, row + len(group))
            row += len(group)
            samples.append(sample_of(lo + j, lat[j], e["states"][r].numpy(), e["mask"][r].numpy(), group,
                                     None if e["pooled"] is None else e["pooled"][r].numpy(),
                                     None if tids is None else tids[j],
                                     label if image_manifest["classes"] else None))
        write_shard(out / name, samples)
        bar.update(len(part))
    bar.close()
    text = {**record_of(enc.identity(), {"states": empty["states"], "pooled": empty["pooled"]}, micro,
                        [c[0] for c in caps[:10]]),
            "captions": sum(len(c) for c in caps), "max_captions": kmax, "truncated": enc.truncated, "column": column}
    meta = {"classes": image_manifest["classes"], "source": str(root.resolve()), "settings": settings, "text": text,
            "latents": {"source": str(root.resolve()), "image_size": image_size, "vae": settings["vae"],
                        "posterior": "mean_std", "channels": int(vae.config.latent_channels), "dtype": "float16",
                        "skipped_images": image_manifest["bad"]}}
    index = finish(out, names, meta)
    (out / PROGRESS).unlink(missing_ok=True)
    return index


def write_synthetic(out, n: int, captions: int = 1, length: int = 8, width: int = 16, shape=(4, 4, 4),
                    shard_size: int = 100, seed: int = 0, pooled: int | None = None, ids: bool = True) -> dict:
    """Captioned latent shards of random numbers (tests and benchmarks: any number of captions without
    encoders): sample i's posterior mean is the constant i (`ids`: exact in fp16 up to 2048; else standard
    normal), std 0, each of its `captions` encodings random; recorded as encoded by a made-up SD 1.x VAE
    and encoders ("synthetic")."""
    if ids and n > 2048:
        raise ValueError(f"write_synthetic: sample ids above 2048 are not exact in fp16 ({n} samples): ids=False")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    c = shape[0]
    names = []
    for k, lo in enumerate(range(0, n, shard_size)):
        samples = []
        for i in range(lo, min(n, lo + shard_size)):
            mean = np.full(shape, float(i)) if ids else rng.standard_normal(shape)
            lat = np.concatenate([mean, np.zeros(shape)])
            samples.append(sample_of(i, lat, rng.standard_normal((captions, length, width)),
                                     np.ones((captions, length)), [f"caption {j} of {i}" for j in range(captions)],
                                     None if pooled is None else rng.standard_normal((captions, pooled))))
        names.append(f"shard-{k:06d}.tar")
        write_shard(out / names[-1], samples)
    save_empty(out, {"states": torch.zeros(1, length, width), "mask": torch.ones(1, length, dtype=torch.bool),
                     "pooled": None if pooled is None else torch.zeros(1, pooled)})
    ident = {"path": "synthetic", "family": "sd1" if pooled is None else "sd3", "clip_skip": None, "sha256": {}}
    text = {"encoders": ident, "family": ident["family"], "length": length, "width": width, "pooled": pooled,
            "micro": False, "prompts": [], "captions": n * captions, "max_captions": captions, "truncated": 0}
    vae = {"path": "synthetic", "scaling_factor": 1.0, "shift_factor": None, "downsample": 8}
    meta = {"classes": [], "source": "synthetic", "text": text,
            "latents": {"source": None, "image_size": shape[1] * 8, "vae": vae, "posterior": "mean_std",
                        "channels": c, "dtype": "float16", "skipped_images": []}}
    return finish(out, names, meta)


# -- training ----------------------------------------------------------------------------------------------
class CaptionedLatentSamples(ShardSamples):
    """Samples → (latent [2C, h, w] float16, {"states" [K, L, D], "mask" [K, L], "pooled" [K, P], "time_ids"
    [6], "count"}), the caption rows padded to K = the set's most captions per sample."""

    needs = (("latent.npy",), ("states.npy",), ("mask.npy",))

    def __init__(self, index: ShardIndex, kmax: int, pooled: bool, micro: bool):
        super().__init__(index)
        self.kmax, self.pooled, self.micro = kmax, pooled, micro
        if pooled:
            self.needs = self.needs + (("pooled.npy",),)
        if micro:
            self.needs = self.needs + (("time_ids.npy",),)

    def decode(self, s: dict, extra):
        from .shard_reader import Undecodable

        try:
            lat = torch.from_numpy(from_npy(s["latent.npy"]))
            states = torch.from_numpy(from_npy(s["states.npy"]))
            mask = torch.from_numpy(from_npy(s["mask.npy"])).bool()
            k = states.shape[0]
            if not 1 <= k <= self.kmax or mask.shape[0] != k:
                raise ValueError(f"{k} caption rows, the set's samples hold 1 to {self.kmax}")
            pad = self.kmax - k
            text = {"states": torch.nn.functional.pad(states, (0, 0, 0, 0, 0, pad)),
                    "mask": torch.nn.functional.pad(mask, (0, 0, 0, pad)), "count": torch.tensor(k)}
            if self.pooled:
                text["pooled"] = torch.nn.functional.pad(torch.from_numpy(from_npy(s["pooled.npy"])), (0, 0, 0, pad))
            if self.micro:
                text["time_ids"] = torch.from_numpy(from_npy(s["time_ids.npy"])).float()
        except (ValueError, OSError) as e:  # numpy's errors for a damaged .npy member
            raise Undecodable(f"cannot decode ({type(e).__name__}: {e})") from None
        return lat, text


class StreamedCaptions:
    """A latent stream whose batches carry their encodings (x, text dict) → (x, caption-group codes): each
    batch's encodings written into its slot of a `per_batch` TextTable on the device (module docstring).
    Its position is the wrapped stream's."""

    def __init__(self, inner, empty: dict, kmax: int, batch: int, slots: int, device):
        L, D = empty["states"].shape[1:]
        rows = slots * batch * kmax + 1
        dev = torch.device(device)

        def zeros(*shape, dtype=torch.float16):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        states, mask = zeros(rows, L, D), zeros(rows, L, dtype=torch.bool)
        states[-1], mask[-1] = empty["states"][0].to(dev), empty["mask"][0].bool().to(dev)
        pooled = None
        if empty.get("pooled") is not None:
            pooled = zeros(rows, empty["pooled"].shape[1])
            pooled[-1] = empty["pooled"][0].to(dev)
        time_ids = zeros(rows, 6, dtype=torch.float32) if empty.get("micro") else None
        groups = slots * batch
        from ..conditioning import TextTable

        offsets, counts = torch.arange(groups, device=dev) * kmax, torch.ones(groups, dtype=torch.long, device=dev)
        self.table = TextTable(states, mask, pooled, time_ids, rows - 1, offsets, counts, per_batch=True)
        self.inner, self.kmax, self.batch, self.slots, self.k = inner, kmax, batch, slots, 0

    def __iter__(self):
        return self

    def __next__(self):
        x, text = next(self.inner)
        slot, self.k = self.k % self.slots, self.k + 1
        B, K, t = x.shape[0], self.kmax, self.table
        lo = slot * self.batch
        rows = slice(lo * K, (lo + B) * K)
        t.states[rows].copy_(text["states"].flatten(0, 1))
        t.mask[rows].copy_(text["mask"].flatten(0, 1))
        if t.pooled is not None:
            t.pooled[rows].copy_(text["pooled"].flatten(0, 1))
        if t.time_ids is not None:
            t.time_ids[rows].copy_(text["time_ids"].repeat_interleave(K, 0))
        t.counts[lo:lo + B].copy_(text["count"])
        return x, torch.arange(lo, lo + B, device=t.counts.device)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def bytes_read(self) -> int:
        return self.inner.inner.bytes_read()


def load_empty(root: Path, micro: bool) -> dict:
    from safetensors.torch import load_file

    path = root / EMPTY
    if not path.is_file():
        raise DataError(f"{root} holds no {EMPTY} (the empty prompt's encoding): write the shards again with "
                        f"`fasttrain data prepare IMAGES --vae PIPE --text-encoders PIPE --shards {root}`")
    return {**load_file(str(path)), "micro": micro}


@register("captioned_shards")
class CaptionedShards(DataKind):
    traits = Traits(images=True, pixels=False, resident=False, needs_root=True, latents=True, sized_by_config=False,
                    conditioning="text")

    def build(self, d, at: Placement, backend: str):
        from ..pretrained.vae import latent_record
        from .latents import LatentStream
        from .shards import shard_stream

        index = ShardIndex(d.root, kind=KIND)
        meta = index.index
        text, lat = meta["text"], meta["latents"]
        record = latent_record(lat, d.latent_norm)
        ds = CaptionedLatentSamples(index, int(text["max_captions"]), bool(text.get("pooled")), bool(text["micro"]))
        inner = LatentStream(shard_stream(ds, d, at), record, at.seed, at.rank)
        stream = StreamedCaptions(inner, load_empty(index.root, bool(text["micro"])), ds.kmax, d.batch_size,
                                  max(1, at.batches_per_step), at.device)
        shape = lat["shape"]
        info = DataInfo(record["channels"], shape[1], 0, index.count, record, None)
        info.text = {k: text[k] for k in ("encoders", "family", "length", "width", "pooled", "micro", "prompts")}
        info.text_table = stream.table
        return stream, info

    def reference(self, cfg, spec, ref_path, n):
        """FID: the images the latents came from (or --ref); bits/dim: the first n posterior means."""
        from .latents import prepare_batch
        from .reference import latent_images

        images = latent_images(spec, ref_path, n)
        train = None if images.items is None else torch.stack(list(images.items))
        test, root = None, cfg.data.root
        if root and (Path(root) / INDEX).is_file():
            index = ShardIndex(root, kind=KIND)
            ds = CaptionedLatentSamples(index, int(index.index["text"]["max_captions"]), False, False)
            rows = [ds[i][0].float() for i in range(min(n, index.count))]
            test = prepare_batch(torch.stack(rows), spec.latents) if rows else None
        return Reference(train, test, images.source)

    def reference_images(self, cfg, spec, ref_path, n):
        from .reference import latent_images

        return latent_images(spec, ref_path, n)
