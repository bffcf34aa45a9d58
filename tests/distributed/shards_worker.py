"""Launched by tests/distributed/test_shards_ranks.py and test_caption_shards_ranks.py through torchrun:

    shards_worker.py KIND ROOT OUT BATCHES [STATE]

Each rank streams `data.name=KIND` (shards, captioned_shards) from ROOT (from STATE, a saved position, when
given), takes BATCHES batches of 2, and rank 0 writes every rank's sample identities, bytes read and checks,
and its position, to OUT. Sample identities: write_images' file i is a flat grey 10·i + 5 (shards); a
synthetic captioned shard's sample i has latents i (captioned_shards), and there each batch's caption
encodings in the device table are checked against the sample's own members. Ends with barrier → destroy
→ os._exit (gloo's teardown can abort otherwise)."""
import json
import os
import sys

import torch
import torch.distributed as dist

from fasttrain.config import DataConfig
from fasttrain.data import build_data


def main():
    kind, root, out, batches = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    extra = {"latent_norm": "none"} if kind == "captioned_shards" else {"image_size": 8, "flip": False}
    s, info = build_data(DataConfig(name=kind, batch_size=2, root=root, shuffle_buffer=4, **extra),
                         seed=5, rank=rank, world_size=world)
    if len(sys.argv) > 5:
        s.load_state_dict(json.loads(open(sys.argv[5]).read()))
    ids, checked = [], 0
    for _ in range(batches):
        x, y = next(s)
        if kind == "captioned_shards":
            batch = x[:, 0, 0, 0].round().long().tolist()
            from fasttrain.data.latent_shards import from_npy
            from fasttrain.data.shard_index import parse_sample

            index, t = s.inner.inner.shards, info.text_table
            for b, i in enumerate(batch):  # the encodings that arrived are this sample's own
                k, j = index.locate(i)
                with open(index.root / index.names[k], "rb") as f:
                    off, size = index.spans[k][j].tolist()
                    f.seek(off)
                    want = torch.from_numpy(from_npy(parse_sample(f.read(size))["states.npy"]))
                rows = t.offsets[y[b]] + torch.arange(want.shape[0])
                assert torch.equal(t.states[rows], want)
                checked += 1
        else:
            batch = [int(round(((v + 1) * 127.5 - 5) / 10)) for v in x[:, 0].mean((1, 2)).tolist()]
        ids += batch
    every = [None] * world
    dist.all_gather_object(every, {"ids": ids, "bytes": s.bytes_read(), "checked": checked})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ids": [e["ids"] for e in every], "bytes": [e["bytes"] for e in every],
                       "checked": [e["checked"] for e in every], "state": s.state_dict()}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
