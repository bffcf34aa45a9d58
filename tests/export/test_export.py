"""`fasttrain export RUN --to diffusers OUT`: trained runs exported and sampled against fasttrain, the
scheduler config a stock scheduler reads, the model card, the custom pipeline's diffusers protocol
(class names, num_images_per_prompt, eta, callbacks, save_pretrained), the export → fine-tune round
trip, and what diffusers cannot hold refused with the reason. The matrix of every exportable
configuration is tests/export/test_export_conformance.py."""
import json

import pytest
import torch
from diffusers_fixtures import TINY_UNET, fake_run, perturbed_run, save_tiny_vae

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.export.dispatch import export_diffusers

pytest.importorskip("diffusers")

TINY = ["train.steps=1", "train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false",
        "train.threads=1", "data.batch_size=4"]
ADM = ["model.name=adm_32", "model.args.ch_mult=[1,1]", "model.args.num_res_blocks=1",
       "model.args.attn_resolutions=[4]"]
DIT = ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2", "model.args.heads=2"]


def _run(tmp_path, name, *over):
    assert main(["train", f"run_dir={tmp_path / name}"] + TINY + list(over)) == 0
    return perturbed_run(tmp_path / name, tmp_path / f"{name}-perturbed", scale=0.03)


def _load(out, remote=True):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(out), trust_remote_code=remote)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_equals_fasttrain(run, out, labels, steps=4, guidance=1.0, solver="ddim", atol=1e-4):
    """The exported pipeline's images against fasttrain's samples for the same seed (diffusers keeps the
    schedule's tables in float32: its sqrt(ᾱ) differs from fasttrain's float64 tables by up to 7e-6
    relative, which a few steps of a random network amplify)."""
    pipe = _load(out)
    b = ModelBundle.load(run, device="cpu")
    n = len(labels) if labels is not None else 2
    x = b.generate(n, None if labels is None else torch.tensor(labels), seed=7, steps=steps, guidance=guidance,
                   solver=solver)
    got = pipe(class_labels=labels, batch_size=n, num_inference_steps=steps, guidance_scale=guidance,
               generator=torch.Generator().manual_seed(7), output_type="pt").images
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
    run = _run(tmp_path, "flow", *DIT, "diffusion.schedule=flow", "diffusion.prediction=flow",
               "diffusion.weighting=simple")
    export_diffusers(str(run), str(tmp_path / "flow-export"))
    _pipeline_equals_fasttrain(run, tmp_path / "flow-export", [1, 2], solver="flow_euler")

    cfg = json.dumps(TINY_UNET).replace('"', "")  # a YAML flow mapping for the override
    run = _run(tmp_path, "hf", "model.name=diffusers", "model.class_conditional=false", f"model.args.config={cfg}")
    res = export_diffusers(str(run), str(tmp_path / "hf-export"))
    assert res["network"] == "UNet2DModel" and res["pipeline"] == "DDIMPipeline"
    pipe = _load(tmp_path / "hf-export", remote=False)
    x = ModelBundle.load(run, device="cpu").generate(2, seed=7, steps=4)
    got = pipe(batch_size=2, num_inference_steps=4, generator=torch.Generator().manual_seed(7),
               use_clipped_model_output=True, output_type="pt").images
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=1e-4)


def test_shifted_flow_dit_export_samples_as_fasttrain(tmp_path):
    """diffusion.flow_shift=3 (SD3's shifted grid) on a fasttrain DiT: the scheduler gets shift 3 and the
    pipeline maps its σ·T back to fasttrain's t."""
    run = _run(tmp_path, "shift", *DIT, "diffusion.schedule=flow", "diffusion.prediction=flow",
               "diffusion.weighting=simple", "diffusion.flow_shift=3.0")
    export_diffusers(str(run), str(tmp_path / "shift-export"))
    conf = json.loads((tmp_path / "shift-export" / "scheduler" / "scheduler_config.json").read_text())
    assert conf["shift"] == 3.0 and not conf["use_dynamic_shifting"]
    _pipeline_equals_fasttrain(run, tmp_path / "shift-export", [1, 2], solver="flow_euler")


def test_scheduler_config_reads_the_same_in_every_stock_scheduler(tmp_path, capsys):
    """Named betas (no trained_betas list), clip_sample set explicitly (latents are never clipped),
    trailing spacing, zero terminal SNR as rescale_betas_zero_snr; a run that samples on linspace is
    told which spacing the pipeline uses."""
    import diffusers

    from fasttrain.diffusion import schedule

    run = fake_run(tmp_path / "run", ["model.args.ch=8", "diffusion.schedule=cosine", "diffusion.prediction=v",
                                      "diffusion.zero_terminal_snr=true", "sample.spacing=linspace"])
    export_diffusers(str(run), str(tmp_path / "out"))
    assert "pipeline equals `fasttrain sample --spacing trailing`" in capsys.readouterr().err
    conf = json.loads((tmp_path / "out" / "scheduler" / "scheduler_config.json").read_text())
    assert conf["_class_name"] == "DDIMScheduler" and conf["beta_schedule"] == "squaredcos_cap_v2"
    assert conf["trained_betas"] is None and conf["rescale_betas_zero_snr"] and conf["clip_sample"]
    assert conf["timestep_spacing"] == "trailing" and conf["prediction_type"] == "v_prediction"
    want = schedule("cosine", 1000, zero_terminal_snr=True).alphas_cumprod
    for name in ("DDIMScheduler", "DDPMScheduler", "EulerDiscreteScheduler", "UniPCMultistepScheduler"):
        abar = getattr(diffusers, name).from_config(conf).alphas_cumprod.double()
        torch.testing.assert_close(abar[:-1], want[:-1], rtol=2e-5, atol=1e-7)  # float32 tables
    for name, schedule_name in (("linear", "linear"), ("quad", "scaled_linear"), ("scaled_linear", "scaled_linear")):
        run = fake_run(tmp_path / name, ["model.args.ch=8", f"diffusion.schedule={name}", "data.name=latents",
                                          "data.root=x"], latents={"channels": 4, "shift": [0.0] * 4,
                                                                    "scale": [1.0] * 4, "norm": "none"})
        export_diffusers(str(run), str(tmp_path / f"{name}-out"))
        conf = json.loads((tmp_path / f"{name}-out" / "scheduler" / "scheduler_config.json").read_text())
        assert conf["beta_schedule"] == schedule_name and conf["clip_sample"] is False
        abar = diffusers.DDIMScheduler.from_config(conf).alphas_cumprod.double()
        torch.testing.assert_close(abar, schedule(name, 1000).alphas_cumprod, rtol=2e-5, atol=1e-7)


def test_model_card_names_the_recipe_the_data_and_the_metrics(tmp_path):
    run = fake_run(tmp_path / "run", ["model.args.ch=8", "diffusion.weighting=snr"])
    (run / "summary.json").write_text(json.dumps({"steps": 1, "eval": {"fid": 12.5, "precision": 0.5}}))
    export_diffusers(str(run), str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: diffusers\n") and "- diffusers:FasttrainPipeline" in card
    for needle in ("unet_tiny", "linear schedule, T = 1000, eps prediction, snr weighting", "`digits`",
                   "| fid | 12.5 |", "trust_remote_code=True", "--spacing trailing", "class 3"):
        assert needle in card, needle


def test_the_custom_pipeline_follows_the_diffusers_protocol(tmp_path):
    run = fake_run(tmp_path / "run", ["model.args.ch=8"])
    export_diffusers(str(run), str(tmp_path / "out"))
    pipe = _load(tmp_path / "out")
    b = ModelBundle.load(run, device="cpu")
    assert pipe.get_label_ids(["class 3", "class 7"]) == [3, 7] and pipe.labels["class 0"] == 0

    # labels by name, num_images_per_prompt, eta = 1 (ancestral steps): fasttrain's samples, same seed
    x = b.generate(4, torch.tensor([3, 3, 7, 7]), seed=1, steps=4, eta=1.0, guidance=2.0)
    calls = []

    def count(pipeline, i, t, tensors):
        calls.append((i, int(t), tuple(tensors["latents"].shape)))
        return tensors

    got = pipe(class_labels=["class 3", "class 7"], num_images_per_prompt=2, num_inference_steps=4, eta=1.0,
               guidance_scale=2.0, generator=torch.Generator().manual_seed(1), output_type="pt",
               callback_on_step_end=count).images
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=1e-4)
    assert [c[:2] for c in calls] == [(0, 999), (1, 749), (2, 499), (3, 249)] and calls[0][2] == (4, 1, 8, 8)
    pil = pipe(class_labels=[1], num_inference_steps=2, output_type="pil").images
    assert pil[0].size == (8, 8) and pil[0].mode == "L"
    with pytest.raises(ValueError, match="unknown label"):
        pipe(class_labels=["nope"], num_inference_steps=2)

    # save_pretrained keeps the file and its class: the folder loads again, with its model card
    pipe.save_pretrained(str(tmp_path / "saved"))
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline", "FasttrainPipeline"] and index["id2label"]["3"] == "class 3"
    assert (tmp_path / "saved" / "pipeline.py").is_file() and (tmp_path / "saved" / "README.md").is_file()
    again = _load(tmp_path / "saved")
    torch.testing.assert_close(again(class_labels=[3, 3, 7, 7], num_inference_steps=4, eta=1.0, guidance_scale=2.0,
                                     generator=torch.Generator().manual_seed(1), output_type="pt").images, got)


def test_an_export_finetunes_from_where_the_run_stopped(tmp_path, capsys):
    """Exported, then fine-tuned from the folder (model.args.pretrained): the same network (a DiT's
    standalone transformer is the stock class), and the run's scheduler taken from the folder."""
    run = fake_run(tmp_path / "run", DIT + ["diffusion.prediction=v", "diffusion.schedule=cosine"])
    export_diffusers(str(run), str(tmp_path / "out"))
    cfg = load_config("default", [f"run_dir={tmp_path / 'ft'}", "model.name=diffusers",
                                  "model.args.class_name=DiTTransformer2DModel",
                                  f"model.args.pretrained={tmp_path / 'out'}", "model.args.subfolder=transformer"])
    assert (cfg.diffusion.prediction, cfg.diffusion.schedule, cfg.sample.spacing) == ("v", "cosine", "trailing")
    from fasttrain.bundle import build_network

    b = ModelBundle.load(run, device="cpu")
    tuned = build_network(cfg, b.spec).eval()
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 400, 999]), torch.tensor([2, 10, 5])
    with b.averaged() as net, torch.no_grad():
        ref = net.net(x, t, y)
        torch.testing.assert_close(tuned.net(x, t, y), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_a_latent_imagenet_class_dit_is_a_stock_ditpipeline(tmp_path):
    """fasttrain's own DiT with 1000 classes on VAE-normalised latents: DiTPipeline (its null label is
    1000) drives it without remote code, and equals fasttrain's sampler with guidance."""
    from fasttrain.pretrained.vae import identity, latent_record, load_vae

    folder = save_tiny_vae(tmp_path / "vae")
    rec = latent_record({"channels": 4, "posterior": "mean_std", "vae": identity(load_vae(folder), folder)}, "vae")
    run = fake_run(tmp_path / "run", DIT + ["data.name=latents", "data.root=x"], latents=rec, classes=1000)
    res = export_diffusers(str(run), str(tmp_path / "out"))
    assert res["pipeline"] == "DiTPipeline" and not res["remote_code"]
    pipe = _load(tmp_path / "out", remote=False)
    assert len(pipe.labels) == 1000 and pipe.get_label_ids(["class 999"]) == [999]
    b = ModelBundle.load(run, device="cpu")
    x = b.decode(b.generate(2, torch.tensor([5, 999]), seed=2, steps=4, guidance=3.0))
    got = pipe(class_labels=[5, 999], guidance_scale=3.0, num_inference_steps=4,
               generator=torch.Generator().manual_seed(2), output_type="pt").images
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=1e-4)


def test_cli_export_names_the_pipeline_and_whether_it_needs_remote_code(tmp_path, capsys):
    run = fake_run(tmp_path / "run", ["model.args.ch=8", "model.class_conditional=false"])
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "as a DDIMPipeline" in out and "trust_remote_code" not in out
    assert not (tmp_path / "out" / "pipeline.py").exists()
    # DDPMPipeline takes the folder too; with DDPMScheduler it is fasttrain's ancestral sampler (eta 1)
    from diffusers import DDPMPipeline, DDPMScheduler

    pipe = DDPMPipeline.from_pretrained(str(tmp_path / "out"))
    pipe.scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    x = ModelBundle.load(run, device="cpu").generate(3, seed=4, steps=4, solver="ddpm")
    got = pipe(batch_size=3, num_inference_steps=4, generator=torch.Generator().manual_seed(4),
               output_type="pt").images
    torch.testing.assert_close(got, (x * 0.5 + 0.5).clamp(0, 1), rtol=0, atol=1e-4)


@pytest.mark.parametrize("over,reason", [
    (["model.args.ch=16", "model.args.convention=legacy"], "GroupNorms use"),  # per-layer groups (format 3)
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


def test_an_export_that_fails_while_writing_leaves_no_folder(tmp_path, monkeypatch):
    """export.written_whole, which every exporter writes through: a failure after the first files are
    written (here the model card) removes the folder again, so no half-written pipeline can be loaded."""
    import fasttrain.export.dispatch as export

    assert main(["train", f"run_dir={tmp_path / 'run'}", "model.args.ch=8"] + TINY) == 0

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("fasttrain.export.model_card.model_card", broken)
    with pytest.raises(OSError, match="disk full"):
        export.export_diffusers(str(tmp_path / "run"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
