"""The CUDA-graph step: everything but the capture is checked on CPU (the same body with static
buffers and device-side learning rate, EMA decay and noise offset gives the same run as the plain
step); capture and replay themselves are GPU-marked."""
import pytest
import torch

from fasttrain.configure import load_config
from fasttrain.parallel import graphs
from fasttrain.train import Trainer

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "optim.warmup_steps=3", "data.batch_size=8", "diffusion.stats_every=2"]


def _run(tr, steps):
    losses = [tr.train_step()[0].item() for _ in range(steps)]
    return losses, [p.detach().clone() for p in tr.model.parameters()], [s.clone() for s in tr.ema.shadow]


def test_static_buffer_step_equals_the_plain_step(tmp_path):
    plain = Trainer(load_config("default", [f"run_dir={tmp_path / 'a'}", "train.steps=8"] + TINY))
    static = Trainer(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=8"] + TINY))
    try:
        static.step_fn = graph = graphs.GraphedStep(static.step_fn, static.opt, static.parts.generators.all(),
                                                    capture=False)
        assert all(g["lr"] is graph.lr for g in static.opt.param_groups)  # a device tensor the graph reads
        off0 = int(static.objective.offset)
        a, b = _run(plain, 8), _run(static, 8)
        # bit-identical losses until the float32 tensor learning rate's rounding reaches the weights (the
        # second update), then equal to that rounding
        assert a[0][:2] == b[0][:2]
        torch.testing.assert_close(torch.tensor(b[0]), torch.tensor(a[0]), rtol=1e-6, atol=0)
        for x, y in zip(a[1] + a[2], b[1] + b[2]):  # a float32 tensor learning rate rounds differently
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        assert static.ema.n == plain.ema.n == 8
        assert int(static.objective.offset) == off0 + 8 * 8 * 64  # advanced on the device, in place
        assert graph.lr.item() == pytest.approx(plain.opt.param_groups[0]["lr"])
    finally:
        plain.close()
        static.close()


def test_interference_on_the_static_buffer_step_equals_the_plain_step(tmp_path):
    """The diagnostic runs outside the graph: with the replayed step's batch, labels after dropout and
    learning rate, it measures what the eager step's hook measures."""
    diag = ["diagnostics.interference_every=3", "diagnostics.buckets=3", "diagnostics.probe_size=6",
            "model.label_dropout=0.5"]
    plain = Trainer(load_config("default", [f"run_dir={tmp_path / 'a'}", "train.steps=7"] + TINY + diag))
    static = Trainer(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.steps=7"] + TINY + diag))
    try:
        static.step_fn = graphs.GraphedStep(static.step_fn, static.opt, static.parts.generators.all(), capture=False)
        for tr in (plain, static):
            for _ in range(7):
                tr.train_step()
        a, b = plain.interference.history, static.interference.history
        assert len(a) == len(b) == 2
        for ha, hb in zip(a, b):
            assert ha["step"] == hb["step"]
            torch.testing.assert_close(hb["matrix"], ha["matrix"], rtol=1e-4, atol=1e-9)
    finally:
        plain.close()
        static.close()


def test_unsupported_steps_say_why_and_fall_back(tmp_path, capsys):
    tr = Trainer(load_config("default", [f"run_dir={tmp_path}", "train.steps=2", "train.cuda_graph=true"] + TINY))
    try:
        assert not isinstance(tr.step_fn, graphs.GraphedStep)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["fasttrain: train.cuda_graph: keeping the eager step (CUDA graphs need a CUDA device)"]
        tr.train_step()  # the eager step still trains
    finally:
        tr.close()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_captured_step_replays_like_the_eager_step(tmp_path, precision):
    over = ["train.device=cuda", f"parallel.precision={precision}", "train.steps=10"]
    plain = Trainer(load_config("default", [f"run_dir={tmp_path / 'a'}"] + over + TINY))
    graphed = Trainer(load_config("default", [f"run_dir={tmp_path / 'b'}", "train.cuda_graph=true"] + over + TINY))
    try:
        assert isinstance(graphed.step_fn, graphs.GraphedStep)
        a, b = _run(plain, 10), _run(graphed, 10)
        assert graphed.step_fn.graph is not None  # captured after the warm-up
        torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=1e-5, atol=1e-6)
        for x, y in zip(a[1], b[1]):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    finally:
        plain.close()
        graphed.close()


def test_batches_of_changing_shape_keep_the_eager_step_for_any_device():
    """Graph mode is decided in parallel/graphs.py alone: a data kind whose batch shape changes (buckets:
    DataInfo.fixed_shape False, tests/data/test_buckets.py) is refused first, even on a CUDA device."""
    why = graphs.unsupported(torch.device("cuda"), 1, 1, None, None, None, fixed_shape=False)
    assert "data.buckets" in why and "one shape" in why
    assert graphs.unsupported(torch.device("cpu"), 1, 1, None, None, None) == "CUDA graphs need a CUDA device"


def test_shuffled_captions_keep_the_eager_step_for_any_device():
    """data.shuffle_caption (text-encoder LoRA, conditioning.TextCaptions with keep_tokens) rewrites the
    batch's token ids on the host: refused before the device is looked at; captions without it are not."""
    from types import SimpleNamespace

    why = graphs.unsupported(torch.device("cuda"), 1, 1, None, None, None,
                             conditioning=SimpleNamespace(keep_tokens=0))
    assert "data.shuffle_caption" in why
    unshuffled = graphs.unsupported(torch.device("cpu"), 1, 1, None, None, None,
                                    conditioning=SimpleNamespace(keep_tokens=None))
    assert unshuffled == "CUDA graphs need a CUDA device"

