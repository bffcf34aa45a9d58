"""Collect the kernel benchmarks of one run into bench/results/kernels-<device>.{json,md}, with ratios
measured side by side: each benchmark round of bench_diffusion_loss.py runs every implementation once
(interleaved), and the ratios are of the medians over those rounds."""
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_sessionfinish(session, exitstatus):
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None or not bs.benchmarks:
        return
    opt = session.config.option
    if exitstatus != 0 or getattr(opt, "keyword", "") or getattr(opt, "markexpr", ""):
        why = "a benchmark failed" if exitstatus != 0 else "only a subset ran (-k/-m)"
        print(f"\nnot writing bench/results/kernels-*: {why}; the committed results are kept", file=sys.stderr)
        return
    from cases import machine

    rows = []
    for b in bs.benchmarks:
        info = b.extra_info
        if not b.stats or not b.stats.rounds or "times_s" not in info:  # failed or did not run
            continue
        med = {impl: statistics.median(ts) for impl, ts in info["times_s"].items()}
        for impl, sec in med.items():
            rows.append({"shape": b.group, "impl": impl, "median_ms": sec * 1e3,
                         "min_ms": min(info["times_s"][impl]) * 1e3,
                         "rounds": len(info["times_s"][impl]), "launches": info["launches"][impl],
                         "floor_GBps": info["floor_bytes"] / sec / 1e9, "device": info["device"],
                         "threads": info["threads"],
                         "speedup_vs_eager": med["eager"] / sec if "eager" in med else None,
                         "speedup_vs_compile": med["compile_ref"] / sec if "compile_ref" in med else None})
    if not rows:
        return
    device = rows[0]["device"]
    name = f"kernels-{device}" + (f"-{rows[0]['threads']}thread" if device == "cpu" and rows[0]["threads"] != 2 else "")
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "command": " ".join(sys.argv),
           "rows": rows}
    lines = [f"# Diffusion math per step (forward + backward), {device}", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "| batch | impl | median ms | min ms | launches | GB/s at the byte floor | × vs eager | × vs compile |",
             "|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        lines.append(f"| {r['shape']} | {r['impl']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['launches']} | "
                     f"{r['floor_GBps']:.1f} | {r['speedup_vs_eager'] or nan:.2f} | "
                     f"{r['speedup_vs_compile'] or nan:.2f} |")
    lines += ["", f"{rows[0]['rounds']} interleaved rounds per batch (every implementation once per round, rotating "
              f"order), {rows[0]['threads']} threads on CPU; ratios are of the medians.",
              "launches: CUDA kernels per call on GPU; on CPU, top-level ops dispatched (aten and fasttrain)."]
    from _env import Results

    with Results() as res:
        res.text(f"{name}.json", json.dumps(out, indent=2))
        res.text(f"{name}.md", "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
