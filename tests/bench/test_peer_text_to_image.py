"""The peer benchmark's loops (bench/t2i_loops.py): fasttrain's text-to-image step and diffusers'
train_text_to_image.py step, fed the same x0, ε and t, give the same loss curve to float32 rounding and
end with the same UNet; with the peer's own draws they do not (the comparison can fail). And the
benchmark's parts (bench/peer_text_to_image.py) run on tiny shapes."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import peer_text_to_image as bench
from t2i_loops import PeerLoop, Setup, batch_rows, equal_noise_run

from fasttrain.kernels import native

TINY = dict(batch=4, size=8, width=16, length=8, channels=(16, 32), captions=8)
BACKENDS = ["torch"] + (["native"] if native.available("cpu") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prediction,gamma", [("eps", 5.0), ("v", None)])
def test_equal_noise_gives_equal_losses_and_weights(prediction, gamma, backend):
    torch.manual_seed(0)
    setup = Setup(prediction=prediction, snr_gamma=gamma, use_ema=True, **TINY)
    ours, theirs, agree, (ft, peer, _) = equal_noise_run(setup, 4, "cpu", backend)
    assert len(set(ours)) == 4 and all(torch.isfinite(torch.tensor(ours)))  # a curve, not one value
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 2e-6 * abs(b), (ours, theirs)
    assert agree["moved_norm"] > 0 and agree["rel_norm"] < 1e-3, agree  # trained, and to the same weights
    assert peer.ema.optimization_step == ft.parts.ema.n == 4


def test_the_peers_own_draws_give_another_curve():
    """Without fasttrain's t and ε the peer's losses differ: equality above is not a property of the setup."""
    setup = Setup(snr_gamma=5.0, **TINY)
    ours, _, _, (ft, _, start) = equal_noise_run(setup, 3, "cpu", "torch")
    torch.manual_seed(1)
    peer = PeerLoop(setup, "cpu", start)
    theirs = [float(peer.step(batch_rows(setup, k, "cpu"))) for k in range(3)]
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) > 1e-3


def test_benchmark_parts_run_on_tiny_shapes():
    args = bench.parse(["--device", "cpu", "--threads", "1", "--rounds", "2", "--steps", "1", "--warmup", "1",
                        "--weightings", "min_snr", "--equal-steps", "2", "--memory-steps", "1", "--batch", "4",
                        "--size", "8", "--length", "8", "--channels", "16,32", "--captions", "8"])
    rows = bench.timing(args, torch.device("cpu"))
    assert [r["loop"] for r in rows] == list(bench.LOOPS)
    assert all(r["cpu_ms"] > 0 and len(r["rounds_wall_ms"]) == 2 for r in rows)
    assert rows[0]["cpu_ratio_vs_diffusers"] == 1.0
    eq = bench.equality(args, torch.device("cpu"))
    assert len(eq) == 3 and all(e["loss_max_rel_diff"] < 1e-5 for e in eq[:2])
    args.memory_of = "fasttrain"
    mem = bench.memory_of(args, torch.device("cpu"))
    assert mem["loop"] == "fasttrain" and mem["peak_above_base_mib"] >= 0
    with pytest.raises(SystemExit):
        bench.parse(["--channels", "12,32"])


def test_the_emas_differ_only_in_their_first_update():
    """diffusers' EMAModel takes decay 0 at its first step (training_utils.get_decay: step − 1 = 0), so its
    average becomes the weights; fasttrain's takes min(decay, (1+n)/(10+n)) = 0.1 at n = 0. Later updates
    share the decay k/(9+k) (what docs/benchmarks.md says)."""
    setup = Setup(use_ema=True, **TINY)
    _, _, _, (ft, peer, start) = equal_noise_run(setup, 1, "cpu", "torch")
    w1 = list(ft.model.parameters())
    assert len(ft.parts.ema.shadow) == len(w1) == len(peer.ema.shadow_params)
    for s, p in zip(peer.ema.shadow_params, peer.unet.parameters()):  # s − 1·(s − p): p up to rounding
        torch.testing.assert_close(s, p.detach(), rtol=1e-6, atol=1e-7)
    for s, w, w0 in zip(ft.parts.ema.shadow, w1, start.parameters()):
        torch.testing.assert_close(s, w0 + 0.9 * (w.detach() - w0), rtol=1e-6, atol=1e-7)
    gap = max(float((s - w.detach()).abs().max()) for s, w in zip(ft.parts.ema.shadow, w1))
    assert gap > 1e-6  # a tenth of the first step's move (AdamW, lr 1e-4): above the tolerance used above
    assert ft.parts.ema.current_decay() == peer.ema.get_decay(peer.ema.optimization_step + 1) == 2 / 11
