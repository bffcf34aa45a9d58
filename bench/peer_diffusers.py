"""fasttrain's training step against diffusers' own example loop, on the same network, batch and
optimizer (issue 35): eager and compiled, one and two threads (CPU), side by side.

    python bench/peer_diffusers.py [--steps 100] [--rounds 3] [--threads 1,2] [--no-compile]

The peer is the per-step body of diffusers' examples/unconditional_image_generation/train_unconditional.py
(huggingface/diffusers at 58eb52c0, lines cited in `DiffusersLoop`), ported for one process: with one
process and gradient_accumulation_steps=1 `accelerator.accumulate` is a no-op, `accelerator.backward` is
`loss.backward()` and `accelerator.clip_grad_norm_` is torch's; its `--use_ema` EMA is on (fasttrain
always keeps one); the data loader is the script's (shuffled, num_workers 0) over the same digits; the
progress bars of both sides are off. The network is the UNet2DModel that fasttrain's `unet_tiny` exports
to (fasttrain/export/convert.py: unconditional, 756k parameters), with the same initial weights on both sides;
the batch 16×1×8×8 digits; the optimizer AdamW at lr 1e-4, gradients clipped at 1.0.

fasttrain's side is `fasttrain train` itself: the trainer built from a config (model.name=diffusers with
that UNet2DModel; and its own `unet_tiny`, the default run's network, for reference), timed through the
run loop's body (Trainer.train_step and the periodic actions, as Trainer.fit runs them; the log line
every 100 steps, no evaluation or checkpoint in the window). Compiled: diffusers' loop with
`torch.compile(model)`, fasttrain with parallel.compile=model; their compile time is reported apart.

Each thread count runs in its own process (inductor bakes the thread count into its code); the
variants run in `--rounds` interleaved blocks of `--steps` steps. Reported per step: wall time and
process CPU time (on a shared machine the CPU time is the steadier figure; see bench/profile_default.py).
On a GPU (bench/gpu_check.sh) the same script runs on cuda. Writes
bench/results/peer-diffusers-<device>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _env
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

BATCH = 16
DIFFUSERS_AT = "huggingface/diffusers@58eb52c0 examples/unconditional_image_generation/train_unconditional.py"


def unet_setup():
    """The UNet2DModel config fasttrain's unconditional unet_tiny exports to, and that network's weights
    in diffusers' layout (convert.py)."""
    import diffusers

    from fasttrain.export.convert import unet_config, unet_state_dict
    from fasttrain.models import build_model
    from fasttrain.models.unet import UNet

    torch.manual_seed(0)
    args = {"ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [4], "heads": 4}
    net = build_model("unet_tiny", in_channels=1, image_size=8, num_classes=0)
    assert isinstance(net, UNet)
    for p in net.parameters():  # non-zero output layers, so that both sides train from the first step
        if p.dim() > 1 and p.abs().max() == 0:
            torch.nn.init.normal_(p, std=0.02)
    config = unet_config(net, args)
    hf = diffusers.UNet2DModel(**config)
    hf.load_state_dict(unet_state_dict(net, hf))
    return config, hf.state_dict()


class DiffusersLoop:
    """train_unconditional.py's training step (line numbers of DIFFUSERS_AT)."""

    def __init__(self, config: dict, state: dict, x: torch.Tensor, device: torch.device, compile: bool,
                 total_steps: int):
        from diffusers import DDPMScheduler, UNet2DModel
        from diffusers.optimization import get_scheduler
        from diffusers.training_utils import EMAModel

        self.device = device
        model = UNet2DModel(**config)                                             # l. 381
        model.load_state_dict(state)
        model.to(device)
        self.ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True,  # l. 409-418, defaults l. 199-201
                            inv_gamma=1.0, power=3 / 4, model_cls=UNet2DModel, model_config=model.config)
        self.ema.to(device)                                                       # l. 536
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear",  # l. 444
                                             prediction_type="epsilon")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999),  # l. 453, l. 171-193
                                           weight_decay=1e-6, eps=1e-8)
        self.loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=BATCH,  # l. 518
                                                  shuffle=True, num_workers=0)
        self.lr_scheduler = get_scheduler("cosine", optimizer=self.optimizer, num_warmup_steps=500,  # l. 523
                                          num_training_steps=total_steps)
        self.model = torch.compile(model) if compile else model
        self.model.train()                                                        # l. 586
        self.batches = iter(self.loader)
        self.global_step = 0

    def steps(self, n: int) -> None:
        model = self.model
        for _ in range(n):
            try:
                (clean,) = next(self.batches)                                     # l. 589
            except StopIteration:  # the next epoch (l. 585)
                self.batches = iter(self.loader)
                (clean,) = next(self.batches)
            clean_images = clean.to(self.device).to(torch.float32)               # l. 596
            noise = torch.randn(clean_images.shape, dtype=torch.float32, device=clean_images.device)  # l. 598
            bsz = clean_images.shape[0]
            timesteps = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (bsz,),  # l. 601
                                      device=clean_images.device).long()
            noisy_images = self.noise_scheduler.add_noise(clean_images, noise, timesteps)  # l. 607
            model_output = model(noisy_images, timesteps).sample                 # l. 611
            loss = F.mse_loss(model_output.float(), noise.float())               # l. 614
            loss.backward()                                                       # l. 626
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)              # l. 629
            self.optimizer.step()                                                 # l. 630
            self.lr_scheduler.step()
            self.optimizer.zero_grad()
            self.ema.step(model.parameters())                                     # l. 637
            self.global_step += 1
            logs = {"loss": loss.detach().item(), "lr": self.lr_scheduler.get_last_lr()[0],  # l. 667
                    "step": self.global_step}
            logs["ema_decay"] = self.ema.cur_decay_value


class FasttrainLoop:
    """`fasttrain train` with a config: its run loop's body (as Trainer.fit runs it)."""

    def __init__(self, model_yaml: str, compile: bool, threads: int, tmp: str, name: str):
        from fasttrain.config import read_config
        from fasttrain.logger import MetricLogger
        from fasttrain.train import Trainer
        from fasttrain.train_state import StepClock

        preset = Path(tmp) / f"{name}.yaml"
        with open(preset, "w") as f:  # a temporary preset (results go through _env.Results)
            f.write("data: {name: digits, batch_size: 16}\n" + model_yaml +
                    "diffusion: {schedule: linear, prediction: eps, weighting: min_snr, sampler: uniform}\n"
                    "optim: {lr: 1.0e-4, grad_clip: 1.0}\n"
                    "parallel: {channels_last: true}\n")  # as the default preset (docs/performance-cpu.md)
        cfg = read_config(str(preset), [f"run_dir={tmp}/{name}", "train.progress=false", f"train.threads={threads}",
                                        "train.steps=1000000", "train.ckpt_every=0", "eval.every=0",
                                        "diagnostics.interference_every=0",
                                        f"parallel.compile={'model' if compile else 'none'}"])
        self.tr = tr = Trainer(cfg)
        tr.log, tr.clock = MetricLogger(tr.run_dir), StepClock()
        tr.bar = _NoBar()
        self.one = torch.ones((), device=tr.device)

    def steps(self, n: int) -> None:
        tr, st = self.tr, self.tr.state
        for _ in range(n):  # Trainer.fit's loop body
            loss, gnorm = tr.train_step()
            ok = torch.isfinite(loss) & torch.isfinite(gnorm)
            st.interval += torch.stack([loss.double(), gnorm.double(), self.one.double()]).where(ok, 0.0)
            st.interval_steps += 1
            tr.clock.tick()
            tr.bar.update(1)
            tr._act(in_step=False)

    def close(self):
        self.tr.log.close()
        self.tr.close()


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kw):
        pass


def worker(args) -> dict:
    """One thread count: every variant built, warmed (compile timed), then interleaved rounds."""
    from fasttrain.data.builtin import digits

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config, state = unet_setup()
    x, _ = digits(split="train")
    import yaml  # (PyYAML writes 1e-5 as a float that YAML reads back as one; JSON's 1e-05 reads as a string)

    hf_config = {k: v for k, v in config.items() if k not in ("sample_size", "in_channels")}  # the data's
    hf_yaml = yaml.safe_dump({"model": {"name": "diffusers", "class_conditional": False,
                                        "args": {"class_name": "UNet2DModel", "config": hf_config}}})
    tiny_yaml = "model: {name: unet_tiny, class_conditional: false}\n"
    total = args.steps * (args.rounds + 1) + 1000
    variants, startup = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for compiled in ([False, True] if args.compile else [False]):
            tag = "compiled" if compiled else "eager"
            builders = {f"diffusers loop, {tag}": lambda c=compiled: DiffusersLoop(config, state, x, device, c, total),
                        f"fasttrain, UNet2DModel, {tag}": lambda c=compiled, t=tag: FasttrainLoop(
                            hf_yaml, c, args.threads, tmp, f"hf-{t}"),
                        f"fasttrain, unet_tiny, {tag}": lambda c=compiled, t=tag: FasttrainLoop(
                            tiny_yaml, c, args.threads, tmp, f"tiny-{t}")}
            for name, build in builders.items():
                t0 = time.perf_counter()
                v = build()
                if name.startswith("fasttrain, UNet2DModel"):  # the diffusers side's initial weights
                    next(m for m in v.tr.model.modules() if type(m).__name__ == "UNet2DModel").load_state_dict(state)
                v.steps(3)  # the first steps: compile, oneDNN's first calls
                sync()
                startup[name] = time.perf_counter() - t0
                v.steps(10)
                variants[name] = v
                print(f"threads {args.threads}: {name} ready ({startup[name]:.1f} s)", file=sys.stderr, flush=True)
        wall = {k: [] for k in variants}
        cpu = {k: [] for k in variants}
        for r in range(args.rounds):
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for k in order:
                sync()
                w, c = time.perf_counter(), time.process_time()
                variants[k].steps(args.steps)
                sync()
                wall[k].append((time.perf_counter() - w) / args.steps * 1e3)
                cpu[k].append((time.process_time() - c) / args.steps * 1e3)
        for v in variants.values():
            if isinstance(v, FasttrainLoop):
                v.close()
    return {"threads": args.threads, "device": device.type, "startup_s": startup, "wall_ms": wall, "cpu_ms": cpu}


def main(argv=None) -> None:
    ap = _env.Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=_env.count(), default=100, help="steps per round and variant")
    ap.add_argument("--rounds", type=_env.count(), default=3)
    ap.add_argument("--threads", type=_env.counts(), default=[1, 2], help="thread counts, e.g. 1,2")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager variants only")
    ap.add_argument("--out", type=_env.stem, default=None, help="result files' stem (default: peer-diffusers-<device>)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one thread count, JSON out
    args = ap.parse_args(argv)
    if args.worker:
        args.threads = args.threads[0]
        print(json.dumps(worker(args)))
        return
    from cases import machine

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                                   str(Path(tempfile.gettempdir()) / "peer-inductor"))}
    runs = []
    for n in args.threads:
        cmd = [sys.executable, __file__, "--worker", "--threads", str(n), "--steps", str(args.steps),
               "--rounds", str(args.rounds)] + ([] if args.compile else ["--no-compile"])
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"the {n}-thread worker failed (exit {out.returncode})")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    info = machine()
    info.pop("threads", None)
    dev = runs[0]["device"]
    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
            "peer": DIFFUSERS_AT, "steps_per_round": args.steps, "rounds": args.rounds, "runs": runs}
    lines = [f"# fasttrain's step vs diffusers' example loop ({dev})", "",
             f"machine: {info.get('gpu', info['cpu'])}, {info['cores']} cores, load {info['loadavg_1min']} at the "
             f"start; torch {info['torch']}  ", f"when: {meta['when']}  ", f"command: `{meta['command']}`  ",
             f"peer: `{DIFFUSERS_AT}` (its step, ported in bench/peer_diffusers.py)", "",
             "Same UNet2DModel (fasttrain's unet_tiny exported, unconditional, same initial weights), batch 16×1×8×8 "
             "digits, AdamW lr 1e-4, clip 1.0, EMA on both sides. Median over "
             f"{args.rounds} interleaved rounds of {args.steps} steps. Ratio: diffusers' time / fasttrain's "
             "(above 1: fasttrain is faster).", "",
             "| threads | variant | ms/step (wall) | ms/step (CPU) | ratio (wall) | ratio (CPU) | start-up (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        med_w = {k: statistics.median(v) for k, v in r["wall_ms"].items()}
        med_c = {k: statistics.median(v) for k, v in r["cpu_ms"].items()}
        r["median_wall_ms"], r["median_cpu_ms"] = med_w, med_c
        for k in med_w:
            tag = k.rsplit(", ", 1)[1]
            ref = f"diffusers loop, {tag}"
            rw, rc = med_w[ref] / med_w[k], med_c[ref] / med_c[k]
            lines.append(f"| {r['threads']} | {k} | {med_w[k]:.1f} | {med_c[k]:.1f} | {rw:.2f}× | {rc:.2f}× | "
                         f"{r['startup_s'][k]:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with _env.Results() as res:
        name = args.out or f"peer-diffusers-{dev}"
        res.text(f"{name}.json", json.dumps(meta, indent=2))
        res.text(f"{name}.md", text)


if __name__ == "__main__":
    _env.run(main)
