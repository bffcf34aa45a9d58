"""diffusers networks as fasttrain backbones (`model.name=diffusers`): trained or fine-tuned with
fasttrain's kernels, timestep strategies, compile, FSDP2 and checkpoints like any model.

    model.args.class_name=UNet2DModel  model.args.config.block_out_channels=[32,64] ...   # from a config
    model.args.class_name=UNet2DModel  model.args.pretrained=FOLDER [model.args.subfolder=unet]  # fine-tune

The data decide `in_channels`, `sample_size` and the class table, the prediction kind `out_channels`;
a pretrained model must already fit them (one line naming what differs); one with twice the output
channels (DiT's learned variance, e.g. facebook/DiT-XL-2) is trained on the first half, as DiTPipeline
samples it. Its config.json is copied
into the run's config when the run is configured (`complete`), so a checkpoint rebuilds the network
without the pretrained folder; its weights are read only when a run starts.

    model.args.class_name=UNet2DConditionModel model.args.pretrained=PIPE model.args.subfolder=unet  # text
    model.args.class_name=SD3Transformer2DModel model.args.pretrained=PIPE model.args.subfolder=transformer
    model.args.class_name=FluxTransformer2DModel ...    # models/flux.py, registered here (`register_kind`)

A UNet2DConditionModel (SD 1.x/2.x; SDXL with added_cond_kwargs) trains on captioned data: its text
inputs are gathered from the run's cached encodings (conditioning.TextTable), the data decide its
cross_attention_dim and SDXL's added-embedding width (`_text_network`).

Conventions bridged here:
  classes   fasttrain's null label is `num_classes` (classifier-free guidance); it is mapped to the
            network's own last row (UNet2DModel: num_class_embeds − 1; DiT: num_embeds_ada_norm), so a
            pretrained table with more classes than the data works. A DiT's built-in label dropout
            (10%, drawn independently in every block, diffusers' `LabelEmbedding`) is switched off:
            the trainer drops labels itself (`model.label_dropout`).
  timesteps the integer t ∈ [0, T−1] is passed as diffusers' schedulers pass it; an SD3Transformer2DModel
            (trained on the shifted flow schedule only) gets σ_t·T, as FlowMatchEulerDiscreteScheduler's
            timesteps are, from the run's σ table (`flow_sigma`, a non-persistent buffer).
  blocks    the repeated units (`repeated_blocks()`: per-block activation checkpointing, compile and
            sharding, parallel/wrap.py): a UNet2DModel's down, mid and up blocks, a DiT's transformer blocks
            but the first (whose embedding the final layer reuses; it stays with the root), an SD3
            transformer's joint blocks.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

import torch
from torch import nn

from .. import optional
from ..errors import InvalidInput
from ..pretrained.model_folders import load_model, model_dir, read_config
from . import load_pretrained, register


@dataclass(frozen=True)
class Kind:
    """A diffusers class fasttrain trains as a backbone: its class table's config key, and the image
    sizes it can take (`sizes(image_size, config)` raises InvalidInput)."""
    label_key: str
    sizes: Callable[[int, dict], None]
    child: str  # its subfolder in a pipeline folder
    text: bool = False   # conditioned on text (captioned data, conditioning.TextTable)
    flow: bool = False   # trained on the (shifted) flow schedule only, taking the run's σ table
    # the network builder of a kind another module registers (`register_kind`; models/flux.py), called as
    # network(in_channels=, image_size=, out_channels=, config=, pretrained=, subfolder=, text=, num_classes=,
    # flow_sigma=, guidance=)
    network: Callable | None = None
    dynamic_shift: bool = False  # samples with a resolution-dependent shift (use_dynamic_shifting)


def _unet_sizes(image_size: int, cfg: dict) -> None:
    levels = len(cfg.get("block_out_channels", (224, 448, 672, 896)))
    if image_size % 2 ** (levels - 1):
        raise InvalidInput(f"the UNet2DModel halves the image size {levels - 1} times: it must be a multiple of "
                           f"{2 ** (levels - 1)}")


def _dit_sizes(image_size: int, cfg: dict) -> None:
    if image_size % int(cfg.get("patch_size", 2)):
        raise InvalidInput(f"image_size {image_size} is not divisible by model.args.config.patch_size")


def _sd3_sizes(image_size: int, cfg: dict) -> None:
    _dit_sizes(image_size, cfg)
    patch, most = int(cfg.get("patch_size", 2)), cfg.get("pos_embed_max_size", 96)
    if most is not None and image_size > patch * int(most):
        raise InvalidInput(f"image_size {image_size} is larger than the SD3 transformer's position table "
                           f"(pos_embed_max_size {most} × patch_size {patch})")


# the classes model.args.class_name takes; UNet2DConditionModel is conditioned on text (conditioning.py)
KINDS = {"UNet2DModel": Kind("num_class_embeds", _unet_sizes, "unet"),
         "DiTTransformer2DModel": Kind("num_embeds_ada_norm", _dit_sizes, "transformer"),
         "UNet2DConditionModel": Kind("num_class_embeds", _unet_sizes, "unet", text=True),
         "SD3Transformer2DModel": Kind("", _sd3_sizes, "transformer", text=True, flow=True)}  # time input σ·T


def register_kind(class_name: str, kind: Kind) -> None:
    """A diffusers class whose backbone lives in its own module (models/flux.py), which registers it here."""
    KINDS[class_name] = kind


def _kind(class_name) -> Kind:
    if class_name not in KINDS:
        raise InvalidInput(f"model.args.class_name must be one of {', '.join(KINDS)}, got {class_name!r}")
    return KINDS[class_name]


def config_keys(cls) -> set[str]:
    """The keys a diffusers model class's config takes: its `__init__` parameters (register_to_config)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_config_keys(class_name: str, config) -> dict:
    """The user's `model.args.config` as a dict whose keys the class takes (its signature decides: a
    misspelt key would otherwise be ignored by `from_config` and the class default built)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InvalidInput(f"model.args.config must be a mapping of {class_name} config keys (e.g. "
                           f"{{block_out_channels: [32, 64]}}), got {config!r}")
    cls = getattr(optional.diffusers("model.name=diffusers"), class_name)
    allowed = config_keys(cls)
    for key in config:
        if not str(key).startswith("_") and key not in allowed:
            near = get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise InvalidInput(f"unknown config key 'model.args.config.{key}' ({class_name} takes no {key}{hint})")
    return dict(config)


def construct(class_name: str, config: dict, meta: bool = False) -> nn.Module:
    """`cls.from_config(config)`; a config the class cannot be built from (a GroupNorm whose groups do not
    divide the channels, a head size that does not divide the width, ...) is one line naming the key.
    `meta`: on the meta device, to check a config at configuration without allocating it."""
    cls = getattr(optional.diffusers("model.name=diffusers"), class_name)
    try:
        if meta:
            with torch.device("meta"):
                return cls.from_config(config)
        return cls.from_config(config)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError, IndexError, KeyError, AssertionError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise InvalidInput(f"model.args.config: a {class_name} cannot be built from it ({first[:200]})") from None


def _pretrained_dir(pretrained: str, subfolder: str, class_name: str):
    return model_dir(pretrained, subfolder or None, what="model.args.pretrained", key="model.args.subfolder=",
                     child=KINDS[class_name].child)


def complete(args: dict) -> dict:
    """The model arguments with a pretrained model's architecture written into `config` (its config.json,
    under the user's `config` keys), so that the run's config alone rebuilds the network; the class and
    the user's keys checked, and the network built on the meta device, so that a config diffusers
    cannot build is one line at configuration. Inside `weights_from_checkpoint` (a resumed run: its
    `config` comes from the checkpoint, configure.py) the pretrained folder is not read."""
    class_name = args.get("class_name", "UNet2DModel")
    _kind(class_name)
    fresh = load_pretrained()
    user = check_config_keys(class_name, args.get("config")) if fresh else dict(args.get("config") or {})
    config = user
    if args.get("pretrained") and fresh:
        saved = read_config(_pretrained_dir(args["pretrained"], args.get("subfolder", ""), class_name))
        if saved.get("_class_name") != class_name:
            raise InvalidInput(f"model.args.pretrained holds a {saved.get('_class_name')}, model.args.class_name is "
                               f"{class_name}")
        config = {**{k: v for k, v in saved.items() if not k.startswith("_")}, **user}
        _refuse_patched_export(args["pretrained"], args.get("subfolder", ""))
    construct(class_name, config, meta=True)
    return {**args, "config": config} if config or "config" in args else args


def _refuse_patched_export(pretrained: str, subfolder: str) -> None:
    """An export of a DiT from before checkpoint format 4 is not the stock class: its pipeline file sets
    other timestep frequencies on loading (export/remote_pipeline.py), which a backbone built from the folder
    would not have."""
    root = Path(pretrained) if subfolder else Path(pretrained).parent
    index = root / "model_index.json"
    settings = read_config(root, index.name).get("fasttrain") or {} if index.is_file() else {}
    if settings.get("timestep_frequencies") == "fasttrain":
        raise InvalidInput(f"model.args.pretrained: {root} is the export of a DiT trained before fasttrain's "
                           f"checkpoint format 4, whose timestep frequencies DiTTransformer2DModel cannot hold: "
                           f"continue that run from its own checkpoint instead")


def check(image_size: int, class_name: str = "UNet2DModel", config: dict | None = None, pretrained: str = "",
          subfolder: str = "", guidance: float | None = None, **_) -> None:
    """Structural needs, checked when the run is configured (configure.py)."""
    kind = _kind(class_name)
    if guidance is not None and kind.network is None:
        raise InvalidInput(f"model.args.guidance={guidance}: a guidance embedding's input is a guidance-distilled "
                           f"FluxTransformer2DModel's (guidance_embeds), not a {class_name}'s")
    if pretrained and load_pretrained():
        _pretrained_dir(pretrained, subfolder, class_name)
    kind.sizes(image_size, config if isinstance(config, dict) else {})


def _fit(cfg: dict, key: str, want, strict: bool, what: str) -> None:
    """Set a config key the data decide; where the user or the pretrained model gave it (`strict`), the
    values must agree."""
    if strict and cfg.get(key) is not None and cfg[key] != want:
        raise InvalidInput(f"the diffusers model has {key}={cfg[key]}, the run needs {want} ({what})")
    cfg[key] = want


class DiffusersBackbone(nn.Module):
    """A diffusers UNet2DModel, DiTTransformer2DModel or UNet2DConditionModel with fasttrain's
    forward(x, t, y) → prediction. A text-conditioned one reads y as caption codes into `text_table`
    (conditioning.TextTable, attached by the trainer or the bundle; not a buffer: never in a checkpoint); with
    text-encoder LoRA the table holds token ids (pretrained/text_lora.LiveTable) and `text_encoders`, a submodule,
    encodes them in the forward."""

    def __init__(self, model: nn.Module, num_classes: int, null_row: int | None, out_channels: int | None = None,
                 text: dict | None = None, flow_sigma: torch.Tensor | None = None):
        super().__init__()
        self.model, self.num_classes, self.null_row = model, num_classes, null_row
        self.out_channels = out_channels  # fewer than the model's: a learned-Σ half left unused
        self.text = text
        self.compute_dtype = None  # a LoRA run's frozen base held in bf16/fp16 (lora.hold_base): inputs cast to it
        if text is not None:
            self.text_table = None
        self.is_sd3 = type(model).__name__ == "SD3Transformer2DModel"
        if self.is_sd3:  # its time input is σ_t·T (FlowMatchEulerDiscreteScheduler.timesteps); not in checkpoints
            here = torch.empty(0).device  # the device being built on (meta when FLOPs are counted)
            self.register_buffer("flow_time", (flow_sigma * flow_sigma.numel()).float().to(here), persistent=False)
        self.is_dit = type(model).__name__ == "DiTTransformer2DModel"
        if self.is_dit:
            for blk in model.transformer_blocks:  # the trainer drops labels; diffusers' own 10% would add to it
                emb = getattr(blk.norm1, "emb", None)
                if emb is not None:
                    emb.class_embedder.dropout_prob = 0.0

    def _labels(self, y: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor | None:
        if self.null_row is None:
            return None
        if y is None:
            return torch.full_like(t, self.null_row, dtype=torch.long)
        return torch.where(y == self.num_classes, torch.full_like(y, self.null_row), y)

    def _text(self, y: torch.Tensor | None, x: torch.Tensor) -> dict:
        """UNet2DConditionModel's text inputs: encoder_hidden_states (SD 1.x/2.x), and SDXL's
        added_cond_kwargs {text_embeds: pooled, time_ids} (UNet2DConditionModel with addition_embed_type
        "text_time"). The attention mask is not passed, as the stock pipelines do not."""
        if self.text_table is None:  # no table (FLOP counting on the meta device): zero states of the right shape
            b, r = x.shape[0], self.text
            g = {"states": x.new_zeros(b, r["length"], r["width"]),
                 "pooled": x.new_zeros(b, r["pooled"]) if r.get("pooled") else None,
                 "time_ids": x.new_zeros(b, 6) if r.get("micro") else None}
        else:
            g = self.text_table.gather(y, x.shape[0], x.dtype)
            if "ids" in g:  # text-encoder LoRA (pretrained/text_lora.py): the adapted encoders run here, on token ids
                states, pooled = self.text_encoders(g["ids"])
                g = {"states": states.to(x.dtype), "time_ids": g["time_ids"],
                     "pooled": None if pooled is None else pooled.to(x.dtype)}
        kw = {"encoder_hidden_states": g["states"]}
        if self.is_sd3:  # StableDiffusion3Pipeline: CLIP-L+G (padded) ++ T5 states, CLIP-L ++ CLIP-G pooled
            kw["pooled_projections"] = g["pooled"]
        elif self.model.config.get("addition_embed_type") == "text_time":
            kw["added_cond_kwargs"] = {"text_embeds": g["pooled"], "time_ids": g["time_ids"]}
        return kw

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        given = x.dtype
        if self.compute_dtype is not None:  # as a diffusers pipeline in bf16 casts its latents to unet.dtype
            x = x.to(self.compute_dtype)
        if self.is_sd3:
            out = self.model(x, timestep=self.flow_time[t].to(x.dtype), **self._text(y, x)).sample
        elif self.text is not None:
            out = self.model(x, t, **self._text(y, x)).sample
        else:
            out = self.model(x, t, class_labels=self._labels(y, t)).sample
        if self.compute_dtype is not None:
            out = out.to(given)
        return out if self.out_channels is None else out[:, :self.out_channels]

    def repeated_blocks(self) -> list[nn.Module]:
        m = self.model
        if self.is_dit:
            # not block 0: DiTTransformer2DModel's final layer calls block 0's time/label embedding from
            # the root's forward, after the block (where FSDP has resharded a unit's parameters)
            return list(m.transformer_blocks)[1:]
        if self.is_sd3:
            return list(m.transformer_blocks)
        return [*m.down_blocks, *([m.mid_block] if m.mid_block is not None else []), *m.up_blocks]

    def feature_blocks(self) -> list[nn.Module]:
        """The blocks whose outputs are the network's intermediate features, in order (the d-th is what
        diffusion.align aligns): a DiT's every transformer block, a UNet's down, mid and up blocks; none of
        SD3's (its joint blocks return the text and the image tokens together)."""
        if self.is_dit:
            return list(self.model.transformer_blocks)
        return [] if self.is_sd3 else self.repeated_blocks()


def build(in_channels: int, image_size: int, num_classes: int = 0, out_channels: int | None = None,
          class_name: str = "UNet2DModel", config: dict | None = None, pretrained: str = "",
          subfolder: str = "", text: dict | None = None, flow_sigma: torch.Tensor | None = None,
          guidance: float | None = None) -> DiffusersBackbone:
    """The network from `config` (completed from `pretrained` by configure.py), with pretrained weights
    when a run starts (not when a checkpoint's weights will replace them). `text`: the run's text record
    (data/captioned.py: the encoders' width, length, pooled width, micro-conditions) for a text class.
    `flow_sigma`: the run's flow σ table (bundle.py passes it to the flow classes). `guidance`: the value a
    guidance-distilled Flux transformer's guidance embedding is fed in training (models/flux.py)."""
    check(image_size, class_name, config, pretrained, subfolder, guidance)
    kind = KINDS[class_name]
    if kind.text != (text is not None):
        raise InvalidInput(f"model.args.class_name={class_name} is conditioned on "
                           f"{'text' if kind.text else 'class labels'}, the data are "
                           f"{'captioned' if text is not None else 'not captioned'} (captioned data train a "
                           f"UNet2DConditionModel; others UNet2DModel or DiTTransformer2DModel)")
    user = dict(config or {})
    pre = bool(pretrained)
    if pre and "in_channels" not in user:  # built without configure.py's `complete`
        user = complete({"class_name": class_name, "config": user, "pretrained": pretrained,
                         "subfolder": subfolder})["config"]
    if kind.network is not None:
        return kind.network(in_channels=in_channels, image_size=image_size, out_channels=out_channels, config=user,
                            pretrained=pretrained, subfolder=subfolder, text=text, num_classes=num_classes,
                            flow_sigma=flow_sigma, guidance=guidance)
    cfg = dict(user)
    dit = class_name == "DiTTransformer2DModel"
    _fit(cfg, "in_channels", in_channels, pre or "in_channels" in user, "the data's channels")
    want, sliced = out_channels or in_channels, None
    if pre and cfg.get("out_channels") == 2 * want:  # DiT's learned Σ (Nichol & Dhariwal 2021): mean half used
        sliced = want
    else:
        _fit(cfg, "out_channels", want, pre or "out_channels" in user, "the prediction's output channels")
    if not (pre and kind.flow):  # SD3 crops its position table to the input: size is free
        _fit(cfg, "sample_size", image_size, dit and (pre or "sample_size" in user), "data.image_size")
    # the class table: rows 0..K-1 the data's classes, the last row the null label
    key = KINDS[class_name].label_key
    given = cfg.get(key) if (pre or key in user) else None
    if text is not None:
        if kind.flow:
            return _sd3_network(cfg, pre, user, pretrained, subfolder, sliced, text, num_classes, flow_sigma)
        return _text_network(cfg, pre, user, class_name, pretrained, subfolder, sliced, text, num_classes)
    if dit:
        if cfg.setdefault("norm_type", "ada_norm_zero") != "ada_norm_zero":
            raise InvalidInput("a DiTTransformer2DModel needs norm_type=ada_norm_zero here (timestep and class "
                               "conditioning)")
        rows = (given if given is not None else num_classes) + 1
        cfg[key] = rows - 1
    else:
        if cfg.get("class_embed_type") is not None:
            raise InvalidInput(f"class_embed_type={cfg['class_embed_type']!r}: fasttrain conditions on class "
                               f"indices (an embedding table: class_embed_type=None)")
        rows = given if (pre or given is not None) else (num_classes + 1 if num_classes else None)
        cfg[key] = rows
    if num_classes and (rows is None or rows < num_classes + 1):
        have = "no class table" if rows is None else f"a class table of {rows} rows"
        raise InvalidInput(f"the diffusers {class_name} has {have}, the data need {num_classes + 1} ({num_classes} "
                           f"classes and the null label; model.class_conditional=false trains it unconditionally)")
    null_row = None if rows is None else rows - 1
    model = _construct_loaded(class_name, cfg, pre, pretrained, subfolder)
    return DiffusersBackbone(model.train(), num_classes, null_row, sliced)


def _construct_loaded(class_name: str, cfg: dict, pre: bool, pretrained: str, subfolder: str) -> nn.Module:
    model = construct(class_name, cfg)
    if pre and load_pretrained():
        cls = getattr(optional.diffusers("model.name=diffusers"), class_name)
        weights = load_model(cls, pretrained, subfolder or None, what="model.args.pretrained", low_cpu_mem_usage=False)
        try:
            model.load_state_dict(weights.state_dict())
        except RuntimeError as e:
            raise InvalidInput(f"model.args.config changes the pretrained {class_name}'s shapes "
                               f"({str(e).strip().splitlines()[-1][:160]})") from None
    return model


def _text_network(cfg: dict, pre: bool, user: dict, class_name: str, pretrained: str, subfolder: str,
                  sliced, text: dict, num_classes: int) -> DiffusersBackbone:
    """A UNet2DConditionModel whose cross-attention width is the text encoders' (SD 1.x: 768, SD 2.x: 1024,
    SDXL: 2048), and, for SDXL (addition_embed_type "text_time"), whose added embedding takes the pooled
    vector and the six micro-conditions (projection_class_embeddings_input_dim = pooled + 6 · addition_time_embed_dim,
    diffusers' UNet2DConditionModel)."""
    if num_classes:
        raise InvalidInput("a text-conditioned run has no class labels (model.class_conditional=false)")
    if cfg.get("addition_embed_type") == "text_time":
        if not text.get("pooled") or not text.get("micro"):
            raise InvalidInput("this UNet2DConditionModel is SDXL's (addition_embed_type=text_time): it needs the "
                               "pooled text vector and the size/crop micro-conditions, and the data have "
                               f"{'no micro-conditions' if text.get('pooled') else 'no pooled vector'} (prepare them "
                               "with SDXL's text encoder pair)")
        want = text["pooled"] + 6 * int(cfg.get("addition_time_embed_dim") or 256)
        _fit(cfg, "projection_class_embeddings_input_dim", want, pre or "projection_class_embeddings_input_dim" in user,
             "the pooled width + 6 micro-conditions")
    elif cfg.get("addition_embed_type") is not None:
        raise InvalidInput(f"addition_embed_type={cfg['addition_embed_type']!r} is not a Stable Diffusion UNet's "
                           f"(none: SD 1.x/2.x, text_time: SDXL)")
    _fit(cfg, "cross_attention_dim", text["width"], pre or "cross_attention_dim" in user,
         "the text encoders' width")
    if cfg.get("class_embed_type") is not None or cfg.get("num_class_embeds"):
        raise InvalidInput("a text-conditioned UNet2DConditionModel here has no class embedding "
                           "(class_embed_type=None, num_class_embeds=None)")
    model = _construct_loaded(class_name, cfg, pre, pretrained, subfolder)
    return DiffusersBackbone(model.train(), 0, None, sliced, text=text)


def check_flow_text(what: str, encoders: str, text: dict | None, num_classes: int,
                    flow_sigma: torch.Tensor | None) -> None:
    """What a text transformer on the flow schedule needs of the run (SD3, Flux): no class labels, the
    schedule's σ as its time input, and a pooled text vector (`encoders`: the encoders that give one)."""
    if num_classes:
        raise InvalidInput("a text-conditioned run has no class labels (model.class_conditional=false)")
    if flow_sigma is None:
        raise InvalidInput(f"{what} takes the flow schedule's noise level as its time input (built by the trainer "
                           f"with diffusion.schedule=flow)")
    if not (text or {}).get("pooled"):
        raise InvalidInput(f"{what} needs the pooled text vector, and the data have none (prepare them with "
                           f"{encoders})")


def _sd3_network(cfg: dict, pre: bool, user: dict, pretrained: str, subfolder: str, sliced, text: dict,
                 num_classes: int, flow_sigma: torch.Tensor | None) -> DiffusersBackbone:
    """An SD3Transformer2DModel: its joint attention takes the text states (joint_attention_dim: T5's width,
    the CLIP pair zero-padded to it) and its time embedding the pooled CLIP pair (pooled_projection_dim)."""
    check_flow_text("an SD3Transformer2DModel", "SD3's text encoders: CLIP-L, CLIP-G and T5", text, num_classes,
                    flow_sigma)
    _fit(cfg, "joint_attention_dim", text["width"], pre or "joint_attention_dim" in user, "the text encoders' width")
    _fit(cfg, "pooled_projection_dim", text["pooled"], pre or "pooled_projection_dim" in user,
         "the pooled text vector's width")
    model = _construct_loaded("SD3Transformer2DModel", cfg, pre, pretrained, subfolder)
    return DiffusersBackbone(model.train(), 0, None, sliced, text=text, flow_sigma=flow_sigma)


def _declared(args: dict, what: str) -> bool:
    kind = KINDS.get(args.get("class_name", "UNet2DModel"))
    return bool(kind is not None and getattr(kind, what))


def takes_text(args: dict) -> bool:
    return _declared(args, "text")


def flow_only(args: dict) -> bool:
    return _declared(args, "flow")


def dynamic_shift(args: dict) -> bool:
    return _declared(args, "dynamic_shift")


register("diffusers", check=check, complete=complete, recorded=("config",), text=takes_text,
         flow=flow_only, dynamic_shift=dynamic_shift)(build)
