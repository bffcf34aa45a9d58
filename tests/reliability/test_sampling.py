"""Class 6: rank-parallel sampling and evaluation. `--npz` or `--out` into a read-only or impossible place:
one line before any image is generated; `--ref-stats` with wrong keys or shapes, NaN statistics, complex
numbers or a pickled object inside (never loaded with allow_pickle): one line naming the file, no result
written. (More ranks than images, a killed run resumed on another rank count: tests/distributed/
test_generation_ranks.py and tests/generation/test_generation.py.)"""
import numpy as np
import pytest
from common import TINY, files, one_line

from fasttrain.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("sampling") / "run"
    assert main(["train", f"run_dir={run}", "train.steps=1"] + TINY) == 0
    return run


def test_unwritable_outputs_are_refused_before_sampling(run, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    base = ["sample", "--ckpt", str(run), "--n", "2"]
    for extra, needle in ((["--out", str(tmp_path / "s"), "--npz", str(ro / "x.npz")], "is read-only"),
                          (["--out", str(ro / "s")], "is read-only"),
                          (["--out", str(tmp_path / "s"), "--npz", "/proc/x.npz"], "/proc is read-only")):
        capsys.readouterr()
        assert main(base + extra) == 1
        one_line(capsys, needle)
    assert files(tmp_path) == ["ro"] and files(ro) == []  # no sample chunk, no folder
    ro.chmod(0o755)


@pytest.mark.parametrize("arrays,needle", [
    ({"m": np.zeros(64), "s": np.eye(64)}, "holds no 'mu' and 'sigma' arrays (keys: m, s)"),
    ({"mu": np.zeros(64), "sigma": np.zeros((64, 3))}, "mu (64,) and sigma (64, 3) do not fit together"),
    ({"mu": np.full(64, np.nan), "sigma": np.eye(64)}, "mu hold NaN or infinite values"),
    ({"mu": np.zeros(64), "sigma": np.where(np.eye(64) > 0, np.inf, 0.0)}, "sigma hold NaN or infinite values"),
    ({"mu": np.zeros(64, np.complex64), "sigma": np.eye(64)}, "mu is an array of complex64, not of real numbers"),
    ({"mu": np.array([{"run": "os.system('x')"}], dtype=object), "sigma": np.eye(64)},
     "holds pickled Python objects, which fasttrain never loads"),
])
def test_reference_statistics_that_cannot_be_used_are_one_line(run, tmp_path, capsys, arrays, needle):
    stats = tmp_path / "ref.npz"
    np.savez(stats, **arrays)
    capsys.readouterr()
    out = tmp_path / "e.json"
    assert main(["eval", "--ckpt", str(run), "--n", "4", "--steps", "2", "--no-bpd", "--chunk", "2", "--ref-stats",
                 str(stats), "--out", str(out)]) == 1
    one_line(capsys, needle, str(stats), notes=True)
    assert not out.exists()
