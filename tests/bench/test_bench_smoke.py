"""The kernel benchmark's cases run (tiny shapes): keeps bench/ working between GPU runs."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

from cases import Case, count_launches, impls, machine


def test_bench_cases_run_on_tiny_shapes():
    case = Case((3, 2, 4, 4), "cpu")
    assert case.floor_bytes == 3 * 2 * 4 * 4 * (2 * 4 + 3 * 2)
    runs = [case.eager, lambda: case.fused(backend="torch"), lambda: case.fused(backend="interpret")]
    runs += [case.native] if "native" in impls("cpu") else []
    losses = []
    for fn in runs:
        loss = fn()
        assert torch.isfinite(loss) and case.pred.grad is not None and case.pred.grad.dtype == torch.bfloat16
        losses.append(loss)
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-4, atol=1e-6)  # same stream: Triton = reference
    if len(losses) > 3:
        torch.testing.assert_close(losses[3], losses[1], rtol=1e-4, atol=1e-6)  # and native
    assert case.bins.data[0].sum().item() == 3 * len(runs)
    # the fused path dispatches its two ops and the backward's one scale (what the GPU test counts in
    # kernels); the eager reference dispatches dozens
    fused = count_launches(lambda: case.fused(backend="torch"))
    assert fused <= 4 and count_launches(case.eager) >= 10 * fused
    assert "torch" in machine()


def test_mixed_loss_bench_cases_run_on_tiny_shapes():
    """bench_mixed_loss.py's implementations, and its Triton variant's call through the interpreter
    (what the benchmark times on CUDA)."""
    import bench_mixed_loss as bm

    names, skipped = bm.impls("cpu")
    assert names[:2] == ["eager", "torch"] and "triton" in skipped
    for gate in ("pixel", "timestep"):
        case = bm.Case(gate, "cpu", shape=(3, 4, 3, 3))
        runs = [getattr(case, impl) for impl in names] + [lambda case=case: case.fused("interpret", seed=1, offset=0)]
        for fn in runs:
            loss = fn()
            assert torch.isfinite(loss) and case.out.grad is not None and case.out.grad.dtype == torch.bfloat16
            assert (case.gate is None) == (gate == "pixel") and (case.gate is None or case.gate.grad is not None)
        assert case.bins.data[0].sum().item() == 3 * len(runs)


def test_noise_and_noise_std_bench_cases_run_on_tiny_shapes():
    """bench_noise.py and bench_noise_std.py: every implementation of the device, and the interpreter
    (what their Triton variant calls on CUDA), on tiny shapes; the fused noise_std equals the reference's
    std of the same noise, the eager baseline a std of the same order (its own torch.randn draws)."""
    import bench_noise
    import bench_noise_std
    from cases import impls

    from fasttrain.kernels.torch_ref_noise_std import reference_std

    case = bench_noise.Case((3, 2, 4, 5), "cpu")
    outs = [getattr(case, impl)() for impl in impls("cpu")] + [case.fused("interpret")]
    assert all(o.shape == (3, 2, 4, 5) and o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all() for o in outs)
    torch.testing.assert_close(outs[-1].float(), case.fused("torch").float(), rtol=1e-2, atol=1e-2)
    assert case.floor_bytes == 3 * 2 * 4 * 5 * (4 + 2)
    case = bench_noise_std.Case((2, 3, 8, 8), "cpu")
    want = reference_std(case.spec, (2, 3, 8, 8), 1, 0, "cpu")
    for impl in impls("cpu"):
        std = getattr(case, impl)()
        assert std.shape == () and 0.5 < float(std) < 2
    for backend in ["interpret"] + (["native"] if "native" in impls("cpu") else []):
        torch.testing.assert_close(case.fused(backend), want.reshape(()), rtol=1e-5, atol=0)


def test_every_benchmark_script_imports():
    """A script that imports a module a refactor removed fails here, not in the next benchmark run."""
    import importlib

    scripts = sorted(p.stem for p in (Path(__file__).parents[2] / "bench").glob("*.py") if p.stem != "conftest")
    assert {"bench_diffusion_loss", "bench_mixed_loss", "bench_noise", "bench_noise_std", "convergence",
            "throughput", "presets", "adaptive_digits"} <= set(scripts)
    for name in scripts:
        mod = importlib.import_module(name)
        assert mod.__file__.endswith(f"bench/{name}.py")


def test_immiscible_bench_runs_on_tiny_sizes():
    import immiscible

    rows = immiscible.run([5], [16], seeds=1, reps=1, count_ops=False)  # the profiler takes seconds
    assert [r["variant"] for r in rows] == list(immiscible.VARIANTS)
    for r in rows:
        assert r["batches"] == 2 and r["gap_mean"] >= -1e-9 and r["ms"] > 0
        assert 0 <= r["fp16_lost_mean"] < 1


def test_a_subset_of_presets_never_replaces_the_full_presets_table():
    """bench/presets.py's default result stem: the full default set alone writes presets-<device>; a subset
    or a side-by-side run (--against) writes a table of its own (it once replaced the committed table)."""
    from presets import PRESETS, default_stem

    assert default_stem("cpu", list(PRESETS), None) == "presets-cpu"
    stems = {default_stem("cpu", ["default"], None), default_stem("cpu", list(PRESETS), "main"),
             default_stem("cpu", ["default"], "origin/main~2")}
    assert "presets-cpu" not in stems and len(stems) == 3
    assert all("/" not in s and "~" not in s for s in stems)
