"""The presets' own runs, as a user runs them: `fasttrain train PRESET`, timed end to end (training,
evaluations, samples, plots), with the final evaluation. Writes bench/results/presets-<device>.{json,md}.

    python bench/presets.py                          # default, digits-adaptive, digits-mixed, digits-mixed-small
    python bench/presets.py default digits-speed
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
RUNS = Path(__file__).parent / ".presets"
PRESETS = ["default", "digits-adaptive", "digits-mixed", "digits-mixed-small"]


def main(argv=None) -> None:
    import torch
    from _env import Parser, Results

    from fasttrain.config import presets as known

    ap = Parser(description="Time presets end to end, as a user runs them.")
    ap.add_argument("presets", nargs="*", choices=sorted(known()), metavar="PRESET",
                    help=f"presets to run (default: {' '.join(PRESETS)})")
    presets = ap.parse_args(argv).presets or PRESETS
    rows = []
    for name in presets:
        run = RUNS / name
        t0 = time.time()
        out = subprocess.run([sys.executable, "-m", "fasttrain.cli", "train", name, f"run_dir={run}",
                              "train.progress=false", "--restart"], capture_output=True, text=True)
        seconds = time.time() - t0
        if out.returncode != 0:
            why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode
            raise SystemExit(f"{name} failed: {why}")
        summary = json.loads((run / "summary.json").read_text())
        ev = summary.get("eval", {})
        rows.append({"preset": name, "seconds": seconds, "steps": summary["steps"], **{k: ev.get(k) for k in (
            "fid", "precision", "recall", "bpd", "bpd_se", "digits_confidence", "digits_classes_present",
            "digits_label_agreement")}})
        print(rows[-1], flush=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "device": dev}
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv)}
    lines = [f"# Preset runs (`fasttrain train PRESET`, end to end), {dev}", "", f"machine: {json.dumps(info)}  ",
             f"when: {meta['when']}  ", f"command: `{meta['command']}`", "",
             "| preset | steps | wall time | FID | precision / recall | bits/dim | classifier confidence | classes "
             "| agrees with label |",
             "|---|---|---|---|---|---|---|---|---|"]
    def f(v, spec=".2f"):  # toy presets have no digits metrics
        return "—" if v is None else format(v, spec)

    for r in rows:
        m, s = divmod(int(round(r["seconds"])), 60)
        agree = None if r["digits_label_agreement"] is None else 100 * r["digits_label_agreement"]
        lines.append(f"| {r['preset']} | {r['steps']} | {m} min {s:02d} s | {f(r['fid'])} | {f(r['precision'])} / "
                     f"{f(r['recall'])} | {f(r['bpd'])} ± {f(r['bpd_se'])} | {f(r['digits_confidence'], '.3f')} | "
                     f"{f(r['digits_classes_present'], 'd')}/10 | {f(agree, '.0f')}% |")
    with Results(RESULTS) as res:  # once every preset has run (a failed one exits above)
        res.text(f"presets-{dev}.json", json.dumps({**meta, "rows": rows}, indent=2))
        res.text(f"presets-{dev}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
