"""FSDP2 (with activation checkpointing, per-block compile, the bf16 policy) and DDP on two ranks
against one process on the global batch, for a DiT and for a UNet's stages, and for diffusers' DiT and
UNet2DModel as backbones; per-rank streams."""
import pytest
from torchrun_launch import worker


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    r = worker("parity", tmp_path / "parity.json", timeout=900)
    for kind in ("dit", "unet"):
        for name in ("fsdp", "fsdp_ac_full", "fsdp_ac_selective", "ddp") + (("fsdp_compile",) if kind == "dit" else ()):
            assert r[f"{kind}/{name}"] < 1e-5, (kind, name, r)  # SGD, fp32: equal to rounding
            assert r[f"{kind}/{name}/same_model"], (kind, name)
        assert 1e-5 < r[f"{kind}/fsdp_bf16"] < 5e-2, r  # bf16 parameters: close, not equal
    assert r["unet_units_sharded"] >= 6  # every stage of the UNet is a unit, plus the root


@pytest.mark.slow
def test_diffusers_backbones_shard_checkpoint_and_replicate_like_fasttrain_models(tmp_path):
    pytest.importorskip("diffusers")
    r = worker("diffusers_parity", tmp_path / "parity.json")
    for kind in ("hf_dit", "hf_unet"):  # their declared blocks are the FSDP units and the checkpointed ones
        for name in ("fsdp", "fsdp_ac_full", "fsdp_ac_selective", "ddp"):
            assert r[f"{kind}/{name}"] < 1e-5, (kind, name, r)
            assert r[f"{kind}/{name}/same_model"], (kind, name)
        assert 1e-5 < r[f"{kind}/fsdp_bf16"] < 5e-2, r


def test_ranks_draw_their_own_noise_and_agree_on_statistics(tmp_path):
    r = worker("streams", tmp_path / "streams.json")
    assert r["noise_differs"] and r["probs_equal"] and r["counts_equal"]
    assert r["count_total"] == 2 * 30 * 32  # both ranks' samples, counted once
