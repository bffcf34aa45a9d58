"""fasttrain's DiT and UNets in diffusers' conventions (new runs: the stock DiTTransformer2DModel's
timestep frequencies and position embedding, UNet2DModel's single norm_num_groups), and checkpoints
written before format 4 keeping theirs (`convention: legacy`, linspace sampling) when they load,
sample, resume and export."""
import numpy as np
import pytest
import torch

from fasttrain import checkpoint as ckpt
from fasttrain.bundle import ModelBundle
from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.errors import ConfigError
from fasttrain.models import build_model
from fasttrain.models.dit import sincos_pos_embed
from fasttrain.models.layers import timestep_embedding
from fasttrain.models.unet import default_norm_groups

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "data.batch_size=4", "diagnostics.interference_every=0", "train.log_every=1"]
DIT = ["model.name=dit_tiny", "model.args.hidden=32", "model.args.depth=2", "model.args.heads=2"]


def test_dit_embeddings_are_diffusers_own():
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    t = torch.tensor([0, 1, 17, 500, 999])
    want = diffusers.models.embeddings.Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)(t)
    torch.testing.assert_close(timestep_embedding(t, 256, freq_shift=1), want)
    assert not torch.allclose(timestep_embedding(t, 256), want)  # the legacy frequencies differ
    pos = get_2d_sincos_pos_embed(48, 5, base_size=5, interpolation_scale=1.0, output_type="pt")
    torch.testing.assert_close(sincos_pos_embed(48, 5), pos.float())
    legacy = sincos_pos_embed(48, 5, "legacy")
    torch.testing.assert_close(legacy, torch.cat([pos[:, 24:], pos[:, :24]], 1).float())  # halves swapped


def test_unet_groups_are_one_count_that_divides_every_width():
    assert [default_norm_groups(c) for c in (4, 8, 32, 42, 48, 64, 128, 192)] == [1, 2, 8, 7, 12, 16, 32, 32]
    for ch, conv in ((32, "diffusers"), (48, "diffusers"), (32, "legacy")):
        m = build_model("unet_tiny", in_channels=1, image_size=8, ch=ch, convention=conv)
        groups = {g.num_groups for g in m.modules() if isinstance(g, torch.nn.GroupNorm)}
        assert groups == ({default_norm_groups(ch)} if conv == "diffusers" else {8, 16, 24, 32}), (ch, conv)
    m = build_model("unet_tiny", in_channels=1, image_size=8, norm_groups=4)
    assert {g.num_groups for g in m.modules() if isinstance(g, torch.nn.GroupNorm)} == {4}


def _as_format_3(run):
    """The run's last.pt as fasttrain wrote it before format 4: no convention, no sample.spacing (a run
    trained with convention=legacy has the weights such a checkpoint held)."""
    st = torch.load(run / "last.pt", weights_only=True)
    st["config"]["model"]["args"].pop("convention")
    st["config"]["sample"].pop("spacing")
    st["format"] = 3
    torch.save(st, run / "last.pt")


@pytest.mark.parametrize("model", [["model.args.ch=16"], DIT], ids=["unet", "dit"])
def test_checkpoints_before_format_4_load_sample_resume_and_export_as_before(tmp_path, capsys, model):
    old, ref = tmp_path / "old", tmp_path / "ref"
    legacy = ["model.args.convention=legacy", "sample.spacing=linspace"]
    for run, steps in ((old, 2), (ref, 4)):
        assert main(["train", f"run_dir={run}", f"train.steps={steps}"] + TINY + model + legacy) == 0
    _as_format_3(old)
    b = ModelBundle.load(old, device="cpu")
    assert b.cfg.model.args.convention == "legacy" and b.cfg.sample.spacing == "linspace"
    assert ckpt.read_plain(old)["format"] == 4  # upgraded on reading
    # resumed without naming the convention: the same network and the same steps as a straight run
    assert main(["train", f"run_dir={old}", "train.steps=4", "--resume"] + TINY + model) == 0
    a, r = (torch.load(p / "last.pt", weights_only=True) for p in (old, ref))
    assert all(torch.equal(a["model"][k], r["model"][k]) for k in r["model"])
    assert a["config"]["model"]["args"]["convention"] == "legacy" and a["config"]["sample"]["spacing"] == "linspace"
    # a new run of the same arguments is the diffusers convention, and another network
    new = build_model(b.cfg.model.name, in_channels=1, image_size=8, num_classes=10,
                      **{k: v for k, v in b.cfg.model.args.items() if k != "convention"})
    g = torch.Generator().manual_seed(0)  # away from the zero-initialised start, where both give ~0
    sd = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in b.net.net.state_dict().items()}
    new.load_state_dict(sd)
    b.net.net.load_state_dict(sd)
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 10])
    with torch.no_grad():
        a, c = new(x, t, y), b.net.net(x, t, y)
    assert float((a - c).abs().max()) > 0.01 * float(c.abs().max())
    capsys.readouterr()
    # export as before: a legacy DiT through the pipeline file, a legacy UNet refused with the reason
    code = main(["export", str(old), "--to", "diffusers", str(tmp_path / "out")])
    err = capsys.readouterr().err
    if model == DIT:
        assert code == 0, err
        pytest.importorskip("diffusers")
        import json

        index = json.loads((tmp_path / "out" / "model_index.json").read_text())
        assert index["_class_name"] == ["pipeline", "FasttrainPipeline"]
        assert index["fasttrain"]["timestep_frequencies"] == "fasttrain"
        # its transformer is not the stock class: a fine-tune from the export is refused, naming why
        with pytest.raises(ConfigError, match="before fasttrain's checkpoint format 4"):
            load_config("default", ["model.name=diffusers", "model.args.class_name=DiTTransformer2DModel",
                                    f"model.args.pretrained={tmp_path / 'out'}", "model.args.subfolder=transformer"])
    else:
        assert code == 1 and "convention=legacy" in err and len(err.strip().splitlines()) == 1, err


def test_new_checkpoints_record_nothing_old(tmp_path):
    """A new run's config holds no convention key (the factory default is the new one) and its sampling
    is trailing; the linspace of old checkpoints stays available by name."""
    assert main(["train", f"run_dir={tmp_path / 'r'}", "train.steps=1", "model.args.ch=8"] + TINY) == 0
    st = ckpt.read_plain(tmp_path / "r")
    assert st["format"] == ckpt.FORMAT == 4 and "convention" not in st["config"]["model"]["args"]
    b = ModelBundle.load(tmp_path / "r", device="cpu")
    assert b.cfg.sample.spacing == "trailing"
    groups = {g.num_groups for g in b.net.modules() if isinstance(g, torch.nn.GroupNorm)}
    assert groups == {2}
    x = b.generate(2, torch.tensor([0, 1]), steps=4, spacing="linspace")
    assert x.shape == (2, 1, 8, 8) and bool(np.isfinite(x.numpy()).all())
