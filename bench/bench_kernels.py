"""pytest-benchmark: the per-step diffusion math, eager vs torch.compile(reference) vs fused ops.

    pytest bench/bench_kernels.py --benchmark-only          # writes bench/results/kernels-<device>.{json,md}

On CPU only the torch backends run (the Triton interpreter is a correctness tool, ~1000× slower);
on CUDA the fused Triton ops run too. Ratios are computed from the same run (bench/conftest.py).
"""
import pytest
import torch

from cases import SHAPES, Case, count_launches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["eager", "compile_ref"] + (["fused"] if DEVICE == "cuda" else [])
_cases: dict = {}


def _case(name):
    if name not in _cases:
        _cases[name] = Case(SHAPES[name], DEVICE)
    return _cases[name]


def _run(case, impl):
    fn = getattr(case, impl)

    def call():
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    return call


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", IMPLS)
def test_diffusion_math(benchmark, shape, impl):
    case = _case(shape)
    call = _run(case, impl)
    launches = count_launches(call)
    benchmark.group = shape
    benchmark.extra_info.update({"impl": impl, "shape": list(SHAPES[shape]), "launches": launches,
                                 "floor_bytes": case.floor_bytes, "device": DEVICE})
    rounds = 20 if DEVICE == "cuda" else 3
    benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)
