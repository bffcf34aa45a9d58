"""CPU threads on a shared machine.

torch's CPU ops run on libgomp (GNU OpenMP) threads, one per core by default. By default libgomp's
idle threads spin for a while before they sleep (OMP_WAIT_POLICY unset). On a 2-core machine where
another process holds one core, each parallel region then waits for a thread that spins on, or is
scheduled against, the busy core: the default run measured 1.5–5 s per step instead of ~30–60 ms
(bench/threads.py). With the PASSIVE wait policy idle threads yield at once, and the same run stays
near its single-thread speed on a busy machine while keeping two threads' speed on a free one.

The policy is read once, when torch loads libgomp, so it must be in the environment before `import
torch`: the command line (cli.py), the tests (tests/conftest.py) and the benchmarks set it first
(`prepare_openmp`); a user's own setting always wins. A Python program that imports fasttrain after
torch keeps whatever policy torch started with (call `prepare_openmp()` before importing torch).
`train.threads=N` still forces N threads; 0 keeps torch's default (one per core).
"""
from __future__ import annotations

import os
import sys

WAIT_POLICY = "PASSIVE"


def prepare_openmp() -> bool:
    """Put OpenMP's wait policy in the environment unless the user chose one; returns whether it can
    still take effect (torch not imported yet)."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return "torch" not in sys.modules


def set_threads(n: int) -> None:
    """`train.threads`: N > 0 forces N intra-op threads; 0 keeps torch's default."""
    if n > 0:
        import torch

        torch.set_num_threads(n)
