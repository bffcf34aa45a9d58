import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))


@pytest.mark.parametrize("args,key", [
    (["train.stepz=3"], "train.stepz"),
    (["train.steps=abc"], "train.steps"),
    (["diffusion.weighting=minsnr"], "diffusion.weighting"),
    (["diffusion.weighting_args.k=1"], "diffusion.weighting_args.k"),
    (["diffusion.sampler=speed", "diffusion.sampler_args.gamma=1"], "diffusion.sampler_args.gamma"),
    (["optim.lr=-1"], "optim.lr"),
    (["model.label_dropout=1.5"], "model.label_dropout"),
    (["data.name=mnist"], "data.name"),
    (["nokey"], "nokey"),
    (["model.name=mlp", "model.args.ch=4"], "model.args.ch"),
])
def test_bad_config_is_one_line_naming_the_key(capsys, args, key):
    assert main(["train"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and err.startswith("fasttrain: error:")


def test_unknown_preset(capsys):
    assert main(["train", "no-such-preset"]) == 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_help_lists_presets_and_keys():
    out = subprocess.run([sys.executable, "-m", "fasttrain.cli", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for word in ("presets:", "default", "diffusion.weighting", "optim.lr", "train.steps", "--resume"):
        assert word in out.stdout


def test_print_config_applies_overrides(capsys):
    assert main(["train", "diffusion.prediction=v", "--print-config"]) == 0
    assert "prediction: v" in capsys.readouterr().out


def test_tiny_run_and_resume_errors(tmp_path, capsys):
    base = ["train", f"run_dir={tmp_path}", "model.args.ch=8", "train.steps=3", "sample.num=0", "train.progress=false",
            "eval.num_samples=0", "eval.bpd=false"]
    assert main(base + ["--resume"]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    assert main(base) == 0
    assert "done: 3 steps" in capsys.readouterr().out


@pytest.mark.parametrize("args,key", [
    (["diffusion.sampler=speed", "diffusion.sampler_args.k=abc"], "diffusion.sampler_args.k"),
    (["model.args.ch=abc"], "model.args.ch"),
    (["data.name=moons", "model.name=unet_tiny"], "model.name"),
    (["data.name=digits", "model.name=mlp"], "model.name"),
    (["optim.lr=inf"], "optim.lr"),
    (["optim.lr=nan"], "optim.lr"),
    (["data.image_size=7"], "data.image_size"),
    (["data.name=folder", "data.root=/tmp", "data.channels=4"], "data.channels"),
    (["diffusion.schedule=flow"], "diffusion.prediction"),
    (["sample.guidance=nan"], "sample.guidance"),
    (["sample.solver=heun", "sample.eta=0.5"], "sample.eta"),
    (["model.args.in_channels=3"], "model.args.in_channels"),
])
def test_more_bad_values_are_one_line_naming_the_key(capsys, args, key):
    assert main(["train"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and err.startswith("fasttrain: error:"), err


@pytest.mark.parametrize("text", ["data: [1, 2\n", "- a\n- b\n", "data:\n  name: digits\n bad-indent: 1\n"])
def test_malformed_presets_are_one_line(tmp_path, capsys, text):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "p.yaml" in err, err


def _one_line(capsys, *names):
    """One error line (progress notes like "checking ROOT" may precede it), no traceback."""
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("fasttrain: error:")]
    assert len(errors) == 1 and "Traceback" not in err and err.splitlines()[-1] == errors[0], err
    for n in names:
        assert n in errors[0], err


def test_data_problems_are_one_line_naming_the_input(tmp_path, capsys):
    import json

    from folder_fixtures import write_images

    root = tmp_path / "imgs"
    paths = write_images(root, n_per_class=3)
    assert main(["data", "prepare", str(root)]) == 0
    paths[2].write_bytes(b"\xff\xd8 truncated after prepare")
    base = ["train", f"run_dir={tmp_path / 'run'}", "data.name=folder", f"data.root={root}", "data.image_size=8",
            "data.batch_size=6", "train.steps=2", "train.progress=false", "model.name=dit_tiny", "sample.num=0",
            "eval.num_samples=0", "eval.bpd=false"]
    capsys.readouterr()
    assert main(base + ["data.backend=torch"]) == 1
    _one_line(capsys, paths[2].name, "data prepare")
    from fasttrain.data import dali
    if dali.available():
        assert main(base + ["data.backend=dali", f"run_dir={tmp_path / 'run2'}"]) == 1
        _one_line(capsys, paths[2].name)
    assert main(base + [f"data.manifest={tmp_path / 'nope.json'}", f"run_dir={tmp_path / 'run3'}"]) == 1
    _one_line(capsys, "data.manifest")
    (root / "fasttrain-manifest.json").write_text(json.dumps({"files": "oops"}))
    assert main(base + [f"run_dir={tmp_path / 'run4'}"]) == 1
    _one_line(capsys, "data.manifest")
    (root / "fasttrain-manifest.json").unlink()
    (root / "empty").mkdir()
    assert main(base + [f"run_dir={tmp_path / 'run5'}"]) == 1
    _one_line(capsys, "'empty'")


def test_out_paths_onto_or_under_a_file(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for argv in (["sample", "--ckpt", str(tmp_path), "--out", str(f)],
                 ["sample", "--ckpt", str(tmp_path), "--out", str(f / "sub")],
                 ["eval", "--ckpt", str(tmp_path), "--out", str(f / "e.json")],
                 ["eval", "--ckpt", str(tmp_path), "--out", str(tmp_path)],
                 ["data", "prepare", str(tmp_path), "--out", str(f / "m.json")]):
        assert main(argv) == 1, argv
        _one_line(capsys, "--out")


@pytest.mark.parametrize("preset", list(__import__("fasttrain.config", fromlist=["presets"]).presets()))
def test_every_preset_loads_validates_and_builds(preset):
    """A preset that names a renamed key (sample.method → sample.solver) fails here, not on a user."""
    from fasttrain.bundle import DataSpec, build_network, build_objective
    from fasttrain.configure import load_config, validate
    from fasttrain.data import build_data

    cfg = load_config(preset)
    validate(cfg)
    d = cfg.data
    _, info = build_data(d)  # the preset's data section, whole
    spec = DataSpec(d.name, info.channels, info.image_size, info.num_classes if cfg.model.class_conditional else 0,
                    cfg.model.label_dropout, text=info.text)  # captioned data: the text encoders' shapes
    assert sum(p.numel() for p in build_network(cfg, spec).parameters()) > 0
    build_objective(cfg, stats=False)


def test_list_valued_model_arguments(capsys):
    """`model.args.NAME=[...]` reaches the factory as a list (OmegaConf gives a ListConfig)."""
    args = ["train", "model.args.ch_mult=[1,2]", "model.args.attn_resolutions=[4]", "--print-config"]
    assert main(args) == 0
    from fasttrain.bundle import DataSpec, build_network
    from fasttrain.configure import load_config

    net = build_network(load_config("default", args[1:3]), DataSpec("digits", 1, 8, 10, 0.1))
    assert len(net.net.repeated_blocks()) > 0


def test_probe_findings_are_one_line_and_leave_nothing_behind(tmp_path, capsys):
    """Bad level lists, unparsable override values, a text file as a checkpoint, --resume on a folder
    that does not exist, and sampling into a folder that already holds samples."""
    base = ["model.args.ch=8", "train.steps=2", "sample.num=0", "train.progress=false", "eval.num_samples=0",
            "eval.bpd=false"]
    for bad, words in ((["model.args.ch_mult=[a]"], "model.args.ch_mult must be a non-empty list of positive"),
                       (["model.args.ch_mult=[]"], "model.args.ch_mult must be a non-empty list"),
                       (["model.args.attn_resolutions=[[4]]"], "model.args.attn_resolutions must be a list"),
                       (["model.args.ch_mult=[1,2"], "its value is not valid YAML")):
        code = main(["train", f"run_dir={tmp_path / 'bad'}"] + base + bad)
        assert code in (1, 2)
        _one_line(capsys, words)
    missing = tmp_path / "never"
    assert main(["train", f"run_dir={missing}", "--resume"] + base) == 1
    _one_line(capsys, "no checkpoint")
    assert not missing.exists()
    text = tmp_path / "notes.txt"
    text.write_text("hi\n")
    assert main(["sample", "--ckpt", str(text), "--out", str(tmp_path / "s")]) == 1
    _one_line(capsys, "cannot read checkpoint")
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}"] + base) == 0
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(run), "--n", "3", "--steps", "2", "--out", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert main(["sample", "--ckpt", str(run), "--n", "2", "--steps", "2", "--out", str(tmp_path / "s")]) == 1
    _one_line(capsys, "already holds samples (00000.png, 3 files)")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before


def test_an_interrupt_before_the_first_checkpoint_does_not_promise_a_resume(tmp_path, capsys, monkeypatch):
    import fasttrain.train

    def interrupted(cfg, resume=False, restart=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(fasttrain.train, "train", interrupted)
    assert main(["train", f"run_dir={tmp_path}", "train.steps=3"]) == 130
    err = capsys.readouterr().err
    assert "stopped before the first checkpoint, nothing to resume" in err and "--restart" in err
    (tmp_path / "last.pt").write_bytes(b"x")  # latest() only looks for the file
    assert main(["train", f"run_dir={tmp_path}", "train.steps=3"]) == 130
    assert "the run continues with: fasttrain train" in capsys.readouterr().err
