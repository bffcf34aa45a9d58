"""Captioned latent shards (fasttrain/data/latent_shards.py) at two sizes, and resuming a shard stream
late in an epoch.

  memory   a tiny text UNet (UNet2DConditionModel, cross-attention width 32) trains S steps on synthetic
           captioned shards of 1 000 and of 100 000 captions (one per image, 77 tokens × 32, fp16), each
           run in its own process: the caption rows the data keep on the device (the per-batch table),
           the process's peak RSS and the images/s of its steps. For comparison, the table the
           `captioned_latents` kind would hold on the device for the same captions (every caption's
           encoding: N × 77 × (32 × 2 + 1) bytes), computed, not run.
  resume   time to the first batch after a resume at 90% of an epoch of image shards: the stream as it
           is (seeks to its slot) against the stream before the index recorded offsets (fasttrain's
           shards.py at 4be7066, read from git: it replays the epoch's tar stream up to the slot without
           decoding), interleaved, on one rank.

    python bench/caption_shards.py [--steps 40] [--batch 8] [--work /tmp/fasttrain-bench-shards]

Writes bench/results/caption-shards-<device>.{json,md}.
"""
from __future__ import annotations

import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import machine

SIZES = (1000, 100000)
LENGTH, WIDTH = 77, 32
UNET = ('model.args.config={"block_out_channels": [16, 32], "down_block_types": ["CrossAttnDownBlock2D", '
        '"DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "layers_per_block": 1, '
        '"norm_num_groups": 8, "attention_head_dim": 8, "cross_attention_dim": 32}')


def synthetic(work: Path, n: int) -> Path:
    from fasttrain.data.latent_shards import write_synthetic

    root = work / f"captions-{n}"
    if not (root / "fasttrain-shards.json").is_file():
        write_synthetic(root, n, captions=1, length=LENGTH, width=WIDTH, shape=(4, 8, 8), shard_size=1000, ids=False)
    return root


def train_child(root: str, steps: int, batch: int, run: str) -> dict:
    """One run in this process (`--child`): the table's bytes, the peak RSS, images/s after a warm-up."""
    from fasttrain.configure import load_config
    from fasttrain.train import Trainer

    torch.set_num_threads(1)
    cfg = load_config(overrides=[f"run_dir={run}", "data.name=captioned_shards", f"data.root={root}",
                                 f"data.batch_size={batch}", f"train.steps={steps}", "train.progress=false",
                                 "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
                                 "diagnostics.interference_every=0", "train.ckpt_every=0", "train.plots=false",
                                 "train.log_every=1000", "model.name=diffusers",
                                 "model.args.class_name=UNet2DConditionModel", UNET])
    t = Trainer(cfg, restart=True)
    table = t.data.table
    for _ in range(3):  # warm-up
        t.train_step()
    t0 = time.perf_counter()
    for _ in range(steps - 3):
        t.train_step()
    dt = time.perf_counter() - t0
    t.close()
    tensors = [table.states, table.mask, table.offsets, table.counts]
    return {"table_rows": table.rows, "table_bytes": sum(v.numel() * v.element_size() for v in tensors),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "images_per_s": (steps - 3) * batch / dt}


def memory(args, work: Path) -> list[dict]:
    rows = []
    roots = {n: synthetic(work, n) for n in SIZES}
    for n in SIZES:
        cmd = [sys.executable, __file__, "--child", str(roots[n]), str(args.steps), str(args.batch),
               str(work / f"run-{n}")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise RuntimeError(f"child run failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        shard_bytes = sum(p.stat().st_size for p in roots[n].glob("shard-*.tar"))
        rows.append({"captions": n, **r, "shard_set_mb": shard_bytes / 2**20,
                     "captioned_latents_table_mb_computed": n * LENGTH * (WIDTH * 2 + 1) / 2**20})
    return rows


def _old_shards():
    """fasttrain/data/shards.py as it was at 4be7066 (the replaying stream), loaded under another name."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "-C", str(root), "show", "4be7066:fasttrain/data/shards.py"], capture_output=True,
                         text=True, check=True).stdout
    src = src.replace('@register("shards")', "")  # its kind is not registered again
    spec = importlib.util.spec_from_loader("fasttrain.data._shards_4be7066", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "fasttrain.data"
    exec(compile(src, "shards.py@4be7066", "exec"), mod.__dict__)
    return mod


def image_shards(work: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    from fasttrain.cli import main

    images, out = work / f"images-{n}", work / f"image-shards-{n}"
    if (out / "fasttrain-shards.json").is_file():
        return out
    rng = np.random.default_rng(0)
    for i in range(n):
        d = images / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((48, 48, 3)) * 255).astype(np.uint8)).save(d / f"{i:05d}.jpg", quality=90)
    assert main(["data", "prepare", str(images), "--shards", str(out), "--shard-size", "500"]) == 0
    return out


def resume(args, work: Path) -> list[dict]:
    from fasttrain.config import DataConfig
    from fasttrain.data import build_data
    from fasttrain.data.shard_index import ShardIndex

    root = image_shards(work, args.images)
    old = _old_shards()
    index = ShardIndex(root)
    pos = int(0.9 * index.count)
    state = {"epoch": 0, "pos": pos, "world_size": 1, "shards": index.fingerprint, "order": "blocks-v1"}
    times = {"seek (now)": [], "replay (4be7066)": []}
    for r in range(args.rounds):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            if name.startswith("seek"):
                s = build_data(DataConfig(name="shards", root=str(root), batch_size=8, image_size=32,
                                          shuffle_buffer=1000), seed=0)[0]
            else:
                s = old.ShardStream(old.ShardSet(root), 8, 0, 32, buffer=1000)
            t0 = time.perf_counter()
            s.load_state_dict(state)
            next(s)
            times[name].append(time.perf_counter() - t0)
    return [{"stream": k, "resume_at": f"{pos} of {index.count}", "first_batch_s_median": sorted(v)[len(v) // 2],
             "all_s": v} for k, v in times.items()]


def main(args):
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "command": " ".join(sys.argv),
           "memory": memory(args, work), "resume": resume(args, work)}
    lines = ["# Captioned latent shards: device memory with 1 000 vs 100 000 captions; resume late in an epoch", "",
             f"machine: {json.dumps(out['machine'])}  ", f"when: {out['when']}  ", f"command: `{out['command']}`  ",
             "CPU only, other processes share the machine's cores (its load average above): times are noisy.", "",
             f"## Memory (a tiny text UNet, batch {args.batch}, {args.steps} steps; one process per run)", "",
             "| captions | device table rows | device table bytes | peak RSS (MB) | images/s | shard set (MB) | "
             "captioned_latents' device table (MB, computed) |", "|---|---|---|---|---|---|---|"]
    for r in out["memory"]:
        lines.append(f"| {r['captions']} | {r['table_rows']} | {r['table_bytes']} | {r['peak_rss_mb']:.0f} | "
                     f"{r['images_per_s']:.0f} | {r['shard_set_mb']:.0f} | "
                     f"{r['captioned_latents_table_mb_computed']:.1f} |")
    lines += ["", f"## Time to the first batch after a resume at 90% of an epoch ({args.images} image shards' "
              f"samples, 48×48 JPEG, batch 8, {args.rounds} rounds interleaved)", "",
              "| stream | resumed at | first batch (s, median) |", "|---|---|---|"]
    for r in out["resume"]:
        lines.append(f"| {r['stream']} | {r['resume_at']} | {r['first_batch_s_median']:.3f} |")
    with _env.Results() as res:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        res.text(f"caption-shards-{dev}.json", json.dumps(out, indent=1))
        res.text(f"caption-shards-{dev}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(train_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
        sys.exit(0)
    p = _env.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=_env.count(4), default=40)
    p.add_argument("--batch", type=_env.count(), default=8)
    p.add_argument("--images", type=_env.count(10), default=4000)
    p.add_argument("--rounds", type=_env.count(), default=3)
    p.add_argument("--work", default="/tmp/fasttrain-bench-shards")
    _env.run(main, p.parse_args())
