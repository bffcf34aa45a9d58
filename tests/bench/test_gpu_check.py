"""The GPU check (bench/gpu_check.sh, bench/gpu_plan.py) made ready without a GPU: its plan fits one call,
every part's dry command runs its real script with the real flags, the machine's import rules catch a
package that would be missing there, the CUDA-graph columns of the kernel tables are built right, and
the whole dry run passes on the CPU."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_plan  # noqa: E402

# flags only the real run needs (the device, pytest's workers and marks, quiet); every other real flag is given
# to the dry command too, so that its script's parser has seen it
REAL_ONLY = {"--device", "-n", "-m", "-q"}


def _flags(cmd):
    return {a for a in cmd if a.startswith("-") and not a.lstrip("-").isdigit()}


def test_the_first_call_fits_one_command_and_the_parts_are_complete():
    first = [p for p in gpu_plan.PARTS if p.call == "first"]
    assert sum(p.limit for p in first) <= gpu_plan.FIRST_BUDGET <= 540
    assert [p.name for p in first][:3] == ["install-wheels", "install-fasttrain", "machine"]
    assert [p.name[0] for p in first[3:]] == ["a", "b", "b", "c", "c", "d"]  # the headline figures, in order
    assert {p.call for p in gpu_plan.PARTS} == {"first", "extra", "second"}
    names = [p.name for p in gpu_plan.PARTS]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[a-z0-9-]+", n) for n in names)
    for p in gpu_plan.PARTS:
        dry = p.dry or p.cmd
        assert 0 < p.limit <= 300
        scripts = [a for a in p.cmd if a.endswith(".py") and not a.startswith("-")]
        assert scripts == [a for a in dry if a.endswith(".py") and not a.startswith("-")]  # the same script
        assert all((REPO / s).is_file() for s in scripts), scripts
        assert _flags(p.cmd) - REAL_ONLY <= _flags(dry), p.name
        assert all((REPO / a.split("::")[0]).exists() for a in p.cmd if a.startswith("tests/"))
    lines = gpu_plan.plan_lines(gpu_plan.PARTS, gpu_plan.FIRST_BUDGET)
    assert f"first call: {sum(p.limit for p in first)} s of limits (budget 540 s)" in lines[-1]


def _guarded(*args, wheels=None):
    env = {**os.environ, "PYTHONPATH": str(REPO / "bench" / "gpu_sim")}
    env.pop("FASTTRAIN_GPU_SITE", None)
    if wheels is not None:
        env["FASTTRAIN_GPU_WHEELS"] = str(wheels)
    return subprocess.run([sys.executable, str(REPO / "bench" / "gpu_machine.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_machines_import_rules_refuse_what_it_lacks_and_allow_what_it_holds_or_a_wheel_carries(tmp_path):
    dali = _guarded("--import", "nvidia.dali")
    assert dali.returncode != 0
    assert "lent GPU machine lacks nvidia-dali-cuda130 and bench/gpu_wheels.txt carries no wheel" in dali.stderr
    ok = _guarded("--import", "omegaconf", "scipy")  # carried; held there
    assert ok.returncode == 0, ok.stderr
    assert "omegaconf: " in ok.stdout and "scipy: " in ok.stdout
    pins = tmp_path / "pins.txt"  # the wheel list with omegaconf left out: what the dry run would then report
    pins.write_text("".join(ln + "\n" for ln in (REPO / "bench" / "gpu_wheels.txt").read_text().splitlines()
                            if not ln.startswith("omegaconf")))
    lost = _guarded("--import", "omegaconf", wheels=pins)
    assert lost.returncode != 0 and "lacks omegaconf" in lost.stderr


def test_every_package_our_code_imports_that_the_machine_lacks_is_carried_but_dali():
    import gpu_machine

    lacking = gpu_machine.our_imports()
    assert {"omegaconf", "diffusers", "torch-fidelity", "webdataset"} <= set(lacking)
    assert set(lacking) - set(gpu_machine.wheels()) == {"nvidia-dali-cuda130"}  # its wheel is far over 64 MiB
    assert "fasttrain/config.py" in lacking["omegaconf"]


def test_the_kernel_tables_cuda_graph_columns():
    """bandwidth() and table() with a stand-in capture (each call itself): the columns a GPU fills, on
    the CPU; a capture that fails is reported and the rest goes on."""
    import bench_diffusion_loss as bd


    def capture(fn):
        if getattr(fn, "func", None) is not None and fn.func.__name__ == "compile_ref":
            raise RuntimeError("cannot capture this\nsecond line")
        return fn

    try:
        with torch._dynamo.config.patch(debug_backend_override=">=0:eager"):  # compile_ref traced, not built
            rows = bd.bandwidth((2, 3, 4, 4), rounds=1, calls=1, interpret=False, capture=capture)
    finally:
        torch._dynamo.reset()  # nothing compiled under the override stays for later tests
    for r in rows:
        r["case"] = "2x3x4x4"
    by = {r["impl"]: r for r in rows}
    assert by["eager"]["graph_us"] > 0 and by["eager"]["graph_fwd_us"] > 0
    assert by["compile_ref"]["graph_us"] is None and len(by["compile_ref"]["graph_failed"]) == 2
    lines, notes = bd.table(rows, copy=10.0, rounds=1, calls=1)
    assert len(lines) == 2 + len(rows) and all(ln.count("|") == 13 for ln in lines)
    assert any(n.startswith("Not captured: 2x3x4x4 compile_ref graph fwd+bwd: RuntimeError: cannot capture this")
               for n in notes)
    if "native" in by and by["native"]["graph_bwd_us"] > 0:
        assert "fwd_GBps" in by["native"]


def test_the_mixed_loss_benchmark_times_captured_calls_beside_plain_ones():
    import bench_mixed_loss as bm

    times = bm.run("pixel", "cpu", ["eager", "torch"], shape=(2, 4, 3, 3), rounds=2, calls=1, capture=lambda fn: fn)
    assert set(times) == {"eager", "torch", "eager graph", "torch graph"}
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())
    # the table's CUDA graph columns, filled as on a GPU (the dry run's plain CPU run leaves them "—")
    rows = bm.rows_of("pixel", times, ["eager", "torch"])
    by = {r["impl"]: r for r in rows}
    assert by["torch"]["graph_ms"] > 0 and by["eager"]["x_vs_eager_graph"] == 1.0
    assert by["torch"]["x_vs_eager_graph"] == pytest.approx(by["eager"]["graph_ms"] / by["torch"]["graph_ms"])
    lines = bm.table(rows, {"triton": "needs CUDA"})
    assert len(lines) == 2 + len(rows) + 1 and all(ln.count("|") == 9 for ln in lines)
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]  # torch's row
    assert cells[:2] == ["pixel", "torch"] and float(cells[4]) == pytest.approx(by["torch"]["graph_ms"], abs=1e-4)
    assert float(cells[7]) == pytest.approx(by["torch"]["x_vs_eager_graph"], abs=0.006)
    assert lines[-1].startswith("| both | triton | skipped: needs CUDA |")
    plain = bm.table(bm.rows_of("pixel", {k: v for k, v in times.items() if "graph" not in k}, ["eager", "torch"]), {})
    assert [c.strip() for c in plain[2].split("|")[1:-1]][4::3] == ["—", "—"]


@pytest.mark.slow
def test_the_dry_run_runs_every_part_on_the_cpu():
    """`bash bench/gpu_check.sh --dry-run`: every part's dry command under the machine's import rules
    (~20 processes that each import torch: 2-4 minutes on 2 cores). Without wheels/ (a fresh clone) the
    wheelhouse's install is skipped and the imports are checked against bench/gpu_wheels.txt."""
    if torch.cuda.is_available():
        pytest.skip("the dry run hides CUDA; on a GPU machine run bench/gpu_check.sh itself")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)  # (the runner drops the PYTEST_* variables an xdist worker would hand on)
    out = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--dry-run", "--quiet"], env=env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    n = len(gpu_plan.PARTS)
    wheels = any((REPO / "wheels").glob("*.whl"))
    want = f"dry run: {n} of {n} parts ok" if wheels else f"dry run: {n - 1} of {n} parts ok (install-wheels skipped"
    assert want in out.stdout, out.stdout[-3000:]
    budget = re.search(r"first call: (\d+) s of limits \(budget 540 s\)", out.stdout)
    assert budget and int(budget.group(1)) <= 540
    carried = re.search(r"each carried by bench/gpu_wheels.txt \([^)]*\): (.*)", out.stdout).group(1)
    assert {"omegaconf", "diffusers"} <= set(carried.split(", "))
    assert "gpu check: every part that ran is ok" in out.stdout
