"""pytest-benchmark of the diffusion loss op together with the noise op: the per-step diffusion math,
eager vs torch.compile(reference) vs fused ops, forward + backward.

    pytest bench/bench_diffusion_loss.py --benchmark-only   # writes bench/results/kernels-<device>.{json,md}

The two ops are timed together, as one training step runs them: the fused loss regenerates the eps
the noise op drew, while the unfused baselines keep eps in memory between the two halves, so timing
either op alone would leave out the memory traffic that fusing saves.

Implementations (cases.py): the PyTorch reference math eagerly ("eager") and under torch.compile
("compile_ref"), and every fused backend that runs on the device: on CUDA the Triton kernels, and the
native ops of fasttrain._C (C++ on CPU, CUDA C++ on GPUs) where they are built. The Triton
interpreter is a correctness tool (~1000x slower) and is left out on CPU. The variants are
interleaved: each benchmark round runs every implementation once, in a rotating order, so that load
from other processes on a shared machine hits them alike; the medians per implementation and their
ratios come from the same run (bench/conftest.py). On CPU the run uses FASTTRAIN_BENCH_THREADS threads
(default 2).
"""
import os
import time

import pytest
import torch

from cases import SHAPES, Case, count_launches, impls

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = impls(DEVICE)
if DEVICE == "cpu":
    torch.set_num_threads(int(os.environ.get("FASTTRAIN_BENCH_THREADS", "2")))


def _timed(fn):
    def call():
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return call


@pytest.mark.parametrize("shape", list(SHAPES))
def test_diffusion_math(benchmark, shape):
    case = Case(SHAPES[shape], DEVICE)
    calls = {impl: _timed(getattr(case, impl)) for impl in IMPLS}
    launches = {impl: count_launches(getattr(case, impl)) for impl in IMPLS}  # also warms (compiles)
    for call in calls.values():
        call()
    times = {impl: [] for impl in IMPLS}
    order = list(IMPLS)

    def one_round():
        for impl in order:
            times[impl].append(calls[impl]())
        order.append(order.pop(0))  # rotate, so no implementation always runs first

    rounds = 20 if DEVICE == "cuda" else 7
    benchmark.group = shape
    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"shape": list(SHAPES[shape]), "device": DEVICE, "floor_bytes": case.floor_bytes,
                                 "threads": torch.get_num_threads(), "launches": launches,
                                 "times_s": {impl: ts for impl, ts in times.items()}})
