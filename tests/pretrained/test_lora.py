"""LoRA through peft (lora.py): a tiny SD 1.x-shaped pipeline fine-tuned with adapters on the attention
projections; only the adapter trains, is averaged and checkpointed (with the base's identity), the run
resumes exactly, a changed base is refused, and the adapter exported as pytorch_lora_weights.safetensors
applied by the stock pipeline's load_lora_weights gives fasttrain's samples; so does the merged full export."""
import json
import shutil

import pytest
import torch
from text_fixtures import save_sd1, save_sdxl
from text_runs import PROMPTS, TRAIN
from text_runs import prepare as _prepare
from text_runs import same_samples as _same_samples

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.errors import CheckpointError, InvalidInput
from fasttrain.train import Trainer, train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2"]


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    pipe = save_sd1(root / "pipe")
    return {"root": root, "pipe": pipe, "lat": _prepare(root, pipe)}


def _cfg(sd1, run, steps, extra=(), resume=False):
    return load_config("default", [f"run_dir={run}", f"train.steps={steps}", "sample.num=0", f"data.root={sd1['lat']}",
                                   f"model.args.pretrained={sd1['pipe']}"] + TRAIN + LORA + list(extra), resume=resume)


def test_lora_trains_the_adapter_alone_and_resumes_exactly(sd1, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    drop = ["model.lora.dropout=0.1"]  # peft's dropout draws from the global stream, which checkpoints hold
    train(_cfg(sd1, a, 6, drop))
    train(_cfg(sd1, b, 3, drop))
    train(_cfg(sd1, b, 6, drop, resume=True), resume=True)
    loss = [[r["loss"] for r in map(json.loads, (r / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
            for r in (a, b)]
    assert len(loss[0]) == 6 and loss[0] == loss[1]
    sa, sb = (torch.load(r / "last.pt", weights_only=True) for r in (a, b))
    assert sa["model"] and all("lora_" in k for k in sa["model"])  # the adapter alone, no base weights
    assert set(sa["ema"]["shadow"]) == set(sa["model"]) and sa["lora"]["sha256"]
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=0, atol=0)
    moved = [k for k in sa["model"] if "lora_B" in k and sa["model"][k].abs().sum() > 0]
    assert moved  # B starts at zero: the adapter trained
    bundle = ModelBundle.load(a, device="cpu")
    unet = diffusers.UNet2DConditionModel.from_pretrained(sd1["pipe"], subfolder="unet")
    frozen = dict(bundle.net.net.model.named_parameters())
    for name, p in unet.named_parameters():  # the base stays the pretrained one
        stem, leaf = name.rsplit(".", 1)
        key = name if name in frozen else f"{stem}.base_layer.{leaf}"  # peft wraps the adapted layers
        torch.testing.assert_close(frozen[key], p, rtol=0, atol=0)


def test_a_changed_base_is_refused_and_lora_export_needs_a_lora_run(sd1, tmp_path, capsys):
    pipe = tmp_path / "pipe"
    shutil.copytree(sd1["pipe"], pipe)
    cfg = load_config("default", [f"run_dir={tmp_path / 'r'}", "train.steps=1", "sample.num=0",
                                  f"data.root={sd1['lat']}", f"model.args.pretrained={pipe}"] + TRAIN + LORA)
    train(cfg)
    torch.manual_seed(9)
    diffusers.UNet2DConditionModel.from_pretrained(pipe, subfolder="unet").apply(
        lambda m: torch.nn.init.normal_(m.weight) if isinstance(m, torch.nn.Linear) else None).save_pretrained(
        pipe / "unet")
    with pytest.raises(CheckpointError, match="is not the one this LoRA run was trained on"):
        ModelBundle.load(tmp_path / "r", device="cpu")
    more = load_config("default", [f"run_dir={tmp_path / 'r'}", "train.steps=2", "sample.num=0",
                                   f"data.root={sd1['lat']}", f"model.args.pretrained={pipe}"] + TRAIN + LORA,
                       resume=True)
    with pytest.raises(CheckpointError, match="is not the one this LoRA run was trained on"):
        train(more, resume=True)  # nor resumed
    plain = tmp_path / "plain"
    train(load_config("default", [f"run_dir={plain}", "train.steps=1", "sample.num=0", f"data.root={sd1['lat']}",
                                  f"model.args.pretrained={sd1['pipe']}"] + TRAIN))
    assert main(["export", str(plain), "--to", "lora", str(tmp_path / "out")]) == 1
    assert "was not trained with LoRA (model.lora.rank=0)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidInput, match=r"model.lora.target_modules=\['to_qq'\]"):
        train(_cfg(sd1, tmp_path / "t", 1, ["model.lora.target_modules=[to_qq]"]))
    with pytest.raises(InvalidInput, match="LoRA applies to diffusers backbones"):
        train(load_config("default", [f"run_dir={tmp_path / 'u'}", "train.steps=1", "model.lora.rank=2"]))


def test_a_bf16_base_trains_samples_resumes_exactly_and_exports_the_fp32_base(sd1, tmp_path):
    """model.lora.base_dtype=bf16 (what auto picks on CUDA), run here on CPU without autocast: the frozen base
    is held in bf16, the adapter, its optimizer state and EMA in fp32; the step computes in bf16 (losses near
    the fp32 base's, not equal), in-run sampling works, resume is exact, and a checkpoint reads back with the
    fp32 pretrained base, which the full export merges into."""
    bf = ["model.lora.base_dtype=bf16", "parallel.precision=fp32", "sample.num=2", "sample.steps=2"]
    t = Trainer(_cfg(sd1, tmp_path / "x", 1, bf))
    try:
        unet = t.bundle.net.net.model
        frozen = [p for p in unet.parameters() if not p.requires_grad]
        trained = [p for group in t.opt.param_groups for p in group["params"]]
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
        assert trained and all(p.dtype == torch.float32 for p in trained)
        assert len(trained) == sum(1 for n, _ in unet.named_parameters() if "lora_" in n)
        assert all(s.dtype == torch.float32 for s in t.ema.shadow)
    finally:
        t.close()
    a, b, full = tmp_path / "a", tmp_path / "b", tmp_path / "fp32"
    train(_cfg(sd1, a, 4, bf))
    train(_cfg(sd1, b, 2, bf))
    train(_cfg(sd1, b, 4, bf, resume=True), resume=True)
    train(_cfg(sd1, full, 4, ["model.lora.base_dtype=fp32", "parallel.precision=fp32", "sample.num=2",
                              "sample.steps=2"]))
    loss = [[r["loss"] for r in map(json.loads, (r / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
            for r in (a, b, full)]
    assert len(loss[0]) == 4 and loss[0] == loss[1]
    assert loss[0] != loss[2]  # the bf16 base computes in bf16 ...
    torch.testing.assert_close(torch.tensor(loss[0]), torch.tensor(loss[2]), rtol=0.05, atol=0)  # ... near fp32's
    assert (a / "samples.png").is_file()
    sa, sb = (torch.load(r / "last.pt", weights_only=True) for r in (a, b))
    assert all(v.dtype == torch.float32 for v in sa["model"].values())
    for k in sa["model"]:
        torch.testing.assert_close(sa["model"][k], sb["model"][k], rtol=0, atol=0)
    bundle = ModelBundle.load(a, device="cpu")
    assert all(p.dtype == torch.float32 for p in bundle.net.parameters())  # sampling and export: the fp32 base
    out = tmp_path / "export"
    assert main(["export", str(a), "--to", "diffusers", str(out)]) == 0  # checked against fasttrain's sampler
    merged = diffusers.UNet2DConditionModel.from_pretrained(out, subfolder="unet")
    assert all(p.dtype == torch.float32 for p in merged.parameters())


@pytest.mark.gpu
def test_on_cuda_the_base_is_held_in_bf16_by_default_and_the_run_trains_and_samples(sd1, tmp_path):
    """What model.lora.base_dtype=auto does on a GPU (bench/gpu_check.sh runs it): bf16 base, fp32 adapter,
    under the default bf16 autocast; finite losses, in-run samples."""
    run = tmp_path / "cuda"
    t = Trainer(_cfg(sd1, run, 3, ["sample.num=2", "sample.steps=2"]))
    try:
        assert t.device.type == "cuda" and t.precision.name == "bf16"
        unet = t.bundle.net.net.model
        assert all(p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16) for p in unet.parameters())
    finally:
        t.close()
    train(_cfg(sd1, run, 3, ["sample.num=2", "sample.steps=2"]))
    loss = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(loss) == 3 and all(torch.isfinite(torch.tensor(loss)))
    assert (run / "samples.png").is_file()


def test_base_dtype_errors(sd1, tmp_path):
    with pytest.raises(InvalidInput, match="model.lora.base_dtype=fp16 needs CUDA"):
        train(_cfg(sd1, tmp_path / "h", 1, ["model.lora.base_dtype=fp16"]))
    with pytest.raises(InvalidInput, match=r"this run has no adapter \(model.lora.rank=0\)"):
        train(load_config("default", [f"run_dir={tmp_path / 'p'}", "train.steps=1", "model.lora.base_dtype=bf16"]))
    with pytest.raises(InvalidInput, match="model.lora.base_dtype"):
        load_config("default", ["model.lora.base_dtype=bfloat16"])


def _lora_exports_match(run, pipe_folder, tmp_path, cls):
    """export --to lora applied by the base pipeline's load_lora_weights, and --to diffusers (the adapter
    merged), both give fasttrain's samples; returns the base pipeline folder and the samples."""
    out = tmp_path / "lora"
    assert main(["export", str(run), "--to", "lora", str(out)]) == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    class WithLora(cls):  # the base pipeline, then load_lora_weights(out)
        @classmethod
        def from_pretrained(cls_, folder, **kw):
            pipe = cls.from_pretrained(folder, **kw)
            pipe.load_lora_weights(str(out))
            return pipe

    full = tmp_path / "full"
    assert main(["export", str(run), "--to", "diffusers", str(full)]) == 0  # the adapter merged
    _same_samples(run, full, cls)
    # the base pipeline: the full export with its UNet replaced by the pretrained one (the run's scheduler)
    base = tmp_path / "base"
    shutil.copytree(full, base, ignore=shutil.ignore_patterns("unet"))
    diffusers.UNet2DConditionModel.from_pretrained(pipe_folder, subfolder="unet").save_pretrained(base / "unet")
    ours, pipe = _same_samples(run, base, WithLora)
    assert len(PROMPTS) == ours.shape[0] and pipe.get_active_adapters()
    return base, ours


def test_sdxl_lora_export_is_applied_by_load_lora_weights(tmp_path):
    pipe = save_sdxl(tmp_path / "xl")
    lat = _prepare(tmp_path, pipe, "xl-lat")
    def cfg(run, steps, resume=False):
        return load_config("default", [f"run_dir={run}", f"train.steps={steps}", "sample.num=0", f"data.root={lat}",
                                       f"model.args.pretrained={pipe}"] + TRAIN + LORA, resume=resume)

    run, other = tmp_path / "run", tmp_path / "other"
    train(cfg(run, 4))
    train(cfg(other, 2))
    train(cfg(other, 4, resume=True), resume=True)  # SDXL: resumes exactly too
    loss = [[r["loss"] for r in map(json.loads, (x / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
            for x in (run, other)]
    assert len(loss[0]) == 4 and loss[0] == loss[1]
    _lora_exports_match(run, pipe, tmp_path, diffusers.StableDiffusionXLPipeline)


def test_lora_export_is_applied_by_load_lora_weights(sd1, tmp_path):
    run = tmp_path / "run"
    train(_cfg(sd1, run, 3))
    base, ours = _lora_exports_match(run, sd1["pipe"], tmp_path, diffusers.StableDiffusionPipeline)
    plain = diffusers.StableDiffusionPipeline.from_pretrained(base)  # without the adapter: other samples
    x = plain(PROMPTS, num_inference_steps=4, guidance_scale=3.0, height=16, width=16, output_type="latent",
              generator=[torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]).images
    assert float((x - ours).abs().max()) > 1e-3


def test_lora_on_a_class_conditional_unet2dmodel_exports_merged(tmp_path, capsys):
    from diffusers_fixtures import save_tiny_unet

    pre = save_tiny_unet(tmp_path / "pretrained")  # digits-sized UNet2DModel: LoRA comes with the backbone
    run = tmp_path / "run"
    train(load_config("default", [f"run_dir={run}", "model.name=diffusers", "model.args.class_name=UNet2DModel",
                                  f"model.args.pretrained={pre}", "train.steps=2", "model.lora.rank=2",
                                  "model.lora.target_modules=[conv1,conv2]", "train.progress=false", "sample.num=0",
                                  "eval.num_samples=0", "eval.bpd=false", "train.threads=1", "data.batch_size=8",
                                  "optim.lr=1e-2", "optim.warmup_steps=1"]))
    saved = torch.load(run / "last.pt", weights_only=True)
    assert all("lora_" in k for k in saved["model"])
    assert main(["export", str(run), "--to", "diffusers", str(tmp_path / "out")]) == 0  # verified on probes
    unet = diffusers.UNet2DModel.from_pretrained(tmp_path / "out", subfolder="unet")
    assert not any("lora" in k for k in unet.state_dict())
    assert main(["export", str(run), "--to", "lora", str(tmp_path / "l")]) == 1
    assert "LoRA weights are exported for SD / SDXL pipelines" in capsys.readouterr().err
