"""Step-time overhead of the adaptive timestep sampler against uniform sampling, side by side, and the
reward-variance reduction of common random numbers.

    python bench/adaptive_overhead.py [--periods 5] [--cases unet8,dit8,unet32]

Each case is a model and a batch (the CPU tiny models on 16×1×8×8 digits, and 16×3×32×32); each
variant is the same training step (objective → backward → look-ahead hooks → AdamW, the trainer's
order, `step.reference_step`) with a different sampler:
  uniform                       the baseline
  adaptive, fasttrain defaults  fd.timestep_sampler("adaptive", s)
  adaptive, official setting    tau_grid=0, every=40: all T = 1000 timesteps per look-ahead, every 40 steps
  (+ any --extra variants, as name=key:value,key:value)
The overhead is measured in two parts, in this process's CPU time (one thread; on a shared 2-core
machine other processes inflate wall time, hardly CPU time):
  draw        the per-step cost of drawing t from the policy, with the look-ahead switched off
              (every = 10⁹): the median over short interleaved rounds of each round's time against the
              uniform round beside it;
  look-ahead  the time inside the hooks (the sampler's HookTimer) per training step, from rounds of
              the longest look-ahead period (100 steps with the defaults), against uniform's step.
The same rounds give the direct comparison (each full-period round against the uniform round beside
it), reported as a cross-check: it measures the same thing whole and is noisier.

CRN: on a fixed model (after a short warm-up) and one fixed update θ_k → θ_{k+1}, the per-sample reward
Σ_{s∈S} [L_s(θ_k) − L_s(θ_{k+1})] is measured over repeated probe draws with the same x_s before and
after (common random numbers) and with fresh noise after (the official code); the ratio of the
variances is the reduction.
Writes bench/results/adaptive-overhead-<device>.{json,md}.
"""
from __future__ import annotations

import copy
import json
import platform
import sys
import time

import _env  # OpenMP's wait policy, before torch loads it
import torch

from fasttrain import diffusion as fd
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.diffusion.lookahead import Probe, x0_mse
from fasttrain.diffusion.vlb import vlb_tables
from fasttrain.models import build_model
from fasttrain.step import reference_step

DEFAULT_EVERY = fd.SAMPLERS.args("adaptive")["every"]
CASES = {"unet8": ("unet_tiny", 1, 8), "dit8": ("dit_tiny", 1, 8), "unet32": ("unet_tiny", 3, 32),
         "dit32": ("dit_tiny", 3, 32)}
VARIANTS = {"uniform": None, "adaptive, fasttrain defaults": {},
            "adaptive, official setting": {"tau_grid": 0, "every": 40}}


def digits_batches(n: int, batch: int, g: torch.Generator) -> list[torch.Tensor]:
    """sklearn's 8×8 digits in [-1, 1] (what the digits presets train on)."""
    from sklearn.datasets import load_digits

    x = torch.from_numpy(load_digits().images).float().div(8).sub(1).unsqueeze(1)
    return [x[torch.randint(0, len(x), (batch,), generator=g)] for _ in range(n)]


class Runner:
    def __init__(self, case, sampler_args, batch, seed=0):
        name, c, h = CASES[case]
        torch.manual_seed(seed)
        lin = fd.schedule("linear")
        self.model = Denoiser(build_model(name, in_channels=c, image_size=h, num_classes=10),
                              PredictionOutput("eps", lin), lin)  # the network with its x̂0 conversion
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-4)
        sampler = "uniform" if sampler_args is None else "adaptive"
        self.obj = fd.DiffusionObjective(lin, "eps", "min_snr", sampler,
                                         sampler_args=sampler_args or {})
        self.components = [self.obj.sampler]
        g = torch.Generator().manual_seed(1)
        self.data = (digits_batches(64, batch, g) if h == 8 else
                     [torch.randn(batch, c, h, h, generator=g).clamp(-1, 1) for _ in range(16)])
        self.labels = torch.randint(0, 10, (batch,), generator=g)
        self.gen = torch.Generator().manual_seed(2)
        self.step = 0

    def steps(self, n: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) per step over n steps."""
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            x0 = self.data[self.step % len(self.data)]
            reference_step(self.model, self.obj, self.opt, [(x0, self.labels)], self.step, self.components,
                           generator=self.gen)
            self.step += 1
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def sample_cost(runner: Runner, n: int = 200) -> float:
    """ms per `sampler.sample` call on a batch (the per-step policy cost)."""
    x0 = runner.data[0]
    g = torch.Generator().manual_seed(0)
    runner.obj.sampler.sample(x0.shape[0], g, x0)
    t0 = time.perf_counter()
    for _ in range(n):
        runner.obj.sampler.sample(x0.shape[0], g, x0)
    return (time.perf_counter() - t0) / n * 1e3


def draw_overhead(case: str, batch: int, rounds: int, steps: int = 20) -> dict:
    """Per-step cost of drawing t from each policy, with no look-ahead (every = 10⁹), as the median
    over short interleaved rounds of each round's CPU time against the uniform round beside it."""
    runners = {"uniform": Runner(case, None, batch), "beta": Runner(case, {"every": 10**9}, batch),
               "global": Runner(case, {"every": 10**9, "policy": "global"}, batch)}
    for r in runners.values():
        r.steps(3)
    cpu = {k: [] for k in runners}
    for _ in range(rounds):
        for k, r in runners.items():
            cpu[k].append(r.steps(steps)[1])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {k: med([a / b for a, b in zip(cpu[k], cpu["uniform"])]) - 1 for k in ("beta", "global")}


def crn_variance(case: str, batch: int, draws: int = 24) -> dict:
    """Reward variance with and without common random numbers on one fixed update (see module doc)."""
    r = Runner(case, None, batch)
    r.steps(40)  # a model that has learned something
    before = copy.deepcopy(r.model).eval()
    r.steps(1)
    after = r.model.eval()
    obj = r.obj
    coef = vlb_tables(obj.schedule)[0].float()
    x0, y = r.data[7], r.labels
    S = torch.tensor([20, 350, 700])  # three timesteps across the range, as a selected S
    xb, tb, yb = x0.repeat_interleave(3, 0), S.repeat(batch), y.repeat_interleave(3, 0)

    def L(model, p):
        return coef[p.t] * x0_mse(model, p)

    crn, fresh = [], []
    for i in range(draws):
        p = Probe.draw(obj, xb, tb, yb, seed=11, offset=i << 30)
        q = Probe.draw(obj, xb, tb, yb, seed=12, offset=i << 30)
        lb = L(before, p)
        crn.append((lb - L(after, p)).view(batch, 3).sum(1))
        fresh.append((lb - L(after, q)).view(batch, 3).sum(1))
    crn, fresh = torch.stack(crn).double(), torch.stack(fresh).double()
    return {"case": case, "draws": draws, "S": S.tolist(),
            "var_per_sample_crn": float(crn.var(0).mean()), "var_per_sample_fresh": float(fresh.var(0).mean()),
            "var_batch_mean_crn": float(crn.mean(1).var()), "var_batch_mean_fresh": float(fresh.mean(1).var()),
            "mean_reward_crn": float(crn.mean()), "mean_reward_fresh": float(fresh.mean()),
            "reduction_per_sample": float(fresh.var(0).mean() / crn.var(0).mean()),
            "reduction_batch_mean": float(fresh.mean(1).var() / crn.mean(1).var())}


def parse_extra(specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        name, _, args = spec.partition("=")
        pairs = [a.split(":") for a in args.split(",") if a]
        if not name or name in VARIANTS or any(len(p) != 2 or not p[0] for p in pairs):
            raise SystemExit(f"adaptive_overhead.py: error: --extra {spec!r}: give a new variant as "
                             f"name=key:value,key:value (the sampler's arguments)")
        kv = dict(pairs)
        out[name] = {k: (float(v) if "." in v else int(v)) if v.replace(".", "").isdigit() else v for k,
                     v in kv.items()}
    return out


def main() -> None:
    ap = _env.Parser()
    ap.add_argument("--cases", type=_env.names(CASES, "case"), default=["unet8", "dit8", "unet32"],
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--batch", type=_env.count(), default=16)
    ap.add_argument("--periods", type=_env.count(), default=5,
                    help="interleaved rounds per case, one look-ahead period each")
    ap.add_argument("--periods-32", type=_env.count(), default=3, help="rounds for the 32×32 cases (slower)")
    ap.add_argument("--draw-rounds", type=_env.count(), default=30,
                    help="rounds of 20 steps for the per-step draw cost")
    ap.add_argument("--extra", nargs="*", default=[], help="more variants: name=key:value,key:value")
    ap.add_argument("--out", type=_env.stem, default="adaptive-overhead", help="stem of the result files")
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = dict(VARIANTS, **parse_extra(args.extra))
    rows = []
    for case in args.cases:
        small = CASES[case][2] <= 8
        draw = draw_overhead(case, args.batch, args.draw_rounds if small else max(5, args.draw_rounds // 3))
        print(json.dumps({"case": case, "draw_overhead": draw}), flush=True)
        runners = {v: Runner(case, a, args.batch) for v, a in variants.items()}
        period = max((r.obj.sampler.every for r in runners.values() if hasattr(r.obj.sampler, "timer")), default=40)
        for r in runners.values():
            r.steps(2)  # warm-up: builds the policy, the tables, the first look-ahead
        times = {v: [] for v in runners}   # wall
        cpu = {v: [] for v in runners}     # this process's CPU time: what other processes cannot inflate
        for r in runners.values():
            if hasattr(r.obj.sampler, "timer"):
                r.obj.sampler.timer.read()
        rounds = args.periods_32 if CASES[case][2] > 8 else args.periods
        for _ in range(rounds):
            for v, r in runners.items():
                w, c = r.steps(period)
                times[v].append(w)
                cpu[v].append(c)
        base = sorted(times["uniform"])[len(times["uniform"]) // 2] * 1e3
        for v, r in runners.items():
            ms = sorted(times[v])[len(times[v]) // 2] * 1e3
            smp = r.obj.sampler
            la = smp.timer.read() / (rounds * period) * 1e3 if hasattr(smp, "timer") else 0.0
            paired = sorted(a / b for a, b in zip(times[v], times["uniform"]))  # each round against uniform's
            paired_cpu = sorted(a / b for a, b in zip(cpu[v], cpu["uniform"]))
            kind = "global" if (variants[v] or {}).get("policy") == "global" else "beta"
            base_cpu = sorted(cpu["uniform"])[len(cpu["uniform"]) // 2] * 1e3
            draw_v = 0.0 if variants[v] is None else draw[kind]
            rows.append({"case": case, "model": CASES[case][0], "shape": [args.batch, *CASES[case][1:], CASES[case][2]],
                         "draw_overhead": draw_v, "lookahead_share": la / base_cpu,
                         "overhead_decomposed": draw_v + la / base_cpu,
                         "variant": v, "args": variants[v], "ms_per_step": base if v == "uniform" else ms,
                         "rounds_ms": [t * 1e3 for t in times[v]], "overhead": paired[len(paired) // 2] - 1,
                         "cpu_ms_per_step": sorted(cpu[v])[len(cpu[v]) // 2] * 1e3,
                         "overhead_cpu": paired_cpu[len(paired_cpu) // 2] - 1,
                         "lookahead_ms_per_step": la, "sample_ms_isolated": sample_cost(r),
                         "probe_elements_per_update": (None if variants[v] is None else
                                                       2 * (smp.K + args.batch * smp.n_select))})
            print(json.dumps({k: rows[-1][k] for k in ("case", "variant", "ms_per_step", "overhead", "overhead_cpu",
                                                         "overhead_decomposed", "draw_overhead", "lookahead_share",
                                                         "lookahead_ms_per_step")}), flush=True)
    crn = crn_variance("unet8", args.batch)
    print(json.dumps(crn), flush=True)
    dev = "cpu"
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "device": dev, "cpu": platform.processor() or platform.machine(), "nproc": __import__("os").cpu_count()}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(["python"] + sys.argv),
           "batch": args.batch, "rows": rows, "crn": crn}
    lines = [f"# Adaptive timestep sampler: step-time overhead against uniform, {dev}", "",
             f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ", f"command: `{out['command']}`", "",
             "Interleaved rounds of the longest look-ahead period each, one thread; median ms/step over rounds. "
             "**overhead** = per-step draw + look-ahead: the draw is the median, over short interleaved rounds "
             "with no look-ahead, of each round's process CPU time against the uniform round beside it; the "
             "look-ahead is the time inside the hooks (the sampler's HookTimer) per step, against uniform's "
             "CPU step. **direct** is the median over full-period rounds of each round's CPU time against the "
             "uniform round beside it (the same quantity, measured whole: noisier, ±2% here). On a shared "
             "2-core machine other processes inflate wall time, not this process's CPU time; one thread, so "
             "CPU time is the step's compute.", "",
             "| case | variant | ms/step (CPU) | overhead | draw | look-ahead | direct (CPU) | direct (wall) | "
             "look-ahead ms/update | probe forwards/update |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        every = (r["args"] or {}).get("every", DEFAULT_EVERY) if r["args"] is not None else None
        lines.append(f"| {r['model']} {'×'.join(map(str, r['shape']))} | {r['variant']} | "
                     f"{r['cpu_ms_per_step']:.2f} | **{100 * r['overhead_decomposed']:+.1f}%** | "
                     f"{100 * r['draw_overhead']:+.1f}% | {100 * r['lookahead_share']:+.1f}% | "
                     f"{100 * r['overhead_cpu']:+.1f}% | {100 * r['overhead']:+.1f}% | "
                     f"{(r['lookahead_ms_per_step'] * every if every else 0):.0f} | "
                     f"{r['probe_elements_per_update'] or '-'} |")
    lines += ["", f"## Common random numbers ({crn['case']}, {crn['draws']} probe draws, S = {crn['S']})", "",
              "| reward | variance, fresh noise (official) | variance, CRN | reduction |", "|---|---|---|---|",
              f"| per sample | {crn['var_per_sample_fresh']:.3e} | {crn['var_per_sample_crn']:.3e} | "
              f"{crn['reduction_per_sample']:.0f}× |",
              f"| batch mean | {crn['var_batch_mean_fresh']:.3e} | {crn['var_batch_mean_crn']:.3e} | "
              f"{crn['reduction_batch_mean']:.0f}× |"]
    with _env.Results() as res:
        res.text(f"{args.out}-{dev}.json", json.dumps(out, indent=2))
        res.text(f"{args.out}-{dev}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    _env.run(main)
