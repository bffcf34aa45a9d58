"""Fixtures: small generated image and latent folders."""
import pytest
from folder_fixtures import write_images, write_latents


@pytest.fixture
def image_folder(tmp_path):
    write_images(tmp_path / "imgs")
    return tmp_path / "imgs"


@pytest.fixture
def latent_folder(tmp_path):
    write_latents(tmp_path / "lat")
    return tmp_path / "lat"
