"""Launched by tests/distributed/test_shards_ranks.py through torchrun:

    shards_worker.py ROOT OUT BATCHES [STATE]

Each rank streams `data.name=shards` from ROOT (from STATE, a saved position, when given), takes BATCHES
batches of 2, and rank 0 writes every rank's sample identities and its position to OUT. Ends with barrier →
destroy → os._exit (gloo's teardown can abort otherwise)."""
import json
import os
import sys

import torch.distributed as dist

from fasttrain.config import DataConfig
from fasttrain.data import build_data


def main():
    root, out, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    s, _ = build_data(DataConfig(name="shards", batch_size=2, root=root, image_size=8, flip=False, shuffle_buffer=4),
                                 seed=5, rank=rank, world_size=world)
    if len(sys.argv) > 4:
        s.load_state_dict(json.loads(open(sys.argv[4]).read()))
    ids = []
    for _ in range(batches):
        x, _ = next(s)  # write_images' file i is a flat grey 10·i + 5
        ids += [int(round(((v + 1) * 127.5 - 5) / 10)) for v in x[:, 0].mean((1, 2)).tolist()]
    every = [None] * world
    dist.all_gather_object(every, ids)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ids": every, "state": s.state_dict()}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
