"""Training through the CLI from an image folder and from .npy latents, on DALI and torch."""
import json
import sys
from pathlib import Path

import pytest
from folder_fixtures import write_images, write_latents

from fasttrain.cli import main
from fasttrain.data import dali

BASE = ["train.steps=3", "train.progress=false", "sample.num=4", "sample.steps=3", "eval.num_samples=0",
        "eval.bpd_samples=4", "eval.bpd_timesteps=2", "data.batch_size=4", "model.name=dit_tiny",
        "model.args.hidden=32", "model.args.depth=1", "model.args.heads=2"]


@pytest.mark.parametrize("backend", [pytest.param("dali", marks=pytest.mark.skipif(not dali.available(),
                                                                                   reason="dev extra")),
                                     "torch"])
@pytest.mark.parametrize("kind", ["folder", "latents"])
def test_train_from_folder(tmp_path, capsys, backend, kind):
    root = tmp_path / "data"
    (write_images if kind == "folder" else write_latents)(root)
    if kind == "folder":
        assert main(["data", "prepare", str(root)]) == 0
        assert "12 readable files, 2 classes" in capsys.readouterr().out
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", f"data.name={kind}", f"data.root={root}", f"data.backend={backend}",
                 "data.image_size=8"] + BASE) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and "bpd" in summary["eval"]
    assert (run / "samples.png").is_file()
    if kind == "latents":
        assert (run / "samples.pt").is_file()


def test_prepare_encodes_latents_with_a_user_hook(tmp_path, capsys, monkeypatch):
    root = tmp_path / "imgs"
    write_images(root, n_per_class=3)
    hook = tmp_path / "myenc.py"
    hook.write_text("import torch.nn.functional as F\n\ndef encode(x):\n    return F.avg_pool2d(x, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "lat"
    assert main(["data", "prepare", str(root), "--encoder", "myenc:encode", "--latents-out", str(out),
                 "--image-size", "8"]) == 0
    m = json.loads((out / "fasttrain-manifest.json").read_text())
    assert m["kind"] == "latents" and m["num_files"] == 6 and m["sizes"] == {"[3, 4, 4]": 6}
    assert main(["data", "prepare", str(root), "--encoder", "nomodule:encode", "--latents-out", str(out)]) == 1
    assert "nomodule" in capsys.readouterr().err
    del sys.modules["myenc"]
    assert Path(out / "cat" / "000.npy").is_file()
