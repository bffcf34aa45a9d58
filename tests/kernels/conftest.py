"""The `backend` fixture of the kernel tests: tests choose their backends with `harness.backends(...)`
(an indirect parametrisation), and the fixture turns each choice into a `Backend` (the op's backend
argument and the device its tensors live on), running native ones on the CPU kernel set the parameter
names, if any."""
import pytest
import torch
from harness import Backend, device_of


@pytest.fixture
def backend(request):
    name, _, cpu_set = request.param.partition("/")
    be = Backend(name, device_of(name))
    if not cpu_set:
        yield be
        return
    before = torch.ops.fasttrain_C.cpu_capability()
    torch.ops.fasttrain_C.cpu_capability(cpu_set)  # each set is a separately compiled copy of the kernels
    try:
        yield be
    finally:
        torch.ops.fasttrain_C.cpu_capability(before)
