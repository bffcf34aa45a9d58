"""The VAE module: latent normalisation conventions, loading from local folders (pipeline folders too),
identity checks when decoding, and one-line errors."""
import json

import pytest
import torch
from diffusers_fixtures import save_tiny_vae

from fasttrain.errors import DataError, InvalidInput, MissingFile
from fasttrain.pretrained.vae import LatentCodec, denormalize, latent_record, load_vae, model_dir, normalize

INFO = {"channels": 2, "posterior": "mean_std", "channel_mean": [1.0, -2.0], "channel_std": [2.0, 0.5],
        "vae": {"scaling_factor": 0.5, "shift_factor": 0.1, "config_sha256": "a", "weights_sha256": "b"}}


def test_normalisation_conventions_and_their_inverse():
    z = torch.randn(3, 2, 4, 4)
    for norm, shift, scale in (("vae", [0.1, 0.1], [0.5, 0.5]), ("auto", [0.1, 0.1], [0.5, 0.5]),
                               ("channel", [1.0, -2.0], [0.5, 2.0]), ("none", [0.0, 0.0], [1.0, 1.0])):
        rec = latent_record(INFO, norm)
        assert rec["shift"] == shift and rec["scale"] == scale and rec["posterior"]
        x = normalize(z, rec)
        torch.testing.assert_close(x[:, 1], (z[:, 1] - shift[1]) * scale[1])
        torch.testing.assert_close(denormalize(x, rec), z)
    assert latent_record(None, "auto") is None and latent_record({**INFO, "vae": None}, "auto")["norm"] == "none"
    with pytest.raises(DataError, match="data prepare --vae"):
        latent_record(None, "vae")
    with pytest.raises(DataError, match="record no VAE"):
        latent_record({**INFO, "vae": None}, "vae")
    with pytest.raises(DataError, match="per-channel statistics"):
        latent_record({**INFO, "channel_mean": None}, "channel")


def test_loading_from_folders_and_identity_when_decoding(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from fasttrain.pretrained.vae import identity

    with pytest.raises(MissingFile, match="does not exist"):
        load_vae(tmp_path / "nope")
    save_tiny_vae(tmp_path / "pipe" / "vae")
    with pytest.raises(MissingFile, match="--vae-subfolder vae"):
        model_dir(tmp_path / "pipe")
    vae = load_vae(tmp_path / "pipe", subfolder="vae")
    assert not vae.training and vae.config.latent_channels == 4
    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(InvalidInput, match="not|needs an AutoencoderKL"):
        load_vae(unet)

    rec = latent_record({"channels": 4, "posterior": "mean_std", "vae": identity(vae, tmp_path / "pipe", "vae")},
                        "vae")
    x = torch.randn(2, 4, 8, 8)
    codec = LatentCodec.load(rec)  # the recorded folder and subfolder
    with torch.no_grad():
        expect = vae.decode(x / 0.5).sample.clamp(-1, 1)
    torch.testing.assert_close(codec.decode(x), expect)
    assert capsys.readouterr().err == ""
    other = save_tiny_vae(tmp_path / "other", seed=1)
    LatentCodec.load(rec, str(other))  # another VAE of the same shape decodes, with a warning
    assert "not the one the latents were encoded with" in capsys.readouterr().err
    LatentCodec.load(rec, str(tmp_path / "pipe"))  # a pipeline folder given as --vae
    wide = save_tiny_vae(tmp_path / "wide", latent_channels=8)
    with pytest.raises(InvalidInput, match="8 latent channels"):
        LatentCodec.load(rec, str(wide))
