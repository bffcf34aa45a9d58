"""Throughput of the captioned shard stream (fasttrain/data/latent_shards.py) on 1 and 2 ranks (torchrun,
gloo) with 0, 2 and 4 loader workers per rank: images/s per rank and in all, the bytes each rank read in
one epoch against the set's, and the share of the step spent waiting for data.

Each rank reads one epoch of synthetic captioned shards (N samples: latents 8×4×8×8 fp16, one caption of
77 tokens × 32 fp16), batch B, with a stand-in training step between batches (a fixed amount of CPU work,
--step-ms long when alone on an idle core) so that loader workers have something to overlap with. The
bytes read are counted by the readers (shard_reader.ShardSamples.read_bytes, shared with the workers):
the epoch's own samples, plus what the loader had already read ahead of the next epoch when the epoch's
last batch was handed out (the read-ahead, listed apart).

    python bench/shard_throughput.py [--n 4000] [--batch 16] [--workers 0,2,4] [--ranks 1,2]

Writes bench/results/shard-throughput-<device>.{json,md}.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _env  # OpenMP's wait policy, before torch loads it
import torch

sys.path.insert(0, str(Path(__file__).parent))


def _step(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a = torch.tanh(a @ a) * 0.5


MARK = "shard-throughput-ranks: "


def worker(root: str, batch: int, workers: int, reps: int) -> None:
    """One rank under torchrun: one epoch, timed; rank 0 prints every rank's row (one line after MARK)."""
    import torch.distributed as dist

    from fasttrain.config import DataConfig
    from fasttrain.data import build_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    s, info = build_data(DataConfig(name="captioned_shards", root=root, batch_size=batch, num_workers=workers,
                                    latent_norm="none", shuffle_buffer=1000), seed=0, rank=rank, world_size=world)
    index = s.inner.inner.shards
    per_rank = index.count // world
    batches = per_rank // batch
    a = torch.randn(128, 128)
    next(s)  # the first batch: workers start (not timed)
    dist.barrier()
    wait = step = 0.0
    t0 = time.perf_counter()
    for _ in range(batches - 1):
        w0 = time.perf_counter()
        next(s)
        w1 = time.perf_counter()
        _step(a, reps)
        wait, step = wait + (w1 - w0), step + (time.perf_counter() - w1)
    wall = time.perf_counter() - t0
    own = index.span_bytes(s.inner.inner.order(0)[0][: batches * batch])
    row = {"rank": rank, "images_per_s": (batches - 1) * batch / wall, "wait_share": wait / (wait + step),
           "bytes_read": s.bytes_read(), "own_epoch_bytes": own, "samples": batches * batch}
    every = [None] * world
    dist.all_gather_object(every, row)
    if rank == 0:
        print(MARK + json.dumps(every), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def calibrate(ms: float) -> int:
    a = torch.randn(128, 128)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    _step(a, 200)
    per = (time.perf_counter() - t0) / 200
    return max(1, round(ms / 1000 / per))


def main(args):
    from cases import machine

    from fasttrain.data.latent_shards import write_synthetic
    from fasttrain.data.shard_index import ShardIndex

    work = Path(args.work)
    root = work / f"throughput-{args.n}"
    if not (root / "fasttrain-shards.json").is_file():
        write_synthetic(root, args.n, captions=1, length=77, width=32, shape=(4, 8, 8), shard_size=250, ids=False)
    index = ShardIndex(root)
    set_bytes = index.span_bytes(range(index.count))
    reps = calibrate(args.step_ms)
    rows = []
    for world in args.ranks:
        for w in args.workers:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   __file__, "--worker", str(root), str(args.batch), str(w), str(reps)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            if r.returncode != 0:
                raise RuntimeError(f"torchrun failed:\n{r.stderr[-3000:]}")
            ranks = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith(MARK))[len(MARK):])
            rows.append({"ranks": world, "workers": w, "per_rank": ranks,
                         "images_per_s_total": sum(x["images_per_s"] for x in ranks),
                         "bytes_share_per_rank": [x["own_epoch_bytes"] / set_bytes for x in ranks],
                         "read_ahead_bytes": [x["bytes_read"] - x["own_epoch_bytes"] for x in ranks]})
    info = machine()
    res_out = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "command": " ".join(sys.argv),
               "set_bytes": set_bytes, "samples": index.count, "step_reps": reps, "rows": rows}
    lines = ["# Captioned shard stream: images/s, bytes read per rank per epoch, time waiting for data", "",
             f"machine: {json.dumps(info)}  ", f"when: {res_out['when']}  ", f"command: `{res_out['command']}`  ",
             f"{index.count} samples in {len(index.names)} shards, {set_bytes / 2**20:.1f} MiB of sample bytes; "
             f"batch {args.batch}; a stand-in step of ~{args.step_ms} ms CPU work ({reps} matmuls) per batch. "
             "CPU only, on a machine whose cores other processes share (load average above): ranks and workers "
             "compete for its cores, so images/s is noisy and does not scale as on a real node; the bytes are "
             "exact.", "",
             "| ranks | loader workers | images/s per rank | images/s in all | waiting for data (share of the step) "
             "| epoch's sample bytes per rank (share of the set) | bytes read per rank, measured (share of the set; "
             "the read-ahead included) | read ahead into the next epoch (bytes per rank) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']} | {r['workers']} | "
                     + ", ".join(f"{x['images_per_s']:.0f}" for x in r["per_rank"]) + " | "
                     + f"{r['images_per_s_total']:.0f} | "
                     + ", ".join(f"{x['wait_share']:.0%}" for x in r["per_rank"]) + " | "
                     + ", ".join(f"{x:.3f}" for x in r["bytes_share_per_rank"]) + " | "
                     + ", ".join(f"{x['bytes_read']} ({x['bytes_read'] / set_bytes:.3f})" for x in r["per_rank"])
                     + " | "
                     + ", ".join(str(x) for x in r["read_ahead_bytes"]) + " |")
    with _env.Results() as res:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        res.text(f"shard-throughput-{dev}.json", json.dumps(res_out, indent=1))
        res.text(f"shard-throughput-{dev}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    p = _env.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=_env.count(16), default=4000)
    p.add_argument("--batch", type=_env.count(), default=16)
    p.add_argument("--workers", type=_env.counts(0), default=[0, 2, 4])
    p.add_argument("--ranks", type=_env.counts(1), default=[1, 2])
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--work", default="/tmp/fasttrain-bench-shards")
    _env.run(main, p.parse_args())
