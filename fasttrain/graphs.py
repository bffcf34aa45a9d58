"""The whole training step in one CUDA graph (`train.cuda_graph=true`).

At small batch on one GPU a step is a few hundred short kernels whose launch costs more than their
work. fasttrain's step never syncs with the host, so it can be captured once and replayed:
timestep sampling and label dropout (the trainer's generator is registered with the graph), the noise
kernel, the forward, the loss kernel with the statistics scatter, the backward, gradient clipping, the
non-finite check, the fused AdamW step (`capturable=True`, learning rate read from a device tensor), the
EMA update (decay read from a device tensor) and the skipped-step counters. Everything that changes
between steps lives on the device and is updated in place: the batch is copied into static input
buffers, the noise offset and the statistics window are advanced by the kernels themselves, the
learning rate and EMA decay are written into their tensors before each replay. Statistics syncs,
sampler updates, the interference diagnostic (after the replay, on its own probe), logging and
checkpoints stay outside the graph, every K steps.

The first `WARMUP` steps run eagerly on a side stream (what capture needs: allocator and cuDNN
warm-up), the next step is captured and replayed. Where something in the step cannot be captured
the trainer says what in one line and keeps the eager step (`unsupported`).

Off CUDA (and in tests) the same body runs eagerly with the same static buffers and device-side
state (`capture=False`), so that everything but the capture itself is checked without a GPU.
"""
from __future__ import annotations

import torch

WARMUP = 3


def unsupported(trainer) -> str | None:
    """Why the trainer's step cannot be captured, or None."""
    cfg = trainer.cfg
    if trainer.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if trainer.dist.world_size > 1:
        return "collectives of FSDP/DDP are not captured (one process only)"
    if cfg.train.grad_accum != 1:
        return "gradient accumulation changes the step's structure (train.grad_accum must be 1)"
    if any(h is not trainer.interference for h in trainer.hooks):
        return f"the {cfg.diffusion.sampler} sampler's look-ahead runs host logic around the optimizer step"
    st = trainer.objective.stats
    if st is not None and st.history > 0:
        return f"the {cfg.diffusion.sampler} sampler keeps a host-side queue of recent losses"
    if trainer.scaler is not None:
        return "fp16's gradient scaler decides on the host (use bf16)"
    if not getattr(trainer.opt, "_step_supports_amp_scaling", False) or not isinstance(trainer.opt, torch.optim.AdamW):
        return "only torch's fused AdamW is capturable (optim.impl=torch)"
    return None


class GraphedStep:
    def __init__(self, trainer, capture: bool = True):
        self.tr = trainer
        self.capture = capture
        dev = trainer.device
        self.lr = torch.tensor(trainer.opt.param_groups[0]["lr"], dtype=torch.float32, device=dev)
        self.ema_weight = torch.zeros((), dtype=torch.float32, device=dev)
        self.arm()
        self.x0 = self.y = self.labels = None  # labels: the step's labels after dropout (a graph output)
        self.out = None
        self.graph = None
        self.calls = 0

    def arm(self) -> None:
        """Fused AdamW reads a tensor learning rate and runs capturable. Called again before every
        step: a resumed optimizer state (its param groups) or a changed learning rate replaces both."""
        for g in self.tr.opt.param_groups:
            if not isinstance(g["lr"], torch.Tensor):
                self.lr.fill_(float(g["lr"]))
                g["lr"] = self.lr
            if "capturable" in g:
                g["capturable"] = True

    def sync_lr(self) -> None:
        """After the host-side scheduler stepped: its float into the device tensor the graph reads."""
        self.arm()

    def _body(self):
        tr = self.tr
        self.labels = labels = tr._labels(self.y)
        with tr.precision.context(cache=False):
            loss, _ = tr.objective(tr.model, self.x0, labels, tr.gen)
        loss.backward()
        gnorm = tr.update(loss.detach(), ema_weight=self.ema_weight)  # the trainer's own update (no hooks)
        return loss.detach(), gnorm

    def __call__(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x0, y = batch
        self.arm()
        if self.x0 is None:
            self.x0, self.y = torch.empty_like(x0), torch.empty_like(y)
        self.x0.copy_(x0, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.ema_weight.fill_(1 - self.tr.ema.current_decay())
        self.tr.ema.n += 1
        if not self.capture:
            self.out = self._body()
            self.tr.opt.zero_grad(set_to_none=True)
            return self.out
        if self.graph is None and self.calls < WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.out = self._body()
                self.tr.opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(side)
            self.calls += 1
            return self.out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.register_generator_state(self.tr.gen)
            self.tr.opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(self.graph):  # recorded, not run: the replay below is this step
                self.out = self._body()
        self.graph.replay()
        return self.out
