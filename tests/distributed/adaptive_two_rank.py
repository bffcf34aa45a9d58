"""A two-rank gloo run of the adaptive sampler, launched by test_adaptive_two_rank.py:

    torchrun --standalone --nproc_per_node=2 tests/distributed/adaptive_two_rank.py OUT_DIR

Each rank builds the same tiny model (same seed) on its own data and noise and steps it with the
trainer's call order (step.reference_step) twice: "plain" (gradients averaged by hand, as DDP
would) and "fsdp" (the model through fasttrain.parallel: FSDP2 with bf16 parameters, so the probes'
forwards are collective and the model's outputs bf16). It writes what the tests compare to
OUT_DIR/{run}-rank{r}.json: the policy, S, the FIFO, and which τ-grid elements this rank evaluated.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from fasttrain import diffusion as fd
from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
from fasttrain.models import build_model
from fasttrain.parallel.wrap import parallelize
from fasttrain.step import reference_step

STEPS, ARGS = 7, dict(every=2, tau_grid=10, capacity=3)


def run(out: str, kind: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model on every rank
    net = build_model("unet_tiny", in_channels=1, image_size=8, num_classes=10, ch=8, attn_resolutions=())
    sched = fd.schedule("linear")
    net = Denoiser(net, PredictionOutput("eps", sched), sched)  # the network with its x̂0 conversion
    if kind == "fsdp":
        net = parallelize(net, "fsdp", precision="bf16")
    obj = fd.DiffusionObjective(fd.schedule("linear"), "eps", "min_snr", "adaptive", sampler_args=ARGS,
                                seed=rank)  # per-rank training noise, as the trainer's seeds
    smp = obj.sampler
    smp.set_partition(rank, world, 1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    evaluated = []
    before = smp.before_update

    def spy(ctx):  # what this rank's look-ahead put in its probe
        before(ctx)
        probe, split, _, _ = smp._pending
        evaluated.append({"index": split.index[split.mask].tolist(), "per": split.per,
                          "tau": probe.t[:split.per][split.mask].tolist(),
                          "star": float(probe.x0[0].double().sum()), "grid": smp._grid(smp.updates).tolist()})

    smp.before_update = spy

    def average_grads():
        if kind == "fsdp":
            return  # FSDP reduce-scatters the gradients itself
        for p in net.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batch
        x0, y = torch.randn(8, 1, 8, 8, generator=g).clamp(-1, 1), torch.randint(0, 10, (8,), generator=g)
        reference_step(net, obj, opt, [(x0, y)], step, [smp], rank=rank, world_size=world, generator=gen,
                       before_step=average_grads)
    m = smp.metrics()
    result = {"rank": rank, "world": world, "evaluated": evaluated, "updates": smp.updates,
              "policy": [v.double().flatten().tolist() for v in smp.net.state_dict().values()],
              "S": smp.S.tolist(), "fifo_X": smp.fifo_X.tolist(), "hist_S": [s.tolist() for s in smp.hist_S],
              "reward": float(m["adaptive/reward"]),
              "model": float(sum(p.full_tensor().double().sum() if hasattr(p, "full_tensor") else p.double().sum()
                                 for p in net.parameters()))}
    with open(os.path.join(out, f"{kind}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for kind in ("plain", "fsdp"):
        run(out, kind)
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown is flaky otherwise


if __name__ == "__main__":
    main(sys.argv[1])
