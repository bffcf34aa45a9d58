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

This module is the only place that decides graph mode: `step_function` gives the trainer its
step body (step.py's `update` for one micro-batch), captured where `train.cuda_graph` asks for it and
it can be, and otherwise eager, saying in one line why (`unsupported`). Off CUDA (and in tests)
`capture=False` runs the same step function eagerly with the same static buffers and device-side
state, so everything but the capture itself is checked without a GPU.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

WARMUP = 3


def step_function(body, parts, enabled: bool, *, device: torch.device, grad_accum: int, announce: bool = True,
                  fixed_shape: bool = True):
    """The step body to run for one micro-batch: `body` itself, or `body` replayed from a CUDA graph
    where `enabled` (train.cuda_graph) and the step can be captured; where it cannot, one line on stderr
    (rank 0: `announce`) says why and the eager body is kept. `fixed_shape`: every batch has one shape
    (the data kind's DataInfo.fixed_shape)."""
    if not enabled:
        return body
    reason = unsupported(device, parts.world_size, grad_accum, parts.objective, parts.scaler, parts.optimizer,
                         fixed_shape, getattr(parts, "align", None), getattr(parts, "conditioning", None))
    if reason:
        if announce:
            print(f"fasttrain: train.cuda_graph: keeping the eager step ({reason})", file=sys.stderr)
        return body
    return GraphedStep(body, parts.optimizer, parts.generators.all())


def unsupported(device: torch.device, world_size: int, grad_accum: int, objective, scaler, optimizer,
                fixed_shape: bool = True, align=None, conditioning=None) -> str | None:
    """Why this step cannot be captured, or None. `align`: the step's representation alignment
    (diffusion/align.py), whose cached targets are a new tensor per batch, read outside the graph;
    `conditioning`: the step's (conditioning.py), whose caption shuffle rewrites token ids on the host."""
    if not fixed_shape:
        return "data.buckets: batch shapes change batch by batch, and a graph replays one shape"
    if getattr(conditioning, "keep_tokens", None) is not None:
        return "data.shuffle_caption tokenizes each batch's shuffled captions on the host"
    if align is not None and align.cached:
        return ("diffusion.align's cached targets are a new tensor per batch (diffusion.align.targets=step "
                "computes them inside the graph)")
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
    """`GraphedStep(step_fn, optimizer, generators)(x0, y)` returns what `step_fn(x0, y)` returns (the
    graph's static outputs after a replay); `generators`: every generator the step draws from."""

    def __init__(self, step_fn, optimizer: torch.optim.Optimizer, generators: Sequence[torch.Generator],
                 capture: bool = True):
        self.step_fn, self.opt, self.capture = step_fn, optimizer, capture
        self.gens = [generators] if isinstance(generators, torch.Generator) else list(generators)
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
            for g in self.gens:
                self.graph.register_generator_state(g)
            with torch.cuda.graph(self.graph):  # recorded, not run: the replay below is this step
                self.out = self.step_fn(*self.inputs)
        self.graph.replay()
        return self.out
