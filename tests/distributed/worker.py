"""Checks that need two processes, launched by the tests through torchrun:

    worker.py parity OUT      FSDP2 (± AC, per-block compile, bf16) and DDP against one process on the
                              global batch, for a DiT and a UNet (its stages)
    worker.py streams OUT     per-rank noise differs, samplers and statistics agree after a sync
    worker.py diffusers_parity OUT   the parity check for diffusers networks (model.name=diffusers)

Rank 0 writes a JSON result to OUT; every check ends with barrier → destroy → os._exit (gloo's
teardown can abort otherwise)."""
import json
import os
import sys

import torch
import torch.distributed as dist

from fasttrain import diffusion as fd
from fasttrain.models import build_model
from fasttrain.models.dit import DiT
from fasttrain.models.unet import UNet
from fasttrain.parallel.wrap import parallelize

HF = {"hf_dit": ("DiTTransformer2DModel", {"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2}),
      "hf_unet": ("UNet2DModel", {"block_out_channels": [8, 16], "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                                  "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "layers_per_block": 1,
                                  "norm_num_groups": 4, "attention_head_dim": 8})}


def _model(kind):
    torch.manual_seed(0)
    if kind == "dit":
        return build_model("dit_tiny", in_channels=2, image_size=8, hidden=32, depth=2, heads=2)
    if kind in HF:  # diffusers networks as fasttrain backbones (model.name=diffusers)
        return build_model("diffusers", in_channels=2, image_size=8, class_name=HF[kind][0], config=HF[kind][1])
    return build_model("unet_tiny", in_channels=2, image_size=8, ch=8)


def _train(model, x, t, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = (model(x, t) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _full(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def parity(out, kinds=("dit", "unet")):
    from fasttrain.models.diffusers_backbone import DiffusersBackbone

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * world, 2, 8, 8, generator=g)
    t = torch.randint(0, 1000, (4 * world,), generator=g)
    mine = slice(4 * rank, 4 * (rank + 1))
    res = {}
    for kind in kinds:
        ref = {k: v.clone() for k, v in _train(_model(kind), x, t).state_dict().items()}  # one process, global batch
        for name, kw in [("fsdp", {}), ("fsdp_ac_full", {"ac": "full"}), ("fsdp_ac_selective", {"ac": "selective"}),
                         ("fsdp_compile", {"compile": "blocks"}), ("fsdp_bf16", {"precision": "bf16"}),
                         ("ddp", {"strategy": "ddp"})]:
            if name == "fsdp_compile" and kind != "dit":  # a compile per distinct stage: minutes on 2 cores
                continue
            model = parallelize(_model(kind), **{"strategy": "fsdp", **kw})
            if kind == "unet" and name == "fsdp":
                res["unet_units_sharded"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
            _train(model, x[mine], t[mine])
            sd = _full(model)
            res[f"{kind}/{name}"] = max((sd[k].float() - ref[k].float()).abs().max().item() for k in ref)
            res[f"{kind}/{name}/same_model"] = isinstance(model, (DiT, UNet, DiffusersBackbone))  # wrapped in place
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def streams(out):
    from fasttrain import seeds
    from fasttrain.kernels import philox

    rank = dist.get_rank()
    s = fd.schedule("linear", T=100)
    obj = fd.DiffusionObjective(s, "eps", "min_snr", "loss_second_moment", sampler_args={"history": 2},
                                seed=seeds.derive(0, "noise", rank))
    eps = philox.randn((64,), obj.seed, 0)
    gathered = [torch.zeros(64) for _ in range(2)]
    dist.all_gather(gathered, eps)
    lin = torch.nn.Linear(3, 3)
    g = torch.Generator().manual_seed(seeds.derive(0, "timesteps", rank))
    for _ in range(30):
        obj(lambda x, t: lin(x), torch.randn(32, 3, generator=g), generator=g)
    obj.sync_stats()
    probs = obj.probs()
    both = [torch.zeros_like(probs) for _ in range(2)]
    dist.all_gather(both, probs)
    counts = [torch.zeros_like(obj.stats.count) for _ in range(2)]
    dist.all_gather(counts, obj.stats.count)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"noise_differs": bool((gathered[0] - gathered[1]).abs().mean() > 0.5),
                       "probs_equal": bool(torch.equal(both[0], both[1])),
                       "counts_equal": bool(torch.equal(counts[0], counts[1])),
                       "count_total": float(counts[0].sum())}, f)


if __name__ == "__main__":
    import datetime
    import traceback

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    code = 0
    try:
        checks = {"parity": parity, "streams": streams,
                  "diffusers_parity": lambda out: parity(out, kinds=("hf_dit", "hf_unet"))}
        checks[sys.argv[1]](sys.argv[2])
        dist.barrier()
    except Exception:  # reported through the exit code and the traceback
        traceback.print_exc()
        code = 1
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
