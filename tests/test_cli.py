import subprocess
import sys

import pytest

from fasttrain.cli import main


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
