"""Class 1: latent folders. Mixed shapes, ranks and dtypes (complex, bool, object, int, float16 beside
float32) and NaN/Inf arrays in one folder: `data prepare` names each file with its reason, and the run
says at its start (before the first step) what it leaves out, with the counts, and trains on the
folder's one layout only (the packed array holds only those); a folder with nothing usable is refused
at `data prepare` and at train start, before any step (docs/reliability.md: why the majority is kept)."""
import numpy as np
import pytest
from common import TINY, files, one_line

from fasttrain.cli import main

DIT = TINY[:-2] + ["data.name=latents", "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1",
                   "model.args.heads=2", "data.backend=torch", "train.steps=1", "data.batch_size=2"]
rng = np.random.default_rng(0)
GOOD = [rng.standard_normal((4, 4, 4)).astype(np.float32) for _ in range(6)]
ODD = {"c3.npy": (np.zeros((3, 4, 4), np.float32), "differs from the folder's shape [4, 4, 4]"),
       "s8.npy": (np.zeros((4, 8, 8), np.float32), "shape [4, 8, 8], dtype float32"),
       "rank2.npy": (np.zeros((4, 4), np.float32), "shape [4, 4] is not [C, S, S]"),
       "rank4.npy": (np.zeros((1, 4, 4, 4), np.float32), "shape [1, 4, 4, 4] is not [C, S, S]"),
       "half.npy": (np.zeros((4, 4, 4), np.float16), "dtype float16 (little-endian) differs"),
       "complex.npy": (np.ones((4, 4, 4), np.complex64), "dtype complex64 is not a floating-point type"),
       "bool.npy": (np.ones((4, 4, 4), bool), "dtype bool is not a floating-point type"),
       "int.npy": (np.ones((4, 4, 4), np.int32), "dtype int32 is not a floating-point type"),
       "object.npy": (np.array([{"a": 1}] * 4, dtype=object), "Python objects in dtype"),
       "nan.npy": (np.full((4, 4, 4), np.nan, np.float32), "holds NaN or infinite values"),
       "inf.npy": (np.where(np.eye(4, dtype=bool)[None].repeat(4, 0), np.inf, 0).astype(np.float32),
                   "holds NaN or infinite values")}


def _folder(root, arrays):
    root.mkdir()
    for name, a in arrays.items():
        np.save(root / name, a, allow_pickle=True)
    return root


def test_mixed_and_nonfinite_latents_are_named_and_never_trained_on(tmp_path, capsys):
    lat = _folder(tmp_path / "lat", {**{f"{i}.npy": a for i, a in enumerate(GOOD)},
                                     **{k: a for k, (a, _) in ODD.items()}})
    assert main(["data", "prepare", str(lat), "--pack"]) == 0
    out = capsys.readouterr().out
    assert "6 readable files" in out and "packed 6 latents of shape [4, 4, 4]" in out, out
    for name, (_, why) in ODD.items():
        assert any(ln.startswith(f"skipped {name}: ") and why in ln for ln in out.splitlines()), (name, out)
    assert "training refuses this folder until the 11 skipped file(s) are removed" in out, out
    for kind in ("latents", "packed"):  # refused before training: nothing of a run is written
        assert main(["train", f"run_dir={tmp_path / ('refused-' + kind)}", f"data.root={lat}",
                     f"data.name={kind}"] + DIT[1:]) == 1
        one_line(capsys, "11 of its 17 latent files are not usable", "data.skip_bad_latents=true", notes=True)
        assert not (tmp_path / f"refused-{kind}" / "last.pt").exists()
    for kind in ("latents", "packed"):
        assert main(["train", f"run_dir={tmp_path / kind}", f"data.root={lat}", f"data.name={kind}",
                     "data.skip_bad_latents=true"] + DIT[1:]) == 0
    err = capsys.readouterr().err
    assert ("6 usable arrays; left out: 8 unreadable and 3 of another shape or dtype ([3, 4, 4] float32 ×1, "
            "[4, 4, 4] float16 ×1, [4, 8, 8] float32 ×1)") in err, err
    packed = np.load(lat / "fasttrain-packed.npy", mmap_mode="r")
    assert packed.shape == (6, 4, 4, 4) and packed.dtype == np.float32 and np.isfinite(packed).all()


@pytest.mark.parametrize("bad", ["complex.npy", "bool.npy", "int.npy", "object.npy", "nan.npy", "inf.npy"])
def test_a_folder_with_nothing_usable_is_refused_at_prepare_and_at_train_start(tmp_path, capsys, bad):
    a, why = ODD[bad]
    lat = _folder(tmp_path / "lat", {f"{i}{bad}": a for i in range(3)})
    assert main(["data", "prepare", str(lat)]) == 1
    one_line(capsys, f"{lat} holds no usable latents: all 3 file(s)", why, notes=True)
    assert files(lat) == sorted(f"{i}{bad}" for i in range(3))  # no manifest written
    assert main(["train", f"run_dir={tmp_path / 'run'}", f"data.root={lat}"] + DIT) == 1
    one_line(capsys, "holds no readable files", notes=True)
    assert not (tmp_path / "run" / "last.pt").exists()
