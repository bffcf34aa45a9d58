"""The Triton kernels compiled by the real compiler for sm_80 and sm_90 on this machine (no GPU needed),
checked: every specialisation compiles, none spills, and every row stream moves the widest vectors
its alignment allows (128-bit for aligned fp32, bf16 and fp16 rows). kernels/aot.py does the work in a
subprocess without TRITON_INTERPRET (compiled and interpreted Triton cannot share a process).

CI compiles `--set ci`: every argument type and alignment and every constexpr value of every kernel at
least once, for both targets (about a minute on 2 cores); FASTTRAIN_AOT_SET=full compiles all of them
(several minutes; bench/kernels_aot.py writes that table to bench/results/kernels-aot.md). The CUDA
C++ ops of fasttrain._C are checked from their compiled code (registers and spills; their accesses are
scalar by design, reported, not asserted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.kernels import aot, aot_inspect, native
from fasttrain.kernels.backend import has_triton

pytestmark = pytest.mark.skipif(not has_triton(), reason="triton is not installed")
HERE = Path(__file__).parent
SET = os.environ.get("FASTTRAIN_AOT_SET", "ci")
TOYS = "aot_toys"  # tests/kernels/aot_toys.py: kernels the check must reject


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "fasttrain.kernels.aot", "--set", SET, "--json", str(out),
                          "--modules", *aot.MODULES, TOYS], env=env, capture_output=True, text=True,
                         timeout=3600)
    assert out.exists(), run.stdout + run.stderr
    res = json.loads(out.read_text())
    res["stdout"] = run.stdout
    return res


ROW_KERNELS = ("noise_kernel", "loss_kernel", "mixed_loss_kernel")  # those with row streams
KERNELS = ROW_KERNELS + ("moments_kernel",)  # + the pyramid noise's std (regenerates noise, reads no rows)
TOY_KERNELS = ("arange_kernel", "spill_kernel", "copy_kernel")


def ours(rows):
    return [r for r in rows if r["module"] != TOYS]


def toy_problems(problems):
    return [p for p in problems if p.startswith(TOY_KERNELS) or f"{TOYS}." in p]


def test_every_specialisation_compiles_for_sm80_and_sm90_without_spills_or_narrow_rows(result):
    bad = [p for p in result["problems"] if p not in toy_problems(result["problems"])]
    assert not bad, "\n".join(bad)
    rows = ours(result["rows"])
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in KERNELS for a in (80, 90)}
    assert all("registers" in r for r in rows)
    print(result["stdout"].splitlines()[0])


def test_every_option_and_tile_extreme_is_compiled_for_both_targets(result):
    """Each value of every flag and of every constexpr with up to 5 values, and the smallest, median
    and largest of each longer range (the tile sizes), compiled on each target."""
    compiled: dict = {}
    for r in ours(result["rows"]):
        for name, v in r["constexprs"].items():
            compiled.setdefault((r["kernel"], name, r["arch"]), set()).add(v)
    for key, values in result["summary"]["constexpr_values"].items():
        kernel, name = key.split(".")
        if kernel in TOY_KERNELS:
            continue
        want = set(values) if len(values) <= 5 else {values[0], values[len(values) // 2], values[-1]}
        for arch in (80, 90):
            assert want <= compiled[(kernel, name, arch)], (kernel, name, arch)


def test_aligned_rows_are_read_and_written_128_bits_at_a_time(result):
    """Not vacuous: every kernel has fp32 and bf16 rows, read and written, that the check held to 128 bits."""
    seen = set()
    for r in ours(result["rows"]):
        for a in r["accesses"]:
            if a.get("expected") == 128 and a["widths"] == [128]:
                seen.add((r["kernel"], r["arch"], a["dtype"], a["op"]))
    want = {(k, arch, dt, op) for k in ROW_KERNELS for arch in (80, 90) for dt in ("fp32", "bf16")
            for op in ("load", "store")}
    assert not want - seen, sorted(want - seen)


def test_the_check_names_kernel_specialisation_and_target_of_each_failure(result):
    """The kernels of aot_toys.py, each failing for its reason, on each target."""
    toys = toy_problems(result["problems"])
    src = (HERE / "aot_toys.py").read_text().splitlines()
    load, store = (1 + next(i for i, ln in enumerate(src) if text in ln) for text in ("v = tl.load(x_ptr + b * D",
                                                                                       "tl.store(y_ptr + b * D"))
    for arch in (80, 90):
        assert any(p.startswith("arange_kernel[case=arange | ]") and f"sm_{arch}: does not compile: "
                   "CompilationError" in p and "constexpr" in p for p in toys), toys
        assert any(p.startswith("spill_kernel[case=spill | BLOCK=4096]") and f"sm_{arch}: spills (" in p
                   for p in toys), toys
        for line, op in ((load, "load(x_ptr)"), (store, "store(y_ptr)")):
            assert any(p.startswith("copy_kernel[case=copy D=1020 | BLOCK=1024 FLAG=False]") and
                       f"sm_{arch}: line {line} {op} (fp32) moves 32-bit accesses, 128-bit expected" in p
                       for p in toys), toys
    assert "copy_kernel.FLAG: only [False] in aot_toys.specializations(); add the launches that set it" in toys
    assert len(toys) == 9, toys


def test_the_cuda_ops_of_the_native_extension_do_not_spill():
    """Registers and stack of the CUDA C++ kernels of fasttrain._C, sm_80 and sm_90, from the library
    itself (cuobjdump); a stack of 0 means no spills. Their loads are scalar by design (one element per
    thread per step, any dtype through one code path): reported in the table, not asserted."""
    if not native.available("cpu"):
        pytest.skip("fasttrain._C is not built")
    import torch

    if not torch.ops.fasttrain_C.has_cuda():
        pytest.skip("fasttrain._C was built without its CUDA part (no nvcc)")
    import fasttrain._C as ext

    rows = aot_inspect.native_resources(ext.__file__)
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    assert {n for r in rows for n in ("noise_kernel", "loss_kernel") if n in r["name"]} == {"noise_kernel",
                                                                                            "loss_kernel"}
    spilled = [f"{r['name']} {r['arch']}: stack {r['stack']}, local {r['local']}" for r in rows
               if r["stack"] or r["local"]]
    assert not spilled, spilled
    assert all(0 < r["registers"] <= 255 and sum(r["accesses"].values()) > 0 for r in rows)


def test_access_widths_come_from_the_ptx_by_source_line():
    ptx = """.file 1 "/k.py"
\t.loc 1 7 0
\t// begin inline asm
\t.loc 1 7 0
\t.loc 1 8 0
\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\t// end inline asm
\t.loc 1 9 0
\tst.global.b16 [%rd2], %rs1;
\tcp.async.cg.shared.global [ %r5 + 0 ], [ %rd3 + 0 ], 0x10, %r6;
\tatom.global.gpu.acq_rel.add.f32 %f1, [%rd4], %f2;
"""
    got = aot_inspect.accesses_by_line(ptx)
    assert got == {("/k.py", 7): [("ld", 128)], ("/k.py", 9): [("st", 16), ("ld", 128), ("atom", 32)]}


def test_ptxas_report_parsing():
    log = ("ptxas info    : Function properties for k\n"
           "    56 bytes stack frame, 20 bytes spill stores, 24 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 56 bytes cumulative stack size, 64 bytes smem\n")
    assert aot_inspect.parse_ptxas(log) == dict(registers=128, spill_stores=20, spill_loads=24, stack=56, smem=64)
    with pytest.raises(ValueError):
        aot_inspect.parse_ptxas("ptxas info : 0 bytes gmem")
