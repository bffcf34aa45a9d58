"""DreamBooth prior preservation (`data.prior`; Ruiz et al. 2023, §3.3): a few instance images under their
instance prompt ("a photo of sks dog") trained together with class images of the base model under the
class prompt ("a photo of a dog"), so that the fine-tune keeps what the class looks like.

The batches are diffusers' (examples/dreambooth/train_dreambooth_lora.py, `DreamBoothDataset` and
`collate_fn`): the data set has max(instance images, class images) items, item k pairs instance latent
k mod n_i with class latent k mod n_c, and a batch of `data.batch_size` items is the instance latents
followed by their class latents (2 · data.batch_size latents). The order is the run's seeded epoch order
over the items (order.py), so resume is exact as for any latent folder.

The loss is the script's: mse(instance half) + prior_loss_weight · mse(class half). fasttrain's loss is
the batch mean of per-sample losses ℓ_b = w(t_b)·iw_b·mean(m_b·ρ(d)) (kernels/diffusion_loss.py), so the
prior's weights ride on the loss op's per-pixel weight m (the masked loss's, data/masks.py): 2 on the
instance latents and 2 · data.prior.weight on the class latents, times the image's own mask with
data.mask (class latents: ones). sd-scripts' regularisation images (--reg_data_dir) weigh the class
samples by --prior_loss_weight in a batch mean, i.e. half this loss: the same gradient direction.

Both folders are captioned latents written by `data prepare ... --vae PIPE --text-encoders PIPE` with
the same VAE, image size and text encoders (checked: one line naming data.prior.root); the run's caption
table holds the instance captions, then the class captions, then the empty prompt. Class images are made
from the base model by `fasttrain data class-images` (generation/class_images.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..errors import DataError, InvalidInput
from .folder import LatentFolderDataset
from .loader import LoaderStream
from .manifest import load_manifest


def check(d) -> None:
    """data.prior's rules that need no file read (configure.py names the key)."""
    if d.prior.root is None:
        return
    if d.backend == "dali":
        raise InvalidInput(f"bad value for 'data.prior.root': {d.prior.root!r} (prior preservation reads "
                           f"instance and class latents in pairs through the torch DataLoader: use "
                           f"data.backend=torch or auto)")
    if not Path(d.prior.root).is_dir():
        raise InvalidInput(f"bad value for 'data.prior.root': {d.prior.root!r} is not a folder (the class "
                           f"latents: `fasttrain data prepare CLASS_IMAGES --vae PIPE --text-encoders PIPE "
                           f"--prompt CLASS_PROMPT --latents-out {d.prior.root}`)")
    if d.root and Path(d.root).resolve() == Path(d.prior.root).resolve():
        raise InvalidInput(f"bad value for 'data.prior.root': {d.prior.root!r} is data.root itself (the class "
                           f"latents are another folder than the instance latents)")


class PriorPairs(Dataset):
    """Item k: (instance x, its caption group, [its mask,] class x, its caption group), instance k mod n_i
    and class k mod n_c, as diffusers' DreamBoothDataset pairs them; max(n_i, n_c) items."""

    def __init__(self, instance: LatentFolderDataset, classes: LatentFolderDataset):
        self.instance, self.classes = instance, classes

    def __len__(self) -> int:
        return max(len(self.instance), len(self.classes))

    def __getitem__(self, k: int):
        return (*self.instance[k % len(self.instance)], *self.classes[k % len(self.classes)])


def halves(b: int, weight: float, device="cpu") -> torch.Tensor:
    """[2b, 1, 1, 1]: 2 for the b instance latents, 2 · `weight` for the b class latents after them, so that
    the batch mean of the per-sample losses is mse(instance half) + weight · mse(class half)."""
    return torch.tensor([2.0] * b + [2.0 * float(weight)] * b, device=device).view(2 * b, 1, 1, 1)


class PriorBatches:
    """Paired batches → (x, y, per-pixel loss weight): the instance half then the class half (diffusers'
    collate_fn), the weight 2 on instance and 2 · `weight` on class latents (module docstring), times the
    instance masks where the pairs carry them. Its position is the paired stream's."""

    def __init__(self, inner: LoaderStream, weight: float, masked: bool):
        self.inner, self.weight, self.masked = inner, float(weight), masked
        self._scale: dict = {}

    epoch = property(lambda self: self.inner.epoch)
    pos = property(lambda self: self.inner.pos)

    def __iter__(self):
        return self

    def _halves(self, b: int, device) -> torch.Tensor:
        key = (b, str(device))
        if key not in self._scale:  # made once per batch size: no host data per step
            self._scale[key] = halves(b, self.weight, device)
        return self._scale[key]

    def __next__(self):
        batch = next(self.inner)
        if self.masked:
            xi, yi, mi, xc, yc = batch
        else:
            (xi, yi, xc, yc), mi = batch, None
        b = xi.shape[0]
        x, y = torch.cat([xi, xc]), torch.cat([yi, yc])
        grid = (2 * b, 1) + tuple(x.shape[-2:])
        m = torch.ones(grid, device=x.device) if mi is None else torch.cat([mi, torch.ones_like(mi)])
        return x, y, m * self._halves(b, x.device)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def _refuse(d, why: str) -> DataError:
    return DataError(f"data.prior.root={d.prior.root}: {why}")


def class_folder(d, instance: dict, embeddings: str) -> tuple[dict, dict]:
    """(the class folder's manifest, its saved encodings), checked against the instance folder's manifest
    `instance`: captioned latents of the same VAE, image size and text encoders."""
    root = Path(d.prior.root)
    how = (f"`fasttrain data prepare CLASS_IMAGES --vae PIPE --text-encoders PIPE --prompt CLASS_PROMPT "
           f"--latents-out {root}`")
    m = load_manifest(root)
    if m is None or m.get("kind") != "latents" or not m.get("text") or not (root / embeddings).is_file():
        raise _refuse(d, f"holds no captioned latents: run {how}")
    if not m["files"]:
        raise _refuse(d, "holds no latents")
    if (m.get("bad") or []) and not d.skip_bad_latents:
        raise _refuse(d, f"{len(m['bad'])} of its latent files are not usable (`fasttrain data prepare {root}` "
                         f"lists each): re-encode them")
    mine, theirs = instance.get("latents") or {}, m.get("latents") or {}
    if mine.get("vae") != theirs.get("vae") or mine.get("image_size") != theirs.get("image_size"):
        raise _refuse(d, f"its latents were encoded with another VAE or image size than data.root's "
                         f"({theirs.get('image_size')} vs {mine.get('image_size')}): encode both with one")
    a, b = instance["text"]["encoders"], m["text"]["encoders"]
    if (a.get("sha256"), a.get("clip_skip")) != (b.get("sha256"), b.get("clip_skip")):
        raise _refuse(d, f"its captions were encoded by other text encoders ({b.get('path')}) than data.root's "
                         f"({a.get('path')}): encode both with one")
    saved = torch.load(root / embeddings, weights_only=True)
    if len(saved["counts"]) != len(m["files"]):
        raise _refuse(d, f"{embeddings} encodes {len(saved['counts'])} images, the folder holds {len(m['files'])}: "
                         f"run {how} again")
    if d.prior.num_images is not None:  # diffusers: min(the folder's class images, --num_class_images)
        n = min(len(m["files"]), d.prior.num_images)
        m = {**m, "files": m["files"][:n]}
        first = int(saved["counts"][:n].sum())
        keep = list(range(first)) + [int(saved["counts"].sum())]  # their captions, then the empty prompt
        saved = {**saved, "counts": saved["counts"][:n], "states": saved["states"][keep], "mask": saved["mask"][keep],
                 "pooled": None if saved.get("pooled") is None else saved["pooled"][keep],
                 "time_ids": None if saved.get("time_ids") is None else saved["time_ids"][:n]}
    return m, saved


def prompted(d, saved: dict, which: str, flag: str) -> None:
    """Every caption of `saved` has text: a row equal to the empty prompt's (the last, encoded by the same
    encoders) is an image prepared without its prompt (--allow-empty-captions)."""
    states = saved["states"]
    empty = (states[:-1] == states[-1:]).flatten(1).all(1)
    if bool(empty.any()):
        raise DataError(f"data.prior.root={d.prior.root}: {int(empty.sum())} {which} caption(s) are the empty "
                        f"prompt: prior preservation trains the {which} images under their prompt (`data prepare "
                        f"... --prompt {flag}`)")


def joined(instance: dict, classes: dict) -> dict:
    """One table's encodings: the instance captions, the class captions, then the empty prompt (the
    instance folder's last row; both folders encode "" with the same encoders)."""
    out = {}
    for k in ("states", "mask", "pooled"):
        rows = instance.get(k)
        out[k] = None if rows is None else torch.cat([rows[:-1], classes[k][:-1], rows[-1:]])
    out["counts"] = torch.cat([instance["counts"], classes["counts"]])
    ti = instance.get("time_ids")
    out["time_ids"] = None if ti is None else torch.cat([ti, classes["time_ids"]])
    if "captions" in instance and "captions" in classes:  # their text, in the same order (text-encoder LoRA)
        out["captions"] = json.dumps(json.loads(instance["captions"]) + json.loads(classes["captions"]))
    return out


def pairs(d, instance_root: str, instance: dict, classes: dict, masked: bool) -> PriorPairs:
    """The paired data set: instance latents labelled by their caption group, class latents by theirs after
    the instance groups."""
    n = len(instance["files"])
    cls = {**classes, "files": [[rel, n + i] for i, (rel, _) in enumerate(classes["files"])], "classes": []}
    return PriorPairs(LatentFolderDataset(instance_root, instance, mask=masked),
                      LatentFolderDataset(d.prior.root, cls))


def shapes_agree(d, a: PriorPairs) -> None:
    si, sc = a.instance.shape(), a.classes.shape()
    if si != sc:
        raise _refuse(d, f"its latents are {list(sc)}, data.root's {list(si)}: encode both at one --image-size")


def build(kind, d, at, m: dict, saved: dict, embeddings: str):
    """(stream of (x, y, weight) batches, DataInfo, the joined encodings) of the instance folder whose
    indexed manifest is `m` and encodings `saved`, paired with data.prior.root's class latents; `kind`: the
    captioned latents kind (its mask check)."""
    from ..pretrained.vae import latent_record
    from .kinds import DataInfo
    from .latents import LatentStream

    masked = d.mask != "none"
    if masked:
        kind.check_masks(d, m)
    cm, csaved = class_folder(d, m, embeddings)
    prompted(d, saved, "instance", '"a photo of sks dog"')
    prompted(d, csaved, "class", '"a photo of a dog"')
    ds = pairs(d, d.root, m, cm, masked)
    shapes_agree(d, ds)
    shape = ds.instance.shape()
    rec = latent_record(m.get("latents"), d.latent_norm)
    info = DataInfo(rec["channels"] if rec else shape[0], shape[1], 0, len(ds), rec)
    info.loss_weights = True
    inner = LoaderStream(ds, d.batch_size, at.seed, at.device, d.num_workers, at.rank, at.world_size)
    s = PriorBatches(inner, d.prior.weight, masked)
    return (LatentStream(s, rec, at.seed, at.rank) if rec else s), info, joined(saved, csaved)
