"""Mixed precision acts with one process (and DDP): bf16 autocast on CPU runs the model's matmuls in
bf16, losses stay close to fp32, weights, optimizer state and checkpoints stay fp32."""
import pytest
import torch

from fasttrain.configure import load_config
from fasttrain.parallel.precision import resolve
from fasttrain.train import Trainer, train

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2",
        "train.log_every=1", "train.ckpt_every=0", "optim.lr=1e-3"]


def test_bf16_autocast_runs_the_matmuls_in_bf16_and_keeps_fp32_state(tmp_path):
    tr = Trainer(load_config("default", [f"run_dir={tmp_path}", "train.steps=2", "parallel.precision=bf16"] + TINY))
    try:
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
                 for m in tr.model.modules() if isinstance(m, torch.nn.Linear)]
        tr.train_step()
        for h in hooks:
            h.remove()
        assert seen and all(d == torch.bfloat16 for d in seen)
        assert all(p.dtype == torch.float32 for p in tr.model.parameters())
        assert all(p.grad is None for p in tr.model.parameters())  # zeroed after the step
        assert all(v.dtype == torch.float32 for st in tr.opt.state.values() for k, v in st.items() if k != "step")
        assert all(s.dtype == torch.float32 for s in tr.ema.shadow)
    finally:
        tr.close()


def test_bf16_losses_stay_close_to_fp32(tmp_path):
    runs = {}
    for prec in ("fp32", "bf16"):
        train(load_config("default", [f"run_dir={tmp_path / prec}", "train.steps=12",
                                      f"parallel.precision={prec}"] + TINY))
        runs[prec] = [r["loss"] for r in __import__("fasttrain.logger", fromlist=["read_jsonl"]).read_jsonl(
            tmp_path / prec / "metrics.jsonl") if "loss" in r]
        sd = torch.load(tmp_path / prec / "last.pt", weights_only=True)
        assert all(v.dtype == torch.float32 for v in sd["model"].values() if v.is_floating_point())
        assert all(v.dtype == torch.float32 for v in sd["ema"]["shadow"].values())
    assert runs["fp32"] != runs["bf16"]  # bf16 did act
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert b == pytest.approx(a, rel=0.05, abs=0.02)


def test_precision_choices_and_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve("auto", cpu, "none").name == "fp32" and resolve("auto", cuda, "none").name == "bf16"
    p = resolve("bf16", cpu, "ddp")
    assert p.autocast and not p.fsdp_policy and p.input_dtype == torch.bfloat16
    p = resolve("bf16", cpu, "fsdp")
    assert p.fsdp_policy and not p.autocast
    with pytest.raises(ValueError, match="fp16 needs CUDA"):
        resolve("fp16", cpu, "none")
    with pytest.raises(ValueError, match="fp16 with parallel.strategy=fsdp"):
        resolve("fp16", cuda, "fsdp")
    assert resolve("fp16", cuda, "none").scaler
