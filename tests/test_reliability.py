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
                                  "train.steps=3", "data.skip_bad_latents=true"] + TINY[:-2])
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
    code = ("import sys, torch; from fasttrain.parallel.cpu import set_threads; torch.set_num_threads(2); "
            "set_threads(int(sys.argv[1]), cpu_run=sys.argv[2] == '1'); print(torch.get_num_threads())")
    got = [subprocess.run([sys.executable, "-c", code, n, cpu], capture_output=True, text=True, check=True
                          ).stdout.strip() for n, cpu in (("0", "1"), ("2", "1"), ("0", "0"))]
    assert got == ["1", "2", "2"]


# ------------------------------------------------------------------------------------------------------
# Fourth pass (issue 29): images, folder layouts, outputs among inputs, numeric ranges, key names,
# thread counts, latent layouts, benchmark scripts. One test per class.
# ------------------------------------------------------------------------------------------------------

def _png16_rgb(path, arr):
    """A 16-bit RGB PNG (Pillow cannot write one): IHDR bit depth 16, colour type 2, filter 0 rows."""
    import struct
    import zlib

    h, w, _ = arr.shape
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _image_modes(root):
    """One file per decoding rule, each a flat colour whose expected value is known."""
    from PIL import Image

    root.mkdir(parents=True)
    for i, level in enumerate((0.25, 0.5, 0.75)):  # 16-bit grey: 8-bit conversion clipped all three to white
        Image.fromarray(np.full((6, 6), round(level * 65535), np.uint16)).save(root / f"grey16-{i}.png")
    _png16_rgb(root / "rgb16.png", np.tile(np.array([0x4000, 0x8000, 0xC000], np.uint16), (6, 6, 1)))
    p = Image.new("P", (6, 6))
    p.putpalette([200, 40, 10, 0, 0, 0])
    p.save(root / "palette-transparent.png", transparency=1)
    Image.new("CMYK", (6, 6), (0, 255, 255, 0)).save(root / "cmyk.jpg", quality=100)
    Image.new("LA", (6, 6), (100, 30)).save(root / "grey-alpha.png")
    Image.new("RGBA", (6, 6), (10, 200, 30, 0)).save(root / "rgba.png")
    # stored 6 wide × 12 high with the top half white, EXIF 6 (rotate 90° clockwise): upright it is 12
    # wide × 6 high with the right half white
    arr = np.zeros((12, 6, 3), np.uint8)
    arr[:6] = 255
    im = Image.fromarray(arr)
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(root / "exif.png", exif=exif)
    return {"grey16-0.png": [-0.5] * 3, "grey16-1.png": [0.0] * 3, "grey16-2.png": [0.5] * 3,
            "rgb16.png": [64 / 127.5 - 1, 128 / 127.5 - 1, 192 / 127.5 - 1], "palette-transparent.png":
            [200 / 127.5 - 1, 40 / 127.5 - 1, 10 / 127.5 - 1], "cmyk.jpg": [1.0, -1.0, -1.0],
            "grey-alpha.png": [100 / 127.5 - 1] * 3, "rgba.png": [10 / 127.5 - 1, 200 / 127.5 - 1, 30 / 127.5 - 1]}


def test_images_are_read_at_their_true_bit_depth_mode_and_orientation(tmp_path):
    """16-bit grey keeps its levels, 16-bit RGB its scale, palette/CMYK/LA/RGBA map by fixed rules, EXIF
    orientation is applied; DALI's decoder gives the torch backend's values."""
    from fasttrain.config import DataConfig
    from fasttrain.data import build_data, dali
    from fasttrain.data.folder import ImageFolderDataset
    from fasttrain.data.images import open_image
    from fasttrain.data.manifest import build_manifest

    root = tmp_path / "modes"
    want = _image_modes(root)
    m = build_manifest(root, progress=False)
    assert not m["bad"] and m["modes"]["I;16"] == 3 and m["sizes"]["[12, 6]"] == 1  # EXIF: the upright size
    for name, value in want.items():
        x = ImageFolderDataset(str(root), 6, 3, files=[(name, 0)])[0][0]
        torch.testing.assert_close(x.mean((1, 2)), torch.tensor(value), atol=1.5 / 255, rtol=0, msg=name)
        grey = ImageFolderDataset(str(root), 6, 1, files=[(name, 0)])[0][0]
        assert grey.shape == (1, 6, 6) and grey.std() < 1e-6, name
    upright = np.asarray(open_image(root / "exif.png", 3))
    assert upright.shape == (6, 12, 3) and upright[:, :6].max() == 0 and upright[:, 6:].min() == 255
    if not dali.available():
        return
    files = [f for f, _ in build_data(DataConfig(name="folder", batch_size=1, root=str(root),
                                                 backend="torch"))[0].dataset.files]
    ds = ImageFolderDataset(str(root), 6, 3, files=[(f, 0) for f in files])
    s, _ = build_data(DataConfig(name="folder", batch_size=len(files), root=str(root), image_size=6, backend="dali",
                                 flip=False))
    order = [f for f, _ in s.epoch_files(0)]
    for f, x in zip(order, next(s)[0]):
        ref = ds[files.index(f)][0]
        assert (x - ref).abs().max() <= 3 / 127.5 + 1e-6, f  # as test_dali.py: JPEG IDCTs may round apart


def test_folder_layouts_follow_explicit_rules_and_say_what_they_decided(tmp_path, capsys):
    from PIL import Image

    def img(path, level=0):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), level, np.uint8)).save(path)

    flat = tmp_path / "flat"  # ten images beside a stray thumbs/ folder of two: which is the data?
    for i in range(10):
        img(flat / f"{i}.png", 20 * i)
    img(flat / "thumbs" / "a.png")
    img(flat / "thumbs" / "b.png")
    assert main(["data", "prepare", str(flat)]) == 1
    _one_line(capsys, "10", "top level", "thumbs/ 2")
    assert not (flat / "fasttrain-manifest.json").exists()
    # a folder without images beside them is left out, and said; hidden files are not data
    for f in (flat / "thumbs").iterdir():
        f.unlink()
    (flat / "thumbs" / "notes.txt").write_text("x")
    img(flat / ".cache" / "z.png")
    img(flat / ".partial.png")
    assert main(["data", "prepare", str(flat)]) == 0
    out = capsys.readouterr().out
    assert "unlabelled (no class subfolders), 10 files at its top level" in out and "left out (thumbs)" in out
    classes = tmp_path / "classes"
    for c, n in (("cat", 3), ("dog", 2)):
        for i in range(n):
            img(classes / c / "sub" / f"{i}.png", 9 * i)
    assert main(["data", "prepare", str(classes)]) == 0
    assert "2 classes from its subfolders (cat 3, dog 2), 5 files" in capsys.readouterr().out
    assert main(["train", f"run_dir={tmp_path / 'run'}", "data.name=folder", f"data.root={classes}",
                 "data.batch_size=2", "train.steps=1"] + TINY) == 0
    assert f"fasttrain: data: {classes}: 2 classes (cat 3, dog 2), 5 usable images" in capsys.readouterr().err
    # symbolic links: a loop, a folder repeated inside, a folder or a file outside are refused, a file inside is read
    outside = tmp_path / "elsewhere"
    img(outside / "x.png")
    for name, target, why in (("loop", ".", "loops back"), ("again", "cat", "read twice"),
                              ("ext", str(outside), "leaves the folder"), ("ext.png", str(outside / "x.png"),
                                                                          "leaves the folder")):
        link = (classes / name) if name != "ext.png" else (classes / "dog" / name)
        link.symlink_to(target)
        assert main(["data", "prepare", str(classes)]) == 1, name
        _one_line(capsys, "symbolic link", name, why)
        link.unlink()
    (classes / "dog" / "same.png").symlink_to(classes / "cat" / "sub" / "0.png")
    assert main(["data", "prepare", str(classes)]) == 0
    assert "(cat 3, dog 3), 6 files" in capsys.readouterr().out


def test_outputs_that_overlap_the_inputs_are_refused_before_anything_is_written(tmp_path, capsys):
    imgs = tmp_path / "imgs"
    write_images(imgs, n_per_class=3)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for out in (imgs, imgs / "lat", tmp_path):  # into, inside, around the image folder
        assert main(["data", "prepare", str(imgs), "--encoder", "numpy:tanh", "--latents-out", str(out)]) == 1
        _one_line(capsys, "--latents-out", str(imgs))
    assert main(["data", "prepare", str(imgs), "--out", str(imgs / "cat" / "000.jpg")]) == 1
    _one_line(capsys, "would be read as data")
    (tmp_path / "notes.json").write_text("[1]")
    assert main(["data", "prepare", str(imgs), "--out", str(tmp_path / "notes.json")]) == 1
    _one_line(capsys, "is not an earlier result")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before + [Path("notes.json")]
    # training: the run directory is, lies inside, or holds the data
    common = ["data.name=folder", "data.batch_size=2", "train.steps=1"] + TINY
    for run, data in ((imgs, imgs), (imgs / "run", imgs), (tmp_path, imgs)):
        assert main(["train", f"run_dir={run}", f"data.root={data}"] + common) == 2
        _one_line(capsys, "'run_dir'", "data.root")
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", f"data.root={imgs}"] + common) == 0
    capsys.readouterr()
    last = (run / "last.pt").read_bytes()
    for argv, needle in ((["sample", "--ckpt", str(run), "--n", "2", "--out", str(run)], "is the run directory"),
                         (["sample", "--ckpt", str(run), "--n", "2", "--out", str(imgs / "new")], "lies inside"),
                         (["eval", "--ckpt", str(run), "--out", str(run / "last.pt")], "--out"),
                         (["eval", "--ckpt", str(run), "--out", str(run / "config.yaml")], "not an earlier result"),
                         (["eval", "--ckpt", str(run), "--out", str(imgs / "e.json")], "lies inside"),
                         (["export", str(run), "--to", "diffusers", str(imgs / "pipe")], "lies inside")):
        assert main(argv) == 1, argv
        _one_line(capsys, needle)
    assert (run / "last.pt").read_bytes() == last and not (imgs / "new").exists() and not (imgs / "pipe").exists()
    assert main(["sample", "--ckpt", str(run), "--n", "2", "--steps", "2", "--out", str(run / "samples")]) == 0


def _numeric_keys():
    """(key, its range metadata, is an integer) for every int and float key of the schema (lists too)."""
    from fasttrain.config import _leaves, keys

    types = {k: t for k, t, _, _ in keys()}
    return [(k, m, "int" in types[k]) for k, m in _leaves() if ("int" in types[k] or "float" in types[k])]


def test_every_numeric_key_has_a_range_checked_at_configuration():
    """Each numeric key declares the values it accepts; one just outside them is refused naming the key.
    (A new numeric key without a range fails here.)"""
    from omegaconf import OmegaConf

    from fasttrain.config import check_schema, read_config
    from fasttrain.errors import ConfigError

    base, checked = read_config("default"), 0
    for key, meta, is_int in _numeric_keys():
        assert meta.get("finite") and any(meta.get(b) is not None for b in ("min", "max", "above", "below")), \
            f"{key} declares no range"
        bad = []
        if meta.get("min") is not None:
            bad.append(meta["min"] - 1 if is_int else meta["min"] - 0.5)
        if meta.get("max") is not None:
            bad.append(meta["max"] + 1 if is_int else meta["max"] * 2 + 1)
        if meta.get("above") is not None:
            bad.append(meta["above"])
        if meta.get("below") is not None:
            bad.append(meta["below"])
        bad += [] if is_int else [float("nan"), float("inf")]
        for v in bad:
            current = OmegaConf.select(base, key)  # a list key (optim.betas, phema.sigma_rels): its first item bad
            value = [v, *list(current)[1:]] if OmegaConf.is_list(current) else v
            cfg = base.copy()  # the schema's own check (read_config runs it on every override)
            OmegaConf.update(cfg, key, value)
            with pytest.raises(ConfigError, match=f"'{key}'"):
                check_schema(cfg)
            checked += 1
    assert checked > 80


@pytest.mark.parametrize("args,key", [
    (["diffusion.noise.offset=1e30"], "diffusion.noise.offset"), (["diffusion.noise.pyramid_discount=1e30"],
                                                                  "diffusion.noise.pyramid_discount"),
    (["train.threads=9999999999"], "train.threads"), (["train.seed=18446744073709551616"], "train.seed"),
    (["diffusion.schedule=cosine", "diffusion.T=20", "sample.steps=50", "sample.num=4"], "sample.steps"),
    (["diffusion.schedule=cosine", "diffusion.T=20", "sample.num=0", "eval.steps=50"], "eval.steps"),
    (["diffusion.schedule=cosine", "diffusion.T=20", "sample.num=0", "eval.num_samples=0", "eval.bpd_timesteps=20",
      "diagnostics.loss_cv_buckets=21"], "diagnostics.loss_cv_buckets"),
    (["data.holdout=1790"], "data.holdout"), (["optim.lr=0.1", "optim.weight_decay=10"], "optim.weight_decay"),
    (["sample.eta=2"], "sample.eta"), (["diffusion.loss.huber_c=1e30"], "diffusion.loss.huber_c")])
def test_absurd_values_and_combinations_are_refused_naming_the_key(capsys, args, key):
    assert main(["train"] + args) == 2
    _one_line(capsys, f"'{key}'")


def test_a_nonfinite_stop_names_the_option_outside_its_usual_range(tmp_path):
    cfg = load_config("default", [f"run_dir={tmp_path}", "train.steps=40", "train.max_nonfinite=3",
                                  "train.log_every=1", "optim.lr=1e30", "optim.grad_clip=0", "optim.warmup_steps=0",
                                  "diffusion.noise.offset=0.5"] + TINY)
    with pytest.raises(NonFiniteStop, match=r"outside the usual range: diffusion\.noise\.offset=0\.5 \(usually 0 to "
                                            r"0\.2\); optim\.lr=1e\+30 \(usually 1e-06 to 0\.05\)"):
        train(cfg)


@pytest.mark.parametrize("args,needles", [
    (["diffusion.loss=huber"], ["'diffusion.loss' is a section", "diffusion.loss.type=huber"]),
    (["data=folder"], ["'data' is a section", "data.name=folder"]),
    (["model.args=48"], ["'model.args' is a mapping", "model.args.NAME=48"]),
    (["data.batch_size=2000"], ["'data.batch_size'", "digits has 1797"]),
    (["data.name=synthetic", "data.batch_size=16000000"], ["'data.batch_size'", "needs at least"])])
def test_errors_name_the_key_the_user_got_wrong(tmp_path, capsys, args, needles):
    assert main(["train"] + args) == 2
    _one_line(capsys, *needles)
    p = tmp_path / "p.yaml"
    p.write_text("diffusion:\n  loss: huber\n")
    assert main(["train", str(p)]) == 2
    _one_line(capsys, "'diffusion.loss' is a section", "p.yaml")


def test_thread_counts_above_the_cores_are_capped_or_warned_once(monkeypatch, capsys):
    """train.threads above the cores this process may use is capped there (one warning, however many
    trainers); data.num_workers above them is kept with one warning (docs/reliability.md says why)."""
    from fasttrain.parallel import cpu

    monkeypatch.setattr(cpu, "_warned", set())
    before = torch.get_num_threads()
    try:
        n = cpu.cores() + 62
        for _ in range(2):
            cpu.set_threads(n, cpu_run=True)
            cpu.check_workers(n)
        assert torch.get_num_threads() == cpu.cores()
        warnings = capsys.readouterr().err.strip().splitlines()
        assert len(warnings) == 2 and f"train.threads={n} is more than the {cpu.cores()} cores" in warnings[0]
        assert f"using {cpu.cores()}" in warnings[0] and "data.num_workers" in warnings[1] and "kept" in warnings[1]
        monkeypatch.setattr(cpu, "_warned", set())
        cpu.set_threads(cpu.cores(), cpu_run=True)
        cpu.check_workers(cpu.cores())
        assert torch.get_num_threads() == cpu.cores() and not capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_latent_folders_of_mixed_shapes_and_dtypes_keep_the_majority_and_say_so(tmp_path, capsys):
    lat = tmp_path / "lat"
    lat.mkdir()
    for i in range(6):
        np.save(lat / f"{i}.npy", np.random.default_rng(i).standard_normal((4, 4, 4)).astype(np.float32))
    odd = {"c3.npy": np.zeros((3, 4, 4), np.float32), "s8.npy": np.zeros((4, 8, 8), np.float32),
           "h.npy": np.zeros((4, 4, 4), np.float16), "flat.npy": np.zeros((4, 4), np.float32),
           "4d.npy": np.zeros((1, 4, 4, 4), np.float32)}
    for name, a in odd.items():
        np.save(lat / name, a)
    assert main(["data", "prepare", str(lat)]) == 0
    out = capsys.readouterr().out
    assert "6 readable files" in out and all(f"skipped {n}" in out for n in odd), out
    tiny = TINY[:-2] + ["data.name=latents", f"data.root={lat}", "model.name=dit_tiny", "model.args.hidden=32",
                        "model.args.depth=1", "model.args.heads=2", "data.backend=torch", "train.steps=1",
                        "data.skip_bad_latents=true"]
    assert main(["train", f"run_dir={tmp_path / 'a'}", "data.batch_size=2"] + tiny) == 0
    err = capsys.readouterr().err
    assert ("6 usable arrays; left out: 2 unreadable and 3 of another shape or dtype ([3, 4, 4] float32 ×1, "
            "[4, 4, 4] float16 ×1, [4, 8, 8] float32 ×1)") in err, err
    assert "leaving out 3 file(s) whose shape or dtype differs from the folder's: c3.npy, h.npy, s8.npy" in err
    # a batch the usable files cannot fill says what was left out (it once blamed only the shard)
    assert main(["train", f"run_dir={tmp_path / 'b'}", "data.batch_size=8"] + tiny) == 1
    _one_line(capsys, "data.batch_size 8", "6 usable file(s)", "left out: 2 unreadable and 3 of another", notes=True)
    # no layout holds most files: which to keep would be a guess
    for i in range(3):
        np.save(lat / f"h{i}.npy", np.zeros((4, 4, 4), np.float16))
    (lat / "fasttrain-manifest.json").unlink()
    assert main(["data", "prepare", str(lat)]) == 1
    _one_line(capsys, "no shape and dtype holds most of its 12 readable arrays", "[4, 4, 4] float32 ×6",
              "[4, 4, 4] float16 ×4", notes=True)


BENCH = Path(__file__).parents[1] / "bench"


@pytest.mark.parametrize("argv,needle", [
    (["threads", "--workloads", "train,trian"], "unknown workload 'trian'"),
    (["threads", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
    (["throughput", "--model", "nosuch"], "invalid choice: 'nosuch'"),
    (["throughput", "--steps", "-3"], "--steps: must be >= 1"),
    (["immiscible", "--sizes", "16,x"], "must be an integer, got 'x'"),
    (["adaptive_overhead", "--cases", "unet8,unet9"], "unknown case 'unet9'"),
    (["adaptive_digits", "--out", "../elsewhere"], "plain file-name stem"),
    (["kernels_aot", "--out", str(BENCH / "results")], "give a stem in an existing folder"),
    (["peer_diffusers", "--rounds", "0"], "--rounds: must be >= 1"),
    (["profile_default", "--out", "../elsewhere"], "plain file-name stem"),
    (["presets", "--out", "x.md"], "plain file-name stem")])
def test_benchmark_arguments_that_would_measure_nothing_are_one_line(monkeypatch, capsys, argv, needle):
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [f"{argv[0]}.py", *argv[1:]])
    with pytest.raises(SystemExit) as stop:  # before anything is measured or written
        importlib.import_module(argv[0]).main()
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{argv[0]}.py: error:") and needle in err, err


def test_benchmark_results_are_replaced_only_by_a_complete_run(tmp_path):
    sys.path.insert(0, str(BENCH))
    from _env import Results

    (tmp_path / "x-cpu.json").write_text("committed")
    with pytest.raises(ValueError, match="the run failed"):  # a run that fails after writing its first files
        with Results(tmp_path) as res:
            res.text("x-cpu.json", "partial")
            res.path("x-cpu.png").write_bytes(b"png")
            raise ValueError("the run failed")
    assert (tmp_path / "x-cpu.json").read_text() == "committed" and sorted(p.name for p in tmp_path.iterdir()) == [
        "x-cpu.json"]
    with pytest.raises(RuntimeError, match="were not written"):  # a file promised but never written
        with Results(tmp_path) as res:
            res.text("x-cpu.json", "new")
            res.path("x-cpu.png")
    assert (tmp_path / "x-cpu.json").read_text() == "committed" and len(list(tmp_path.iterdir())) == 1
    with Results(tmp_path) as res:
        res.text("x-cpu.json", "new")
        res.text("x-cpu.md", "table")
    assert (tmp_path / "x-cpu.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "x-cpu.json", "x-cpu.md"]
    # every script that writes into bench/results goes through Results (convergence*.py: its own writer)
    for script in BENCH.glob("*.py"):
        text = script.read_text()
        if script.name.startswith("convergence") or script.name == "_env.py":
            continue
        writes = [w for w in (".write_text(", ".write_bytes(", "savefig(") if w in text]
        assert not writes, f"{script.name} writes results directly ({writes[0]})"


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
