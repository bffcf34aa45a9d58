"""The architecture's contracts (docs/architecture.md), each asserted: the kernel backend is decided at
set-up and an impossible one is one line before any file is written."""
import pytest
import torch

from fasttrain.cli import main
from fasttrain.diffusion.objective import kernel_backend
from fasttrain.errors import ConfigError, InvalidInput
from fasttrain.kernels import native

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "train.steps=2"]


# -- one boundary between fasttrain and the kernels ------------------------------------------------------
@pytest.mark.parametrize("backend, needle", [("triton", "needs CUDA tensors"), ("native", "not available")])
def test_an_impossible_backend_is_one_line_before_any_file_is_written(tmp_path, capsys, monkeypatch, backend,
                                                                      needle):
    if backend == "native":  # a machine where fasttrain._C was not built
        monkeypatch.setattr(native, "available", lambda device: False)
    elif torch.cuda.is_available():
        pytest.skip("triton runs on this machine's CUDA device")
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", f"diffusion.backend={backend}"] + TINY) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fasttrain: error: bad value for 'diffusion.backend'"), err
    assert needle in err[0]
    assert not run.exists()  # the run folder was never claimed: no lock, no config, no crash.pt


def test_the_backend_is_decided_once_at_the_boundary():
    assert kernel_backend("torch", "cpu") == "torch"
    assert kernel_backend("auto", "cpu") == ("native" if native.available("cpu") else "torch")
    with pytest.raises(ConfigError, match=r"^bad value for 'diffusion.backend': 'interpret' \(.*CPU tensors"):
        kernel_backend("interpret", torch.device("cuda"), key="diffusion.backend")  # CUDA data
    with pytest.raises(InvalidInput, match="needs CUDA tensors") as e:
        kernel_backend("triton", "cpu")
    assert not isinstance(e.value, ConfigError)
