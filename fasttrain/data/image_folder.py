"""The `folder` data kind: a folder of images (class subfolders give labels, a flat folder label 0),
decoded, resized and cropped to `data.image_size` (folder.py), streamed from the files."""
from __future__ import annotations

from ..errors import InvalidInput
from .folder import ImageFolderDataset
from .kinds import DataInfo, DataKind, Placement, Traits, register
from .streamed import check_folder_args, folder_manifest, stream


@register("folder")
class ImageFolder(DataKind):
    traits = Traits(images=True, pixels=True, resident=False, needs_root=True)
    buckets = True

    def check(self, d) -> None:
        super().check(d)
        if d.channels not in (1, 3):
            raise InvalidInput(f"bad value for 'data.channels': {d.channels!r} (1 (grey) or 3 (RGB))")

    def build(self, d, at: Placement, backend: str):
        check_folder_args(d, self.name)
        m = folder_manifest(d, at)
        files = [tuple(f) for f in m["files"]]
        ds = ImageFolderDataset(d.root, d.image_size, d.channels, manifest=m)
        info = DataInfo(d.channels, d.image_size, len(m["classes"]), len(files), class_names=list(m["classes"]))
        if d.buckets:  # one bucket per batch, any aspect ratio (buckets.py); the DataLoader reads them
            from .buckets import build

            info.fixed_shape = False  # the batch shape changes with the bucket
            return build(d, at, files), info
        return stream("images", ds, files, d, at, backend, (d.flip, d.crop == "random")), info
