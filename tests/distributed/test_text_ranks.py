"""A text-to-image model under torchrun (two gloo ranks, FSDP2): a tiny SD 1.x-shaped UNet2DConditionModel on
captioned latents trains, and a run stopped and resumed on two ranks continues with the losses and weights
of the run that never stopped; so does a LoRA run with its frozen base held in bf16 (what a GPU run does by
default) and fp32 adapters in one FSDP group, whose sharded checkpoint holds the adapter alone; so does a run with
text-encoder LoRA and shuffled captions."""
import pytest
import torch
from test_cli_runs import _losses, _same_weights
from text_fixtures import save_sd1, write_captioned
from text_runs import TRAIN
from torchrun_launch import cli

from fasttrain import checkpoint as ckpt
from fasttrain.bundle import ModelBundle
from fasttrain.cli import main

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

TEXT = TRAIN + ["sample.num=0", "parallel.strategy=fsdp"]  # the single-process text runs' settings, on FSDP2


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    root = tmp_path_factory.mktemp("sd1-ranks")
    pipe = save_sd1(root / "pipe")
    images = write_captioned(root / "img")
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(root / "lat"), "--image-size", "16", "--batch-size", "4"]) == 0
    return [f"data.root={root / 'lat'}", f"model.args.pretrained={pipe}"] + TEXT


def _stop_and_resume(tmp_path, common):
    cli(["train", f"run_dir={tmp_path / 'a'}", "train.steps=4"] + common)
    cli(["train", f"run_dir={tmp_path / 'b'}", "train.steps=2"] + common)
    cli(["train", f"run_dir={tmp_path / 'b'}", "train.steps=4", "--resume"] + common)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b") and len(_losses(tmp_path / "a")) == 4
    extra = ckpt.read_dcp_extra(tmp_path / "a" / "dcp")
    assert extra["world_size"] == 2 and extra["train"]["step"] == 4


@pytest.mark.slow
def test_text_unet_under_fsdp_bf16_and_ac_resumes_exactly_on_two_ranks(sd1, tmp_path):
    """FSDP2 with bf16 parameters (fp32 reductions and master weights) and per-block AC on the UNet's blocks."""
    _stop_and_resume(tmp_path, sd1 + ["parallel.precision=bf16", "parallel.ac=full"])
    _same_weights(tmp_path / "a", tmp_path / "b")
    net = ModelBundle.load(tmp_path / "a").net
    assert all(p.dtype == torch.float32 for p in net.parameters())  # checkpoints keep fp32 weights


@pytest.mark.slow
def test_lora_under_fsdp_resumes_exactly_and_exports_from_the_sharded_checkpoint(sd1, tmp_path):
    _stop_and_resume(tmp_path, sd1 + ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2",
                                      "model.lora.base_dtype=bf16", "parallel.precision=bf16"])
    meta = ckpt.read_dcp_metadata(tmp_path / "a" / "dcp").state_dict_metadata
    model = [k for k in meta if k.startswith("model.")]
    assert model and all("lora_" in k for k in model)  # the adapter alone, sharded; no base weights
    assert all(meta[k].properties.dtype == torch.float32 for k in model)  # the adapter trains in fp32
    assert ckpt.read_dcp_extra(tmp_path / "a" / "dcp")["lora"]["sha256"]
    _same_weights(tmp_path / "a", tmp_path / "b")  # read back alone (no process group), base from the folder
    net = ModelBundle.load(tmp_path / "a").net
    assert any(p.abs().sum() > 0 for k, p in net.named_parameters() if "lora_B" in k)  # B starts at zero: it trained
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "a"), "--to", "lora", str(out)]) == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_text_encoder_lora_with_shuffled_captions_under_fsdp_resumes_exactly(sd1, tmp_path):
    """Text-encoder LoRA (pretrained/text_lora.py): the adapted CLIP in the backbone's root FSDP unit, its own
    parameter group, the caption shuffle drawn per rank; stopped and resumed on two ranks."""
    _stop_and_resume(tmp_path, sd1 + ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2",
                                      "model.lora.text_encoder=true", "optim.text_encoder_lr=5e-3",
                                      "data.shuffle_caption=true", "parallel.precision=bf16"])
    meta = ckpt.read_dcp_metadata(tmp_path / "a" / "dcp").state_dict_metadata
    assert any(k.startswith("model.") and "text_encoders." in k and "lora_" in k for k in meta)
    _same_weights(tmp_path / "a", tmp_path / "b")
    net = ModelBundle.load(tmp_path / "a").net
    assert any(p.abs().sum() > 0 for k, p in net.named_parameters() if "text_encoders." in k and "lora_B" in k)
