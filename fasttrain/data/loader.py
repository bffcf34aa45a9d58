"""Folder data sets through a torch DataLoader: this rank's order from a saved position onwards (with
each sample's augmentation draws, order.py), pinned memory, a non-blocking copy to the device, and
the next batch already on its way while the current one trains."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from ..errors import DataError
from .order import Position, augment_table, epoch_order


class _Order(Sampler):
    """This rank's indices from a saved position onwards, epoch after epoch; with `augment` = (flip,
    random crop), each index comes with its sample's augmentation draws (order.augment_table). `order`:
    another order than epoch_order's, `order(epoch)` → (this rank's indices, their draws or None)
    (shard sets: shard_index.rank_order)."""

    def __init__(self, n: int, seed: int, rank: int, world_size: int, epoch: int, pos: int,
                 augment: tuple[bool, bool] | None = None, order=None):
        self.n, self.seed, self.rank, self.world_size, self.epoch, self.pos = n, seed, rank, world_size, epoch, pos
        self.augment, self.order = augment, order

    def _epoch(self, epoch: int):
        if self.order is not None:
            return self.order(epoch)
        order = epoch_order(self.n, self.seed, epoch, self.rank, self.world_size)
        aug = None if self.augment is None else augment_table(len(order), self.seed, epoch, self.rank, *self.augment)
        return order, aug

    def __iter__(self):
        epoch, pos = self.epoch, self.pos
        while True:
            order, aug = self._epoch(epoch)
            if aug is None:
                yield from order[pos:].tolist()
            else:
                yield from ((i, *a) for i, a in zip(order[pos:].tolist(), aug[pos:].tolist()))
            epoch, pos = epoch + 1, 0

    def __len__(self):
        return 2**62


def _to(y, device):
    """Labels, or a dict of tensors (the encodings a captioned shard batch carries), copied to `device`."""
    if isinstance(y, dict):
        return {k: v.to(device, non_blocking=True) for k, v in y.items()}
    return y.to(device, non_blocking=True)


def _tensors(y) -> list:
    return list(y.values()) if isinstance(y, dict) else [y]


class LoaderStream(Position):
    """Batches of a folder data set through a DataLoader: pinned memory, a non-blocking copy to the
    device, and the next batch already on its way while the current one trains. `state_dict()` is the
    position of the batches handed out (not of those prefetched), so resume is exact."""

    def __init__(self, dataset, batch_size: int, seed: int, device="cpu", num_workers: int = 0,
                 rank: int = 0, world_size: int = 1, augment: tuple[bool, bool] | None = None, order=None):
        n = len(dataset)
        if batch_size > n // world_size:
            raise DataError(f"data.batch_size {batch_size} is larger than the data set ({n}) per rank")
        self.dataset, self.batch_size, self.seed, self.device = dataset, batch_size, seed, torch.device(device)
        self.num_workers, self.rank, self.world_size, self.per_rank = num_workers, rank, world_size, n // world_size
        self.epoch, self.pos, self.augment, self.order = 0, 0, augment, order
        self._it, self._next, self._stream = None, None, None

    def _start(self):
        order = _Order(len(self.dataset), self.seed, self.rank, self.world_size, self.epoch, self.pos, self.augment,
                       self.order)
        self._it = iter(DataLoader(self.dataset, batch_size=self.batch_size, sampler=order,
                                   num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                                   pin_memory=self.device.type == "cuda"))
        self._next = self._fetch()

    def _fetch(self):
        """The next batch, its copy to the device issued now: on CUDA on a side stream (an event marks
        its end), so it overlaps the step that is running."""
        batch = tuple(next(self._it))  # (x, y), or (x, y, mask) with a loss mask (folder.py)
        if self.device.type != "cuda":
            return batch, None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            batch = tuple(_to(b, self.device) for b in batch)
            done = torch.cuda.Event()
            done.record(self._stream)
        return batch, done

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._start()
        (batch, done), self._next = self._next, self._fetch()
        if done is not None:  # the consumer waits for this batch's copy only, and owns its memory
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for t in (t for b in batch for t in _tensors(b)):
                t.record_stream(current)
        self.pos += self.batch_size
        while self.pos >= self.per_rank:
            self.epoch, self.pos = self.epoch + 1, self.pos - self.per_rank
        return batch

    def _restart(self):
        self._it, self._next = None, None
