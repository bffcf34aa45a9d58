"""The digits-adaptive recipe in a hand-written loop outside the trainer (the sampler's own record):
unet_tiny on sklearn's digits, ε-prediction, Min-SNR-5, the adaptive sampler with fasttrain's
defaults (or --official), the default preset's optimizer (AdamW 1e-3, 200 warm-up steps, clip 1.0,
EMA 0.999), in the trainer's call order (`step.reference_step`). At the end: 100 DDIM-50
samples from the EMA weights, judged by the project's digit classifier, and the learned p(t).

    python bench/adaptive_digits.py [--steps 4000] [--official]

Writes bench/results/adaptive-digits-cpu.{json,md} and adaptive-digits-cpu.png (p(t) over training
and S), plus adaptive-digits-samples-cpu.png.
"""
from __future__ import annotations

import json
import platform
import sys
import time

import _env  # OpenMP's wait policy, before torch loads it
import torch

from fasttrain import diffusion as fd
from fasttrain.data.builtin import digits
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.diffusion.solvers import generate
from fasttrain.generation.features import judge
from fasttrain.models import build_model
from fasttrain.optim.ema import EMA
from fasttrain.plots import plot_adaptive
from fasttrain.step import reference_step


def main() -> None:
    ap = _env.Parser()
    ap.add_argument("--steps", type=_env.count(), default=4000)
    ap.add_argument("--official", action="store_true", help="tau_grid=0, every=40")
    ap.add_argument("--out", type=_env.stem, default="adaptive-digits", help="stem of the result files")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = digits(split="train")
    lin = fd.schedule("linear")
    model = Denoiser(build_model("unet_tiny", in_channels=1, image_size=8, num_classes=10), PredictionOutput("eps",
                                                                                                             lin),
                     lin)
    sampler_args = {"tau_grid": 0, "every": 40} if args.official else {}
    obj = fd.DiffusionObjective(lin, "eps", "min_snr", "adaptive", sampler_args=sampler_args)
    smp = obj.sampler
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200))
    ema = EMA(model, 0.999)
    g, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)

    def clip():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    t0, lookahead = time.perf_counter(), 0.0
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (16,), generator=g)
        labels = torch.where(torch.rand(16, generator=g) < 0.1, 10, y[idx])  # 10% label dropout
        reference_step(model, obj, opt, [(x[idx], labels)], step, [smp], generator=gen, before_step=clip)
        sched.step()
        ema.update(model)
        if step % 500 == 499:
            m = smp.metrics()
            lookahead += m["adaptive/lookahead_s"]
            print(f"step {step + 1}: reward {float(m['adaptive/reward']):+.2e} entropy "
                  f"{float(m['adaptive/policy_entropy']):+.3f} alpha {float(m['adaptive/alpha']):.3f} "
                  f"beta {float(m['adaptive/beta']):.3f} S {[int(m[f'adaptive/S{i}']) for i in range(3)]}", flush=True)
    train_s = time.perf_counter() - t0
    lookahead += smp.metrics()["adaptive/lookahead_s"]
    labels = torch.arange(100) % 10
    sch = obj.schedule

    def denoise(x_t, t: int):  # (x̂0, ε̂) from the ε-prediction network
        tt = torch.full((x_t.shape[0],), t, dtype=torch.long)
        x0 = model.x0_hat(x_t, tt, labels)
        return x0, (x_t - sch.alpha[t] * x0) / sch.sigma[t]

    with ema.applied(model), torch.no_grad():
        model.eval()
        imgs = generate(denoise, sch, (100, 1, 8, 8), steps=50, generator=torch.Generator().manual_seed(0))
    verdict = judge(imgs, labels)
    h = smp.p_history(bins=50)
    first, last = h["p"][0], h["p"][-1]
    moved = float(0.5 * abs(last - first).sum())
    setting = "official setting" if args.official else "fasttrain defaults"
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python"] + sys.argv),
           "machine": {"torch": torch.__version__, "python": platform.python_version(), "threads": 1},
           "sampler_args": sampler_args, "steps": args.steps, "train_seconds": train_s,
           "lookahead_seconds": lookahead, "updates": smp.updates, "judge": verdict,
           "p_total_variation_first_to_last": moved, "p_first_50bins": first.tolist(), "p_last_50bins": last.tolist(),
           "S_last": h["S"][-1].tolist()}
    md = [f"# digits with the adaptive sampler ({setting}), cpu",
          "", f"command: `{out['command']}`  ", f"when: {out['when']}", "",
          f"- {args.steps} steps in {train_s:.0f} s, of which {lookahead:.1f} s in the look-ahead "
          f"({100 * lookahead / train_s:.1f}%), {smp.updates} policy updates",
          f"- 100 EMA DDIM-50 samples: classifier confidence {verdict['confidence']:.3f}, "
          f"{verdict['classes_present']}/10 classes, agrees with the requested label "
          f"{100 * verdict['label_agreement']:.0f}%",
          f"- p(t) moved by total variation {moved:.3f} from the first to the last update; last S = {out['S_last']}",
          "", f"![p(t)]({args.out}-cpu.png)", "", f"![samples]({args.out}-samples-cpu.png)"]
    import torchvision

    with _env.Results() as res:  # every file, or none if anything fails
        plot_adaptive(res.path(f"{args.out}-cpu.png"), h["steps"], h["p"], h["S"], h["T"],
                      title=f"digits, adaptive sampler ({setting})")
        torchvision.utils.save_image((imgs + 1) / 2, res.path(f"{args.out}-samples-cpu.png"), nrow=10, padding=1)
        res.text(f"{args.out}-cpu.json", json.dumps(out, indent=2))
        res.text(f"{args.out}-cpu.md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
