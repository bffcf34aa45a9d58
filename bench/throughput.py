"""Training throughput, measured on the trainer's own step, side by side in one run.

    python bench/throughput.py                       # the machinery table (CPU or GPU)
    python bench/throughput.py --small-batch         # + the small-batch single-GPU table (CUDA only)
    python bench/throughput.py --model dit_b2 --data synthetic --channels 4 --image-size 32 --batch 256 \
        --set parallel.precision=bf16 parallel.compile=blocks --variants plain,lsm_min_snr --no-options \
        --interference-steps 0 --direct-calls 0 --out throughput-cuda-dit_b2   # a DiT step, bf16, compiled
    python bench/throughput.py --tables small --small-models dit_b2 --batches 8   # the small table alone

Machinery: the cost of fasttrain's timestep machinery against a plain step (uniform t, unweighted
MSE, no statistics) on the same model and batch: loss-second-moment + Min-SNR with statistics
synced every step (the worst case), SpeeD, the adaptive sampler with fasttrain's defaults and with
the official setting, mixed prediction, and the interference diagnostic at its default period; and each
noise and loss option (`diffusion.noise`, `diffusion.loss`) on the plain step, in the same interleaved
rounds (the fused backend: native C++ on CPU, Triton on CUDA).
Small batch (CUDA): the tiny UNet on digits and DiT-S/2, DiT-B/2 on 4×32×32 latents at batch 8, 32,
256, each eager, compiled, and compiled + the whole step in one CUDA graph, in images/s and MFU.
On CUDA the MFU is given against the bf16 matrix-product rate measured in the same run (cases.ceilings)
and against the datasheet's dense bf16 peak (fasttrain.parallel.distributed.PEAK_BF16). `--set KEY=VALUE`
adds config overrides to every trainer (precision, compile; the GPU check's dry run shrinks a model's
widths with them), `--variants` picks machinery rows by short name, `--tables` which tables run.

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
VARIANTS = dict(zip(("plain", "lsm_min_snr", "speed", "adaptive", "adaptive_official", "mixed", "interference50"),
                    MACHINERY))  # short names for --variants
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


def data_overrides(args) -> list[str]:
    if args.data == "digits":
        return ["data.name=digits"]
    return ["data.name=synthetic", f"data.channels={args.channels}", f"data.image_size={args.image_size}"]


def base_overrides(args) -> list[str]:
    """What every machinery trainer shares: model, batch, data, threads, and --set."""
    return ([f"model.name={args.model}", f"data.batch_size={args.batch}", f"train.threads={args.threads}"]
            + data_overrides(args) + (["model.args.ch=16"] if args.model == "unet_tiny" else []) + args.set)


def mfu(tr, images_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the trainer's own count (3 × forward FLOPs per image, train.py) at this
    rate over `peak`; None where either is unknown (CPU)."""
    flops = tr.throughput.flops_per_image
    return images_per_s * flops / peak if peak and flops else None


def machinery(args, tmp: Path, peaks: dict) -> list[dict]:
    from fasttrain.diffusion import SAMPLERS

    base = base_overrides(args) + ["diagnostics.interference_every=0"]
    chosen = {VARIANTS[n]: MACHINERY[VARIANTS[n]] for n in args.variants} if args.variants else MACHINERY
    variants = {k: v for k, v in chosen.items() if "adaptive" not in " ".join(v) or "adaptive" in SAMPLERS}
    variants.update({k: PLAIN + v for k, v in OPTIONS.items()} if args.options else {})
    trainers = {k: trainer(base + v, tmp) for k, v in variants.items()}
    med = interleaved(trainers, args.steps, args.warmup, args.round)
    base_t = next(iter(med.values()))
    rows = [{"variant": k, "ms_per_step": t * 1e3, "images_per_s": args.batch / t, "overhead": t / base_t - 1,
             "group": "options" if k in OPTIONS else "machinery",
             **{f"mfu_{p}": mfu(trainers[k], args.batch / t, v) for p, v in peaks.items()}} for k, t in med.items()]
    for tr in trainers.values():
        tr.close()
    inter = next((r for r in rows if r["variant"].startswith("interference")), None)
    if inter is not None:
        rows.append({"variant": f"interference diagnostic every {INTERFERENCE_DEFAULT} steps (the default; scaled)",
                     "ms_per_step": base_t * 1e3 * (1 + inter["overhead"] * 50 / INTERFERENCE_DEFAULT),
                     "images_per_s": args.batch / (base_t * (1 + inter["overhead"] * 50 / INTERFERENCE_DEFAULT)),
                     "overhead": inter["overhead"] * 50 / INTERFERENCE_DEFAULT, "group": "machinery"})
    return rows


def interference_default(args, tmp: Path) -> dict:
    """Plain against the diagnostic at its default period, long enough to hold several measurements."""
    base = base_overrides(args) + ["diffusion.weighting=simple", "diffusion.sampler=uniform",
                                   "diffusion.stats_every=1000000"]
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
    base += [o for o in args.set if not o.startswith("model.")]  # precision, compile (the model is fixed here)
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


def small_batch(args, tmp: Path, peaks: dict) -> list[dict]:
    """Each model of --small-models at each of --batches: eager, compiled, compiled + CUDA graph (bf16;
    on CPU the graph mode keeps the eager step and says so: the dry run's check of the path)."""
    rows = []
    for model, data, _c, _s in (m for m in SMALL if m[0] in args.small_models):
        for batch in args.batches:
            trainers = {m: trainer([f"model.name={model}", f"data.batch_size={batch}", "parallel.precision=bf16"]
                                   + data + extra + args.set, tmp) for m, extra in MODES.items()}
            med = interleaved(trainers, args.steps, args.warmup, args.round)
            for mode, t in med.items():
                rows.append({"model": model, "batch": batch, "mode": mode, "ms_per_step": t * 1e3,
                             "images_per_s": batch / t, "speedup_vs_eager": med["eager"] / t,
                             **{f"mfu_{p}": mfu(trainers[mode], batch / t, v) for p, v in peaks.items()}})
            for tr in trainers.values():
                tr.close()
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
    ap.add_argument("--tables", type=_env.names(("machinery", "small"), "table"), default=None,
                    help="which tables run: machinery, small (default: machinery, and small with --small-batch "
                         "on CUDA)")
    ap.add_argument("--small-models", type=_env.names([m[0] for m in SMALL], "model"),
                    default=[m[0] for m in SMALL], help="the small table's models")
    ap.add_argument("--data", choices=("digits", "synthetic"), default="digits",
                    help="the machinery table's data: digits, or synthetic latents (--channels, --image-size)")
    ap.add_argument("--channels", type=_env.count(), default=4)
    ap.add_argument("--image-size", type=_env.count(), default=32)
    ap.add_argument("--variants", type=_env.names(VARIANTS, "variant"), default=None,
                    help=f"machinery rows by short name, the first the baseline ({', '.join(VARIANTS)}; default all)")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides for every trainer (e.g. parallel.precision=bf16 parallel.compile=blocks)")
    ap.add_argument("--out", type=_env.stem, default=None, help="result files' stem (default throughput-<device>)")
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
    if args.variants and args.variants[0] != "plain":
        ap.error("--variants: the first row is the baseline the overheads are of; start with plain")
    bad = [o for o in args.set if "=" not in o]
    if bad:
        ap.error(f"--set takes KEY=VALUE, got {bad[0]!r}")
    tables = args.tables or (["machinery"] + (["small"] if args.small_batch and dev == "cuda" else []))
    clock = CLOCK[args.clock]
    from cases import ceilings

    from fasttrain.parallel.distributed import device_peak_flops

    ceil = ceilings(dev)  # on CPU tiny sizes: the code path (the MFU columns read n/a there)
    peaks = {"measured": ceil["matmul_TFLOPs"] * 1e12, "datasheet": device_peak_flops()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = machinery(args, tmp, peaks) if "machinery" in tables else []
        direct = interference_default(args, tmp) if rows and args.interference_steps else None
        math_ms = options_direct(args, tmp) if rows and args.options and args.direct_calls else None
        small = small_batch(args, tmp, peaks) if "small" in tables else []
    info = {"torch": torch.__version__, "python": platform.python_version(), "threads": args.threads, "device": dev,
            "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "clock": args.clock, "ceilings": ceil,
            "peak_datasheet_TFLOPs": peaks["datasheet"] / 1e12 if peaks.get("datasheet") else None}
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
           "model": args.model, "batch": args.batch, "overrides": args.set, "machinery": rows,
           "interference_default": direct, "options_direct_s": math_ms,
           "small_batch": small}
    mfu_head = "| MFU (measured matmul) | MFU (datasheet) "

    def mfu_cells(r) -> str:
        return "".join(f"| {100 * r[f'mfu_{p}']:.1f}% " if r.get(f"mfu_{p}") else "| n/a " for p in peaks)
    lines = [f"# Training step on the trainer, {dev}", "", f"machine: {json.dumps(info)}  ", f"when: {out['when']}  ",
             f"command: `{out['command']}`", ""]
    sheet = info["peak_datasheet_TFLOPs"]
    lines += [f"ceilings measured in this run: {ceil['matmul']} matrix product at {ceil['matmul_TFLOPs']:.1f} TFLOP/s, "
              f"copy {ceil['copy_GBps']:.0f} GB/s; datasheet dense bf16 peak "
              + (f"{sheet:.0f} TFLOP/s" if sheet else "unknown for this device"), ""]
    if rows:
        data = "digits" if args.data == "digits" else f"synthetic {args.channels}×{args.image_size}×{args.image_size}"
        lines += [f"## Timestep machinery ({args.model}, {data}, batch {args.batch}"
                  + (f", {' '.join(args.set)}" if args.set else "") + f"; mean over interleaved rounds of "
                  f"{args.round} steps, {args.steps} steps each; {args.clock} time)", "",
                  "| variant | ms/step | images/s | overhead vs plain " + mfu_head + "|",
                  "|---|---|---|---|" + "---|" * len(peaks)]
    for r in rows:
        if r.get("group") != "options":
            lines.append(f"| {r['variant']} | {r['ms_per_step']:.2f} | {r['images_per_s']:.0f} | "
                         f"{100 * r['overhead']:+.1f}% " + mfu_cells(r) + "|")
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
        lines += ([""] if lines[-1] else []) + [f"## Small batch, one {'GPU' if dev == 'cuda' else 'CPU'} (bf16"
                  + (f", {' '.join(args.set)}" if args.set else "") + ")", "",
                  "| model | batch | mode | ms/step | images/s " + mfu_head + "| × eager |",
                  "|---|---|---|---|---|" + "---|" * len(peaks) + "---|"]
        for r in small:
            lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['ms_per_step']:.2f} | "
                         f"{r['images_per_s']:.0f} " + mfu_cells(r) + f"| {r['speedup_vs_eager']:.2f} |")
    stem = args.out or f"throughput-{dev}"
    with _env.Results() as res:
        res.text(f"{stem}.json", json.dumps(out, indent=2))
        res.text(f"{stem}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    _env.run(main)
