"""kohya/webui LoRA files (issue 44, item 2): `export --to kohya` writes sd-scripts' key names and per-module
alpha for SD 1.x, SDXL and Flux (the expected names derived here from sd-scripts' naming rule and its models'
layouts, independently of fasttrain/pretrained/kohya.py); diffusers' load_lora_weights of the kohya file gives
the outputs of the diffusers-format file; `model.lora.init=FILE` (either format) starts a run from a LoRA file
with its outputs at step 0, and a file that does not fit the config is refused in one line."""
import json
import shutil

import pytest
import torch
from flux_fixtures import FLUX, save_flux
from text_fixtures import UNET, save_sd1, save_sdxl
from text_runs import FLUX_TRAIN, TRAIN, prepare

from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.conditioning import using
from fasttrain.configure import load_config
from fasttrain.errors import ConfigError, InvalidInput
from fasttrain.pretrained import kohya
from fasttrain.pretrained.lora_file import kohya_tensors
from fasttrain.train import Trainer, train

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-2", "sample.num=0"]
# attention, transformer and resnet layers: a diffusers-format export in the older lora.down spelling lost the
# attention modules of such an adapter in diffusers' loader (export/stable_diffusion.py writes peft's names)
SD1_TARGETS = "model.lora.target_modules=[to_q,to_k,to_v,to_out.0,proj_in,ff.net.2,conv1,time_emb_proj]"
SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".alpha")


def _adapt(model, targets, rank=4, alpha=8.0, seed=0):
    """The model with a peft adapter on `targets` whose B is moved off zero (so that it changes the outputs)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(seed)
    model.add_adapter(peft.LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BaseTunerLayer):
                m.lora_B["default"].weight.normal_(0, 0.05)
    return model


def _adapted(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted(n for n, m in model.named_modules() if isinstance(m, BaseTunerLayer))


def _meta(model) -> dict:
    """The adapter's config as save_lora_weights keeps it beside the weights (its alpha: the scale alpha/r)."""
    cfg = model.peft_config["default"]
    return {**cfg.to_dict(), "target_modules": sorted(cfg.target_modules)}


def _keys(names):
    return {n + s for n in names for s in SUFFIXES}


# -- the names: sd-scripts' rule ----------------------------------------------------------------------------------
def test_sd1_names_are_the_diffusers_paths_with_underscores():
    """sd-scripts trains SD 1.x on diffusers' module names (library/original_unet.py): lora_name = 'lora_unet' +
    '.' + the module's path, dots → underscores (networks/lora.py)."""
    unet = _adapt(diffusers.UNet2DConditionModel(cross_attention_dim=32, **UNET),
                  ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1", "time_emb_proj"])
    tensors = kohya_tensors(unet)
    names = ["lora_unet." + n for n in _adapted(unet)]
    assert set(tensors) == _keys(n.replace(".", "_") for n in names)
    m = "down_blocks.0.resnets.0.conv1"  # a Conv2d: lora_down keeps the kernel, lora_up is 1×1
    layer = unet.get_submodule(m)
    down, up = tensors[f"lora_unet_{m.replace('.', '_')}.lora_down.weight"], tensors[
        f"lora_unet_{m.replace('.', '_')}.lora_up.weight"]
    assert down.shape == (4, 16, 3, 3) and up.shape == (16, 4, 1, 1)
    assert torch.equal(down, layer.lora_A["default"].weight) and torch.equal(up, layer.lora_B["default"].weight)
    assert all(float(v) == 8.0 for k, v in tensors.items() if k.endswith(".alpha"))


def _sgm_layout(config) -> dict[str, str]:
    """diffusers block prefix → the SGM UNet's entry, built as sgm's openaimodel.UNetModel appends its blocks
    (input_blocks: conv_in, then per level its resnet(+attention) entries and a downsampler but at the last
    level; middle_block: resnet, attention, resnet; output_blocks: per level L + 1 entries, the upsampler in the
    level's last entry but at the last level)."""
    L, downs, ups = config.layers_per_block, config.down_block_types, config.up_block_types
    entries, out = [["conv_in"]], {}
    for level, kind in enumerate(downs):
        for i in range(L):
            entries.append([f"down_blocks.{level}.resnets.{i}"] +
                           ([f"down_blocks.{level}.attentions.{i}"] if "Attn" in kind else []))
        if level != len(downs) - 1:
            entries.append([f"down_blocks.{level}.downsamplers.0"])
    for k, entry in enumerate(entries):
        for j, prefix in enumerate(entry):
            out[prefix] = f"input_blocks.{k}.{j}"
    for j, prefix in enumerate(["mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1"]):
        out[prefix] = f"middle_block.{j}"
    k = 0
    for level, kind in enumerate(ups):
        for i in range(L + 1):
            entry = [f"up_blocks.{level}.resnets.{i}"] + ([f"up_blocks.{level}.attentions.{i}"] if "Attn" in kind
                                                          else [])
            if i == L and level != len(ups) - 1:
                entry.append(f"up_blocks.{level}.upsamplers.0")
            for j, prefix in enumerate(entry):
                out[prefix] = f"output_blocks.{k}.{j}"
            k += 1
    return out


# sgm's ResBlock: in_layers = [GroupNorm, SiLU, conv], emb_layers = [SiLU, linear], out_layers = [GroupNorm, SiLU,
# Dropout, conv], skip_connection; Downsample's op, Upsample's conv
RESBLOCK = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
            "conv_shortcut": "skip_connection"}


def test_sdxl_names_are_the_sgm_unets():
    cfg = dict(UNET, layers_per_block=2)
    unet = _adapt(diffusers.UNet2DConditionModel(cross_attention_dim=48, addition_embed_type="text_time",
                                                 addition_time_embed_dim=8,
                                                 projection_class_embeddings_input_dim=24 + 48, **cfg),
                  ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "conv1", "conv2",
                   "time_emb_proj", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "conv_in",
                   "linear_1"])
    layout, want = _sgm_layout(unet.config), set()
    for name in _adapted(unet):
        top = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
               "add_embedding.linear_1": "label_emb.0.0"}
        if name in top:
            sgm = top[name]
        else:
            prefix = next(p for p in sorted(layout, key=len, reverse=True) if name.startswith(p + "."))
            rest = name[len(prefix) + 1:]
            rest = {"conv": "op" if "downsamplers" in prefix else "conv"}.get(rest, RESBLOCK.get(rest, rest))
            sgm = f"{layout[prefix]}.{rest}"
        want.add(f"lora_unet_{sgm.replace('.', '_')}")
    assert len(want) == len(_adapted(unet)) > 40
    assert set(kohya_tensors(unet)) == _keys(want)
    assert "lora_unet_output_blocks_2_1_conv" in want  # up block 0 (no attention): its upsampler is entry 1


# BFL's blocks (library/flux_models.py in sd-scripts): each module and the diffusers Linears it fuses, in order
BFL_DOUBLE = {"img_mod.lin": ["norm1.linear"], "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
              "img_attn.proj": ["attn.to_out.0"], "img_mlp.0": ["ff.net.0.proj"], "img_mlp.2": ["ff.net.2"],
              "txt_mod.lin": ["norm1_context.linear"],
              "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
              "txt_attn.proj": ["attn.to_add_out"], "txt_mlp.0": ["ff_context.net.0.proj"],
              "txt_mlp.2": ["ff_context.net.2"]}
BFL_SINGLE = {"linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], "linear2": ["proj_out"],
              "modulation.lin": ["norm.linear"]}


def test_flux_names_are_bfls_with_fused_qkv_as_split_qkv_saves_them():
    """Flux: lora_unet_ + BFL's module path (networks/lora_flux.py); diffusers' q, k, v (and the single blocks'
    proj_mlp) fused into one module: downs stacked, ups block-diagonal, alpha × parts (the scale alpha/rank kept)."""
    model = _adapt(diffusers.FluxTransformer2DModel(guidance_embeds=True, **FLUX),
                   ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                    "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                    "norm1.linear", "norm1_context.linear", "proj_out", "norm.linear"])
    adapted = set(_adapted(model))
    want = {}
    for i in range(FLUX["num_layers"]):
        for bfl, parts in BFL_DOUBLE.items():
            want[f"lora_unet_double_blocks_{i}_{bfl.replace('.', '_')}"] = [f"transformer_blocks.{i}.{p}"
                                                                             for p in parts]
    for i in range(FLUX["num_single_layers"]):
        for bfl, parts in BFL_SINGLE.items():  # proj_mlp is not adapted: its part of linear1 is zero
            want[f"lora_unet_single_blocks_{i}_{bfl.replace('.', '_')}"] = [f"single_transformer_blocks.{i}.{p}"
                                                                             for p in parts]
    want["lora_unet_final_layer_linear"] = ["proj_out"]
    assert adapted == {p for parts in want.values() for p in parts} - {"single_transformer_blocks.0.proj_mlp"}
    tensors = kohya_tensors(model)
    assert set(tensors) == _keys(want)
    for name, parts in want.items():
        down, up, alpha = (tensors[name + s] for s in SUFFIXES)
        n = len(parts)
        assert down.shape[0] == 4 * n and float(alpha) == 8.0 * n
        rows = 0
        for j, p in enumerate(parts):
            layer = model.get_submodule(p)
            a = layer.lora_A["default"].weight if p in adapted else torch.zeros(4, layer.in_features)
            b = layer.lora_B["default"].weight if p in adapted else torch.zeros(layer.out_features, 4)
            assert torch.equal(down[4 * j:4 * j + 4], a)
            block = up[rows:rows + b.shape[0]]
            assert torch.equal(block[:, 4 * j:4 * j + 4], b)
            assert not block[:, :4 * j].any() and not block[:, 4 * j + 4:].any()  # block-diagonal
            rows += b.shape[0]
        assert rows == up.shape[0]


def test_a_dense_fused_file_splits_into_its_parts():
    """sd-scripts without split_qkv: one down shared by q, k, v; each part's LoRA is that down and its rows of
    the up (the product, and so the update, unchanged)."""
    model = diffusers.FluxTransformer2DModel(**FLUX)
    from fasttrain.pretrained.lora_file import targets_of

    targets = targets_of(model, "flux")
    g = torch.Generator().manual_seed(0)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    down, up = torch.randn(4, 32, generator=g), torch.randn(96, 4, generator=g)
    got = kohya.from_kohya({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                            f"{name}.alpha": torch.tensor(2.0)}, targets, kohya.fused_widths(targets, model), "f")
    assert sorted(got) == [f"transformer_blocks.0.attn.to_{x}" for x in "kqv"]
    fused = torch.cat([got[f"transformer_blocks.0.attn.to_{x}"][1] @ got[f"transformer_blocks.0.attn.to_{x}"][0]
                       for x in "qkv"])
    torch.testing.assert_close(fused, up @ down)
    assert all(s == 0.5 for _, _, s in got.values())


# -- diffusers reads them: the same outputs as the diffusers-format file ------------------------------------------
@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """A tiny SD 1.x LoRA run, and its exports in both formats."""
    root = tmp_path_factory.mktemp("kohya-sd1")
    pipe = save_sd1(root / "pipe")
    lat = prepare(root, pipe)
    run = root / "run"
    train(load_config("default", [f"run_dir={run}", "train.steps=2", f"data.root={lat}",
                                  f"model.args.pretrained={pipe}", *TRAIN, *LORA, SD1_TARGETS]))
    for to in ("kohya", "lora", "diffusers"):
        assert main(["export", str(run), "--to", to, str(root / to)]) == 0
    return {"root": root, "pipe": pipe, "lat": lat, "run": run, "kohya": root / "kohya" / "run.safetensors",
            "lora": root / "lora"}


def _probe(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


def test_sd1_kohya_export_loads_in_diffusers_as_the_diffusers_file(sd1):
    meta = json.loads(json.dumps(_metadata(sd1["kohya"])))
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert meta["ss_network_alpha"] == "8.0" and meta["ss_base_model_version"] == "sd_v1"
    assert all(k.startswith("lora_unet_") for k in load_file(str(sd1["kohya"])))
    pipes = []
    for f in (sd1["lora"], sd1["kohya"]):
        p = diffusers.StableDiffusionPipeline.from_pretrained(sd1["root"] / "diffusers")
        p.unet = diffusers.UNet2DConditionModel.from_pretrained(sd1["pipe"], subfolder="unet")  # the base
        p.load_lora_weights(str(f))
        pipes.append(p)

    def sample(p):
        return p(["a red square", "a blue circle"], num_inference_steps=4, guidance_scale=3.0, height=16, width=16,
                 output_type="latent", generator=[torch.Generator().manual_seed(i) for i in range(2)]).images

    a, b = sample(pipes[0]), sample(pipes[1])
    assert (a - b).abs().max() <= 1e-5 and a.abs().max() > 0.1
    ours = ModelBundle.load(sd1["run"], device="cpu").generate(
        2, seed=0, steps=4, solver="ddim", guidance=3.0, first_image=0, prompts=["a red square", "a blue circle"],
        spacing="trailing")
    assert (b - ours).abs().max() <= 1e-4  # fasttrain's own samples


def _metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_sdxl_kohya_file_loads_in_diffusers_as_the_diffusers_file(tmp_path):
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    root = save_sdxl(tmp_path / "xl")
    base = diffusers.UNet2DConditionModel.from_pretrained(root, subfolder="unet")
    unet = _adapt(diffusers.UNet2DConditionModel.from_pretrained(root, subfolder="unet"),
                  ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1", "time_emb_proj"])
    save_file(kohya_tensors(unet), str(tmp_path / "k.safetensors"))
    # peft's names (diffusers' older lora.down spelling, convert_state_dict_to_diffusers, loses the attention
    # modules of an adapter that also holds resnet convs in diffusers 0.42's loader)
    diffusers.StableDiffusionXLPipeline.save_lora_weights(
        str(tmp_path / "d"), unet_lora_layers=get_peft_model_state_dict(unet), unet_lora_adapter_metadata=_meta(unet))
    g = torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([10, 700]),
              "encoder_hidden_states": torch.randn(2, 12, 48, generator=g),
              "added_cond_kwargs": {"text_embeds": torch.randn(2, 24, generator=g), "time_ids": torch.rand(2, 6) * 16}}
    outs = []
    for f in (tmp_path / "d", tmp_path / "k.safetensors"):
        pipe = diffusers.StableDiffusionXLPipeline(
            vae=diffusers.AutoencoderKL.from_pretrained(root, subfolder="vae"),
            text_encoder=CLIPTextModel.from_pretrained(root, subfolder="text_encoder"),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(root, subfolder="text_encoder_2"),
            tokenizer=AutoTokenizer.from_pretrained(root, subfolder="tokenizer"),
            tokenizer_2=AutoTokenizer.from_pretrained(root, subfolder="tokenizer_2"),
            unet=diffusers.UNet2DConditionModel.from_pretrained(root, subfolder="unet"),
            scheduler=diffusers.EulerDiscreteScheduler())
        pipe.load_lora_weights(str(f))
        outs.append(_probe(pipe.unet, inputs))
    ref = _probe(unet, inputs)
    assert (outs[0] - ref).abs().max() <= 1e-5 and (outs[1] - outs[0]).abs().max() <= 1e-5
    assert (ref - _probe(base, inputs)).abs().max() > 1e-3  # the adapter changes the outputs


def test_flux_kohya_file_loads_in_diffusers_as_the_diffusers_file(tmp_path):
    """Flux: diffusers' reader (lora_conversion_utils._convert_kohya_flux_lora_to_diffusers) splits the fused qkv
    back. Its two limits (documented in docs/text-to-image.md) are kept out of this model's targets: it splits the
    single blocks' linear1 by FLUX.1's widths (3072/12288) only, and drops the layers outside the blocks."""
    from peft.utils import get_peft_model_state_dict

    root = save_flux(tmp_path / "flux")
    targets = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
               "attn.to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2",
               "ff_context.net.2", "norm1.linear", "norm1_context.linear", "single_transformer_blocks.0.proj_out",
               "norm.linear"]
    model = _adapt(diffusers.FluxTransformer2DModel.from_pretrained(root, subfolder="transformer"), targets)
    save_file(kohya_tensors(model), str(tmp_path / "k.safetensors"))
    diffusers.FluxPipeline.save_lora_weights(str(tmp_path / "d"), transformer_lora_layers=get_peft_model_state_dict(
        model), transformer_lora_adapter_metadata=_meta(model))
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(2, 16, 64, generator=g), "timestep": torch.tensor([0.2, 0.9]),
              "guidance": torch.tensor([3.5, 3.5]), "pooled_projections": torch.randn(2, 24, generator=g),
              "encoder_hidden_states": torch.randn(2, 8, 32, generator=g), "txt_ids": torch.zeros(8, 3),
              "img_ids": diffusers.FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)}
    outs = []
    for f in (tmp_path / "d", tmp_path / "k.safetensors"):
        pipe = diffusers.FluxPipeline.from_pretrained(root)
        pipe.load_lora_weights(str(f))
        outs.append(_probe(pipe.transformer, inputs))
    ref = _probe(model, inputs)
    assert (outs[0] - ref).abs().max() <= 1e-5 and (outs[1] - outs[0]).abs().max() <= 1e-5
    assert any(k.endswith("img_attn_qkv.lora_down.weight") for k in load_file(str(tmp_path / "k.safetensors")))


def test_text_encoder_adapters_join_the_file_under_lora_te(sd1):
    """The writer takes the text encoders' adapters (text-encoder LoRA trains them): SD 1.x's CLIP under lora_te_
    with sd-scripts' text_model. paths, which diffusers' reader of sd-scripts files maps back onto the encoder's
    modules. (transformers 5.24 applies adapters to its models only with peft >= 0.22, and 0.21 is pinned here:
    the adapter is injected with peft directly, and the mapping checked by diffusers' conversion of the names.)"""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers
    from transformers import CLIPTextModel

    unet = _adapt(diffusers.UNet2DConditionModel.from_pretrained(sd1["pipe"], subfolder="unet"), ["to_q"])
    clip = CLIPTextModel.from_pretrained(sd1["pipe"], subfolder="text_encoder")
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                             target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])
    clip = peft.inject_adapter_in_model(config, clip)
    clip.peft_config = {"default": config}
    tensors = kohya_tensors(unet, text_encoders=[(0, clip)])
    te = sorted(k for k in tensors if k.startswith("lora_te_"))
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in te and len(te) == 3 * 4 * 2
    state, alphas = _convert_non_diffusers_lora_to_diffusers(dict(tensors))
    mapped = {k.split(".lora_linear_layer.")[0].split("_lora.")[0].split(".lora.")[0].replace("to_q", "q_proj")
              .replace("to_k", "k_proj").replace("to_v", "v_proj").replace("to_out", "out_proj")
              for k in state if k.startswith("text_encoder.")}
    want = {"text_encoder.text_model." + n for n in _adapted(clip)}
    assert mapped == want and set(alphas.values()) == {8.0}
    layer = clip.get_submodule("encoder.layers.1.self_attn.v_proj")
    assert torch.equal(tensors["lora_te_text_model_encoder_layers_1_self_attn_v_proj.lora_down.weight"],
                       layer.lora_A["default"].weight)


# -- model.lora.init ------------------------------------------------------------------------------------------
def _init_cfg(sd1, run, *more, resume=False):
    return load_config("default", [f"run_dir={run}", "train.steps=2", f"data.root={sd1['lat']}",
                                   f"model.args.pretrained={sd1['pipe']}", *TRAIN, *LORA, SD1_TARGETS, *more],
                       resume=resume)


def _same_at_step_0(source_run, trainer, shape, prompts=("a red square", "a blue circle")):
    src = ModelBundle.load(source_run, device="cpu")
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn((3,) + shape, generator=g), torch.tensor([5, 500, 990]), torch.tensor([0, 1, 2])
    table = src.prompts.table(list(prompts), "")
    with torch.no_grad(), src.averaged(True) as net, using(net, table), using(trainer.model, table):
        a, b = net(x, t, y), trainer.model(x, t, y)
    return float((a - b).abs().max()), float(a.abs().max())


@pytest.mark.parametrize("fmt", ["kohya", "lora"])
def test_init_from_a_lora_file_gives_its_outputs_and_trains_on(sd1, tmp_path, fmt):
    run = tmp_path / "run"
    cfg = _init_cfg(sd1, run, f"model.lora.init={sd1[fmt]}")
    trainer = Trainer(cfg)
    try:
        err, size = _same_at_step_0(sd1["run"], trainer, (4, 8, 8))
    finally:
        trainer.close()
    # float32 rounding through the UNet, which differs by CPU kernel (1.1e-6 of 1.04 on an AVX-512 Xeon); the
    # issue's bar for the same LoRA read from two files is 1e-5
    assert err <= 1e-5 * max(1.0, size)
    train(_init_cfg(sd1, tmp_path / "again", f"model.lora.init={sd1[fmt]}"))
    # stopped after 1 step and resumed without the file (the checkpoint holds the adapter): the same run
    copy = tmp_path / "copy"
    (shutil.copytree if sd1[fmt].is_dir() else shutil.copy)(sd1[fmt], copy)
    train(_init_cfg(sd1, tmp_path / "parts", f"model.lora.init={copy}", "train.steps=1"))
    shutil.rmtree(copy) if copy.is_dir() else copy.unlink()
    train(_init_cfg(sd1, tmp_path / "parts", f"model.lora.init={copy}", resume=True), resume=True)
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / x / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for x in ("again", "parts")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    st = torch.load(tmp_path / "again" / "last.pt", weights_only=True)
    assert st["lora"]["init"]["format"] == ("kohya" if fmt == "kohya" else "diffusers") and st["lora"]["init"]["sha256"]
    src = torch.load(sd1["run"] / "last.pt", weights_only=True)["ema"]["shadow"]
    moved = [k for k in st["model"] if "lora_B" in k and not torch.equal(st["model"][k], src[k])]
    assert moved  # trained on from the file's weights


def test_init_refuses_files_that_do_not_fit_in_one_line(sd1, tmp_path):
    with pytest.raises(InvalidInput, match=r"model.lora.init=.*has rank 4, model.lora.rank is 2"):
        Trainer(_init_cfg(sd1, tmp_path / "a", f"model.lora.init={sd1['kohya']}", "model.lora.rank=2"))
    with pytest.raises(InvalidInput, match=r"scaled by alpha/rank = 2 \(alpha 8\), model.lora.alpha=4 scales by 1"):
        Trainer(_init_cfg(sd1, tmp_path / "b", f"model.lora.init={sd1['lora']}", "model.lora.alpha=4"))
    with pytest.raises(InvalidInput, match=r"target_modules=\[.*'proj_out'\] adapts .*proj_out, which the file does "
                                           r"not"):
        Trainer(_init_cfg(sd1, tmp_path / "c", f"model.lora.init={sd1['kohya']}", SD1_TARGETS[:-1] + ",proj_out]"))
    with pytest.raises(InvalidInput, match=r"the file adapts \S+, which model.lora.target_modules=\['to_q'\] does "
                                           r"not"):
        Trainer(_init_cfg(sd1, tmp_path / "d", f"model.lora.init={sd1['kohya']}", "model.lora.target_modules=[to_q]"))
    tensors = load_file(str(sd1["kohya"]))
    tensors["lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"] = torch.zeros(4, 32)
    save_file(tensors, str(tmp_path / "te.safetensors"))
    with pytest.raises(InvalidInput, match="adapts the text encoders"):
        Trainer(_init_cfg(sd1, tmp_path / "e", f"model.lora.init={tmp_path / 'te.safetensors'}"))
    (tmp_path / "junk.safetensors").write_text("not a tensor file")
    with pytest.raises(InvalidInput, match="cannot be read as safetensors"):
        Trainer(_init_cfg(sd1, tmp_path / "f", f"model.lora.init={tmp_path / 'junk.safetensors'}"))
    with pytest.raises(ConfigError, match="'model.lora.init'.*no such file"):
        _init_cfg(sd1, tmp_path / "g", f"model.lora.init={tmp_path / 'none.safetensors'}")
    with pytest.raises(ConfigError, match="'model.lora.init'.*set model.lora.rank"):
        load_config("default", [f"model.lora.init={sd1['kohya']}"])
    assert main(["train", f"run_dir={tmp_path / 'h'}", "train.steps=1", f"data.root={sd1['lat']}",
                 f"model.args.pretrained={sd1['pipe']}", *TRAIN, *LORA, f"model.lora.init={sd1['kohya']}",
                 "model.lora.rank=2"]) == 1  # the CLI: one line, no traceback


def test_flux_init_from_its_kohya_file_splits_the_fused_modules(tmp_path):
    """A Flux LoRA run on to_q/to_k/to_v/to_out.0 (both kinds of block: the single blocks' q, k, v fused with
    proj_mlp into linear1), exported in kohya's format and read back by model.lora.init: its outputs at step 0."""
    from text_fixtures import write_captioned

    pipe = save_flux(tmp_path / "pipe")
    lat = tmp_path / "lat"
    assert main(["data", "prepare", str(write_captioned(tmp_path / "img")), "--vae", str(pipe), "--vae-subfolder",
                 "vae", "--text-encoders", str(pipe), "--latents-out", str(lat), "--image-size", "16"]) == 0
    args = [f"data.root={lat}", f"model.args.pretrained={pipe}", *FLUX_TRAIN, *LORA, "train.steps=2"]
    train(load_config("default", [f"run_dir={tmp_path / 'run'}", *args]))
    assert main(["export", str(tmp_path / "run"), "--to", "kohya", str(tmp_path / "k")]) == 0
    f = tmp_path / "k" / "run.safetensors"
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in load_file(str(f))
    trainer = Trainer(load_config("default", [f"run_dir={tmp_path / 'init'}", *args, f"model.lora.init={f}"]))
    try:
        err, size = _same_at_step_0(tmp_path / "run", trainer, (16, 8, 8))
    finally:
        trainer.close()
    assert err <= 1e-6 * max(1.0, size) and size > 0
