"""The whole training step in one CUDA graph (`train.cuda_graph=true`).

At small batch on one GPU a step is a few hundred short kernels whose launch costs more than their
work. fasttrain's step never syncs with the host and keeps every state that changes between steps on
the device (the noise offset and the statistics window advanced by the kernels, the EMA count, the
skipped-step counters), so it can be captured once and replayed. As torchtitan's
`distributed/cudagraph.py` wraps a callable, `GraphedStep` wraps one step function

    step_fn(x0, y) -> tensors       (one micro-batch: forward, backward, clip, finite check, the
                                     optimizer step, the EMA, the gradients set to None at its end;
                                     no host sync, no host-side state)

and knows nothing of the trainer: it copies each batch into static input buffers, registers the
step's generator with the graph, makes the optimizer capturable with a device learning rate (the
LR scheduler fills that tensor in place), warms up on a side stream, captures, and replays.
Everything outside the step (the scheduler, statistics syncs, sampler updates, the interference
diagnostic after the replay, logging, checkpoints) stays outside the graph.

This module is the only place that knows about graph mode: `unsupported` says (in one line) why a
trainer's step cannot be captured, and the trainer keeps the eager step then. Off CUDA (and in tests)
`capture=False` runs the same step function eagerly with the same static buffers and device-side
state, so everything but the capture itself is checked without a GPU.
"""
from __future__ import annotations

import torch

WARMUP = 3


def unsupported(device: torch.device, world_size: int, grad_accum: int, objective, scaler, optimizer) -> str | None:
    """Why this step cannot be captured, or None."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if world_size > 1:
        return "collectives of FSDP/DDP are not captured (one process only)"
    if grad_accum != 1:
        return "gradient accumulation changes the step's structure (train.grad_accum must be 1)"
    problem = objective.capture_problem()
    if problem:
        return problem
    if scaler is not None:
        return "fp16's gradient scaler decides on the host (use bf16)"
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or not isinstance(optimizer, torch.optim.AdamW):
        return "only torch's fused AdamW is capturable (optim.impl=torch)"
    return None


class GraphedStep:
    """`GraphedStep(step_fn, optimizer, generator)(x0, y)` returns what `step_fn(x0, y)` returns (the
    graph's static outputs after a replay)."""

    def __init__(self, step_fn, optimizer: torch.optim.Optimizer, generator: torch.Generator,
                 capture: bool = True):
        self.step_fn, self.opt, self.gen, self.capture = step_fn, optimizer, generator, capture
        lr = optimizer.param_groups[0]["lr"]
        dev = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.lr = torch.tensor(float(lr), dtype=torch.float32, device=dev)
        self.inputs: tuple[torch.Tensor, ...] | None = None
        self.out = None
        self.graph = None
        self.calls = 0
        self.arm()

    def arm(self) -> None:
        """Fused AdamW reads the device learning rate and runs capturable. Called before every step:
        a restored optimizer state (new param groups) or a changed learning rate (a float) replaces
        both; the LR scheduler then fills the tensor in place (torch's `_update_param_group_val`)."""
        for g in self.opt.param_groups:
            if g["lr"] is not self.lr:
                self.lr.fill_(float(g["lr"]))
                g["lr"] = self.lr
            if "capturable" in g:
                g["capturable"] = True

    def __call__(self, *batch: torch.Tensor):
        self.arm()
        if self.inputs is None:
            self.inputs = tuple(torch.empty_like(b) for b in batch)
        for dst, src in zip(self.inputs, batch):
            dst.copy_(src, non_blocking=True)
        if not self.capture:
            self.out = self.step_fn(*self.inputs)
            return self.out
        if self.graph is None and self.calls < WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.out = self.step_fn(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.calls += 1
            return self.out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.register_generator_state(self.gen)
            with torch.cuda.graph(self.graph):  # recorded, not run: the replay below is this step
                self.out = self.step_fn(*self.inputs)
        self.graph.replay()
        return self.out
