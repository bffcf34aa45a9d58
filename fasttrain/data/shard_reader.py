"""Reading a shard set (shard_index.py) by rank: each rank (and each of its loader workers) seeks to the
samples the global order gives it and reads their bytes alone, so that across the job no byte of an
epoch is read twice (webdataset's split_by_node/split_by_worker split whole shards and lose the
global order; here the recorded spans make the split per sample).

`ShardSamples` is a map-style Dataset over global sample ids: item i is read from its span (the file
opened once per process), parsed (shard_index.parse_sample), checked (`check_sample`) and decoded by
the subclass. A sample that cannot be read, is incomplete or does not decode is replaced by the next
sample of its own shard (cyclically) and named once on stderr: the replacement depends on the sample
alone, so it is the same on every rank count and a resume on another one stays exact. Its bytes read
are counted per process (`read_bytes`, shared with the loader workers).

`ShardLoader` is the DataLoader stream (loader.py) in the shard order (`RankOrder`): resume seeks, the
checkpoint keeps the shard set's fingerprint, and a resume on another shard set is refused.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..errors import DataError
from .loader import LoaderStream
from .order import augment_table
from .shard_index import ShardIndex, check_sample, parse_sample, rank_order

ORDER = "blocks-v1"  # the order's name in a checkpoint (before it: webdataset's shuffle buffer over every shard)
_SLOTS = 65  # read-byte counters: the main process and up to 64 workers


class Undecodable(Exception):
    """A sample's members do not decode (its subclass's `decode` raises it with the reason)."""


class RankOrder:
    """`order(epoch)` for loader.py: this rank's sample ids (shard_index.rank_order) and, with `augment`
    = (flip, random crop), their draws taken by global position, so an image's crop and mirror do not
    depend on the rank count."""

    def __init__(self, index: ShardIndex, seed: int, block: int, rank: int, world_size: int, augment=None):
        self.counts, self.seed, self.block, self.rank, self.world_size = index.counts, seed, block, rank, world_size
        self.augment = augment

    def __call__(self, epoch: int):
        ids = rank_order(self.counts, self.seed, epoch, self.block, self.rank, self.world_size)
        if self.augment is None:
            return ids, None
        n = int(self.counts.sum())
        aug = augment_table(n, self.seed, epoch, 0, *self.augment)[self.rank::self.world_size][: len(ids)]
        return ids, aug


class ShardSamples(Dataset):
    """Global sample ids → decoded items (module docstring). Subclasses set `needs` (shard_index.check_sample)
    and implement `decode(sample, extra)`."""

    needs: tuple[tuple[str, ...], ...] = ()

    def __init__(self, index: ShardIndex):
        self.index = index
        self.read_bytes = torch.zeros(_SLOTS, dtype=torch.int64).share_memory_()
        self.skipped: list[str] = []
        self._files: dict = {}

    def __len__(self) -> int:
        return self.index.count

    def __getstate__(self):  # worker processes open the files themselves
        return {**self.__dict__, "_files": {}}

    def bytes_read(self) -> int:
        """Bytes read so far by this process and its loader workers."""
        return int(self.read_bytes.sum())

    def _read(self, i: int) -> dict:
        k, j = self.index.locate(i)
        name = self.index.names[k]
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.index.root / name, "rb")
        off, size = (int(v) for v in self.index.spans[k][j])
        f.seek(off)
        buf = f.read(size)
        w = get_worker_info()
        self.read_bytes[0 if w is None else 1 + w.id % (_SLOTS - 1)] += len(buf)
        if len(buf) != size:
            raise Undecodable(f"truncated ({len(buf)} of {size} bytes)")
        try:
            s = parse_sample(buf)
        except Exception as e:  # tarfile's errors for a damaged header
            raise Undecodable(f"{type(e).__name__}: {e}") from None
        s["__url__"] = name
        return s

    def item(self, i: int, extra=()):
        """Sample i decoded, or its shard's next decodable sample in its place (module docstring)."""
        k, j = self.index.locate(i)
        count = int(self.index.counts[k])
        for step in range(count):
            g = int(self.index.starts[k]) + (j + step) % count
            try:
                s = self._read(g)
                why = check_sample(s, self.needs)
                if why is None:
                    return self.decode(s, extra)
            except Undecodable as e:
                why = str(e)
            self._note(f"{self.index.names[k]}:{g - int(self.index.starts[k])}", why)
        raise DataError(f"shard {self.index.root / self.index.names[k]} holds no usable sample: write the shards "
                        f"again")

    def _note(self, where: str, why: str) -> None:
        self.skipped.append(f"{where}: {why}")
        print(f"fasttrain: shards: skipped {where} ({why}); the next sample of its shard takes its place",
              file=sys.stderr)

    def __getitem__(self, item):
        if isinstance(item, tuple):
            return self.item(int(item[0]), item[1:])
        return self.item(int(item))

    def decode(self, sample: dict, extra):
        raise NotImplementedError


class ShardLoader(LoaderStream):
    """loader.LoaderStream over a ShardSamples in the shard order (`RankOrder`); its position is
    (epoch, slot) as every stream's, with the shard set's fingerprint and the order's name."""

    def __init__(self, dataset: ShardSamples, batch_size: int, at, block: int, num_workers: int = 0, augment=None):
        index = dataset.index
        if batch_size > index.count // at.world_size:
            raise DataError(f"data.batch_size {batch_size} is larger than one rank's share of {index.root}: "
                            f"{index.count} samples over {at.world_size} rank(s)")
        order = RankOrder(index, at.seed, block, at.rank, at.world_size, augment)
        super().__init__(dataset, batch_size, at.seed, at.device, num_workers, at.rank, at.world_size, augment, order)

    @property
    def shards(self) -> ShardIndex:
        return self.dataset.index

    def bytes_read(self) -> int:
        return self.dataset.bytes_read()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "shards": self.shards.fingerprint, "order": ORDER}

    def load_state_dict(self, state: dict) -> None:
        if "shards" in state and state["shards"] != self.shards.fingerprint:
            raise DataError(f"the shards under {self.shards.root} are not those the checkpoint read (fingerprint "
                            f"{state['shards']} then, {self.shards.fingerprint} now): refusing to resume on another "
                            f"shard set (restore it, or start over with --restart)")
        if "shards" in state and state.get("order") != ORDER:
            print(f"fasttrain: shards: the checkpoint read {self.shards.root} in an older order (a shuffle buffer over "
                  f"every shard); the run continues at the same place of its epoch in the current order",
                  file=sys.stderr)
        super().load_state_dict(state)


def ids_of(stream: ShardLoader, epoch: int) -> np.ndarray:
    """The sample ids this rank reads in `epoch` (benchmarks: the bytes it costs)."""
    return stream.order(epoch)[0]
