"""`fasttrain` command line: `fasttrain train [PRESET] [key=value ...] [--resume]`."""
from __future__ import annotations

import argparse
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
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]  # `fasttrain` alone trains the default preset
    args = _parser().parse_args(argv)
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

    try:
        summary = train(cfg, resume=args.resume)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"fasttrain: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fasttrain: interrupted; resume with: fasttrain train {preset} ... --resume", file=sys.stderr)
        return 130
    print(f"done: {summary['steps']} steps, {summary['images']} images -> {cfg.run_dir}")
    if "digits" in summary:
        s = summary["digits"]["samples"]
        print(f"digit classifier on samples: confidence {s['confidence']:.3f}, "
              f"{100 * s['confident_frac']:.0f}% confident, classes {s['classes_present']}/10"
              + (f", label agreement {100 * s['label_agreement']:.0f}%" if "label_agreement" in s else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
