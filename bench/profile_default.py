"""Where the default run's time goes (issue 35): a short run of the default preset, its phases timed
one by one, scaled to the whole run (4000 steps, evaluations at 2000 and at the end, samples, plots).

    python bench/profile_default.py [--steps 300] [--rounds 2] [--threads N] [--eval] [overrides ...]
    PYTHONPATH=/tmp/main-code python bench/profile_default.py --eval --out default-breakdown-cpu-main --label main

Phases of one optimizer step, measured on the trainer's own parts (the model, objective, optimizer and
EMA that `fasttrain train` builds), in the order of fasttrain/step.py's `update`:
  model forward, the diffusion math around it (timesteps, noise op, loss op, statistics), backward,
  gradient clipping/norm, the optimizer (finite check, AdamW, zero_grad), the EMA;
then the trainer's real loop (`Trainer.train_step` + the periodic actions, as `Trainer.fit` runs them)
over the same number of steps: what it costs beyond the phases is the per-step machinery (data, LR
schedule, counters, progress bar, actions that are not due). The periodic actions that are due
(the log line every 100 steps, checkpoints, the interference look-ahead every 500) are timed where they
act; `--eval` also times one evaluation (sampling, FID features, bits/dim) and the end of the run
(100 samples, plots). Set-up (imports, data, network) is timed too. Writes
bench/results/default-breakdown-cpu.{json,md} (with `--eval`; without it nothing is written).
"""
from __future__ import annotations

import time

T_START = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import _env  # noqa: E402  (OpenMP's wait policy, before torch loads it)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
T_TORCH = time.perf_counter()

from cases import machine  # noqa: E402

from fasttrain.config import read_config  # noqa: E402
from fasttrain.optim.adamw import skip_if_not_finite  # noqa: E402
from fasttrain.train import Trainer  # noqa: E402

T_IMPORTS = time.perf_counter()


def clock() -> float:
    """CPU seconds of this process (all its threads): on a shared machine the steps' own cost, which
    other processes' load changes far less than the wall time (bench/_env.py; the run's wall time is
    bench/presets.py's). With one training thread and a free core the two agree."""
    return time.process_time()


class Timer:
    """Sums of seconds by phase name."""

    def __init__(self):
        self.s = defaultdict(float)
        self.n = defaultdict(int)

    def add(self, name: str, dt: float, n: int = 1) -> None:
        self.s[name] += dt
        self.n[name] += n


def phases(tr: Trainer, steps: int, timer: Timer) -> None:
    """`steps` optimizer steps of step.py's `update`, phase by phase, on the trainer's parts (one
    micro-batch, no look-ahead: the default run's structure)."""
    p, model, opt = tr.parts, tr.parts.model, tr.parts.optimizer
    marks = {}
    pre = model.register_forward_pre_hook(lambda *a: marks.__setitem__("f0", clock()))
    post = model.register_forward_hook(lambda *a: marks.__setitem__("f1", clock()))
    try:
        for _ in range(steps):
            x0, y = next(tr.data)
            t0 = clock()
            cond = p.conditioning(y) if p.conditioning is not None else y
            loss, _ = p.objective(model, x0, cond, p.generators.timesteps)
            t1 = clock()
            loss.backward()
            t2 = clock()
            # the list the step clips (StepParts.params; an older step walked model.parameters() here)
            params = getattr(p, "params", None) or model.parameters()
            gnorm = torch.nn.utils.clip_grad_norm_(params, p.grad_clip or float("inf"))
            finite = torch.isfinite(loss) & torch.isfinite(gnorm)
            t3 = clock()
            skip_if_not_finite(opt, finite)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = clock()
            p.ema.update(model, applied=finite)
            t5 = clock()
            fwd = marks["f1"] - marks["f0"]
            timer.add("model forward", fwd)
            timer.add("diffusion math (timesteps, noise, loss op, statistics)", t1 - t0 - fwd)
            timer.add("backward", t2 - t1)
            timer.add("gradient norm / clip", t3 - t2)
            timer.add("optimizer (finite check, AdamW, zero_grad)", t4 - t3)
            timer.add("EMA", t5 - t4)
    finally:
        pre.remove()
        post.remove()


def wrap(tr: Trainer, timer: Timer) -> None:
    """Time the trainer's periodic actions and look-ahead hooks where they act (by name, into `timer`;
    `timer.acted` sums them so the loop can leave them out of the machinery)."""
    timer.acted = 0.0

    def timed(name, f):
        def call(*a):
            t = clock()
            f(*a)
            dt = clock() - t
            timer.acted += dt
            timer.add(name, dt)
        return call

    for h in tr.hooks:  # look-ahead hooks act inside train_step
        for meth in ("before_update", "after_update"):
            setattr(h, meth, timed(f"look-ahead: {type(h).__name__}", getattr(h, meth)))
    # the loop calls the actions through the trainer's views: wrap the objects it calls
    timed_actions = [_Timed(a, timed(f"action: {a.name}", a.__call__)) for a in tr.actions]
    tr.views = {t: tr.views[t.inner] for t in timed_actions}
    tr.actions = timed_actions


def loop(tr: Trainer, steps: int, timer: Timer) -> float:
    """`steps` steps of the trainer's real loop (Trainer.fit's body). Returns its CPU seconds less those
    of the actions and look-aheads that were due (timed by `wrap`)."""
    one = torch.ones((), device=tr.device)
    acted = timer.acted
    t0 = clock()
    for _ in range(steps):
        tr.advance(one)  # the trainer's own loop body (Trainer.fit)
    return clock() - t0 - (timer.acted - acted)


class _Timed:
    """A periodic action whose calls are timed (its declaration read through)."""

    def __init__(self, inner, call):
        self.inner, self._call = inner, call

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, view):
        self._call(view)


def runs_of(tr: Trainer, full_steps: int) -> dict[str, int]:
    """How often each periodic action and look-ahead acts in the full run (their own `due`)."""
    out = {f"action: {a.name}": sum(a.due(s, s == full_steps) for s in range(1, full_steps + 1)) for a in tr.actions}
    for h in tr.hooks:
        out[f"look-ahead: {type(h).__name__}"] = sum(h.due(s) for s in range(full_steps))
    return out


def main(argv=None) -> None:
    ap = _env.Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=_env.count(), default=300, help="steps of each measurement round")
    ap.add_argument("--rounds", type=_env.count(), default=2, help="alternating rounds of phases and loop")
    ap.add_argument("--threads", type=_env.count(0), default=0,
                    help="train.threads (0, the run's default: one training thread, evaluations on every core)")
    ap.add_argument("--eval", action="store_true", help="also time one evaluation and the run's end; write results")
    ap.add_argument("--preset", default="default")
    ap.add_argument("--out", type=_env.stem, default=None, help="result files' stem (default: PRESET-breakdown-cpu)")
    ap.add_argument("--label", default="", help="what code this is, for the table's title (e.g. 'main')")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    timer, loop_timer = Timer(), Timer()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        cfg = read_config(args.preset, [f"run_dir={tmp}/run", "train.progress=false",
                                        *([f"train.threads={args.threads}"] if args.threads else []), *args.overrides])
        full_steps = cfg.train.steps
        tr = Trainer(cfg)
        setup = time.perf_counter() - t
        from tqdm.auto import tqdm

        from fasttrain.logger import MetricLogger
        from fasttrain.train_state import StepClock

        tr.log = MetricLogger(tr.run_dir)
        tr.clock = StepClock()
        tr.bar = tqdm(total=full_steps, disable=True)
        counts = runs_of(tr, full_steps)
        phases(tr, 20, Timer())  # warm-up
        # the loop's window crosses step 1000 (a checkpoint, an interference measurement, log lines): the
        # run's step counter only; the weights are those of the steps run so far
        tr.state.step = max(0, 1000 - args.steps // 2) if full_steps >= 1000 else 0
        wrap(tr, loop_timer)
        loop_s = 0.0
        for _ in range(args.rounds):
            phases(tr, args.steps, timer)
            loop_s += loop(tr, args.steps, loop_timer)
        n_steps = args.steps * args.rounds
        per_step = {k: v / timer.n[k] for k, v in timer.s.items()}
        phase_sum = sum(per_step.values())
        loop_ms = 1e3 * loop_s / n_steps
        # (within the noise of a shared machine the difference can come out below zero: shown as 0, kept in the JSON)
        per_step["per-step machinery (loop, data, LR, counters, actions not due)"] = max(
            0.0, loop_s / n_steps - phase_sum)
        ev = {}  # name → (wall seconds, CPU seconds, threads while sampling)
        if args.eval:
            seen = []
            generate = tr.bundle.generate

            def counted(*a, **kw):  # the thread count the evaluation samples with
                seen.append(torch.get_num_threads())
                return generate(*a, **kw)
            tr.bundle.generate = counted
            t, c = time.perf_counter(), clock()
            tr.evaluate(tr.log)
            ev["one evaluation (500 samples DDIM-50, FID features, judge, bits/dim 400x50)"] = (
                time.perf_counter() - t, clock() - c, max(seen, default=1))
            t, c = time.perf_counter(), clock()
            e = tr.cfg.eval
            kept = e.num_samples, e.bpd
            e.num_samples, e.bpd = 0, False  # finish() less the evaluation timed above
            tr.finish(tr.log)
            e.num_samples, e.bpd = kept
            # (its CPU time counted whole: the plots, most of it, run on one thread)
            ev["end of run (100 samples DDIM-50, plots, summary)"] = (time.perf_counter() - t, clock() - c, 1)
        tr.log.close()
        tr.close()
    info = machine()
    info["threads"] = args.threads or "auto"
    rows = []  # (phase, seconds per occurrence, occurrences in the full run, seconds in the full run)
    for k, v in per_step.items():
        rows.append((k, v, full_steps, v * full_steps))
    for k, v in loop_timer.s.items():  # the due actions and look-aheads, per occurrence
        each = v / loop_timer.n[k]
        rows.append((k, each, counts.get(k, 0), each * counts.get(k, 0)))
    for k in counts:
        if k not in loop_timer.s and counts[k] and not k.endswith("evaluation"):
            rows.append((k + " (not in the window: not timed)", 0.0, counts[k], 0.0))
    n_eval = counts.get("action: evaluation", 0) + 1  # every `eval.every` before the last, and the end's
    for k, (_wall, cpu, threads) in ev.items():
        # on a free machine: its CPU time spread over the threads it ran on (at best); the wall time
        # measured under this machine's load is in the JSON
        n = n_eval if k.startswith("one evaluation") else 1
        rows.append((f"{k}, CPU time / {threads}", cpu / threads, n, cpu / threads * n))
    imports = T_IMPORTS - T_START
    rows.append(("imports (python, torch, fasttrain)", imports, 1, imports))
    rows.append(("set-up (data, network, optimizer, ...)", setup, 1, setup))
    total = sum(r[3] for r in rows)
    step_ms = 1e3 * sum(per_step.values())
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "preset": args.preset, "label": args.label, "overrides": args.overrides, "measured_steps": n_steps,
           "run_steps": full_steps,
           "rows": [{"phase": r[0], "seconds_each": r[1], "count": r[2], "seconds_in_run": r[3]} for r in rows],
           "projected_run_seconds": total, "step_ms": step_ms,
           "evaluation": {k: {"wall_s": w, "cpu_s": c, "threads": n} for k, (w, c, n) in ev.items()},
           "loop_ms": loop_ms, "phases_ms": 1e3 * phase_sum,
           "step_clock": "process CPU time", "evaluation_clock": "process CPU time / threads"}
    label = f", {args.label}" if args.label else ""
    threads = f"train.threads={args.threads}" if args.threads else "one training thread"
    lines = [f"# Where the `{args.preset}` run's time goes (cpu, {threads}{label})", "",
             f"machine: {info['cpu']}, {info['cores']} cores, load {info['loadavg_1min']} at the start; "
             f"torch {info['torch']}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             f"Step phases: process CPU time, mean over {n_steps} steps of the preset's own parts ({args.rounds} "
             "rounds alternating with the trainer's real loop, whose extra time is the machinery row); periodic "
             "actions: CPU time where they act; evaluation and end of run: CPU time divided by the threads they "
             "ran on (their wall time under this load is in the JSON); imports, set-up: wall time. Total: "
             f"scaled to the run's {full_steps} steps, a projection for a free machine (bench/presets.py "
             "measures the real run).", "",
             "| phase | each | times in the run | seconds in the run | share |", "|---|---|---|---|---|"]
    for r in rows:
        each = f"{r[1] * 1e3:.2f} ms" if r[1] < 1 else f"{r[1]:.1f} s"
        lines.append(f"| {r[0]} | {each} | {r[2]} | {r[3]:.1f} | {100 * r[3] / total:.1f}% |")
    lines += ["", f"The trainer's loop: {loop_ms:.1f} ms per step (CPU), its phases {1e3 * phase_sum:.1f} ms.",
              "", f"One step: {step_ms:.1f} ms. Projected run: {total:.0f} s "
              f"({int(total) // 60} min {int(total) % 60:02d} s)."]
    print("\n".join(lines))
    if args.eval:
        name = args.out or f"{args.preset}-breakdown-cpu"
        with _env.Results() as res:
            res.text(f"{name}.json", json.dumps(out, indent=2))
            res.text(f"{name}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    _env.run(main)
