"""`fasttrain export RUN --to diffusers OUT` for pixel models: an ADM-style UNet as UNet2DModel (with
fasttrain's clipping), a DiT on the flow schedule, a diffusers backbone; what diffusers cannot hold is
refused with the reason. Each export is loaded with diffusers and sampled against fasttrain."""
import json

import pytest
import torch
from diffusers_fixtures import TINY_UNET, perturbed_run

from fasttrain import seeds
from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.export import export_diffusers

pytest.importorskip("diffusers")

TINY = ["train.steps=1", "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false",
        "train.threads=1", "data.batch_size=4"]
ADM = ["model.name=adm_32", "model.args.ch_mult=[1,1]", "model.args.num_res_blocks=1",
       "model.args.attn_resolutions=[4]"]


def _run(tmp_path, name, *over):
    assert main(["train", f"run_dir={tmp_path / name}"] + TINY + list(over)) == 0
    return perturbed_run(tmp_path / name, tmp_path / f"{name}-perturbed", scale=0.03)


def _pipeline_equals_fasttrain(run, out, labels, steps=4, guidance=1.0, solver="ddim", atol=1e-4):
    """The exported pipeline's images against fasttrain's samples from the same noise (diffusers keeps the
    schedule's tables in float32: its sqrt(ᾱ) differs from fasttrain's float64 tables by up to 7e-6
    relative, which a few steps of a random network amplify)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(out), trust_remote_code=True)
    b = ModelBundle.load(run, device="cpu")
    n = len(labels) if labels is not None else 2
    x = b.generate(n, None if labels is None else torch.tensor(labels), seed=7, steps=steps, guidance=guidance,
                   solver=solver)
    noise = torch.randn((n,) + b.spec.shape, generator=torch.Generator().manual_seed(seeds.derive(7, "eval", 0)))
    got = pipe(class_labels=labels, batch_size=n, num_inference_steps=steps, guidance_scale=guidance, latents=noise,
               output_type="pt").images
    assert x.abs().max() > 0.1
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=atol)
    return pipe, b


def test_adm_unet_exports_as_unet2dmodel_with_clipping(tmp_path):
    run = _run(tmp_path, "adm", *ADM)
    out = tmp_path / "export"
    res = export_diffusers(str(run), str(out))
    assert res["network"] == "UNet2DModel" and res["max_abs_diff"] < 1e-9
    index = json.loads((out / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DModel"] and index["fasttrain"]["clip"] == 1.0
    # guidance 1.5 amplifies the float32 tables' rounding: 1.05e-4 at one pixel for the weights this run
    # trains since label dropout draws from its own stream
    pipe, b = _pipeline_equals_fasttrain(run, out, [3, 7, 10 - 1], guidance=1.5, atol=2e-4)
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 500, 999]), torch.tensor([3, 10, 1])
    with b.averaged() as net, torch.no_grad():
        torch.testing.assert_close(pipe.unet(x, t, class_labels=y).sample, net(x, t, y), rtol=0, atol=1e-5)


def test_flow_dit_and_diffusers_backbone_export(tmp_path):
    run = _run(tmp_path, "flow", "model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2",
               "model.args.heads=2", "diffusion.schedule=flow", "diffusion.prediction=flow",
               "diffusion.weighting=simple")
    export_diffusers(str(run), str(tmp_path / "flow-export"))
    _pipeline_equals_fasttrain(run, tmp_path / "flow-export", [1, 2], solver="flow_euler")

    cfg = json.dumps(TINY_UNET).replace('"', "")  # a YAML flow mapping for the override
    run = _run(tmp_path, "hf", "model.name=diffusers", "model.class_conditional=false", f"model.args.config={cfg}")
    res = export_diffusers(str(run), str(tmp_path / "hf-export"))
    assert res["network"] == "UNet2DModel"
    _pipeline_equals_fasttrain(run, tmp_path / "hf-export", None)


@pytest.mark.parametrize("over,reason", [
    (["model.args.ch=16"], "GroupNorms use"),  # unet_tiny: min(32, channels/4) groups by layer
    (["diffusion.prediction=mixed", "model.args.ch=16"], "diffusion.prediction=mixed"),
    (["data.name=moons", "model.name=mlp"], "2-D points"),
    (["model.name=dit_tiny", "model.args.mlp_ratio=2.0", "model.args.hidden=32", "model.args.heads=2"], "mlp_ratio"),
])
def test_what_diffusers_cannot_hold_is_refused_with_the_reason(tmp_path, capsys, over, reason):
    assert main(["train", f"run_dir={tmp_path / 'run'}"] + TINY + over) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", "diffusers", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0], err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_folder_with_files(tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'run'}", "model.args.ch=8"] + TINY) == 0
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["export", str(tmp_path / "run"), "--to", "diffusers", str(tmp_path / "out")]) == 1
    assert "not empty" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").read_text() == "mine"
