"""The `folder` data kind: a folder of images (class subfolders give labels, a flat folder label 0),
decoded, resized and cropped to `data.image_size` (folder.py), streamed from the files."""
from __future__ import annotations

from ..errors import InvalidInput
from .folder import ImageFolderDataset
from .kinds import DataArgs, DataInfo, DataKind, Traits, register
from .streamed import check_folder_args, folder_manifest, stream


@register("folder")
class ImageFolder(DataKind):
    traits = Traits(images=True, pixels=True, resident=False, needs_root=True)
    buckets = True

    def check(self, d) -> None:
        super().check(d)
        if d.channels not in (1, 3):
            raise InvalidInput(f"bad value for 'data.channels': {d.channels!r} (1 (grey) or 3 (RGB))")

    def build(self, a: DataArgs, backend: str):
        check_folder_args(a, self.name)
        m = folder_manifest(a)
        files = [tuple(f) for f in m["files"]]
        ds = ImageFolderDataset(a.root, a.image_size, a.channels, manifest=m)
        info = DataInfo(a.channels, a.image_size, len(m["classes"]), len(files), class_names=list(m["classes"]))
        if a.buckets:  # one bucket per batch, any aspect ratio (buckets.py); the DataLoader reads them
            from .buckets import build

            settings = {"base": a.image_size, "min": a.min_bucket_reso, "max": a.max_bucket_reso,
                        "steps": a.bucket_reso_steps}
            return build(a, files, settings), info
        return stream("images", ds, files, a, backend, (a.flip, a.crop == "random")), info
