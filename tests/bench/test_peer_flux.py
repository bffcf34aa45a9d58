"""The Flux peer loops (bench/flux_loops.py): fasttrain's Flux LoRA step and diffusers'
train_dreambooth_lora_flux.py step, fed the same x0, ε and t, give the same loss curve to float32 rounding and
end with the same adapter, for each of the script's --weighting_scheme values, static and dynamic shifting,
with and without the guidance embedding; with the peer's own draws, or fasttrain's x0-space sd3_sigma_sqrt in
place of flow_sigma_sqrt, they do not (the comparison can fail)."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import flux_loops
import peer_text_to_image as bench
from flux_loops import PeerLoop, Setup, batch_rows, equal_noise_run

from fasttrain.kernels import native

TINY = dict(batch=4, size=8, length=8, captions=8, lr=1e-3)
BACKENDS = ["torch"] + (["native"] if native.available("cpu") else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("over", [{"scheme": "none"}, {"scheme": "sigma_sqrt", "dynamic": False},
                                  {"scheme": "cosmap"}, {"scheme": "logit_normal", "guidance_embeds": False},
                                  {"scheme": "mode", "dynamic": False, "shift": 3.0}])
def test_equal_noise_gives_equal_losses_and_adapters(over, backend):
    setup = Setup(**TINY, **over)
    ours, theirs, agree, (ft, peer, _) = equal_noise_run(setup, 3, "cpu", backend)
    assert len(set(ours)) == 3 and all(torch.isfinite(torch.tensor(ours)))  # a curve, not one value
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 2e-6 * abs(b), (ours, theirs)
    assert agree["tensors"] > 0 and agree["moved_norm"] > 0 and agree["rel_norm"] < 1e-3, agree
    assert ft.objective.schedule.shift == (1.0 if setup.dynamic else setup.shift)  # dynamic: trained unshifted
    # the script's training sigmas (descending) are fasttrain's table (ascending), float32 rounding apart
    torch.testing.assert_close(peer.noise_scheduler_copy.sigmas.double(), ft.objective.schedule.sigma.flip(0),
                               atol=1e-6, rtol=0)


def test_the_peers_own_draws_and_the_x0_space_weight_give_other_curves(monkeypatch):
    """Without fasttrain's t and ε the peer's losses differ; and fasttrain's sd3_sigma_sqrt (an x0-space weight,
    train_dreambooth_lora_sd3.py's preconditioned loss) is not the Flux script's sigma_sqrt on the velocity."""
    setup = Setup(**TINY, scheme="sigma_sqrt")
    ours, _, _, (_, _, start) = equal_noise_run(setup, 3, "cpu", "torch")
    torch.manual_seed(1)
    peer = PeerLoop(setup, "cpu", start)
    theirs = [float(peer.step(batch_rows(setup, k, "cpu"))) for k in range(3)]
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) > 1e-3
    monkeypatch.setitem(flux_loops.SCHEMES, "sigma_sqrt", ("uniform", "sd3_sigma_sqrt"))
    ours, theirs, _, _ = equal_noise_run(setup, 1, "cpu", "torch")
    assert abs(ours[0] - theirs[0]) > 1e-2 * abs(theirs[0])


def test_flux_benchmark_parts_run_on_tiny_shapes():
    args = bench.parse(["--model", "flux", "--device", "cpu", "--threads", "1", "--rounds", "2", "--steps", "1",
                        "--warmup", "1", "--weightings", "cosmap", "--equal-steps", "2", "--memory-steps", "1",
                        "--batch", "4", "--size", "8", "--length", "8", "--captions", "8"])
    rows = bench.timing(args, torch.device("cpu"))
    assert [r["loop"] for r in rows] == list(bench.LOOPS) and all(r["cpu_ms"] > 0 for r in rows)
    eq = bench.equality(args, torch.device("cpu"))
    assert len(eq) == 3 and all(e["loss_max_rel_diff"] < 1e-5 for e in eq[:2])
    with pytest.raises(SystemExit):
        bench.parse(["--model", "flux", "--weightings", "min_snr"])
