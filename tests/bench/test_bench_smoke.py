"""The kernel benchmark's cases run (tiny shapes): keeps bench/ working between GPU runs."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from cases import Case, count_launches, machine  # noqa: E402


def test_bench_cases_run_on_tiny_shapes():
    case = Case((3, 2, 4, 4), "cpu")
    assert case.floor_bytes == 3 * 2 * 4 * 4 * (2 * 4 + 3 * 2)
    for fn in (case.eager, lambda: case.fused(backend="torch"), lambda: case.fused(backend="interpret")):
        loss = fn()
        assert torch.isfinite(loss) and case.pred.grad is not None
    assert count_launches(case.eager) > count_launches(lambda: case.fused(backend="torch")) / 10
    assert "torch" in machine()
