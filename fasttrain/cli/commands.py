"""`fasttrain` command line:

    fasttrain train [PRESET] [key=value ...] [--resume | --restart]
    fasttrain sample --ckpt RUN --n 64 --steps 50 --out DIR [--npz FILE] [--chunk N]
    fasttrain eval --ckpt RUN [--n 500] [--ref FOLDER] [--ref-stats FILE.npz] [--samples DIR]
    fasttrain report RUN
    fasttrain export RUN --to diffusers OUT
    fasttrain ema RUN --sigma-rel S [S ...] [--step N] [--out DIR]   (post-hoc EMA from phema.every snapshots)
    fasttrain data prepare ROOT [--vae FOLDER | --encoder module:function] [--latents-out DIR] [--pack]
                                [--shards DIR] [--text-encoders PIPE]   (captions cached beside the latents,
                                                                         or with --shards in the shards)
    fasttrain sample --ckpt RUN --prompt TEXT [--negative-prompt TEXT] --guidance 4 --out DIR   (text runs)
    fasttrain data class-images PIPE --prompt TEXT --num-images N --out DIR [--seed S]   (DreamBooth class
                                images from the base, resumable: generation/class_images.py)

`sample` and `eval` also run under torchrun (`--num-samples` for `--n` there): the images split across
ranks by index, resumable (generation/ranks.py).

`sample`, `eval` and `report` read a model bundle from the checkpoint alone (bundle.py): they need
neither the training data nor a process group. Every user error ends in one line on stderr.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from ..parallel.cpu import prepare_openmp

prepare_openmp()  # before anything imports torch (cpu.py): idle OpenMP threads yield on a busy machine

from ..config import keys, presets  # noqa: E402
from ..errors import ConfigError, InvalidInput, UserError  # noqa: E402
from ..paths import check_output  # noqa: E402
from .common import USER_ERRORS, checkpoint_reads, first_line, out_dir, out_file  # noqa: E402


def _help_epilog() -> str:
    from ..configure import choices

    lines = ["presets:"]
    lines += [f"  {name:<16} {desc}" for name, desc in presets().items()]
    lines += ["", "keys (key=value overrides; nested: model.args.ch=48, diffusion.weighting_args.gamma=5):"]
    for key, typ, default, help_ in keys(choices=choices()):
        lines.append(f"  {key:<30} {typ:<16} default {default!r:<14} {help_}")
    return "\n".join(lines)


def _checked(name: str, convert, ok, need: str):
    """An argparse type: `convert` the text, then require `ok(value)`; one-line errors naming the flag."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {'an integer' if convert is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{name} must be {need}, got {text}")
        return v

    return parse


def _positive(name: str):
    return _checked(name, int, lambda v: v >= 1, ">= 1")


def _finite(name: str):
    return _checked(name, float, math.isfinite, "a finite number")


_sigma_rel = _checked("--sigma-rel", float, lambda v: 0 < v < math.sqrt(1 / 12), "in (0, 0.2887)")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, the same prefix as every other error
        self.exit(2, f"fasttrain: error: {message}\n")

    def format_help(self) -> str:
        # A callable epilog is built only when help is shown: the key list imports every registry
        # (models, samplers, data sources: ~3 s), which a run that never prints it should not pay.
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def _parser() -> argparse.ArgumentParser:
    from ..diffusion.solvers import SOLVERS, SPACINGS
    from ..generation.evaluate import EXTRACTORS

    p = _Parser(prog="fasttrain", description="Fast diffusion-model training.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    t = sub.add_parser("train", help="train a model (default: the 'default' preset, digits on CPU)",
                       description="Train a diffusion model from a preset with key=value overrides.",
                       epilog=_help_epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("preset", nargs="?", default="default", help="preset name or path to a .yaml file")
    t.add_argument("overrides", nargs="*", help="key=value overrides")
    t.add_argument("--resume", action="store_true", help="continue from RUN_DIR's last checkpoint")
    t.add_argument("--restart", action="store_true", help="start over in a RUN_DIR that holds a run "
                                                          "(the old files move to RUN_DIR/previous-N/)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    sm = sub.add_parser("sample", help="generate images from a checkpoint (EMA weights by default)")
    sm.add_argument("--ckpt", required=True, help="run directory, checkpoint file or DCP folder")
    # --num-samples: torchrun's own parser reads a bare --n as an abbreviation of its --nnodes/--nproc-per-node
    sm.add_argument("--n", "--num-samples", dest="n", type=_positive("--n"), default=64,
                    help="number of samples (under torchrun: --num-samples)")
    sm.add_argument("--steps", type=_positive("--steps"), default=None, help="solver steps (default: the run's)")
    sm.add_argument("--solver", choices=SOLVERS.names(), default=None, help="generation solver (default: the run's)")
    sm.add_argument("--spacing", choices=SPACINGS, default=None,
                    help="which timesteps the steps visit (default: the run's sample.spacing; an exported pipeline: "
                         "trailing)")
    sm.add_argument("--eta", type=_finite("--eta"), default=None, help="DDIM eta")
    sm.add_argument("--guidance", type=_finite("--guidance"), default=None, help="classifier-free guidance scale")
    sm.add_argument("--label", type=int, default=None, help="generate only this class (conditional runs)")
    sm.add_argument("--prompt", action="append", default=None, help="text runs: a prompt (repeat for several; "
                    "samples cycle through them; default: the run's sample.prompts or its data's first captions)")
    sm.add_argument("--negative-prompt", default=None, help="text runs: guidance's unconditional side (default the "
                    "run's sample.negative_prompt, the empty prompt)")
    sm.add_argument("--text-encoders", default=None, help="text runs: encode prompts with this pipeline folder "
                    "(default: the recorded one; it must hold the same encoders)")
    sm.add_argument("--seed", type=int, default=0, help="image i draws its noise from the seed + i (EDM2's rule)")
    sm.add_argument("--raw", action="store_true", help="use the raw weights instead of the EMA")
    sm.add_argument("--out", required=True, help="output directory: grid.png and one PNG per sample")
    sm.add_argument("--vae", default=None, help="latent runs: decode with this VAE folder (default: the recorded one)")
    sm.add_argument("--npz", default=None, help="also write the images as one .npz in the layout of ADM's evaluation "
                    "suite (arr_0 uint8 NHWC; arr_1 the labels of a conditional model)")
    sm.add_argument("--chunk", type=_positive("--chunk"), default=64,
                    help="images per batch and per resumable chunk (under torchrun chunks go round-robin to ranks)")

    ev = sub.add_parser("eval", help="FID/KID/precision/recall and bits/dim of a checkpoint")
    ev.add_argument("--ckpt", required=True, help="run directory, checkpoint file or DCP folder")
    ev.add_argument("--n", "--num-samples", dest="n", type=_positive("--n"), default=None,
                    help="generated samples (default: the run's; under torchrun: --num-samples)")
    ev.add_argument("--steps", type=_positive("--steps"), default=None, help="solver steps")
    ev.add_argument("--extractor", choices=EXTRACTORS, default=None, help="FID feature extractor")
    ev.add_argument("--weights", default=None, help="local Inception weights (offline machines)")
    ev.add_argument("--ref", default=None,
                    help="reference folder (images or .npy latents) for runs trained on a folder")
    ev.add_argument("--no-bpd", action="store_true", help="skip the bits/dim estimate")
    ev.add_argument("--ref-stats", default=None, help="reference statistics .npz (mu, sigma; ADM's reference batches "
                    "work): read when it exists, else computed from the reference data once and written there")
    ev.add_argument("--ref-n", type=_positive("--ref-n"), default=5000,
                    help="reference images the statistics are computed from")
    ev.add_argument("--samples", default=None, help="folder for the generated set's resumable chunks (default "
                    "RUN/eval-samples/<settings hash>)")
    ev.add_argument("--chunk", type=_positive("--chunk"), default=64,
                    help="images per batch and per resumable chunk (under torchrun chunks go round-robin to ranks); "
                         "the reference statistics are computed this many images at a time")
    ev.add_argument("--out", default=None, help="JSON file (default: RUN/eval.json)")
    ev.add_argument("--vae", default=None, help="latent runs: decode with this VAE folder (default: the recorded one)")
    ev.add_argument("--sigma-rel", nargs="+", type=_sigma_rel, default=None, metavar="S",
                    help="post-hoc EMA sweep: reconstruct each σ_rel from RUN's snapshots (fasttrain ema) and "
                         "evaluate it; FID against σ_rel in RUN/ema/sweep-<step>.json and .png")
    ev.add_argument("--step", type=_positive("--step"), default=None,
                    help="with --sigma-rel: the snapshot step to reconstruct at (default: the last)")

    em = sub.add_parser("ema", help="post-hoc EMA: the EMA of any length rebuilt from a run's snapshots "
                                    "(train with phema.every=N)")
    em.add_argument("run", help="run directory (its phema/ snapshots and its checkpoint)")
    em.add_argument("--sigma-rel", nargs="+", type=_sigma_rel, required=True, metavar="S",
                    help="relative EMA lengths to reconstruct (EDM2: the averaging profile's std / the training time), "
                         "each in (0, 0.2887)")
    em.add_argument("--step", type=_positive("--step"), default=None,
                    help="the snapshot step to reconstruct at (default: the last)")
    em.add_argument("--out", default=None, help="folder for phema-<step>-<σ_rel>.pt (default RUN/ema)")

    rp = sub.add_parser("report", help="write RUN/report.html")
    rp.add_argument("run", help="run directory")
    rp.add_argument("--vae", default=None, help="latent runs: the VAE folder to decode samples with")

    ex = sub.add_parser("export", help="write a run as a pipeline folder of another library (diffusers)")
    ex.add_argument("run", help="run directory, checkpoint file or DCP folder")
    ex.add_argument("--to", required=True, choices=("diffusers", "lora", "kohya"),
                    help="the library: diffusers (a pipeline folder), lora (a LoRA run's adapter as "
                         "pytorch_lora_weights.safetensors for pipe.load_lora_weights), or kohya (the adapter as one "
                         "OUT/<run name>.safetensors in sd-scripts' lora_unet_… names with .alpha: ComfyUI, "
                         "AUTOMATIC1111/Forge, sd-scripts)")
    ex.add_argument("out", help="the pipeline folder to write (new or empty)")
    ex.add_argument("--vae", default=None, help="latent runs: the VAE to ship (default: the recorded one)")
    ex.add_argument("--raw", action="store_true", help="export the raw weights instead of the EMA")

    da = sub.add_parser("data", help="data-set tools")
    dsub = da.add_subparsers(dest="data_command", parser_class=_Parser)
    ci = dsub.add_parser("class-images", help="DreamBooth prior preservation: make the class images a folder "
                         "lacks with the base pipeline (diffusers --class_data_dir --num_class_images; seeded per "
                         "image, resumable)")
    ci.add_argument("pipeline", help="the base pipeline folder (its denoiser, VAE and text encoders)")
    ci.add_argument("--prompt", required=True, help="the class prompt (diffusers --class_prompt)")
    ci.add_argument("--num-images", type=_positive("--num-images"), required=True,
                    help="images the folder should hold, its own included (diffusers --num_class_images)")
    ci.add_argument("--out", required=True, help="the class image folder (diffusers --class_data_dir)")
    ci.add_argument("--seed", type=int, default=0, help="class image i draws its noise from the seed + i")
    ci.add_argument("--steps", type=_positive("--steps"), default=25, help="sampling steps")
    ci.add_argument("--guidance", type=_finite("--guidance"), default=7.5, help="classifier-free guidance scale")
    ci.add_argument("--negative-prompt", default="", help="guidance's unconditional side (default the empty prompt)")
    ci.add_argument("--image-size", type=_positive("--image-size"), default=512, help="image side in pixels")
    ci.add_argument("--batch-size", type=_positive("--batch-size"), default=4, help="images per sampling batch")
    ci.add_argument("--solver", choices=SOLVERS.names(), default=None,
                    help="generation solver (default: ddim; flow pipelines: flow_euler)")
    ci.add_argument("--spacing", choices=SPACINGS, default=None,
                    help="step spacing (default: the pipeline scheduler's timestep_spacing; flow pipelines: "
                    "trailing)")
    pr = dsub.add_parser("prepare", help="check a folder, list corrupt files, write its manifest "
                                         "(optionally encode to .npy latents)")
    pr.add_argument("root", help="image folder (class subfolders give labels) or .npy latent folder")
    pr.add_argument("--out", default=None, help="manifest path (default ROOT/fasttrain-manifest.json)")
    pr.add_argument("--encoder", default=None, help="module:function mapping images [N,3,S,S] in [-1,1] to latents")
    pr.add_argument("--vae", default=None, help="encode with a local diffusers AutoencoderKL folder (posterior mean "
                    "and std per image; resumable)")
    pr.add_argument("--vae-subfolder", default=None, help="the VAE's subfolder in a pipeline folder (e.g. vae)")
    pr.add_argument("--latents-out", default=None, help="folder for the encoded .npy latents (--vae: ROOT-latents)")
    pr.add_argument("--image-size", type=_positive("--image-size"), default=256, help="image side fed to the encoder")
    pr.add_argument("--batch-size", type=_positive("--batch-size"), default=64, help="encoder batch size")
    pr.add_argument("--shards", default=None, help="also write the folder's images as WebDataset tar shards "
                    "(+ index) into this folder, for data.name=shards (data/shards.py); with --vae and "
                    "--text-encoders: the images' latents and their captions' encodings instead, for "
                    "data.name=captioned_shards (data/latent_shards.py)")
    pr.add_argument("--shard-size", type=_positive("--shard-size"), default=1000, help="samples per shard")
    pr.add_argument("--buckets", action="store_true", help="with --vae: encode each image at its aspect-ratio "
                    "bucket's size (around --image-size), one packed array per bucket, for data.name=bucket_latents")
    pr.add_argument("--min-bucket-reso", type=_positive("--min-bucket-reso"), default=256)
    pr.add_argument("--max-bucket-reso", type=_positive("--max-bucket-reso"), default=1024)
    pr.add_argument("--bucket-reso-steps", type=_positive("--bucket-reso-steps"), default=64)
    pr.add_argument("--pack", action="store_true", help="also pack the .npy latents (ROOT's, or the encoded ones) "
                    "into one memory-mapped array + index, for data.name=packed (data/packed.py)")
    pr.add_argument("--text-encoders", default=None, help="with --vae: also encode every image's captions (.txt "
                    "beside it or metadata.jsonl) with this pipeline folder's text encoders (fp16 cache)")
    pr.add_argument("--clip-skip", type=int, default=None,
                    help="with --text-encoders: CLIP layers skipped from the end")
    pr.add_argument("--caption-column", default="text", help="metadata.jsonl's caption column (default text)")
    pr.add_argument("--prompt", default=None, help="with --text-encoders: every image's one caption, instead of "
                    "caption files (diffusers' DreamBooth --instance_prompt / --class_prompt)")
    pr.add_argument("--mask", choices=("alpha", "file"), default=None, help="with --vae: also write each image's "
                    "loss mask on the latent grid (alpha: its alpha channel; file: NAME.mask.png beside it), for "
                    "data.mask (sd-scripts --masked_loss)")
    pr.add_argument("--allow-empty-captions", action="store_true", help="encode images without a caption as the "
                    "empty prompt (default: refused, with their count)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]  # `fasttrain` alone trains the default preset
    if argv[0] == "train":  # flags may sit between overrides: argparse wants them after the positionals
        argv = ["train"] + [a for a in argv[1:] if not a.startswith("-")] + [a for a in argv[1:] if a.startswith("-")]
    args = _parser().parse_args(argv)
    if args.command in ("sample", "eval", "report", "data", "export", "ema"):
        try:
            return {"sample": _sample, "eval": _eval, "report": _report, "data": _data,
                    "export": _export, "ema": _ema}[args.command](args)
        except USER_ERRORS as e:
            if os.environ.get("FASTTRAIN_DEBUG") == "1":
                raise
            print(f"fasttrain: error: {first_line(e)}", file=sys.stderr)
            return 1
    if args.command != "train":
        _parser().print_help()
        return 2
    preset, overrides = args.preset, list(args.overrides)
    if "=" in preset:  # `fasttrain train key=value` without a preset name
        preset, overrides = "default", [preset] + overrides
    if args.resume and args.restart:
        print("fasttrain: error: --resume and --restart exclude each other", file=sys.stderr)
        return 2
    try:
        from ..configure import load_config

        cfg = load_config(preset, overrides, resume=args.resume)
    except UserError as e:  # a config key (2), or a folder or checkpoint the config names (1)
        print(f"fasttrain: error: {first_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    if cfg.diffusion.backend == "interpret":  # the interpreter must be chosen before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from ..parallel.distributed import shutdown
    from ..train import train  # imports torch: keep --help and config errors fast

    try:
        summary = train(cfg, resume=args.resume, restart=args.restart)
    except USER_ERRORS as e:
        if os.environ.get("FASTTRAIN_DEBUG") == "1":
            raise
        print(f"fasttrain: error: {first_line(e)}", file=sys.stderr)
        shutdown(1)
        return 1
    except KeyboardInterrupt:
        again = " ".join(a for a in argv[1:] if a not in ("--resume", "--restart"))
        from ..checkpoint import latest

        if latest(cfg.run_dir) is not None:
            print(f"fasttrain: stopped; the run continues with: fasttrain train {again} --resume", file=sys.stderr)
        else:
            print(f"fasttrain: stopped before the first checkpoint, nothing to resume; start again with: "
                  f"fasttrain train {again} --restart", file=sys.stderr)
        shutdown(130)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:
        shutdown(0)
    print(f"done: {summary['steps']} steps, {summary['images']} images -> {cfg.run_dir}")
    if summary.get("skipped_steps"):
        print(f"fasttrain: warning: {summary['skipped_steps']} of the steps were skipped as not finite (see "
              f"skipped_steps in {cfg.run_dir}/metrics.jsonl)", file=sys.stderr)
    _print_eval(summary.get("eval", {}))
    shutdown(0)
    return 0


def _print_eval(ev: dict) -> None:
    if "fid" in ev or "bpd" in ev:
        parts = [f"{k} {ev[k]:.3g}" for k in ("fid", "kid", "precision", "recall", "bpd") if k in ev]
        if "bpd_se" in ev:
            parts[-1] += f" ± {ev['bpd_se']:.2g}"
        print("eval: " + ", ".join(parts))
    if "digits_confidence" in ev:
        print(f"digit classifier on samples: confidence {ev['digits_confidence']:.3f}, "
              f"{100 * ev['digits_confident_frac']:.0f}% confident, classes {ev['digits_classes_present']}/10"
              + (f", label agreement {100 * ev['digits_label_agreement']:.0f}%"
                 if "digits_label_agreement" in ev else ""))


def _sample(args) -> int:
    from .generate import sample

    return sample(args)


def _eval(args) -> int:
    if args.sigma_rel:  # a post-hoc EMA sweep (cli/ema.py)
        from .ema import sweep

        return sweep(args)
    if args.step is not None:
        raise InvalidInput("--step chooses the snapshot of a post-hoc EMA sweep: give --sigma-rel too")
    from .generate import evaluate

    return evaluate(args)


def _ema(args) -> int:
    from .ema import ema

    return ema(args)


def _report(args) -> int:
    from ..generation.report import write_report

    print(f"wrote {write_report(args.run, vae=args.vae)}")
    return 0


def _export(args) -> int:
    from ..bundle import ModelBundle
    from ..export.dispatch import export_diffusers

    check_output(args.out, "the export folder", checkpoint_reads(args, ModelBundle.load(args.run, vae=args.vae)))
    res = export_diffusers(args.run, args.out, vae=args.vae, ema=not args.raw, to=args.to)
    if args.to == "kohya":
        print(f"wrote {res['out']} ({res['tensors']} tensors in sd-scripts' names, {res['pipeline']}, {res['weights']} "
              f"weights of step {res['step']}): ComfyUI / AUTOMATIC1111 / sd-scripts load it, and "
              f"diffusers' pipe.load_lora_weights({res['out']!r}) on {res['base']!r}")
        return 0
    if args.to == "lora":
        print(f"wrote {res['out']}/pytorch_lora_weights.safetensors ({res['tensors']} tensors, {res['weights']} "
              f"weights of step {res['step']}); apply it with {res['pipeline']}.from_pretrained({res['base']!r})"
              f".load_lora_weights({res['out']!r})")
        return 0
    print(f"wrote {res['out']}: {res['network']} ({res['weights']} weights of step {res['step']}, equal to the run's "
          f"network to {res['max_abs_diff']:.1g}), {res['scheduler']}{', the VAE' if res['vae'] else ''} as a "
          f"{res['pipeline']}; load it with diffusers.DiffusionPipeline.from_pretrained({res['out']!r}"
          f"{', trust_remote_code=True' if res['remote_code'] else ''})")
    return 0


def _data(args) -> int:
    if args.data_command == "class-images":
        return _class_images(args)
    if args.data_command != "prepare":
        _parser().parse_args(["data", "--help"])
        return 2
    import json

    from ..data.manifest import check_outputs, prepare

    if args.vae and args.encoder:
        raise InvalidInput("--vae and --encoder exclude each other")
    if args.buckets and not args.vae:
        raise InvalidInput("--buckets encodes VAE latents per aspect-ratio bucket: give --vae")
    if args.mask and (not args.vae or args.buckets):
        raise InvalidInput("--mask writes loss masks beside VAE latents: give --vae (without --buckets; for masks "
                           "with buckets train the image folder with data.buckets=true data.mask=...)")
    if args.text_encoders and not args.vae:
        raise InvalidInput("--text-encoders needs --vae: captions are cached beside VAE latents")
    if args.prompt is not None and not args.text_encoders:
        raise InvalidInput("--prompt is every image's caption: give --text-encoders PIPE to encode it")
    if args.prompt is not None and not args.prompt.strip():
        raise InvalidInput("--prompt is empty: give the instance or class prompt (e.g. \"a photo of sks dog\")")
    captioned_shards = bool(args.shards and args.vae and args.text_encoders)  # data/latent_shards.py
    if captioned_shards and (args.latents_out or args.pack or args.buckets):
        raise InvalidInput("--shards with --vae and --text-encoders writes the latents and captions into the shards: "
                           "drop --latents-out, --pack and --buckets")
    if captioned_shards and args.prompt is not None:
        raise InvalidInput("--prompt is for captioned latents (--latents-out), not captioned shards: write the "
                           "prompt into each image's .txt caption instead")
    if captioned_shards and args.mask:
        raise InvalidInput("--mask is not stored in captioned shards (data.name=captioned_shards takes no loss mask): "
                           "write them beside latents instead (--vae --text-encoders --latents-out OUT --mask ...)")
    if args.text_encoders:
        from ..pretrained.text_encoders import family_of, transformers

        transformers()
        family_of(args.text_encoders)  # a missing or wrong folder before any encoding
    if args.vae:  # a missing VAE or extra before the folder is checked
        from .. import optional
        from ..data.encode import default_out
        from ..pretrained.vae import model_dir

        model_dir(args.vae, args.vae_subfolder)
        optional.diffusers("data prepare --vae")
        if not captioned_shards:
            args.latents_out = args.latents_out or str(default_out(args.root))
    if args.out:
        out_file(args.out, create=False)
    check_outputs(args.root, args.out, args.latents_out, args.vae)  # before anything is created
    if args.shards:
        check_output(args.shards, "--shards", {"the image folder": args.root})
    if args.out:
        out_file(args.out)
    if args.latents_out:
        out_dir(args.latents_out, create=False, flag="--latents-out")  # created by the encoder, once checked
    res = prepare(args.root, args.out, args.encoder, args.latents_out, args.image_size, args.batch_size)
    print(res["layout"])
    print(f"{res['num_files']} readable files, {len(res['classes'])} classes, sizes {res['sizes']}")
    for rel, reason in res["bad"]:
        print(f"skipped {rel}: {reason}")
    if res.get("refused_note"):
        print(res["refused_note"])
    if captioned_shards:
        from ..data.latent_shards import prepare_shards

        index = prepare_shards(json.loads(Path(res["manifest"]).read_text()), out_dir(args.shards), args.vae,
                               args.vae_subfolder, args.text_encoders, args.clip_skip, args.caption_column,
                               args.allow_empty_captions, args.image_size, args.batch_size, args.shard_size)
        t = index["text"]
        print(f"wrote {index['count']} latents and their {t['captions']} captions ({t['family']} encoders, "
              f"{t['length']} tokens × {t['width']}) into {len(index['shards'])} shards in {args.shards} "
              f"(data.name=captioned_shards data.root={args.shards})")
        return 0
    if args.vae and args.buckets:
        from ..data.bucket_latents import encode_buckets

        settings = {"base": args.image_size, "min": args.min_bucket_reso, "max": args.max_bucket_reso,
                    "steps": args.bucket_reso_steps}
        index = encode_buckets(json.loads(Path(res["manifest"]).read_text()), args.latents_out, args.vae,
                               args.vae_subfolder, settings, args.batch_size)
        print(f"encoded {index['count']} images into {len(index['buckets'])} bucket arrays in {args.latents_out} "
              f"(data.name=bucket_latents data.root={args.latents_out})")
        return 0
    job = None
    if args.text_encoders:  # the captions and the encoders checked before any latent is written
        from ..data.captioned import caption_job

        job = caption_job(json.loads(Path(res["manifest"]).read_text()), args.text_encoders, args.clip_skip,
                          args.caption_column, args.allow_empty_captions, prompt=args.prompt)
    if args.vae:
        res.update(_encode_with_vae(args, res["manifest"]))
    if args.text_encoders:
        from ..data.captioned import encode_captions

        m = json.loads(Path(res["manifest"]).read_text())
        t = encode_captions(m, args.latents_out, args.text_encoders, args.clip_skip, args.caption_column,
                            args.allow_empty_captions, args.image_size, job=job)
        cut = f"; {t['truncated']} truncated to the tokenizer's length" if t["truncated"] else ""
        print(f"encoded {t['captions']} captions with the {t['family']} text encoders ({t['length']} tokens × "
              f"{t['width']}){cut}")
    print(f"wrote {res['manifest']}" + (f" and {res['latents_manifest']}" if "latents_manifest" in res else ""))
    if args.shards:
        from ..data.shards import write_shards

        m = json.loads(Path(res["manifest"]).read_text())
        index = write_shards(m, out_dir(args.shards, flag="--shards"), args.shard_size)
        print(f"wrote {index['count']} images into {len(index['shards'])} shards in {args.shards} (data.name=shards "
              f"data.root={args.shards})")
    if args.pack:
        from ..data.packed import PACKED, pack

        folder = Path(args.latents_out or args.root)
        index = pack(folder)
        print(f"packed {index['count']} latents of shape {index['shape']} into {folder / PACKED} (data.name=packed "
              f"data.root={folder})")
    return 0


def _class_images(args) -> int:
    from ..generation.class_images import generate

    if not Path(args.pipeline).is_dir():
        raise InvalidInput(f"the base pipeline {args.pipeline!r} is not a folder")
    out_dir(args.out, create=False, flag="--out")
    check_output(args.out, "--out", {"the base pipeline": args.pipeline})
    r = generate(args.pipeline, args.prompt, args.num_images, args.out, seed=args.seed, steps=args.steps,
                 guidance=args.guidance, negative_prompt=args.negative_prompt, image_size=args.image_size,
                 batch_size=args.batch_size, solver=args.solver, spacing=args.spacing,
                 progress=True)
    print(f"{args.out}: {r['total']} class images ({r['own']} of its own, {r['kept']} made before, {r['made']} made "
          f"now); next: fasttrain data prepare {args.out} --vae {args.pipeline} --vae-subfolder vae --text-encoders "
          f"{args.pipeline} --prompt {args.prompt!r} --image-size {args.image_size} --latents-out LATENTS, then "
          f"data.prior.root=LATENTS")
    return 0


def _encode_with_vae(args, manifest_path) -> dict:
    import json

    from ..data.encode import encode_with_vae

    m = json.loads(Path(manifest_path).read_text())
    lm = encode_with_vae(m, args.latents_out, args.vae, args.vae_subfolder, args.image_size, args.batch_size,
                         mask=args.mask or "none")
    info = lm["latents"]
    print(f"encoded {lm['num_files']} images to {lm['sizes']} latents (posterior mean and std); VAE scaling_factor "
          f"{info['vae']['scaling_factor']}, shift_factor {info['vae']['shift_factor']}")
    return {"latents_manifest": str(Path(args.latents_out) / "fasttrain-manifest.json")}


if __name__ == "__main__":
    sys.exit(main())
