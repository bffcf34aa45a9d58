"""Hostile-user findings, one test per class: each input a user can give ends in one line (or is
handled), never a traceback, a hang, a silent drop or a message about files that do not exist."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttrain.cli import main
from fasttrain.configure import load_config
from fasttrain.errors import NonFiniteStop
from fasttrain.logger import read_jsonl
from fasttrain.train import Trainer, train

sys.path.insert(0, str(Path(__file__).parent / "data"))
from diffusers_fixtures import TINY_UNET
from folder_fixtures import write_images, write_latents

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "diagnostics.interference_every=0"]


def _one_line(capsys, *needles, notes: bool = False):
    """The error is one line; with `notes`, informational lines may come before it (never a traceback)."""
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert lines and lines[-1].startswith("fasttrain: error:") and "Traceback" not in err, err
    assert notes or len(lines) == 1, err
    err = lines[-1]
    for n in needles:
        assert n in err, err
    return err


def test_resume_with_weights_that_do_not_fit_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=2"] + TINY) == 0
    capsys.readouterr()
    # the checkpoint's weights belong to another model than its config names (other sizes)
    st = torch.load(run / "last.pt", weights_only=True)
    name = next(k for k, v in st["model"].items() if v.ndim == 4)
    st["model"][name] = torch.zeros(3, 3, 3, 3)
    torch.save(st, run / "last.pt")
    assert main(["train", f"run_dir={run}", "train.steps=4", "--resume"] + TINY) == 1
    _one_line(capsys, "do not fit the configured model", str(run / "last.pt"))
    # a checkpoint whose config names another model than the weights it holds
    st = torch.load(run / "last.pt", weights_only=True)
    st["config"]["model"].update(name="dit_tiny", args={})
    torch.save(st, run / "last.pt")
    plain = [a for a in TINY if not a.startswith("model.args")]
    assert main(["train", f"run_dir={run}", "train.steps=4", "--resume", "model.name=dit_tiny"] + plain) == 1
    _one_line(capsys, "do not fit the configured model")


@pytest.mark.parametrize("args,needle", [(["data.image_size=100000"], "needs at least"),
                                         (["data.name=synthetic", "data.channels=4096", "data.image_size=4096"],
                                          "needs at least"),
                                         (["diffusion.T=2"], "betas outside (0, 1)")])
def test_sizes_and_schedules_are_checked_before_anything_is_allocated(capsys, args, needle):
    assert main(["train"] + args) == 2
    _one_line(capsys, needle)


def test_report_renders_what_it_can_and_says_what_it_skipped(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=2", "train.log_every=1"] + TINY) == 0
    with open(run / "metrics.jsonl", "a") as f:
        f.write("[1, 2, 3]\n\"a string\"\n{\"step\": \"x\", \"loss\": \"abc\", \"images\": null}\n{truncated\n")
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr()
    assert "skipped 3 unreadable line(s)" in out.err and "line 4: a JSON list, not an object" in out.err
    html = (run / "report.html").read_text()
    assert "Training loss" in html and "skipped 3 unreadable" in html
    skipped = []
    assert len(read_jsonl(run / "metrics.jsonl", skipped)) >= 3 and [n for n, _ in skipped] == [4, 5, 7]


@pytest.mark.parametrize("text,needle", [
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")), "expand to more than"),
    ("train:\n  steps: 3\ntrain:\n  steps: 5\n", "key 'train' is given twice (lines 1 and 3)"),
    ("model:\n  name: unet_tiny\n  args: {ch: 8, ch: 16}\n", "key 'ch' is given twice"),
])
def test_presets_that_expand_without_bound_or_repeat_a_key_are_refused(tmp_path, capsys, text, needle):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    assert main(["train", str(p)]) == 2
    _one_line(capsys, needle)


def test_the_first_log_line_after_a_resume_covers_the_whole_interval(tmp_path):
    common = TINY + ["train.log_every=4", "train.ckpt_every=0", "train.steps=8"]
    train(load_config("default", [f"run_dir={tmp_path / 'a'}"] + common))
    run = tmp_path / "b"
    tr = Trainer(load_config("default", [f"run_dir={run}"] + common))
    try:
        real, n = tr.objective.forward, {"i": 0}

        def fwd(*a, **k):  # stop after step 6 (mid-interval): SIGINT is deferred to the end of the step
            n["i"] += 1
            if n["i"] == 6:
                os.kill(os.getpid(), 2)
            return real(*a, **k)

        tr.objective.forward = fwd
        with pytest.raises(KeyboardInterrupt):
            tr.fit()
    finally:
        tr.close()
    train(load_config("default", [f"run_dir={run}"] + common), resume=True)
    a = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if r.get("loss") is not None]
    b = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("loss") is not None]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [4, 8]
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and a[1]["grad_norm"] == b[1]["grad_norm"]


def test_data_prepare_decides_the_kind_by_content_and_refuses_a_mix(tmp_path, capsys):
    write_images(tmp_path / "f", n_per_class=2)
    np.save(tmp_path / "f" / "cat" / "stray.npy", np.zeros((4, 6, 6), np.float32))
    assert main(["data", "prepare", str(tmp_path / "f")]) == 1
    _one_line(capsys, "holds both images (4", ".npy arrays (1", "stray.npy")
    assert main(["train", f"run_dir={tmp_path / 'run'}", "data.name=folder", f"data.root={tmp_path / 'f'}",
                 "data.backend=torch", "train.steps=1"] + TINY) == 1
    _one_line(capsys, "holds both images", notes=True)


def _odd_latents(root):
    write_latents(root, n_per_class=4)
    files = sorted(root.rglob("*.npy"))
    np.save(files[0], np.load(files[0]).astype(np.float16))             # another dtype
    np.save(files[1], np.load(files[1]).astype(">f4"))                  # another byte order
    a = np.load(files[2])
    a[1, 2, 3] = np.nan
    np.save(files[2], a)                                                # not finite
    np.save(files[3], np.zeros((4, 6, 7), np.float32))                  # not [C, S, S]
    np.save(files[4], np.zeros((4, 6, 6), np.int64))                    # not floating point
    return files


def test_latent_folders_are_checked_like_image_folders(tmp_path, capsys):
    files = _odd_latents(tmp_path / "lat")
    assert main(["data", "prepare", str(tmp_path / "lat")]) == 0
    out = capsys.readouterr().out
    reasons = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if line.startswith("skipped")}
    rel = [str(f.relative_to(tmp_path / "lat")) for f in files[:5]]
    assert set(rel) == set(reasons), out
    assert "float16" in reasons[rel[0]] and "big-endian" in reasons[rel[1]] and "NaN" in reasons[rel[2]]
    assert "[C, S, S]" in reasons[rel[3]] and "floating-point" in reasons[rel[4]]
    m = json.loads((tmp_path / "lat" / "fasttrain-manifest.json").read_text())
    assert m["num_files"] == 7 and len(m["bad"]) == 5


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_training_on_a_latent_folder_with_bad_files_skips_them(tmp_path, backend):
    pytest.importorskip("nvidia.dali") if backend == "dali" else None
    _odd_latents(tmp_path / "lat")  # no manifest: the folder is checked when training starts
    cfg = load_config("default", [f"run_dir={tmp_path / 'run'}", "data.name=latents", f"data.root={tmp_path / 'lat'}",
                                  f"data.backend={backend}", "data.batch_size=3", "model.name=dit_tiny",
                                  "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2",
                                  "train.steps=3"] + TINY[:-2])
    summary = train(cfg)
    assert summary["skipped_steps"] == 0 and summary["steps"] == 3


def test_dali_failures_name_the_file_and_the_reason(tmp_path):
    pytest.importorskip("nvidia.dali")
    from fasttrain.data.dali import DaliStream
    from fasttrain.errors import DataError

    files = _odd_latents(tmp_path / "lat")
    root = tmp_path / "lat"
    items = [(str(f.relative_to(root)), 0) for f in files[5:9]] + [(str(files[0].relative_to(root)), 0)]
    s = DaliStream("latents", str(root), items, batch_size=5, seed=0)  # a file list that bypassed the checks
    with pytest.raises(DataError, match=f"cannot read {files[0]}: shape .* dtype float16"):
        next(s)


def test_scattered_nonfinite_steps_stop_the_run_by_their_rate(tmp_path, capsys):
    cfg = load_config("default", [f"run_dir={tmp_path}", "train.steps=400", "train.log_every=10",
                                  "train.ckpt_every=0", "train.max_nonfinite=5"] + TINY)
    tr = Trainer(cfg)
    try:
        real, n = tr.objective.forward, {"i": 0}

        def every_other(*a, **k):  # never 5 in a row, but half of all steps
            n["i"] += 1
            loss, info = real(*a, **k)
            return (loss * float("nan") if n["i"] % 2 else loss), info

        tr.objective.forward = every_other
        with pytest.raises(NonFiniteStop, match=r"stopped at step 100: 50 of the last 100 steps were not finite.*"
                                                 r"no checkpoint had been written, crash.pt holds this state"):
            tr.fit()
    finally:
        tr.close()
    assert (tmp_path / "crash.pt").is_file() and not (tmp_path / "last.pt").exists()
    assert "previous last.pt" not in capsys.readouterr().err


def test_flags_and_config_keys_share_one_validation(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=1"] + TINY) == 0
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(run), "--eta", "-1", "--out", str(tmp_path / "s")]) == 1
    _one_line(capsys, "eta must be a finite number >= 0")
    assert main(["sample", "--ckpt", str(run), "--eta", "0.5", "--solver", "heun", "--out", str(tmp_path / "s")]) == 1
    _one_line(capsys, "takes no eta")
    assert main(["train", "sample.eta=-1"]) == 2
    _one_line(capsys, "sample.eta")


def test_openmp_threads_yield_on_a_busy_machine_unless_the_user_chose():
    code = "import os, fasttrain.cli, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert out.stdout.strip() == "ACTIVE"


def test_a_cpu_run_uses_one_thread_unless_told_otherwise():
    """train.threads=0 (the default) means one thread for a CPU run (bench/results/threads-cpu.md: a
    second thread bought the tiny default model nothing on a free machine and cost it when a core was
    busy); N > 0 forces N; a GPU run keeps torch's default."""
    code = ("import sys, torch; from fasttrain.cpu import set_threads; torch.set_num_threads(2); "
            "set_threads(int(sys.argv[1]), cpu_run=sys.argv[2] == '1'); print(torch.get_num_threads())")
    got = [subprocess.run([sys.executable, "-c", code, n, cpu], capture_output=True, text=True, check=True
                          ).stdout.strip() for n, cpu in (("0", "1"), ("2", "1"), ("0", "0"))]
    assert got == ["1", "2", "2"]


# -- diffusers folders and model arguments (issue 30's share of the fourth pass) ---------------------
DIFFUSERS = ["model.name=diffusers", "model.args.class_name=UNet2DModel"]
UNET_CONFIG = "model.args.config=" + json.dumps(TINY_UNET).replace('"', "")  # a YAML flow mapping


@pytest.mark.parametrize("over,needles", [
    (["model.args.config.block_out_channel=[16,32]"], ["model.args.config.block_out_channel",
                                                       "did you mean block_out_channels"]),
    (["model.args.class_name=UNet2DConditionModel"], ["model.args.class_name", "UNet2DConditionModel"]),
    (["model.args.config=hello"], ["model.args.config must be a mapping", "'hello'"]),
    ([UNET_CONFIG, "model.args.config.norm_num_groups=5"], ["model.args.config",
                                                             "num_channels (16) must be divisible by num_groups (5)"]),
])
def test_diffusers_model_arguments_are_checked_against_the_class_at_configuration(tmp_path, capsys, over, needles):
    """The class's own signature decides which config keys exist (a typo would build diffusers' default
    UNet2DModel, 4.1 GiB of checkpoint on 8×8 digits), and a config the class cannot build is refused
    before the run directory is touched."""
    pytest.importorskip("diffusers")
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=1"] + TINY[:-2] + DIFFUSERS + over) == 2
    _one_line(capsys, *needles)
    assert not run.exists()  # nothing written, no config.yaml keeping the typo


@pytest.mark.parametrize("over,needle", [
    (["model.args.ch=48", "model.args.convention=legacy"], "model.args.ch=48: a layer of 144 channels"),
    (["model.args.norm_groups=5"], "model.args.norm_groups=5 must divide model.args.ch=32"),
    (["model.args.heads=3"], "model.args.heads=3"),
    (["model.args.convention=dit"], "model.args.convention must be one of"),
    (["model.name=dit_tiny", "model.args.convention=x"], "model.args.convention must be one of"),
])
def test_fasttrain_model_sizes_that_do_not_divide_are_one_line_at_configuration(capsys, over, needle):
    """GroupNorm groups and attention heads that do not divide a layer's width (GroupNorm's ValueError at
    the first step, or a reshape deep in attention, before), checked by building the network on the meta
    device; with one group count for all layers (new runs) model.args.ch=48 simply trains (12 groups)."""
    assert main(["train"] + over) == 2
    _one_line(capsys, needle)
    assert load_config("default", ["model.args.ch=48"]).model.args.ch == 48


def _damage(folder, how):
    weights = folder / "diffusion_pytorch_model.safetensors"
    if how == "no weights":
        weights.unlink()
    elif how == "empty weights":
        weights.write_bytes(b"")
    elif how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "cut-off config":
        text = (folder / "config.json").read_text()
        (folder / "config.json").write_text(text[: len(text) // 2])
    elif how == "empty config":
        (folder / "config.json").write_text("")
    return {"no weights": "holds no weights file", "empty weights": "safetensors is empty",
            "truncated weights": "diffusion_pytorch_model.safetensors cannot be loaded",
            "cut-off config": "config.json is not valid JSON", "empty config": "config.json is empty"}[how]


DAMAGE = ["no weights", "empty weights", "truncated weights", "cut-off config", "empty config"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_vae_folder_is_one_line_naming_the_file(tmp_path, capsys, how):
    pytest.importorskip("diffusers")
    from diffusers_fixtures import save_tiny_vae

    write_images(tmp_path / "img", n_per_class=1, size=(16, 16))
    vae = save_tiny_vae(tmp_path / "vae")
    needle = _damage(vae, how)
    assert main(["data", "prepare", str(tmp_path / "img"), "--vae", str(vae), "--image-size", "16"]) == 1
    _one_line(capsys, needle, str(vae), notes=True)


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_pretrained_folder_is_one_line_naming_the_file(tmp_path, capsys, how):
    pytest.importorskip("diffusers")
    from diffusers_fixtures import save_tiny_unet

    pre = save_tiny_unet(tmp_path / "pre")
    needle = _damage(pre, how)
    code = main(["train", f"run_dir={tmp_path / 'run'}", "train.steps=1", f"model.args.pretrained={pre}"]
                + TINY[:-2] + DIFFUSERS)
    assert code in (1, 2)  # the config at configuration (2), the weights when the run starts (1)
    _one_line(capsys, needle, str(pre))


def test_export_of_a_pixel_run_refuses_a_vae_as_sample_does(tmp_path, capsys):
    pytest.importorskip("diffusers")
    from diffusers_fixtures import save_tiny_vae

    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", "train.steps=1"] + TINY) == 0
    vae = save_tiny_vae(tmp_path / "vae")
    capsys.readouterr()
    for argv in (["sample", "--ckpt", str(run), "--n", "2", "--out", str(tmp_path / "s"), "--vae", str(vae)],
                 ["export", str(run), "--to", "diffusers", str(tmp_path / "out"), "--vae", str(vae)]):
        assert main(argv) == 1
        _one_line(capsys, "--vae", "not trained on VAE latents")
    assert not (tmp_path / "out").exists()


def test_a_finetune_whose_pretrained_folder_is_gone_resumes_from_its_checkpoint(tmp_path, capsys):
    """last.pt holds the weights and the architecture (the pretrained config.json copied into the run's
    config): resuming needs neither the folder nor the user to repeat the architecture."""
    pytest.importorskip("diffusers")
    import shutil

    from diffusers_fixtures import save_tiny_unet

    pre = save_tiny_unet(tmp_path / "pre")
    common = TINY[:-2] + DIFFUSERS + [f"model.args.pretrained={pre}", "train.ckpt_every=0"]
    assert main(["train", f"run_dir={tmp_path / 'a'}", "train.steps=4"] + common) == 0
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=2"] + common) == 0
    shutil.rmtree(pre)
    capsys.readouterr()
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=4", "--resume"] + common) == 0, \
        capsys.readouterr().err
    a, b = (torch.load(tmp_path / r / "last.pt", weights_only=True) for r in "ab")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])  # as if never interrupted
    # a change of architecture on resume is still refused, naming the key
    assert main(["train", f"run_dir={tmp_path / 'b'}", "train.steps=6", "--resume",
                 "model.args.config.layers_per_block=2"] + common) == 1
    _one_line(capsys, "model.args.config.layers_per_block", "differs")
