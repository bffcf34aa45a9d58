"""What a run's network was trained on (`DataSpec`): enough to generate and to judge samples without the
data, recorded in every checkpoint (`data_spec`). Its kind's traits are the data kind's (kinds.py)."""
from __future__ import annotations

from dataclasses import dataclass

from .kinds import traits


@dataclass(frozen=True)
class DataSpec:
    """What the network was trained on: enough to generate and to judge samples without the data."""
    name: str                  # the data kind (data/kinds.py): what it is, its `traits`
    channels: int
    image_size: int | None     # None for 2-D toy data
    num_classes: int           # 0 = unconditional
    label_dropout: float       # > 0: the null label (num_classes) gives the unconditional model
    latents: dict | None = None  # latent data: VAE identity, normalisation, statistics (vae.latent_record)
    class_names: list | None = None  # by label, where the data name them (an export's id2label)
    text: dict | None = None   # captioned data: the text encoders' identity and shapes (data/captioned.py)

    @property
    def decodes(self) -> bool:
        """Latents whose VAE is known: samples are judged as the images it decodes them into."""
        return bool(self.latents and self.latents.get("vae"))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.channels,) + ((self.image_size,) * 2 if self.image_size else ())

    @property
    def traits(self):
        """The data kind's declared traits (data/kinds.py)."""
        return traits(self.name)

    @property
    def is_images(self) -> bool:
        """Image pixels in [-1, 1] (clipped when generated, discrete bits/dim, judged as images)."""
        return self.image_size is not None and self.traits.pixels

    def decoded(self, images) -> DataSpec:
        """The spec of a latent run's decoded samples `images` [N, C, H, W] (the kind `decoded`: images; for
        grids and image metrics)."""
        return DataSpec("decoded", images.shape[1], images.shape[-1], self.num_classes, self.label_dropout)
