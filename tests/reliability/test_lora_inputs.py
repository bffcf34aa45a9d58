"""Class 3: LoRA. Rank 0 is off, a negative rank or alpha and an empty target list are config errors
(test_config_keys.py); targets that match nothing or a layer LoRA cannot adapt (a LayerNorm), a rank larger
than the layer, base_dtype fp16 on CPU or without LoRA: one line at configuration, before the run folder
exists; a resume with another rank, other targets or a moved base: one line naming the key; a base changed
on disk (digest), `export --to lora` of a run without LoRA: tests/pretrained/test_lora.py
(test_a_changed_base_is_refused_and_lora_export_needs_a_lora_run)."""
import pytest
from common import one_line
from text_fixtures import save_sd1, write_captioned

from fasttrain.cli import main

pytest.importorskip("diffusers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    pipe = save_sd1(root / "pipe")
    assert main(["data", "prepare", str(write_captioned(root / "img", n=2)), "--vae", str(pipe), "--vae-subfolder",
                 "vae", "--text-encoders", str(pipe), "--latents-out", str(root / "lat"), "--image-size", "16"]) == 0
    return {"pipe": pipe, "lat": root / "lat"}


def _args(sd1, run, *more):
    return ["train", f"run_dir={run}", "data.name=captioned_latents", f"data.root={sd1['lat']}", "data.batch_size=2",
            "model.name=diffusers", "model.args.class_name=UNet2DConditionModel", "model.args.subfolder=unet",
            f"model.args.pretrained={sd1['pipe']}", "sample.num=0", "eval.num_samples=0", "eval.bpd=false",
            "train.progress=false", "train.threads=1", "train.ckpt_every=0", *more]


@pytest.mark.parametrize("over,needle", [
    (["model.lora.rank=64"], "'model.lora.rank': 64 (at most 16: the adapted layer"),
    (["model.lora.rank=4", "model.lora.target_modules=[norm1]"], "is a LayerNorm, not a linear, convolution"),
    (["model.lora.rank=4", "model.lora.target_modules=[to_qq]"], "['to_qq'] match no module of the network"),
    (["model.lora.rank=4", "model.lora.base_dtype=fp16", "train.device=cpu"], "'fp16' (needs CUDA"),
])
def test_an_adapter_that_does_not_fit_is_refused_at_configuration(sd1, tmp_path, capsys, over, needle):
    assert main(_args(sd1, tmp_path / "run", "train.steps=1", *over)) == 2
    one_line(capsys, needle, notes=True)
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_adapter_or_base_is_one_line(sd1, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    assert main(_args(sd1, run, "train.steps=1", "model.lora.rank=2")) == 0
    moved = tmp_path / "moved"
    shutil.copytree(sd1["pipe"], moved)
    for over, key in ((["model.lora.rank=4"], "model.lora.rank"),
                      (["model.lora.rank=2", "model.lora.target_modules=[to_q]"], "model.lora.target_modules"),
                      (["model.lora.rank=0"], "model.lora.rank"),
                      (["model.lora.rank=2", f"model.args.pretrained={moved}"], "model.args.pretrained")):
        capsys.readouterr()
        assert main(_args(sd1, run, "train.steps=2", "--resume", *over)) == 1
        one_line(capsys, f"config key '{key}' differs from the checkpoint", notes=True)
    import torch

    assert torch.load(run / "last.pt", weights_only=True)["train"]["step"] == 1  # the checkpoint left as it was
