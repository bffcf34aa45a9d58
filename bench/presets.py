"""The presets' own runs, as a user runs them: `fasttrain train PRESET`, timed end to end (training,
evaluations, samples, plots), with the final evaluation. Writes bench/results/presets-<device>.{json,md}.

    python bench/presets.py                          # default, digits-adaptive, digits-mixed, digits-mixed-small
    python bench/presets.py default digits-speed
    python bench/presets.py default --against main   # also the same presets at a git ref, interleaved

`--against REF` runs each preset twice in turn (REF's code first, then this tree's, for every preset):
REF's files come from `git archive REF` into a temporary folder that is put first on PYTHONPATH, with
this tree's built native extension copied in (it must be ABI-compatible: the same torch), so that both
runs see the same machine load as far as a shared machine allows.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = Path(__file__).resolve().parent / ".presets"
PRESETS = ["default", "digits-adaptive", "digits-mixed", "digits-mixed-small"]


def checkout(ref: str, into: Path) -> Path:
    """`git archive REF` unpacked into `into`, with this tree's built native extension."""
    repo = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"presets.py: error: git archive {ref!r} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    for so in (repo / "fasttrain").glob("_C*.so"):
        shutil.copy(so, into / "fasttrain" / so.name)
    return into


def run_preset(name: str, run: Path, code: Path | None) -> dict:
    """`fasttrain train NAME` as a user runs it (with `code` first on the path: another ref's package)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), *filter(None, [env.get("PYTHONPATH")])])
    t0 = time.time()
    # (`python -m` puts the working directory first on the path: REF's code runs from its own folder)
    out = subprocess.run([sys.executable, "-m", "fasttrain.cli", "train", name, f"run_dir={run}",
                          "train.progress=false", "--restart"], capture_output=True, text=True, env=env,
                         cwd=code)
    seconds = time.time() - t0
    if out.returncode != 0:
        why = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode
        raise SystemExit(f"{name} failed: {why}")
    summary = json.loads((run / "summary.json").read_text())
    ev = summary.get("eval", {})
    return {"preset": name, "seconds": seconds, "steps": summary["steps"], **{k: ev.get(k) for k in (
        "fid", "precision", "recall", "bpd", "bpd_se", "digits_confidence", "digits_classes_present",
        "digits_label_agreement")}}


def default_stem(dev: str, presets: list[str], against: str | None) -> str:
    """presets-<device> holds the full default set measured alone; a subset or a side-by-side run gets a
    stem of its own, so that it never replaces that table with fewer rows."""
    if list(presets) == list(PRESETS) and not against:
        return f"presets-{dev}"
    tail = "-".join(presets) + (f"-vs-{re.sub(r'[^A-Za-z0-9_.]+', '_', against)}" if against else "")
    return f"presets-{dev}-{tail}"


def main(argv=None) -> None:
    import torch
    from _env import Parser, Results, stem
    from cases import machine

    from fasttrain.config import presets as known

    ap = Parser(description="Time presets end to end, as a user runs them.")
    ap.add_argument("presets", nargs="*", choices=sorted(known()), metavar="PRESET",
                    help=f"presets to run (default: {' '.join(PRESETS)})")
    ap.add_argument("--against", metavar="REF", help="also run the presets with the code of this git ref, in turn")
    ap.add_argument("--out", type=stem, default=None, help="result files' stem (default: presets-<device>)")
    args = ap.parse_args(argv)
    presets = args.presets or PRESETS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_code = checkout(args.against, Path(tmp) / "ref") if args.against else None
        for name in presets:
            if ref_code is not None:
                rows.append({**run_preset(name, RUNS / f"{name}-ref", ref_code), "code": args.against})
                print(rows[-1], flush=True)
            rows.append({**run_preset(name, RUNS / name, None), "code": "this tree"})
            print(rows[-1], flush=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    info = {**machine(), "device": dev}
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv)}
    lines = [f"# Preset runs (`fasttrain train PRESET`, end to end), {dev}", "",
             f"machine: {info.get('gpu', info['cpu'])}, {info['cores']} cores, load {info['loadavg_1min']} at the "
             f"end; {json.dumps(info)}  ",
             f"when: {meta['when']}  ", f"command: `{meta['command']}`", "",
             "| preset | code | steps | wall time | FID | precision / recall | bits/dim | classifier confidence "
             "| classes | agrees with label |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def f(v, spec=".2f"):  # toy presets have no digits metrics
        return "—" if v is None else format(v, spec)

    for r in rows:
        m, s = divmod(int(round(r["seconds"])), 60)
        agree = None if r["digits_label_agreement"] is None else 100 * r["digits_label_agreement"]
        lines.append(f"| {r['preset']} | {r['code']} | {r['steps']} | {m} min {s:02d} s | {f(r['fid'])} | "
                     f"{f(r['precision'])} / "
                     f"{f(r['recall'])} | {f(r['bpd'])} ± {f(r['bpd_se'])} | {f(r['digits_confidence'], '.3f')} | "
                     f"{f(r['digits_classes_present'], 'd')}/10 | {f(agree, '.0f')}% |")
    with Results(RESULTS) as res:  # once every preset has run (a failed one exits above)
        name = args.out or default_stem(dev, presets, args.against)
        res.text(f"{name}.json", json.dumps({**meta, "rows": rows}, indent=2))
        res.text(f"{name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
