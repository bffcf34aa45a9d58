"""Every GPU kernel of fasttrain compiled for sm_80 and sm_90 on this machine (no GPU) and inspected:
the Triton kernels over every specialisation their launchers can produce (kernels/aot.py, --set full),
the CUDA C++ ops of fasttrain._C from the built library, and what torch.compile (inductor) generates
for the reference math and two models' forward (bench/inductor_aot.py). Writes
bench/results/kernels-aot.{md,json}: kernel × specialisation × target: registers, spills, stack,
shared memory, access widths.

    python bench/kernels_aot.py [--set full|ci] [--jobs N] [--fresh] [--no-inductor]

Exits 1 when a Triton specialisation fails the check (compile error, spill, narrow row access) or a
CUDA C++ kernel spills. TRITON_INTERPRET is removed from the environment (re-executing if needed).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# As a script only (an import, e.g. by the test that imports every bench script, must not re-execute
# its importer): compiled Triton needs TRITON_INTERPRET unset before anything imports triton.
if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)
if __name__ == "__main__" and "--fresh" in sys.argv:  # time the compiles, not Triton's cache: an empty one
    import tempfile

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fasttrain-aot-")


def widths(row: dict) -> str:
    """`x0 ld128 · xt st128`: the row streams' access widths (several when a line mixes them)."""
    parts = []
    for a in row.get("accesses", []):
        if "expected" in a:
            op = "ld" if a["op"] == "load" else "st"
            parts.append(f"{a['pointer'].removesuffix('_ptr')} {op}{'/'.join(map(str, a['widths']))}")
    return " · ".join(dict.fromkeys(parts)) or "–"


def spec_text(row: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in row["axes"].items())


def constexpr_text(row: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in row["constexprs"].items())


def summary_rows(rows: list[dict]) -> list[str]:
    out = ["| kernel | target | specialisations | registers min / median / max | spill bytes | stack bytes | "
           "shared memory bytes (Triton + static) | row streams at 128 bits where aligned |",
           "|---|---|---|---|---|---|---|---|"]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for arch in (80, 90):
            rs = [r for r in rows if r["kernel"] == kernel and r["arch"] == arch and "registers" in r]
            if not rs:
                continue
            regs = sorted(r["registers"] for r in rs)
            spills = max(r["spill_stores"] + r["spill_loads"] for r in rs)
            stack = sorted({r["stack"] for r in rs})
            smem = sorted({r["triton_smem"] + r["smem"] for r in rs})
            exp = [a for r in rs for a in r["accesses"] if a.get("expected") == 128]
            ok = sum(a["widths"] == [128] for a in exp)
            out.append(f"| `{kernel}` | sm_{arch} | {len(rs)} | {regs[0]} / {int(statistics.median(regs))} / "
                       f"{regs[-1]} | {spills} | {'/'.join(map(str, stack))} | {smem[0]}–{smem[-1]} | "
                       f"{ok} of {len(exp)} accesses |")
    return out


def short_name(name: str) -> str:
    """`loss_kernel<float>` of `void fasttrain::cuda::(anonymous namespace)::loss_kernel<float>(LossArgs, float*)`."""
    found = re.findall(r"(\w+(?:<[^()]*>)?)\(", name)
    return found[-1] if found else name


def native_rows(native: list[dict]) -> list[str]:
    out = ["| CUDA C++ kernel | target | registers | stack | local | shared | global accesses (SASS, bits × count) |",
           "|---|---|---|---|---|---|---|"]
    for r in native:
        short = short_name(r["name"])
        acc = ", ".join(f"{k}×{v}" for k, v in r["accesses"].items())
        out.append(f"| `{short}` | {r['arch']} | {r['registers']} | {r['stack']} | {r['local']} | {r['shared']} | "
                   f"{acc} |")
    return out


def full_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | specialisation | constexprs | target | registers | spills st/ld | stack | shared "
           "(Triton + static) | row streams (bits) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| `{r['kernel']}` | {spec_text(r)} | {constexpr_text(r)} | sm_{r['arch']} | "
                       f"compile error | | | | |")
            continue
        out.append(f"| `{r['kernel']}` | {spec_text(r)} | {constexpr_text(r)} | sm_{r['arch']} | {r['registers']} | "
                   f"{r['spill_stores']}/{r['spill_loads']} | {r['stack']} | {r['triton_smem']} + {r['smem']} | "
                   f"{widths(r)} |")
    return out


def measure(a) -> dict:
    """Compile and inspect: the Triton rows, the CUDA C++ kernels, inductor's kernels, the header facts."""
    import triton

    from fasttrain.kernels import aot, aot_inspect, native

    tmp = Path(a.out + ".triton.json")
    aot.main(["--set", a.set, "--jobs", str(a.jobs), "--json", str(tmp)])
    res = json.loads(tmp.read_text())
    tmp.unlink()
    nat = []
    if native.available("cpu"):
        import torch

        import fasttrain._C as ext

        if torch.ops.fasttrain_C.has_cuda():
            nat = aot_inspect.native_resources(ext.__file__)
    ind = None
    if not a.no_inductor:
        t0 = time.perf_counter()
        ind_path = Path(a.out + ".ind.json")
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "inductor_aot.py"), "--json", str(ind_path)],
                             capture_output=True, text=True)
        ind = json.loads(ind_path.read_text()) if ind_path.exists() else dict(error=run.stderr[-3000:])
        ind["seconds"] = round(time.perf_counter() - t0, 1)
        ind_path.unlink(missing_ok=True)
    ptxas = subprocess.run([aot_inspect.tool("ptxas"), "--version"], capture_output=True, text=True).stdout
    return dict(command=f"python bench/kernels_aot.py --set {a.set}{' --fresh' * a.fresh}",
                loadavg=round(os.getloadavg()[0], 1), triton=triton.__version__,
                ptxas=ptxas.strip().splitlines()[-1], aot=res, native=nat, inductor=ind)


def render(m: dict) -> list[str]:
    res, nat, ind = m["aot"], m["native"], m["inductor"]
    s = res["summary"]
    nat_problems = [r for r in nat if r["stack"] or r["local"]]
    md = [
        "# GPU kernels compiled ahead of time for sm_80 and sm_90, without a GPU",
        "",
        f"`{m['command']}` on the CI machine (2 shared CPU cores, load average {m['loadavg']}, no GPU, no CUDA "
        f"driver): triton {m['triton']}, its bundled ptxas ({m['ptxas']}). {s['specialisations']} Triton "
        f"specialisations (of {s['of']}) × 2 targets = {s['compiles']} compiles in {s['wall_seconds']} s wall "
        f"({s['compile_seconds']} s of compiling in {s['jobs']} processes, {s['capture_seconds']} s to enumerate "
        f"them through the launchers). Problems: {len(res['problems']) + len(nat_problems)}.",
        "",
        "Registers and spill bytes from ptxas -v (as Triton runs it), shared memory = Triton's dynamic request + "
        "ptxas's static bytes; the stack of the noise-drawing variants (32 bytes) is libdevice's sinf/cosf slow-path "
        "table under tl.randn, not a spill. Row streams: the width of every global load (ld) and store (st) of "
        "the kernels' row tensors, by source line, from the PTX; the check wants the widest vector the row's "
        "alignment allows (128 bits for 16-byte aligned rows with at least 16 bytes per thread).",
        "",
        "## Triton kernels, per kernel and target",
        "",
        *summary_rows(res["rows"]),
        "",
        "## CUDA C++ ops of fasttrain._C (cuobjdump on the built library)",
        "",
        *(native_rows(nat) if nat else ["fasttrain._C was not built with its CUDA part here."]),
        "",
        "Stack and local 0: no spills (asserted by tests/kernels/test_aot.py). Their loads and stores are scalar "
        "(LDG.E = 32-bit, .U16 = 16-bit, .64 for the int64 timesteps and offsets): one element per thread per step "
        "through a runtime dtype switch, a hand-written baseline; reported, not asserted.",
        "",
    ]
    if ind is not None:
        from inductor_aot import markdown

        md += ["## torch.compile (inductor): the reference math and two models' forward", "", *markdown(ind), ""]
    md += ["## Every Triton specialisation", "", *full_table(res["rows"]), ""]
    return md


def compact(m: dict) -> dict:
    """The JSON kept in bench/results: the table's facts per row, without the per-line access lists."""
    rows = [{k: r.get(k) for k in ("kernel", "axes", "constexprs", "arch", "registers", "spill_stores", "spill_loads",
                                    "stack", "smem", "triton_smem", "seconds", "error")} | {"streams": widths(r)}
            for r in m["aot"]["rows"]]
    aot = {k: v for k, v in m["aot"].items() if k != "rows"} | {"rows": rows}
    return m | {"aot": aot}


def main() -> int:
    import _env  # argument types and the results' writer (bench/ is on the path: __main__ below)

    ap = _env.Parser()
    ap.add_argument("--set", choices=("ci", "full"), default="full")
    ap.add_argument("--jobs", type=_env.count(), default=min(8, os.cpu_count() or 1))
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="compile into an empty Triton cache (timings)")
    ap.add_argument("--render", help="only write the tables again from this JSON of a previous run (uncompacted)")
    ap.add_argument("--out", default=str(RESULTS / "kernels-aot"), help="path and stem of the .md and .json")
    a = ap.parse_args()
    out = Path(a.out)
    if out.is_dir() or not out.parent.is_dir() or out.suffix in (".md", ".json"):
        ap.error(f"--out {a.out}: give a stem in an existing folder (PATH/STEM: STEM.md and STEM.json are written)")
    if a.render and not Path(a.render).is_file():
        ap.error(f"--render {a.render}: no such file")
    m = json.loads(Path(a.render).read_text()) if a.render else measure(a)
    with _env.Results(out.parent) as res:
        res.text(out.name + ".md", "\n".join(render(m)))
        res.text(out.name + ".json", json.dumps(compact(m), separators=(",", ":"), default=str))
    print(f"wrote {a.out}.md and .json")
    failed = m["aot"]["problems"] or any(r["stack"] or r["local"] for r in m["native"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
