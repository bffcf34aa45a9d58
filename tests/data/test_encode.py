"""`data prepare --vae`: images → posterior mean and std per image with a saved AutoencoderKL, batched,
resumable, one folder per encoding; the latent stream draws from the posteriors reproducibly."""
import json

import numpy as np
import pytest
import torch
from diffusers_fixtures import save_tiny_vae
from folder_fixtures import write_images

from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import build_data
from fasttrain.data.encode import encode_with_vae
from fasttrain.data.manifest import build_manifest
from fasttrain.errors import DataError

pytest.importorskip("diffusers")


@pytest.fixture
def folder(tmp_path):
    write_images(tmp_path / "imgs", n_per_class=4, corrupt=1)
    return tmp_path / "imgs", save_tiny_vae(tmp_path / "vae", shift_factor=0.25)


def test_encodes_the_posterior_with_the_vaes_identity_and_statistics(folder, tmp_path, capsys):
    from diffusers import AutoencoderKL

    from fasttrain.data.folder import ImageFolderDataset

    imgs, vae = folder
    assert main(["data", "prepare", str(imgs), "--vae", str(vae), "--image-size", "16", "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    assert "skipped cat/broken0.jpg" in printed and "encoded 8 images" in printed
    lat = imgs.parent / "imgs-latents"  # the default --latents-out
    m = json.loads((lat / "fasttrain-manifest.json").read_text())
    info = m["latents"]
    assert m["classes"] == ["cat", "dog"] and [f[1] for f in m["files"]] == [0] * 4 + [1] * 4
    assert info["vae"]["shift_factor"] == 0.25 and info["vae"]["downsample"] == 2 and info["image_size"] == 16
    # each file holds the posterior of its image, as diffusers computes it
    model = AutoencoderKL.from_pretrained(str(vae))
    x = ImageFolderDataset(str(imgs), 16, 3, files=[("dog/002.jpg", 1)])[0][0][None]
    with torch.no_grad():
        post = model.encode(x).latent_dist
    stored = torch.from_numpy(np.load(lat / "dog" / "002.npy"))
    torch.testing.assert_close(stored, torch.cat([post.mean, post.std], 1)[0], rtol=1e-5, atol=1e-6)
    # channel statistics of z ~ N(mean, std²) over the data set, without draws
    arr = np.stack([np.load(lat / f) for f, _ in m["files"]]).astype(np.float64)
    mean, std = arr[:, :4], arr[:, 4:]
    np.testing.assert_allclose(info["channel_mean"], mean.mean((0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(info["channel_std"], np.sqrt((mean**2 + std**2).mean((0, 2, 3))
                                                            - mean.mean((0, 2, 3))**2), rtol=1e-9)
    # a rerun of plain `data prepare` on the latents keeps what they are
    assert main(["data", "prepare", str(lat)]) == 0
    assert json.loads((lat / "fasttrain-manifest.json").read_text())["latents"] == info


def test_encoding_resumes_and_refuses_another_encoding(folder, tmp_path, monkeypatch):
    import fasttrain.data.encode as enc

    imgs, vae = folder
    m = build_manifest(imgs, progress=False)
    out = tmp_path / "lat"
    saved, real = [], enc._save

    def dies_after_five(path, arr):
        if len(saved) == 5:
            raise KeyboardInterrupt
        real(path, arr)
        saved.append(path)

    monkeypatch.setattr(enc, "_save", dies_after_five)
    with pytest.raises(KeyboardInterrupt):
        encode_with_vae(m, out, str(vae), image_size=16, batch_size=2, progress=False)
    assert len(list(out.rglob("*.npy"))) == 5 and not (out / "fasttrain-manifest.json").exists()
    first = {p: np.load(p) for p in saved}
    monkeypatch.setattr(enc, "_save", lambda path, arr: (saved.append(path), real(path, arr)))
    lm = encode_with_vae(m, out, str(vae), image_size=16, batch_size=2, progress=False)
    assert len(saved) == 5 + 3 and lm["num_files"] == 8 and not (out / "fasttrain-encoding.json").exists()
    assert all(np.array_equal(np.load(p), a) for p, a in first.items())  # the first five were not redone

    other = save_tiny_vae(tmp_path / "other", seed=1)
    with pytest.raises(DataError, match="another VAE"):
        encode_with_vae(m, out, str(other), image_size=16, progress=False)
    with pytest.raises(DataError, match="another image size"):
        encode_with_vae(m, out, str(vae), image_size=32, progress=False)


@pytest.mark.parametrize("norm", ["vae", "channel", "none"])
def test_latent_batches_are_posterior_draws_normalised_and_resumable(folder, tmp_path, norm):
    imgs, vae = folder
    encode_with_vae(build_manifest(imgs, progress=False), tmp_path / "lat", str(vae), image_size=16, progress=False)
    d = DataConfig(name="latents", batch_size=4, root=str(tmp_path / "lat"), backend="torch", latent_norm=norm)
    stream, info = build_data(d, seed=3)
    rec = info.latents
    assert info.channels == 4 and rec["norm"] == norm and rec["posterior"]
    shift, scale = torch.tensor(rec["shift"]), torch.tensor(rec["scale"])
    expect = {"vae": ([0.25] * 4, [0.5] * 4), "none": ([0.0] * 4, [1.0] * 4),
              "channel": (rec["channel_mean"], [1 / s for s in rec["channel_std"]])}[norm]
    torch.testing.assert_close(shift, torch.tensor(expect[0]))
    torch.testing.assert_close(scale, torch.tensor(expect[1]))
    batches = [next(stream) for _ in range(4)]
    state = stream.state_dict()
    after = [next(stream) for _ in range(2)]
    # two epochs see each image twice, with different draws: its posterior, not a fixed latent
    x = torch.cat([b[0] for b in batches]) / scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    assert x.shape == (16, 4, 8, 8) and not torch.allclose(x[:8].sort(0).values, x[8:].sort(0).values)
    again, _ = build_data(d, seed=3)
    again.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(after, [next(again) for _ in range(2)]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if norm == "channel":  # standardised: the draws have about unit variance per channel
        assert 0.5 < float(torch.cat([b[0] for b in batches]).std()) < 1.5


def test_without_diffusers_it_is_one_line_naming_the_extra(folder, tmp_path, monkeypatch, capsys):
    import sys

    imgs, vae = folder
    monkeypatch.setitem(sys.modules, "diffusers", None)  # as if it were not installed
    assert main(["data", "prepare", str(imgs), "--vae", str(vae), "--image-size", "16"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fasttrain: error: data prepare --vae needs the optional package diffusers "
                   "(pip install 'fasttrain[diffusers]')"]
    assert main(["train", f"run_dir={tmp_path / 'r'}", "model.name=diffusers", "train.steps=1"]) == 1
    assert "fasttrain[diffusers]" in capsys.readouterr().err
