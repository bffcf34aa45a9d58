"""`fasttrain` command line:

    fasttrain train [PRESET] [key=value ...] [--resume]
    fasttrain sample --ckpt RUN --n 64 --steps 50 --out DIR
    fasttrain eval --ckpt RUN [--n 500]
    fasttrain report RUN
    fasttrain data prepare ROOT [--encoder module:function --latents-out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import ConfigError, keys, load_config, presets


def _help_epilog() -> str:
    lines = ["presets:"]
    lines += [f"  {name:<16} {desc}" for name, desc in presets().items()]
    lines += ["", "keys (key=value overrides; nested: model.args.ch=48, diffusion.weighting_args.gamma=5):"]
    for key, typ, default, help_ in keys():
        lines.append(f"  {key:<30} {typ:<16} default {default!r:<14} {help_}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fasttrain", description="Fast diffusion-model training.")
    sub = p.add_subparsers(dest="command")
    t = sub.add_parser("train", help="train a model (default: the 'default' preset, digits on CPU)",
                       description="Train a diffusion model from a preset with key=value overrides.",
                       epilog=_help_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("preset", nargs="?", default="default", help="preset name or path to a .yaml file")
    t.add_argument("overrides", nargs="*", help="key=value overrides")
    t.add_argument("--resume", action="store_true", help="continue from RUN_DIR/last.pt")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    sm = sub.add_parser("sample", help="generate images from a checkpoint (EMA weights by default)")
    sm.add_argument("--ckpt", required=True, help="run directory or checkpoint file")
    sm.add_argument("--n", type=int, default=64, help="number of samples")
    sm.add_argument("--steps", type=int, default=None, help="sampling steps (default: the run's sample.steps)")
    sm.add_argument("--method", default=None, help="ddim | ddpm | heun | flow_euler | flow_heun")
    sm.add_argument("--eta", type=float, default=None, help="DDIM eta")
    sm.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale")
    sm.add_argument("--label", type=int, default=None, help="generate only this class (conditional runs)")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--raw", action="store_true", help="use the raw weights instead of the EMA")
    sm.add_argument("--out", required=True, help="output directory: grid.png and one PNG per sample")

    ev = sub.add_parser("eval", help="FID/KID/precision/recall and bits/dim of a checkpoint")
    ev.add_argument("--ckpt", required=True, help="run directory or checkpoint file")
    ev.add_argument("--n", type=int, default=None, help="generated samples (default: the run's eval.num_samples)")
    ev.add_argument("--steps", type=int, default=None, help="sampling steps")
    ev.add_argument("--extractor", default=None, help="fasttrain-digits | inception-v3-compat | none")
    ev.add_argument("--weights", default=None, help="local Inception weights (offline machines)")
    ev.add_argument("--no-bpd", action="store_true", help="skip the bits/dim estimate")
    ev.add_argument("--out", default=None, help="JSON file (default: RUN/eval.json)")

    rp = sub.add_parser("report", help="write RUN/report.html")
    rp.add_argument("run", help="run directory")

    da = sub.add_parser("data", help="data-set tools")
    dsub = da.add_subparsers(dest="data_command")
    pr = dsub.add_parser("prepare", help="check a folder, list corrupt files, write its manifest (optionally encode to .npy latents)")
    pr.add_argument("root", help="image folder (class subfolders give labels) or .npy latent folder")
    pr.add_argument("--out", default=None, help="manifest path (default ROOT/fasttrain-manifest.json)")
    pr.add_argument("--encoder", default=None, help="module:function mapping images [N,3,S,S] in [-1,1] to latents")
    pr.add_argument("--latents-out", default=None, help="folder for the encoded .npy latents")
    pr.add_argument("--image-size", type=int, default=256, help="image side fed to the encoder")
    pr.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]  # `fasttrain` alone trains the default preset
    if argv[0] == "train":  # flags may sit between overrides: argparse wants them after the positionals
        argv = ["train"] + [a for a in argv[1:] if not a.startswith("-")] + [a for a in argv[1:] if a.startswith("-")]
    args = _parser().parse_args(argv)
    if args.command in ("sample", "eval", "report", "data"):
        try:
            return {"sample": _sample, "eval": _eval, "report": _report, "data": _data}[args.command](args)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError, ImportError, AttributeError) as e:
            print(f"fasttrain: error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
    if args.command != "train":
        _parser().print_help()
        return 2
    preset, overrides = args.preset, list(args.overrides)
    if "=" in preset:  # `fasttrain train key=value` without a preset name
        preset, overrides = "default", [preset] + overrides
    try:
        cfg = load_config(preset, overrides)
    except ConfigError as e:
        print(f"fasttrain: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    from .train import train  # imports torch: keep --help and config errors fast

    from .distributed import shutdown

    try:
        summary = train(cfg, resume=args.resume)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"fasttrain: error: {str(e).splitlines()[0]}", file=sys.stderr)
        shutdown(1)
        return 1
    except KeyboardInterrupt:
        print(f"fasttrain: interrupted; resume with: fasttrain train {preset} ... --resume", file=sys.stderr)
        shutdown(130)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:
        shutdown(0)
    print(f"done: {summary['steps']} steps, {summary['images']} images -> {cfg.run_dir}")
    ev = summary.get("eval", {})
    if "fid" in ev or "bpd" in ev:
        parts = [f"{k} {ev[k]:.3g}" for k in ("fid", "kid", "precision", "recall", "bpd") if k in ev]
        print("eval: " + ", ".join(parts))
    if "digits_confidence" in ev:
        print(f"digit classifier on samples: confidence {ev['digits_confidence']:.3f}, "
              f"{100 * ev['digits_confident_frac']:.0f}% confident, classes {ev['digits_classes_present']}/10"
              + (f", label agreement {100 * ev['digits_label_agreement']:.0f}%" if "digits_label_agreement" in ev else ""))
    shutdown(0)
    return 0


def _sample(args) -> int:
    from pathlib import Path

    import torch
    from torchvision.utils import save_image

    from .train import Trainer

    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    tr = Trainer.from_run(args.ckpt)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = None
    if tr.num_classes:
        labels = (torch.full((args.n,), args.label) if args.label is not None else torch.arange(args.n) % tr.num_classes)
        if args.label is not None and not 0 <= args.label < tr.num_classes:
            raise ValueError(f"--label must lie in [0, {tr.num_classes}), got {args.label}")
        labels = labels.to(tr.device)
    x = tr.generate(args.n, labels, seed=args.seed, steps=args.steps, method=args.method, guidance=args.guidance,
                    ema=not args.raw, progress=True, eta=args.eta)
    if tr.info.image_size:
        save_image(x * 0.5 + 0.5, out / "grid.png", nrow=tr.num_classes or int(args.n**0.5), padding=1, pad_value=1.0)
        for i, img in enumerate(x):
            save_image(img * 0.5 + 0.5, out / f"{i:05d}.png")
    else:
        from . import plots

        torch.save(x.cpu(), out / "samples.pt")
        plots.plot_points(out / "grid.png", x, tr.data.x[:2000])
    print(f"wrote {args.n} samples to {out}")
    return 0


def _eval(args) -> int:
    import json
    from pathlib import Path

    from .evaluate import run_evaluation
    from .train import Trainer

    tr = Trainer.from_run(args.ckpt)
    ec = tr.cfg.eval
    if args.n is not None:
        ec.num_samples = args.n
    if args.steps is not None:
        ec.steps = args.steps
    if args.extractor is not None:
        ec.extractor = args.extractor
    if args.weights is not None:
        ec.weights_path = args.weights
    if args.no_bpd:
        ec.bpd = False
    metrics = {"step": tr.step, **run_evaluation(tr)}
    path = Path(args.out) if args.out else tr.run_dir / "eval.json"
    path.write_text(json.dumps(metrics, indent=2))
    print(json.dumps(metrics, indent=2))
    return 0


def _report(args) -> int:
    from .report import write_report

    print(f"wrote {write_report(args.run)}")
    return 0


def _data(args) -> int:
    if args.data_command != "prepare":
        _parser().parse_args(["data", "--help"])
        return 2
    from .data.manifest import prepare

    res = prepare(args.root, args.out, args.encoder, args.latents_out, args.image_size, args.batch_size)
    print(f"{res['num_files']} readable files, {len(res['classes'])} classes, sizes {res['sizes']}")
    for rel, reason in res["bad"]:
        print(f"skipped {rel}: {reason}")
    print(f"wrote {res['manifest']}" + (f" and {res['latents_manifest']}" if "latents_manifest" in res else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
