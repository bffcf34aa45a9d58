"""The convergence study's training runs (bench/convergence.py): each one `fasttrain train` in its own
process with one thread, a pool of them side by side (the longest first, so that the workers finish
together), and what the study reads back from a finished run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Job:
    path: Path               # the run directory
    args: tuple[str, ...]    # `fasttrain train` overrides (run_dir among them)
    cost: float              # relative, to start the longest first

    @property
    def label(self) -> str:
        return "/".join(self.path.parts[-4:])


def expected_cost(domain: str, batch: int, steps: int, args) -> float:
    """A rough relative cost of a run (the pilot measures the real ones)."""
    look = 5.0 if "diffusion.sampler_args.tau_grid=0" in args else 1.5 if "diffusion.sampler=adaptive" in args else 1.0
    return steps * look * (0.3 if domain == "checkerboard" else 0.5 + batch / 32)


def done(job: Job) -> bool:
    """Finished, with the same overrides (a run written before they were kept counts)."""
    kept = job.path.parent / f"{job.path.name}.args.json"
    return (job.path / "summary.json").is_file() and (not kept.is_file() or json.loads(kept.read_text()) ==
                                                      list(job.args))


def launch(args, log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "fasttrain.cli", "train", *args], stdout=f,
                              stderr=subprocess.STDOUT, env=env).returncode


def run_grid(jobs: list[Job], parallel: int, resume: bool) -> list[Job]:
    """Run every job not already done (with `resume`), `parallel` at a time; returns the failed ones."""
    jobs = list({j.path: j for j in jobs}.values())  # a run two rows share (the null seeds' baseline) runs once
    todo = sorted((j for j in jobs if not (resume and done(j))), key=lambda j: j.cost, reverse=True)
    print(f"{len(jobs) - len(todo)} runs done, {len(todo)} to go ({parallel} at a time)", flush=True)

    def one(job: Job) -> Job | None:
        if job.path.exists():  # an interrupted run starts over: its partial files would be refused
            shutil.rmtree(job.path)
        job.path.parent.mkdir(parents=True, exist_ok=True)
        (job.path.parent / f"{job.path.name}.args.json").write_text(json.dumps(list(job.args)))
        t0 = time.time()
        log = job.path.parent / f"{job.path.name}.log"
        rc = launch(job.args, log)
        print(f"  {job.label}: {'ok' if rc == 0 else f'FAILED ({rc}), see {log}'} in {time.time() - t0:.0f} s",
              flush=True)
        return None if rc == 0 else job

    with ThreadPoolExecutor(parallel) as pool:
        return [j for j in pool.map(one, todo) if j is not None]


def curve(run: Path, metric: str) -> dict | None:
    """A finished run's evaluations: {"steps", "value", "agreement"} (None if it did not finish)."""
    from fasttrain.logger import read_jsonl

    if not (run / "summary.json").is_file():
        return None
    ev = [r for r in read_jsonl(run / "metrics.jsonl") if r.get(f"eval/{metric}") is not None]
    return {"steps": [r["step"] for r in ev], "value": [r[f"eval/{metric}"] for r in ev],
            "agreement": [r.get("eval/digits_label_agreement") for r in ev]}


def adaptive_state(run: Path) -> dict | None:
    """Policy updates and the total variation of the final p(t) from uniform, from the run's checkpoint."""
    from fasttrain import checkpoint as ckpt
    from fasttrain import diffusion as fd

    if not (run / "last.pt").is_file():
        return None
    st = ckpt.read_plain(run)
    d = st["config"]["diffusion"]
    sched = fd.schedule(d["schedule"], d["T"], d["zero_terminal_snr"])
    smp = fd.timestep_sampler("adaptive", sched, **dict(d["sampler_args"]))
    smp.load_state_dict(st["objective"]["_extra_state"]["sampler"])
    p = smp.probs().double()
    return {"policy_updates": int(smp.updates), "p_tv_final": float(0.5 * (p - 1.0 / sched.T).abs().sum()),
            "p_small_t": float(p[: sched.T // 10].sum() * 10), "p_large_t": float(p[-sched.T // 10:].sum() * 10)}


def adaptive_summary(runs: list[Path]) -> dict:
    """The fewest policy updates and the median p(t) drift over an adaptive arm's runs."""
    states = [x for x in (adaptive_state(r) for r in runs) if x]
    if not states:
        return {}
    return {"policy_updates": min(x["policy_updates"] for x in states),
            "p_tv_final": sorted(x["p_tv_final"] for x in states)[len(states) // 2], "adaptive_per_seed": states}
