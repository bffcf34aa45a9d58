"""Backend choice (kernels/backend.py): one-line errors, and what "auto" picks. Without fasttrain._C:
test_native_build.py."""
import pytest
import torch

from fasttrain.kernels import native
from fasttrain.kernels.backend import resolve_backend


def test_backend_errors():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            resolve_backend("triton", torch.device("cpu"))
        assert resolve_backend("auto", torch.device("cpu")) in ("torch", "native")


@pytest.mark.skipif(not native.available("cpu"), reason="fasttrain._C is not built")
def test_auto_backend_is_native_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "native"
    assert torch.ops.fasttrain_C.cpu_capability() in ("default", "avx2", "avx512")
