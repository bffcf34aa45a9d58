"""The convergence benchmark's arithmetic on synthetic curves with known answers, and its quick mode."""
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from convergence_lib import Crossing, first_crossing, seconds_at, summarize, value_at  # noqa: E402


def test_crossing_interpolates_between_evaluations():
    c = first_crossing([100, 200, 300], [10.0, 6.0, 2.0], 4.0)
    assert c == Crossing(250.0, False)  # 6 → 2 between 200 and 300: 4 is reached halfway
    assert first_crossing([100, 200], [10.0, 3.0], 10.0) == Crossing(100.0, False)  # a tie at an evaluation counts


def test_crossing_takes_the_first_of_several_and_censors_a_curve_that_never_gets_there():
    assert first_crossing([1, 2, 3, 4], [5.0, 1.0, 6.0, 0.5], 2.0).steps == pytest.approx(1 + 3 / 4)
    never = first_crossing([100, 200, 300], [9.0, 8.0, 7.5], 5.0)
    assert never.censored and never.steps == 300
    assert first_crossing([1, 2], [float("nan"), 1.0], 2.0) == Crossing(2.0, False)  # a NaN evaluation is not a crossing


def test_ratios_and_bounds():
    base = Crossing(3000, False)
    assert Crossing(1000, False).ratio_to(base) == (3.0, "=")
    r, kind = Crossing(3000, True).ratio_to(base)  # the arm never got there: at most 1×
    assert r == 1.0 and kind == "<"
    r, kind = Crossing(1500, False).ratio_to(Crossing(3000, True))  # the baseline never did: at least 2×
    assert r == 2.0 and kind == ">"
    assert math.isnan(Crossing(5, True).ratio_to(Crossing(5, True))[0])
    s = summarize([(3.0, "="), (1.0, "<"), (2.0, "=")])
    assert s == {"median": 2.0, "min": 1.0, "max": 3.0, "bounds": 1}


def test_clock_and_values_at_fractional_steps():
    assert seconds_at(150, [0, 100, 200], [0.0, 10.0, 30.0]) == 20.0
    assert value_at(250, [200, 300], [6.0, 2.0]) == 4.0
    with pytest.raises(ValueError, match="must increase"):
        first_crossing([2, 1], [1.0, 1.0], 1.0)


@pytest.mark.slow
def test_quick_mode_writes_the_table_and_the_plot(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "convergence.py"), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for f in ("convergence.json", "convergence.md", "convergence.png"):
        assert (tmp_path / f).is_file(), f
    table = (tmp_path / "convergence.md").read_text()
    assert "| baseline | 1.00 (1.00–1.00)" in table and "| min_snr_eps |" in table
