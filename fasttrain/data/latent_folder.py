"""The `latents` data kind: a folder of `[C, S, S]` .npy arrays (folder.py), e.g. VAE latents from
`data prepare --vae` (encode.py), whose posteriors are sampled and normalised on the device
(latents.py); its size comes from the files. And `decoded`, the kind of the images a latent run's VAE
decodes its samples into (not a `data.name`: it describes outputs)."""
from __future__ import annotations

from ..errors import DataError
from .folder import LatentFolderDataset
from .kinds import DataInfo, DataKind, Placement, Traits, register
from .latents import LatentStream
from .streamed import check_folder_args, folder_manifest, stream


@register("latents")
class LatentFolder(DataKind):
    traits = Traits(images=True, pixels=False, resident=False, needs_root=True, latents=True, sized_by_config=False)

    def build(self, d, at: Placement, backend: str):
        check_folder_args(d, self.name)
        return self.build_from(d, at, backend, folder_manifest(d, at))

    def build_from(self, d, at: Placement, backend: str, m: dict):
        """The stream and info of the folder whose (checked) manifest is `m`."""
        from ..pretrained.vae import latent_record

        files = [tuple(f) for f in m["files"]]
        ds = LatentFolderDataset(d.root, m)
        shape = ds.shape()
        if len(shape) != 3 or shape[1] != shape[2]:
            raise DataError(f"latents must be stored as [C, S, S] arrays, {ds.files[0][0]} has shape {shape}")
        record = latent_record(m.get("latents"), d.latent_norm)
        c = record["channels"] if record else shape[0]
        if record and shape[0] != c * (2 if record["posterior"] else 1):
            raise DataError(f"{ds.files[0][0]} has {shape[0]} channels, the manifest records {c} latent channels"
                            f"{' (mean and std)' if record['posterior'] else ''}: run `fasttrain data prepare` again")
        info = DataInfo(c, shape[1], len(m["classes"]), len(files), record, list(m["classes"]))
        s = stream("latents", ds, files, d, at, backend, None)
        return (LatentStream(s, record, at.seed, at.rank) if record else s), info

    def reference(self, cfg, spec, ref_path, n):
        from .reference import folder_reference, latent_reference

        if spec.latents:
            return latent_reference(spec, cfg.data, ref_path, n)
        return folder_reference(cfg, spec, ref_path or cfg.data.root, n)

    def reference_images(self, cfg, spec, ref_path, n):
        from .reference import folder_images, latent_images

        if spec.latents:
            return latent_images(spec, ref_path, n)
        return folder_images(ref_path or cfg.data.root, spec, cfg.data, n)


@register("decoded")
class Decoded(DataKind):
    traits = Traits(images=True, pixels=True, resident=False, sized_by_config=False)
    trainable = False
