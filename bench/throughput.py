"""Training throughput, measured on the trainer's own step, side by side in one run.

    python bench/throughput.py                       # the machinery table (CPU or GPU)
    python bench/throughput.py --small-batch         # + the small-batch single-GPU table (CUDA only)

Machinery: the cost of fasttrain's timestep machinery against a plain step (uniform t, unweighted
MSE, no statistics) on the same model and batch: loss-second-moment + Min-SNR with statistics
synced every step (the worst case), SpeeD, the adaptive sampler with fasttrain's defaults and with
the official setting, mixed prediction, and the interference diagnostic at its default period; and each
noise and loss option (`diffusion.noise`, `diffusion.loss`) on the plain step, in the same interleaved
rounds (the fused backend: native C++ on CPU, Triton on CUDA).
Small batch (CUDA): the tiny UNet on digits and DiT-S/2, DiT-B/2 on 4×32×32 latents at batch 8, 32,
256, each eager, compiled, and compiled + the whole step in one CUDA graph, in images/s and MFU.

Variants are interleaved in short rounds and the mean over rounds taken (a cost paid every K steps
counts), so that load changes on a shared machine hit all of them alike. Writes
bench/results/throughput-<device>.{json,md}.
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

QUIET = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.ckpt_every=0",
         "train.log_every=1000000"]


def trainer(overrides: list[str], tmp: Path):
    from fasttrain.configure import load_config
    from fasttrain.train import Trainer

    run = tmp / f"run{len(list(tmp.iterdir()))}"
    return Trainer(load_config("default", [f"run_dir={run}"] + QUIET + overrides))


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def seconds_per_step(tr, n: int) -> float:
    """Seconds per step on `clock`: wall time, or (--clock cpu) this process's CPU time, which on a shared
    machine leaves out the time other processes hold the cores (threads=1: one busy thread)."""
    cuda = tr.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = clock()
    for _ in range(n):
        tr.train_step()
    if cuda:
        torch.cuda.synchronize()
    return (clock() - t0) / n


def interleaved(trainers: dict, steps: int, warmup: int, round_steps: int) -> dict:
    """Mean seconds per step over interleaved rounds: the mean, not the median of rounds, so that a cost
    paid every K steps (a look-ahead) is counted; interleaving spreads load changes over all variants."""
    for tr in trainers.values():
        seconds_per_step(tr, warmup)  # compile, capture, caches
    times = {k: [] for k in trainers}
    for _ in range(max(1, steps // round_steps)):
        for k, tr in trainers.items():
            times[k].append(seconds_per_step(tr, round_steps))
    return {k: sum(v) / len(v) for k, v in times.items()}


MACHINERY = {
    "plain: uniform t, unweighted MSE, no statistics": ["diffusion.weighting=simple", "diffusion.sampler=uniform",
                                                        "diffusion.stats_every=1000000"],
    "loss_second_moment + min_snr, statistics synced every step": ["diffusion.sampler=loss_second_moment",
                                                                   "diffusion.stats_every=1"],
    "speed sampling + speed weighting": ["diffusion.sampler=speed", "diffusion.weighting=speed"],
    "adaptive, fasttrain defaults (tau_grid 16, every 100)": ["diffusion.sampler=adaptive"],
    "adaptive, official setting (all T τ, every 40)": ["diffusion.sampler=adaptive",
                                                       "diffusion.sampler_args.tau_grid=0",
                                                       "diffusion.sampler_args.every=40"],
    "mixed prediction (eps, x0, v; pixel gate)": ["diffusion.prediction=mixed"],
    "interference diagnostic every 50 steps": ["diffusion.weighting=simple", "diffusion.sampler=uniform",
                                               "diffusion.stats_every=1000000", "diagnostics.interference_every=50"],
}
INTERFERENCE_DEFAULT = 500  # the default period: its overhead is the every-50 figure scaled by 50/500
PLAIN = MACHINERY["plain: uniform t, unweighted MSE, no statistics"]
OPTIONS = {  # issue 21: each on the plain step (noise_options.py, loss_shapes.py)
    "noise offset 0.1": ["diffusion.noise.offset=0.1"],
    "noise offset 0.1, random strength, adaptive 0.5": ["diffusion.noise.offset=0.1",
                                                        "diffusion.noise.offset_random_strength=true",
                                                        "diffusion.noise.adaptive_offset=0.5"],
    "pyramid noise, 6 iterations, discount 0.3": ["diffusion.noise.pyramid_iterations=6"],
    "input perturbation 0.1, random strength": ["diffusion.noise.perturbation=0.1",
                                                "diffusion.noise.perturbation_random_strength=true"],
    "immiscible assignment (SciPy exact on CPU)": ["diffusion.noise.immiscible=assignment"],
    "immiscible knn, k = 64": ["diffusion.noise.immiscible=knn"],
    "l1 loss": ["diffusion.loss.type=l1"],
    "huber loss, snr schedule": ["diffusion.loss.type=huber"],
    "pseudo-Huber loss, snr schedule": ["diffusion.loss.type=pseudo_huber"],
    "offset + pyramid + perturbation + pseudo-Huber": ["diffusion.noise.offset=0.1",
                                                       "diffusion.noise.pyramid_iterations=6",
                                                       "diffusion.noise.perturbation=0.1",
                                                       "diffusion.loss.type=pseudo_huber"],
}


def machinery(args, tmp: Path) -> list[dict]:
    from fasttrain.diffusion import SAMPLERS

    base = [f"model.name={args.model}", f"data.batch_size={args.batch}", f"train.threads={args.threads}",
            "data.name=digits", "diagnostics.interference_every=0"]
    base += ["model.args.ch=16"] if args.model == "unet_tiny" else []
    variants = {k: v for k, v in MACHINERY.items() if "adaptive" not in " ".join(v) or "adaptive" in SAMPLERS}
    variants.update({k: PLAIN + v for k, v in OPTIONS.items()} if args.options else {})
    trainers = {k: trainer(base + v, tmp) for k, v in variants.items()}
    med = interleaved(trainers, args.steps, args.warmup, args.round)
    for tr in trainers.values():
        tr.close()
    base_t = next(iter(med.values()))
    rows = [{"variant": k, "ms_per_step": t * 1e3, "images_per_s": args.batch / t, "overhead": t / base_t - 1,
             "group": "options" if k in OPTIONS else "machinery"} for k, t in med.items()]
    inter = next(r for r in rows if r["variant"].startswith("interference"))
    rows.append({"variant": f"interference diagnostic every {INTERFERENCE_DEFAULT} steps (the default; scaled)",
                 "ms_per_step": base_t * 1e3 * (1 + inter["overhead"] * 50 / INTERFERENCE_DEFAULT),
                 "images_per_s": args.batch / (base_t * (1 + inter["overhead"] * 50 / INTERFERENCE_DEFAULT)),
                 "overhead": inter["overhead"] * 50 / INTERFERENCE_DEFAULT, "group": "machinery"})
    return rows


def interference_default(args, tmp: Path) -> dict:
    """Plain against the diagnostic at its default period, long enough to hold several measurements."""
    base = [f"model.name={args.model}", f"data.batch_size={args.batch}", f"train.threads={args.threads}",
            "data.name=digits", "diffusion.weighting=simple", "diffusion.sampler=uniform",
            "diffusion.stats_every=1000000"] + (["model.args.ch=16"] if args.model == "unet_tiny" else [])
    trainers = {"plain": trainer(base + ["diagnostics.interference_every=0"], tmp),
                "diag": trainer(base + [f"diagnostics.interference_every={INTERFERENCE_DEFAULT}"], tmp)}
    rnd = 100
    med = interleaved(trainers, args.interference_steps, args.warmup, rnd)
    n = len(trainers["diag"].interference.history)
    for tr in trainers.values():
        tr.close()
    return {"ms_plain": med["plain"] * 1e3, "ms_diag": med["diag"] * 1e3, "overhead": med["diag"] / med["plain"] - 1,
            "steps": args.interference_steps, "round": rnd, "measurements": n}


def options_direct(args, tmp: Path) -> dict:
    """The diffusion math of one step alone (objective forward with a fixed prediction, and backward), plain
    and with each option, on the trainer's objective and batch shape: the options' added work measured
    without the network's time and its noise (interleaved rounds of `round` calls)."""
    from fasttrain.bundle import build_objective
    from fasttrain.configure import load_config

    base = [f"data.batch_size={args.batch}", "data.name=digits", f"train.threads={args.threads}"] + PLAIN
    variants = {"plain": [], **OPTIONS}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    objs = {k: build_objective(load_config("default", [f"run_dir={tmp}/direct"] + QUIET + base + v)).to(dev)
            for k, v in variants.items()}
    g = torch.Generator().manual_seed(0)
    x0 = (torch.rand(args.batch, 1, 8, 8, generator=g) * 2 - 1).to(dev)
    pred = torch.randn(args.batch, 1, 8, 8, generator=g).to(dev).requires_grad_()
    gen = torch.Generator(dev).manual_seed(0)

    def calls(obj, n):
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(n):
            loss, _ = obj(lambda x, t: pred * 1.0, x0, generator=gen)
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return (clock() - t0) / n

    for obj in objs.values():
        calls(obj, 20)
    times = {k: [] for k in objs}
    rnd = 100
    for _ in range(max(1, args.direct_calls // rnd)):
        for k, obj in objs.items():
            times[k].append(calls(obj, rnd))
    return {k: sum(v) / len(v) for k, v in times.items()}


SMALL = [("unet_tiny", ["data.name=digits"], 1, 8), ("dit_s2", ["data.name=synthetic", "data.channels=4",
                                                                "data.image_size=32"], 4, 32),
         ("dit_b2", ["data.name=synthetic", "data.channels=4", "data.image_size=32"], 4, 32)]
MODES = {"eager": [], "compiled": ["parallel.compile=blocks"],
         "compiled + CUDA graph": ["parallel.compile=blocks", "train.cuda_graph=true"]}


def small_batch(args, tmp: Path) -> list[dict]:
    from fasttrain.models import forward_flops
    from fasttrain.parallel.distributed import device_peak_flops

    peak, rows = device_peak_flops(), []
    for model, data, c, s in SMALL:
        flops = 3 * forward_flops(model, in_channels=c, image_size=s, num_classes=10)
        for batch in args.batches:
            trainers = {m: trainer([f"model.name={model}", f"data.batch_size={batch}", "parallel.precision=bf16"]
                                   + data + extra, tmp) for m, extra in MODES.items()}
            med = interleaved(trainers, args.steps, args.warmup, args.round)
            for tr in trainers.values():
                tr.close()
            for mode, t in med.items():
                rows.append({"model": model, "batch": batch, "mode": mode, "ms_per_step": t * 1e3,
                             "images_per_s": batch / t, "mfu": flops * batch / t / peak if peak else None,
                             "speedup_vs_eager": med["eager"] / t})
            print(rows[-3:], flush=True)
    return rows


def main() -> None:
    from fasttrain.models import MODELS, is_image_model

    ap = _env.Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unet_tiny", choices=[m for m in MODELS.names() if is_image_model(m)],
                    help="an image model of fasttrain's registry (trained on digits)")
    ap.add_argument("--batch", type=_env.count(), default=16)
    ap.add_argument("--threads", type=_env.count(), default=1,
                    help="torch threads (one is fastest for tiny models on 2 shared cores)")
    ap.add_argument("--steps", type=_env.count(), default=400, help="steps per variant, in interleaved rounds")
    ap.add_argument("--round", type=_env.count(), default=20, help="steps per round")
    ap.add_argument("--warmup", type=_env.count(0), default=10, help="steps before timing")
    ap.add_argument("--small-batch", action="store_true", help="also the small-batch single-GPU table (CUDA)")
    ap.add_argument("--interference-steps", type=_env.count(0), default=2000,
                    help="steps per variant for the direct measurement at the diagnostic's default period (0 = skip)")
    ap.add_argument("--batches", type=_env.count(), nargs="+", default=[8, 32, 256])
    ap.add_argument("--no-options", dest="options", action="store_false",
                    help="leave out the noise and loss options (issue 21)")
    ap.add_argument("--direct-calls", type=_env.count(0), default=3000,
                    help="calls per variant of the options' diffusion math alone (0 = skip)")
    ap.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                    help="wall time, or this process's CPU time (a shared CPU machine; not on CUDA)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    global clock
    if args.clock == "cpu" and dev == "cuda":
        ap.error("--clock cpu measures CPU work; on CUDA use wall time")
    clock = CLOCK[args.clock]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = machinery(args, tmp)
        direct = interference_default(args, tmp) if args.interference_steps else None
        math_ms = options_direct(args, tmp) if args.options and args.direct_calls else None
        small = small_batch(args, tmp) if args.small_batch and dev == "cuda" else []
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": args.threads, "device": dev,
            "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "clock": args.clock}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "model": args.model, "batch": args.batch, "machinery": rows, "interference_default": direct,
           "options_direct_s": math_ms,
           "small_batch": small}
    lines = [f"# Training step on the trainer, {dev}", "", f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ",
             f"command: `{out['command']}`", "",
             f"## Timestep machinery ({args.model}, digits, batch {args.batch}; mean over interleaved rounds of "
             f"{args.round} steps, {args.steps} steps each; {args.clock} time)", "",
             "| variant | ms/step | images/s | overhead vs plain |", "|---|---|---|---|"]
    for r in rows:
        if r.get("group") != "options":
            lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                         f"{100 * r['overhead']:+.1f}% |")
    opts = [r for r in rows if r.get("group") == "options"]
    if opts:
        lines += ["", "## Noise and loss options on the plain step (the same interleaved rounds; `diffusion.noise`, "
                      "`diffusion.loss`)", "", "| option | ms/step | images/s | overhead vs plain |",
                  "|---|---|---|---|",
                  f"| plain (as above) | {rows[0]['ms_per_step']:.2f} | {rows[0]['images_per_s']:.0f} | +0.0% |"]
        for r in opts:
            lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                         f"{100 * r['overhead']:+.1f}% |")
    if math_ms:
        plain_step = rows[0]["ms_per_step"] / 1e3
        lines += ["", f"The options' work alone: the step's diffusion math (the objective's forward with a fixed "
                      f"prediction, and its backward; {args.direct_calls} calls per variant in interleaved rounds of "
                      f"100), and what it adds to the plain trainer step above:", "",
                  "| option | diffusion math µs/step | added µs | added to the plain step |", "|---|---|---|---|"]
        for k, t in math_ms.items():
            add = t - math_ms["plain"]
            lines.append(f"| {k} | {t * 1e6:.0f} | {add * 1e6:+.0f} | {100 * add / plain_step:+.2f}% |")
    if direct:
        lines += ["", f"Interference diagnostic at its default period, measured directly: {direct['ms_plain']:.2f} → "
                      f"{direct['ms_diag']:.2f} ms/step, **{100 * direct['overhead']:+.1f}%** ({direct['steps']} steps "
                      f"each in interleaved rounds of {direct['round']}, {direct['measurements']} measurements)."]
    if small:
        lines += ["", "## Small batch, one GPU (bf16)", "",
                  "| model | batch | mode | ms/step | images/s | MFU | × eager |",
                  "|---|---|---|---|---|---|---|"]
        for r in small:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
            lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['ms_per_step']:.2f} | "
                         f"{r['images_per_s']:.0f} | "
                         f"{mfu} | {r['speedup_vs_eager']:.2f} |")
    with _env.Results() as res:
        res.text(f"throughput-{dev}.json", json.dumps(out, indent=2))
        res.text(f"throughput-{dev}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    _env.run(main)
