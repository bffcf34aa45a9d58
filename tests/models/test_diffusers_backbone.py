"""diffusers networks as backbones (`model.name=diffusers`): fine-tuned from a saved folder under a preset
and resumed exactly, rebuilt from the checkpoint alone, conventions (null label, label dropout, blocks)
bridged, and misfits refused in one line naming the key."""
import shutil

import pytest
import torch
from diffusers_fixtures import DIT, TINY_UNET, save_tiny_unet

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.errors import ConfigError
from fasttrain.logger import read_jsonl
from fasttrain.models import build_model, forward_flops
from fasttrain.parallel.wrap import parallelize
from fasttrain.train import train

pytest.importorskip("diffusers")

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "optim.warmup_steps=2", "train.log_every=1", "train.ckpt_every=0", "data.batch_size=8"]


def _finetune(run, pre, steps, *over):
    return load_config("default", [f"run_dir={run}", "model.name=diffusers", "model.args.class_name=UNet2DModel",
                                   f"model.args.pretrained={pre}", f"train.steps={steps}"] + TINY + list(over))


def test_finetune_a_saved_unet2dmodel_under_a_preset_and_resume_exactly(tmp_path):
    from diffusers import UNet2DModel

    pre = save_tiny_unet(tmp_path / "pretrained")  # digits-sized: 1×8×8, 10 classes + the null row
    cfg = _finetune(tmp_path / "a", pre, 6)
    assert cfg.model.args.config.block_out_channels == [16, 32]  # its architecture is in the run's config
    train(cfg)
    train(_finetune(tmp_path / "b", pre, 3))
    train(_finetune(tmp_path / "b", pre, 6), resume=True)
    la = [r["loss"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    lb = [r["loss"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert len(la) == 6 and la == lb
    a, b = (torch.load(tmp_path / r / "last.pt", weights_only=True) for r in "ab")
    for part in (a["model"], a["ema"]["shadow"]):
        other = b["model"] if part is a["model"] else b["ema"]["shadow"]
        assert part.keys() == other.keys() and all(torch.equal(part[k], other[k]) for k in part)

    # it started from the pretrained weights, and the checkpoint alone rebuilds it (folder gone)
    start = UNet2DModel.from_pretrained(str(pre)).state_dict()
    tuned = {k.removeprefix("net.model."): v for k, v in a["model"].items()}
    assert start.keys() == tuned.keys()
    assert max(float((start[k] - tuned[k]).abs().max()) for k in start) < 0.05  # a few small steps away
    shutil.rmtree(pre)
    bundle = ModelBundle.load(tmp_path / "a", device="cpu")
    assert bundle.generate(2, torch.tensor([3, 10]), steps=2).shape == (2, 1, 8, 8)


def test_backbone_conventions(tmp_path):
    torch.manual_seed(0)
    dit = build_model("diffusers", in_channels=4, image_size=8, num_classes=3, class_name="DiTTransformer2DModel",
                      config=DIT)
    assert all(b.norm1.emb.class_embedder.dropout_prob == 0 for b in dit.model.transformer_blocks)
    assert dit.null_row == 3 and dit.repeated_blocks() == [dit.model.transformer_blocks[1]]
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([5, 900])
    for p in dit.parameters():  # away from adaLN-zero's start, so that labels matter
        torch.nn.init.normal_(p, std=0.05)
    dit.train()
    torch.testing.assert_close(dit(x, t), dit(x, t, torch.full((2,), 3)))  # no label = the null label, no dropout
    assert not torch.allclose(dit(x, t, torch.tensor([0, 0])), dit(x, t, torch.tensor([1, 1])))

    # a pretrained table with more classes than the data: fasttrain's null label goes to its last row
    save_tiny_unet(tmp_path / "pre", in_channels=3, num_class_embeds=21)
    unet = build_model("diffusers", in_channels=3, image_size=8, num_classes=4, class_name="UNet2DModel",
                       pretrained=str(tmp_path / "pre"))
    assert unet.null_row == 20 and len(unet.repeated_blocks()) == 5  # 2 down, mid, 2 up
    assert torch.equal(unet._labels(torch.tensor([0, 4]), t), torch.tensor([0, 20]))

    # a pretrained DiT with a learned-Σ half (out_channels = 2C) and 1000 classes, fine-tuned on 4 classes
    from diffusers import DiTTransformer2DModel

    DiTTransformer2DModel(**DIT, in_channels=4, out_channels=8, sample_size=8, num_embeds_ada_norm=1000,
                          norm_eps=1e-6).save_pretrained(str(tmp_path / "dit"))
    sigma = build_model("diffusers", in_channels=4, image_size=8, num_classes=4,
                        class_name="DiTTransformer2DModel", pretrained=str(tmp_path / "dit"))
    assert sigma.null_row == 1000 and sigma(x, t, torch.tensor([1, 4])).shape == (2, 4, 8, 8)
    full = sigma.model(x, t, class_labels=torch.tensor([1, 1000])).sample
    torch.testing.assert_close(sigma(x, t, torch.tensor([1, 4])), full[:, :4])

    # counted on the meta device (the trainer's MFU), a pretrained one from its config alone
    assert forward_flops("diffusers", in_channels=3, image_size=8, num_classes=4, class_name="UNet2DModel",
                         pretrained=str(tmp_path / "pre"), config=dict(TINY_UNET, num_class_embeds=21)) > 0

    # per-block activation checkpointing of the declared blocks: the same outputs and gradients
    ref = build_model("diffusers", in_channels=3, image_size=8, class_name="UNet2DModel", config=TINY_UNET)
    ac = build_model("diffusers", in_channels=3, image_size=8, class_name="UNet2DModel", config=TINY_UNET)
    ac.load_state_dict(ref.state_dict())
    parallelize(ac, ac="full")
    xu = torch.randn(2, 3, 8, 8)
    for m in (ref, ac):
        m(xu, t).square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), ac.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


@pytest.mark.parametrize("over,expect", [
    (["model.args.pretrained=/nonexistent"], "does not exist"),
    (["model.args.class_name=UNet3DModel"], "must be one of"),
    (["model.args.config.patch_size=3", "model.args.class_name=DiTTransformer2DModel"], "not divisible by"),
])
def test_misconfigurations_are_one_line_naming_the_key(over, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        load_config("default", ["model.name=diffusers"] + over)
    assert "model.args" in str(e.value) and "\n" not in str(e.value)


def test_pretrained_models_that_do_not_fit_the_data(tmp_path, capsys):
    save_tiny_unet(tmp_path / "rgb", in_channels=3)
    save_tiny_unet(tmp_path / "uncond", num_class_embeds=None)
    common = ["train.steps=1", "model.name=diffusers", "model.args.class_name=UNet2DModel"] + TINY
    for folder, words in (("rgb", "in_channels=3, the run needs 1"), ("uncond", "no class table")):
        assert main(["train", f"run_dir={tmp_path / folder}-run", f"model.args.pretrained={tmp_path / folder}"]
                    + common) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    # the unconditional one trains unconditionally on labelled data
    assert main(["train", f"run_dir={tmp_path / 'u'}", f"model.args.pretrained={tmp_path / 'uncond'}",
                 "model.class_conditional=false"] + common) == 0


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    """Each declared block compiles with fullgraph=True (no graph breaks in diffusers' blocks)."""
    torch.manual_seed(0)
    m = build_model("diffusers", in_channels=4, image_size=8, num_classes=3, class_name="DiTTransformer2DModel",
                    config={**DIT, "num_layers": 3})
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([0, 3])
    ref = m(x, t, y)
    parallelize(m, compile="blocks")
    out = m(x, t, y)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _pipeline_folder(root, **scheduler):
    """A diffusers pipeline folder: a tiny UNet2DModel in unet/, a DDPMScheduler configured by `scheduler`."""
    import json

    from diffusers import DDPMScheduler

    save_tiny_unet(root / "unet")
    DDPMScheduler(**scheduler).save_pretrained(str(root / "scheduler"))
    index = {"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"],
             "scheduler": ["diffusers", "DDPMScheduler"]}
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_finetuning_from_a_pipeline_takes_its_scheduler(tmp_path, capsys):
    pipe = _pipeline_folder(tmp_path / "pipe", prediction_type="v_prediction", beta_schedule="squaredcos_cap_v2",
                            timestep_spacing="trailing", rescale_betas_zero_snr=True, num_train_timesteps=500)
    base = ["model.name=diffusers", "model.args.class_name=UNet2DModel"] + TINY
    for where in ([f"model.args.pretrained={pipe}", "model.args.subfolder=unet"],
                  [f"model.args.pretrained={pipe / 'unet'}"]):  # the network's folder inside the pipeline
        cfg = load_config("default", base + where)
        d = cfg.diffusion
        assert (d.prediction, d.schedule, d.T, d.zero_terminal_snr, cfg.sample.spacing) == \
            ("v", "cosine", 500, True, "trailing")
        assert "scheduler sets diffusion.schedule=cosine" in capsys.readouterr().err
    where = [f"model.args.pretrained={pipe}", "model.args.subfolder=unet"]
    assert load_config("default", base + where + ["diffusion.prediction=v"]).diffusion.prediction == "v"
    with pytest.raises(ConfigError, match="'diffusion.prediction': 'eps' .*has 'v'"):
        load_config("default", base + where + ["diffusion.prediction=eps"])
    odd = _pipeline_folder(tmp_path / "odd", beta_schedule="sigmoid")
    with pytest.raises(ConfigError, match="sigmoid"):
        load_config("default", base + [f"model.args.pretrained={odd}", "model.args.subfolder=unet"])
    # no scheduler beside the network: the run's own settings
    cfg = load_config("default", base + [f"model.args.pretrained={save_tiny_unet(tmp_path / 'alone')}"])
    assert cfg.diffusion.prediction == "eps" and cfg.diffusion.schedule == "linear"
    # resumed after the pipeline folder is gone: the scheduler's keys come from the checkpoint
    import shutil

    run = ["train", f"run_dir={tmp_path / 'run'}"] + base + where
    assert main(run + ["train.steps=1"]) == 0
    shutil.rmtree(pipe)
    capsys.readouterr()
    assert main(run + ["train.steps=2", "--resume"]) == 0, capsys.readouterr().err
    assert ModelBundle.load(tmp_path / "run", device="cpu").cfg.diffusion.prediction == "v"
