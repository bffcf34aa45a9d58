"""CPU threads on a shared machine.

torch's CPU ops run on libgomp (GNU OpenMP) threads, one per core by default. By default libgomp's
idle threads spin for a while before they sleep (OMP_WAIT_POLICY unset). On a 2-core machine where
another process holds one core, each parallel region then waits for a thread that spins on, or is
scheduled against, the busy core: the default run measured 1.5–5 s per step instead of ~30–60 ms
(bench/threads.py). With the PASSIVE wait policy idle threads yield at once, and the same run stays
near its single-thread speed on a busy machine while keeping two threads' speed on a free one.

The policy is read once, when torch loads libgomp, so it must be in the environment before `import
torch`: the command line (cli/commands.py), the tests (tests/conftest.py) and the benchmarks set it first
(`prepare_openmp`); a user's own setting always wins. A Python program that imports fasttrain after
torch keeps whatever policy torch started with (call `prepare_openmp()` before importing torch).
`train.threads=N` still forces N threads; 0 (the default) means one thread for a CPU training run
(set_threads) and torch's default (one per core) for a GPU run. N above the cores this process may run
on (its CPU affinity) is capped there, with one warning: intra-op threads beyond the cores only wait
for each other (the default run's step took 52x as long with 16 threads as with 1 on 2 busy cores;
docs/reliability.md). Loader workers above the cores are kept (a loader waiting on slow storage can
use them) with one warning. Evaluations inside a CPU run use every core (evaluation_threads).
"""
from __future__ import annotations

import contextlib
import os
import sys

WAIT_POLICY = "PASSIVE"


def prepare_openmp() -> bool:
    """Put OpenMP's wait policy in the environment unless the user chose one; returns whether it can
    still take effect (torch not imported yet)."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return "torch" not in sys.modules


_warned: set[str] = set()


def cores() -> int:
    """The cores this process may run on (its affinity mask; os.cpu_count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _warn_once(key: str, line: str) -> None:
    if key not in _warned:
        _warned.add(key)
        print(line, file=sys.stderr)


def check_workers(n: int) -> None:
    """`data.num_workers` above the cores: kept, said once."""
    if n > cores():
        _warn_once("workers", f"fasttrain: warning: data.num_workers={n} is more than the {cores()} cores this process "
                              f"may use (kept: loader workers can wait on storage; fewer are faster on a busy CPU)")


def set_threads(n: int, cpu_run: bool = False) -> None:
    """`train.threads`: N > 0 forces N intra-op threads; 0 (auto) means one thread for a CPU run and
    torch's default otherwise. One, because the models a CPU trains are small: a second thread bought
    the default run nothing measurable on a free 2-core machine (58-81 ms per step with two spinning
    threads, 58-74 with one) and cost it 1.3-4x when another process held a core, passive or not
    (bench/results/threads-cpu.md)."""
    import torch

    if n > cores():
        _warn_once("threads", f"fasttrain: warning: train.threads={n} is more than the {cores()} cores this process "
                              f"may use: using {cores()} (threads beyond the cores only wait for each other)")
        n = cores()
    if n > 0 or cpu_run:
        torch.set_num_threads(n if n > 0 else 1)


@contextlib.contextmanager
def evaluation_threads(n: int, cpu_run: bool):
    """Evaluation inside a CPU training run (sampling 500 images at once, bits/dim over 400 held-out
    images, their features) on every core: its ops are large and batched, where a second thread pays,
    unlike the training step's tiny ones (set_threads). `n` is train.threads: a forced N (> 0) is kept
    for evaluation too, and a GPU run is left alone. The training thread count comes back after, so
    the training step's numerics do not change."""
    import torch

    if n > 0 or not cpu_run or cores() <= 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(cores())
    try:
        yield
    finally:
        torch.set_num_threads(before)
