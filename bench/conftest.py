"""Collect the kernel benchmarks of one run into bench/results/, with ratios measured side by side."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results"


def pytest_sessionfinish(session, exitstatus):
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None or not bs.benchmarks:
        return
    from cases import machine

    rows = []
    for b in bs.benchmarks:
        if not b.stats or not b.stats.rounds:  # a benchmark that failed or did not run
            continue
        info = b.extra_info
        sec = b.stats.median
        rows.append({"shape": b.group, "impl": info["impl"], "median_ms": sec * 1e3, "launches": info["launches"],
                     "floor_GBps": info["floor_bytes"] / sec / 1e9, "device": info["device"]})
    if not rows:
        return
    for r in rows:
        base = {x["impl"]: x["median_ms"] for x in rows if x["shape"] == r["shape"]}
        r["speedup_vs_eager"] = base["eager"] / r["median_ms"] if "eager" in base else None
        r["speedup_vs_compile"] = base["compile_ref"] / r["median_ms"] if "compile_ref" in base else None
    device = rows[0]["device"]
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "command": " ".join(sys.argv),
           "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"kernels-{device}.json").write_text(json.dumps(out, indent=2))
    lines = [f"# Diffusion math per step (forward + backward), {device}", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "| batch | impl | median ms | launches | GB/s at the byte floor | × vs eager | × vs compile |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['impl']} | {r['median_ms']:.3f} | {r['launches']} | {r['floor_GBps']:.1f} | "
                     f"{r['speedup_vs_eager']:.2f} | {r['speedup_vs_compile'] or float('nan'):.2f} |")
    lines += ["", "launches: CUDA kernels per call on GPU; on CPU, top-level aten ops dispatched."]
    (RESULTS / f"kernels-{device}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
