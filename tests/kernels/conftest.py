"""Shared by the native-op tests: the `capability` fixture runs a test on every CPU kernel set this
processor supports."""
import pytest
import torch

from fasttrain.kernels import native


def _supported():
    if not native.available("cpu"):
        return []
    best = torch.ops.fasttrain_C.cpu_capability()
    return ["default", "avx2", "avx512"][: ["default", "avx2", "avx512"].index(best) + 1]


@pytest.fixture(params=_supported())
def capability(request):
    """Run the test on one CPU kernel set (each is a separately compiled copy), then restore."""
    before = torch.ops.fasttrain_C.cpu_capability()
    torch.ops.fasttrain_C.cpu_capability(request.param)
    yield request.param
    torch.ops.fasttrain_C.cpu_capability(before)
