"""Installing without a compiler: setup.py leaves fasttrain._C out with one line and succeeds, and
fasttrain then chooses the torch backend (simulated: no C++ compiler, no cmake)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttrain.kernels import backend, native

ROOT = Path(__file__).parents[2]


def _build_ext(tmp_path, **env):
    env = {**os.environ, "FASTTRAIN_BUILD_DIR": str(tmp_path / "build"), "FASTTRAIN_CUDA": "0", **env}
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env, why", [({"CXX": "/nonexistent/g++"}, "compiler"),
                                      ({"CMAKE": "/nonexistent/cmake"}, "cmake not found")])
def test_install_without_a_compiler_says_so_in_one_line(tmp_path, env, why):
    run = _build_ext(tmp_path, **env)
    assert run.returncode == 0, run.stderr
    notes = [ln for ln in run.stderr.splitlines() if ln.startswith("fasttrain:")]
    assert len(notes) == 1 and "fasttrain._C not built" in notes[0] and why in notes[0], run.stderr
    assert "torch backend" in notes[0]
    assert not list((tmp_path / "lib").rglob("_C*.so"))


def test_failed_build_is_an_error_when_the_extension_is_required(tmp_path):
    run = _build_ext(tmp_path, CMAKE="/nonexistent/cmake", FASTTRAIN_NATIVE="1")
    assert run.returncode != 0 and "fasttrain._C was not built: cmake not found" in run.stderr


def test_without_the_extension_auto_is_the_reference(monkeypatch):
    monkeypatch.setattr(native, "_LOADED", False)
    monkeypatch.setattr(native, "_ERROR", "fasttrain._C is not built (simulated)")
    assert backend.resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend 'native' is not available for cpu tensors: .*simulated"):
        backend.resolve_backend("native", torch.device("cpu"))


def test_cuda_part_is_compiled_for_a100_and_h100():
    """Where nvcc was found, the CUDA ops are in the module as sm_80 and sm_90 code (checked here on
    a machine without a GPU; tests/kernels/test_gpu.py runs them where there is one)."""
    if not native.available("cpu"):
        pytest.skip("fasttrain._C is not built")
    if not torch.ops.fasttrain_C.has_cuda():
        pytest.skip("fasttrain._C was built without its CUDA part (no nvcc)")
    import fasttrain._C as ext

    blob = Path(ext.__file__).read_bytes()
    assert b"sm_80" in blob and b"sm_90" in blob
