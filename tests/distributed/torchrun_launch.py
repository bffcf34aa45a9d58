"""Launch helpers of the two-rank tests, imported by name (`from torchrun_launch import cli`): every test
folder has a conftest.py, and which one `import conftest` finds depends on what pytest imported first.
Two-rank tests run `torchrun --standalone --nproc_per_node=2` with gloo on CPU (FSDP2, DCP and compile
work there). Each launch costs a few seconds of process start-up, so checks are grouped per launch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def torchrun(args: list[str], nproc: int = 2, timeout: int = 600,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run --standalone --nproc_per_node=N ARGS`; fails the test with
    the output on a non-zero exit."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    e.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if out.returncode != 0:
        pytest.fail(f"torchrun {' '.join(args)} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return out


def cli(args: list[str], nproc: int = 2, **kw) -> subprocess.CompletedProcess:
    return torchrun(["-m", "fasttrain.cli"] + args, nproc, **kw)


def worker(check: str, out: Path, nproc: int = 2, **kw) -> dict:
    torchrun([str(HERE / "worker.py"), check, str(out)], nproc, **kw)
    return json.loads(out.read_text())
