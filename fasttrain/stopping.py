"""Graceful stops: SIGINT (Ctrl-C) and SIGTERM (what cluster schedulers send before a kill) are
deferred to the end of the current optimizer step, so the checkpoint written then is exactly
resumable (data position, noise offset, statistics and generators all at that step). A second
signal aborts at once.

Across ranks a signal may reach processes at different steps, and a collective save must happen at
the same step everywhere: each step every rank starts an asynchronous all-reduce (MAX) of its flag
on a CPU (gloo) group and reads the previous step's result, so all ranks stop after the same step,
one step after the first of them saw the signal, without blocking the device.
"""
from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    def __init__(self, world_size: int = 1):
        self.requested = False
        self.signum: int | None = None
        self._old = {}
        self._group = None
        self._work = None
        self._flag = torch.zeros(1, dtype=torch.int32)
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # a CPU flag: no device sync

    def __enter__(self) -> GracefulStop:
        for s in SIGNALS:
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        if self._work is not None:
            self._work.wait()
            self._work = None

    def _handle(self, signum, frame) -> None:
        if self.requested:  # the second signal: stop now
            for s, old in self._old.items():
                signal.signal(s, old)
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        print(f"\nfasttrain: {signal.Signals(signum).name} received; saving after this step "
              f"(send it again to abort at once)", file=sys.stderr, flush=True)

    def should_stop(self) -> bool:
        """Called once per optimizer step on every rank; True on all ranks at the same step."""
        if self._group is None:
            return self.requested
        stop = False
        if self._work is not None:
            self._work.wait()
            stop = bool(self._flag.item())  # a CPU tensor: no device sync
        self._flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return stop
