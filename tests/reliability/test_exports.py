"""Class 4: exports (export/common.py: written_whole, which every exporter writes through). Into a non-empty
folder, onto a file, into a read-only folder: one line, nothing written; a disk that fills half-way through
each exporter (plain diffusers, SD/SDXL text pipelines, SD3, LoRA weights): one line naming the folder,
and neither the folder nor its hidden partial sibling remains; the wrong kind for the run: one line."""
import errno
import os
from pathlib import Path

import pytest
from common import TINY, files, one_line
from text_fixtures import save_sd1, save_sd3, write_captioned

from fasttrain.cli import main

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

TEXT = ["data.name=captioned_latents", "data.batch_size=4", "train.threads=1", "train.progress=false",
        "model.name=diffusers", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.steps=1",
        "train.ckpt_every=0", "optim.warmup_steps=1"]


def _prepare(root, pipe):
    images, lat = write_captioned(root / "img", n=2), root / "lat"
    assert main(["data", "prepare", str(images), "--vae", str(pipe), "--vae-subfolder", "vae", "--text-encoders",
                 str(pipe), "--latents-out", str(lat), "--image-size", "16", "--batch-size", "4"]) == 0
    return lat


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A pixel digits run, an SD 1.x LoRA run (its merged pipeline and its adapter) and an SD3 run."""
    root = tmp_path_factory.mktemp("exports")
    out = {"pixel": root / "pixel", "lora": root / "lora", "sd3": root / "sd3"}
    assert main(["train", f"run_dir={out['pixel']}", "train.steps=1"] + TINY) == 0
    sd1 = save_sd1(root / "sd1")
    lat = _prepare(root / "a", sd1)
    assert main(["train", f"run_dir={out['lora']}", f"data.root={lat}", f"model.args.pretrained={sd1}",
                 "model.args.class_name=UNet2DConditionModel", "model.args.subfolder=unet", "model.lora.rank=2"]
                + TEXT) == 0
    sd3 = save_sd3(root / "sd3pipe")
    lat3 = _prepare(root / "b", sd3)
    assert main(["train", f"run_dir={out['sd3']}", f"data.root={lat3}", f"model.args.pretrained={sd3}",
                 "model.args.class_name=SD3Transformer2DModel", "model.args.subfolder=transformer",
                 "diffusion.weighting=simple", "sample.solver=flow_euler"] + TEXT) == 0
    return out


def _disk_fills(monkeypatch, last: str, seen: list):
    """The disk fills when `last` is written (after the files before it): half of it lands, then ENOSPC."""
    import safetensors.torch

    def full(path: Path):
        seen.extend(files(path.parent))  # what the exporter had written by then
        path.write_bytes(b"\0" * 7)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    write_text, save_file = Path.write_text, safetensors.torch.save_file
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: full(self) if self.name == last
                        else write_text(self, *a, **k))
    monkeypatch.setattr(safetensors.torch, "save_file", lambda t, f, *a, **k: full(Path(f)) if Path(f).name == last
                        else save_file(t, f, *a, **k))


@pytest.mark.parametrize("run,to,last,before", [
    ("pixel", "diffusers", "README.md", "unet/diffusion_pytorch_model.safetensors"),      # export/dispatch.py
    ("lora", "diffusers", "README.md", "text_encoder/model.safetensors"),                # stable_diffusion.export_text
    ("sd3", "diffusers", "README.md", "transformer/diffusion_pytorch_model.safetensors"),  # sd3.export_sd3
    ("lora", "lora", "pytorch_lora_weights.safetensors", None),                          # stable_diffusion.export_lora
])
def test_a_disk_that_fills_half_way_leaves_no_export(runs, tmp_path, monkeypatch, capsys, run, to, last, before):
    seen: list = []
    _disk_fills(monkeypatch, last, seen)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(runs[run]), "--to", to, str(out)]) == 1
    one_line(capsys, f"export to {out} failed", "No space left on device", "nothing was written", notes=True)
    assert before is None or before in seen, seen  # it failed part-way, after these were written
    assert files(tmp_path) == []  # neither the folder nor its hidden partial sibling


def test_exports_onto_a_file_a_full_or_a_read_only_folder_or_of_the_wrong_kind(runs, tmp_path, capsys):
    pixel = str(runs["pixel"])
    (tmp_path / "file").write_text("mine")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)  # root writes through the permission; the mode says read-only all the same
    cases = [(tmp_path / "file", "diffusers", "is a file, not a folder"),
             (full, "diffusers", "already exists and is not empty"),
             (ro, "diffusers", "is read-only (nothing was written)"),
             (ro / "inside", "diffusers", "is read-only (nothing was written)"),
             (tmp_path / "x", "lora", "was not trained with LoRA")]
    for out, to, needle in cases:
        assert main(["export", pixel, "--to", to, str(out)]) == 1
        one_line(capsys, needle, notes=True)
    assert (tmp_path / "file").read_text() == "mine" and files(full) == ["keep.txt"] and files(ro) == []
    assert not (tmp_path / "x").exists()
    ro.chmod(0o755)
