"""fasttrain's text-to-image training step against diffusers' train_text_to_image.py loop, side by side
(bench/t2i_loops.py: the two loops, the peer ported line by line).

    python bench/peer_text_to_image.py [--device cpu] [--threads 1,2] [--rounds 5] [--steps 10]
    python bench/peer_text_to_image.py --model flux [--weightings none,sigma_sqrt,...]

--model flux: the same three parts for a tiny FluxTransformer2DModel LoRA against diffusers'
train_dreambooth_lora_flux.py (bench/flux_loops.py), per --weighting_scheme of that script (none, sigma_sqrt,
cosmap, logit_normal, mode); weights compared over the adapter.

Same tiny SD UNet2DConditionModel, same cached latents and text embeddings, same batches, AdamW with the
script's defaults, gradient clipping 1.0, EMA (0.9999) on both sides; for each weighting (the script's
plain MSE, and its --snr_gamma 5 against fasttrain's min_snr):

  equality  both loops fed the same x0, ε, t (fasttrain's draws) for --equal-steps steps: the largest
            relative difference of the per-step losses and how far apart the UNets end; fasttrain's fused
            ops (native C++ on CPU, Triton on CUDA) and its PyTorch reference backend, and the two fasttrain
            backends against each other (what float32 rounding alone does to the weights);
  time      interleaved rounds of --steps steps per loop (the order rotating each round, so that load from
            other processes hits all alike) at each thread count: median wall and CPU ms per step, and
            each loop's CPU-time ratio to the peer's (on a shared machine the CPU time is the steadier clock);
  memory    each loop alone in a fresh process (after one step of a tiny instance, which loads what a first
            call loads): the peak above the memory held after building (CPU: the resident set, its
            high-water mark reset through /proc/self/clear_refs; CUDA: torch.cuda.max_memory_allocated),
            over its first --memory-steps steps (so the optimizer's and the EMA's state are included).

Writes bench/results/peer-text-to-image-<device>.{json,md} (--model flux: peer-flux-<device>.{json,md}).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

sys.path.insert(0, str(Path(__file__).parent))

import flux_loops
import t2i_loops
from cases import machine
from interleaved import write

LOOPS = ("diffusers", "fasttrain", "fasttrain-torch")  # the peer; fasttrain's fused ops; its reference backend
WEIGHTINGS = {"mse": None, "min_snr": 5.0}              # the script's default; --snr_gamma 5 / min_snr γ=5
MODULES = {"sd": t2i_loops, "flux": flux_loops}


def weightings_of(model: str) -> tuple[str, ...]:
    return tuple(WEIGHTINGS) if model == "sd" else tuple(flux_loops.SCHEMES)


def setup_of(args, weighting: str):
    if args.model == "flux":
        return flux_loops.Setup(batch=args.batch, size=args.size, length=args.length, captions=args.captions,
                                scheme=weighting)
    return t2i_loops.Setup(batch=args.batch, size=args.size, length=args.length, channels=tuple(args.channels),
                           captions=args.captions, prediction=args.prediction, snr_gamma=WEIGHTINGS[weighting],
                           use_ema=True)


def network(loop) -> torch.nn.Module:
    """The diffusers network a loop trains (the SD loops' UNet, the Flux loops' transformer)."""
    return loop.unet if hasattr(loop, "unet") else loop.transformer


def build(name: str, setup, device):
    """(loop, step function of a step index) for one of LOOPS; each builds the same initial network."""
    m = flux_loops if isinstance(setup, flux_loops.Setup) else t2i_loops
    ft = m.FasttrainLoop(setup, device, "torch" if name == "fasttrain-torch" else "auto")
    loop = m.PeerLoop(setup, device, network(ft)) if name == "diffusers" else ft
    return loop, (lambda k: loop.step(m.batch_rows(setup, k, device)))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def equality(args, device) -> list[dict]:
    rows = []
    for weighting in args.weightings:
        setup = setup_of(args, weighting)
        m = MODULES[args.model]
        runs = {}
        for backend in ("auto", "torch"):
            ours, theirs, agree, (ft, _, start) = m.equal_noise_run(setup, args.equal_steps, device, backend)
            runs[backend] = (ft, start)
            rows.append({"weighting": weighting, "fasttrain_backend": ft.objective.kernels(device),
                         "steps": args.equal_steps, "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                                           zip(ours, theirs)),
                         "weights": agree, "losses_fasttrain": ours, "losses_diffusers": theirs})
        (fa, start), (fb, _) = runs["auto"], runs["torch"]
        agreement = (flux_loops.adapter_agreement if args.model == "flux" else t2i_loops.weight_agreement)
        rows.append({"weighting": weighting, "fasttrain_backend": "native/triton vs torch (control)",
                     "steps": args.equal_steps, "weights": agreement(network(fa), network(fb), start)})
    return rows


def timing(args, device) -> list[dict]:
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for weighting in args.weightings:
            setup = setup_of(args, weighting)
            loops = {n: build(n, setup, device) for n in LOOPS}
            if args.compile:
                for loop, _ in loops.values():
                    network(loop).compile()
            wall = {n: [] for n in LOOPS}
            cpu = {n: [] for n in LOOPS}
            k = {n: 0 for n in LOOPS}
            for n, (_, step) in loops.items():  # warm-up (and compilation)
                for _ in range(args.warmup):
                    step(k[n])
                    k[n] += 1
            for r in range(args.rounds):
                for n in LOOPS[r % len(LOOPS):] + LOOPS[:r % len(LOOPS)]:
                    step = loops[n][1]
                    sync(device)
                    w0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        step(k[n])
                        k[n] += 1
                    sync(device)
                    wall[n].append((time.perf_counter() - w0) / args.steps * 1e3)
                    cpu[n].append((time.process_time() - c0) / args.steps * 1e3)
            base_cpu, base_wall = statistics.median(cpu["diffusers"]), statistics.median(wall["diffusers"])
            for n in LOOPS:
                mw, mc = statistics.median(wall[n]), statistics.median(cpu[n])
                rows.append({"threads": threads, "weighting": weighting, "loop": n, "wall_ms": mw, "cpu_ms": mc,
                             "cpu_ratio_vs_diffusers": base_cpu / mc, "wall_ratio_vs_diffusers": base_wall / mw,
                             "rounds_wall_ms": wall[n], "rounds_cpu_ms": cpu[n],
                             "loadavg_1min": round(os.getloadavg()[0], 2)})
            print(f"threads {threads} {weighting}: " + ", ".join(
                f"{r['loop']} {r['wall_ms']:.1f} ms ({r['cpu_ratio_vs_diffusers']:.2f}x cpu)" for r in rows[-3:]),
                flush=True)
            del loops
    return rows


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


def memory_of(args, device) -> dict:
    """One loop alone (this process): its peak memory above what it holds once built."""
    torch.set_num_threads(1)
    setup = setup_of(args, args.weightings[0])
    # one step of a tiny instance first: what the first call loads (code, kernels, lazily imported modules)
    # is not the step's memory (it was +25 MiB of the resident set on CPU, alike for all loops)
    small = {"size": 8, "captions": setup.batch, "length": 8}
    tiny = dataclasses.replace(setup, **small, **({} if args.model == "flux" else {"channels": (16, 32)}))
    warm = build(args.memory_of, tiny, device)
    warm[1](0)
    del warm
    _, step = build(args.memory_of, setup, device)
    gc.collect()  # the peer's build made a fasttrain loop for its initial UNet: freed before the baseline
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set (not a result:
            f.write("5")                                # results go through interleaved.write, _env.Results)
    for k in range(args.memory_steps):
        step(k)
    sync(device)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _status("VmHWM")
    return {"loop": args.memory_of, "weighting": args.weightings[0], "base_mib": base / 2**20,
            "peak_above_base_mib": (peak - base) / 2**20}


def memory(args, device) -> list[dict]:
    rows = []
    for weighting in args.weightings:
        for n in LOOPS:
            cmd = [sys.executable, __file__, "--model", args.model, "--memory-of", n, "--weightings", weighting,
                   "--device", str(device),
                   "--batch", str(args.batch), "--size", str(args.size), "--length", str(args.length),
                   "--channels", ",".join(map(str, args.channels)), "--captions", str(args.captions),
                   "--prediction", args.prediction, "--memory-steps", str(args.memory_steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def parse(argv=None) -> argparse.Namespace:
    ap = _env.Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=_env.counts(), default=[1, 2])
    ap.add_argument("--rounds", type=_env.count(), default=5)
    ap.add_argument("--steps", type=_env.count(), default=10, help="steps per loop per round")
    ap.add_argument("--warmup", type=_env.count(), default=3)
    ap.add_argument("--model", choices=tuple(MODULES), default="sd",
                    help="sd: a UNet2DConditionModel against train_text_to_image.py; flux: a FluxTransformer2DModel "
                         "LoRA against train_dreambooth_lora_flux.py")
    ap.add_argument("--weightings", default=None,
                    help=f"comma-separated: sd {','.join(WEIGHTINGS)}; flux the script's --weighting_scheme "
                         f"{','.join(flux_loops.SCHEMES)} (default: all)")
    ap.add_argument("--prediction", choices=("eps", "v"), default="eps")
    ap.add_argument("--batch", type=_env.count(), default=8)
    ap.add_argument("--size", type=_env.count(), default=16, help="latent size (4 × size × size)")
    ap.add_argument("--length", type=_env.count(), default=77, help="tokens per cached caption")
    ap.add_argument("--channels", type=_env.counts(8), default=[32, 64], help="the UNet's two block widths")
    ap.add_argument("--captions", type=_env.count(), default=64, help="cached latents and captions")
    ap.add_argument("--equal-steps", type=_env.count(), default=20)
    ap.add_argument("--memory-steps", type=_env.count(), default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile the UNet in every loop")
    ap.add_argument("--memory-of", choices=LOOPS, help=argparse.SUPPRESS)  # the child process of `memory`
    args = ap.parse_args(argv)
    if args.weightings is None:
        args.weightings = list(weightings_of(args.model))
    else:
        args.weightings = [w for w in args.weightings.split(",") if w]
        bad = [w for w in args.weightings if w not in weightings_of(args.model)]
        if bad or not args.weightings:
            ap.error(f"--weightings for --model {args.model}: choose from {', '.join(weightings_of(args.model))}")
    if len(args.channels) != 2 or any(c % 8 for c in args.channels):
        ap.error(f"--channels takes two multiples of 8 (GroupNorm of 8 groups), got {args.channels}")
    if args.captions < args.batch:
        ap.error(f"--captions {args.captions} is less than one batch of {args.batch}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    device = torch.device(args.device)
    if args.memory_of:
        print(json.dumps(memory_of(args, device)))
        return
    t0 = time.time()
    eq = equality(args, device)
    mem = memory(args, device)
    rows = timing(args, device)
    setup = setup_of(args, args.weightings[0])
    net = setup.flux_config() if args.model == "flux" else setup.unet_config()
    out = {"machine": machine(), "device": str(device), "model": args.model, "setup": {**setup.__dict__, "net": net},
           "rounds": args.rounds, "steps_per_round": args.steps, "compile": args.compile, "equality": eq,
           "memory": mem, "timing": rows, "seconds": round(time.time() - t0, 1)}
    table = _tables(args, setup, eq, mem, rows)
    if args.model == "flux":
        notes = ["The peer is diffusers' examples/dreambooth/train_dreambooth_lora_flux.py (commit 58eb52c), its "
                 "step ported in bench/flux_loops.py with line citations; both loops read cached latents, T5 states "
                 "and CLIP pooled vectors, and train the script's LoRA (rank 4, alpha 4, its 12 target modules). "
                 "fasttrain-torch is fasttrain's step on its PyTorch reference backend (the ops unfused)."]
        write(f"peer-flux-{device.type}", f"Flux LoRA step: fasttrain vs diffusers' train_dreambooth_lora_flux.py "
              f"({device.type})", out, table, notes)
        return
    notes = ["The peer is diffusers' examples/text_to_image/train_text_to_image.py (commit 58eb52c), its step "
             "ported in bench/t2i_loops.py with line citations; both loops read cached latents and text "
             "states (the script encodes them every step). fasttrain-torch is fasttrain's step on its PyTorch "
             "reference backend (the ops unfused)."]
    write(f"peer-text-to-image-{device.type}", f"Text-to-image step: fasttrain vs diffusers' train_text_to_image.py "
          f"({device.type})", out, table, notes)


def _tables(args, setup, eq, mem, rows) -> list[str]:
    if args.model == "flux":
        head = (f"FluxTransformer2DModel ({setup.layers} double + {setup.single} single blocks, {setup.heads}×"
                f"{setup.head_dim}), LoRA rank {setup.rank}, latents {args.batch}×16×{args.size}×{args.size}, T5 "
                f"states {setup.length}×{setup.width}, AdamW lr {setup.lr}, clip 1.0")
    else:
        head = (f"UNet2DConditionModel {setup.channels}, latents {args.batch}×4×{args.size}×{args.size}, text states "
                f"{setup.length}×{setup.width}, {args.prediction}, AdamW lr {setup.lr}, clip 1.0, EMA 0.9999")
    lines = [head + f"; {args.rounds} interleaved rounds of {args.steps} steps per loop" +
             (", compiled" if args.compile else ", eager"), "",
             "| threads | weighting | loop | wall ms/step | CPU ms/step | CPU-time ratio (diffusers / loop) | "
             "load (1 min) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['weighting']} | {r['loop']} | {r['wall_ms']:.1f} | {r['cpu_ms']:.1f} | "
                     f"{r['cpu_ratio_vs_diffusers']:.2f} | {r['loadavg_1min']} |")
    lines += ["", "Peak memory above the built state, each loop alone over its first "
              f"{args.memory_steps} steps (one thread):", "", "| weighting | loop | peak above base (MiB) |",
              "|---|---|---|"]
    lines += [f"| {m['weighting']} | {m['loop']} | {m['peak_above_base_mib']:.1f} |" for m in mem]
    lines += ["", f"Equal noise ({args.equal_steps} steps, the same x0, ε, t): per-step loss and the trained weights "
              "after (the UNet; Flux: its adapter) (‖Δw‖ relative to how far training moved them):", "",
              "| weighting | fasttrain backend | max rel. loss diff | max abs weight diff | ‖Δw‖ / ‖w − w₀‖ |",
              "|---|---|---|---|---|"]
    for e in eq:
        loss = f"{e['loss_max_rel_diff']:.1e}" if "loss_max_rel_diff" in e else "—"
        w = e["weights"]
        lines.append(f"| {e['weighting']} | {e['fasttrain_backend']} | {loss} | {w['max_abs']:.1e} | "
                     f"{w['rel_norm']:.1e} |")
    return lines


if __name__ == "__main__":
    _env.run(main)
