import os

from fasttrain.parallel.cpu import prepare_openmp

# OpenMP's wait policy is read when torch loads libgomp: before the first `import torch` (fasttrain/parallel/cpu.py)
prepare_openmp()

# The Triton interpreter must be chosen before anything imports triton (triton jits its tl.rand helpers
# at import time); fasttrain itself never sets it, so the tests choose it here, once.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest  # noqa: E402

# the cache of model-file digests (fasttrain/pretrained/file_hashes.py): the session's own, never the user's ~/.cache
if "FASTTRAIN_CACHE" not in os.environ:
    import tempfile

    os.environ["FASTTRAIN_CACHE"] = tempfile.mkdtemp(prefix="fasttrain-cache-")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (.ci/run: one worker per core) each worker keeps to one intra-op thread: two
    # workers of two threads each on 2 cores only wait for each other (fasttrain/parallel/cpu.py). Tests that need
    # more threads set them themselves.
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    yield
