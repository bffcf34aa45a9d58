"""The extension points are one file each: a new module dropped into fasttrain/diffusion/ or
fasttrain/models/ registers a weighting, a timestep sampler, a prediction type, a generation solver
and a model, one dropped into fasttrain/data/ a data kind, one into fasttrain/periodic/ a periodic
action, and the CLI trains, validates and samples with them by name, with no other edit.
The files go into extra folders of the packages' __path__ in a child process, so the installed
package and this process's registries are left as they were."""
import subprocess
import sys
import textwrap

import pytest

from fasttrain.registry import Registry, type_problem

EXTENSIONS = {
    "diffusion/ext_weighting.py": """
        from fasttrain.diffusion.weighting import register

        @register("ext_sqrt_snr")
        def sqrt_snr(s, prediction, scale: float = 1.0):
            return scale * s.snr.sqrt()
    """,
    "diffusion/ext_sampler.py": """
        import torch
        from fasttrain.diffusion.samplers import TimestepSampler, register

        @register("ext_low_half")
        class LowHalf(TimestepSampler):
            def _draw(self, n, generator):
                return torch.randint(0, self.T // 2, (n,), generator=generator, device=self.device)

            def probs(self, n=None):
                p = torch.zeros(self.T, dtype=torch.float64, device=self.device)
                p[: self.T // 2] = 1.0 / (self.T // 2)
                return p
    """,
    "diffusion/ext_prediction.py": """
        from fasttrain.diffusion.prediction import Prediction, register

        @register("ext_two_v")
        class TwoV(Prediction):
            @staticmethod
            def coefficients(a, s):
                return 2 * a, -2 * s
    """,
    "diffusion/ext_solver.py": """
        from fasttrain.diffusion.solvers import ddim, register

        @register("ext_ddim_half_eta")
        def half_eta(denoise, x, ts, schedule, *, generator=None, progress: bool = False):
            return ddim(denoise, x, ts, schedule, generator=generator, eta=0.5, progress=progress)
    """,
    "models/ext_model.py": """
        from torch import nn
        from fasttrain.models import register
        from fasttrain.models.layers import TimeLabelEmbedding

        class Block(nn.Module):
            def __init__(self, ch):
                super().__init__()
                self.conv = nn.Conv2d(ch, ch, 3, padding=1)

            def forward(self, h):
                return h + self.conv(nn.functional.silu(h))

        @register("ext_convnet")
        class ConvNet(nn.Module):
            def __init__(self, in_channels=1, image_size=8, num_classes=0, out_channels=None, ch: int = 8):
                super().__init__()
                self.embed = TimeLabelEmbedding(32, ch, num_classes)
                self.inp = nn.Conv2d(in_channels, ch, 3, padding=1)
                self.blocks = nn.ModuleList(Block(ch) for _ in range(2))
                self.out = nn.Conv2d(ch, out_channels or in_channels, 3, padding=1)

            def repeated_blocks(self):
                return list(self.blocks)

            def forward(self, x, t, y=None):
                h = self.inp(x) + self.embed(t, y)[:, :, None, None]
                for b in self.blocks:
                    h = b(h)
                return self.out(h)
    """,
}

CHILD = """
import sys
import fasttrain.diffusion as d, fasttrain.models as m
from fasttrain.registry import discover
d.__path__.append(sys.argv[1] + "/diffusion")
m.__path__.append(sys.argv[1] + "/models")
discover("fasttrain.diffusion"); discover("fasttrain.models")  # what the packages do when they are imported
from fasttrain.cli import main
run = sys.argv[1] + "/run"
train = ["train", "run_dir=" + run, "model.name=ext_convnet", "model.args.ch=12", "diffusion.weighting=ext_sqrt_snr",
         "diffusion.weighting_args.scale=0.5", "diffusion.sampler=ext_low_half", "diffusion.prediction=ext_two_v",
         "sample.solver=ext_ddim_half_eta", "train.steps=4", "sample.num=0", "train.progress=false",
         "eval.num_samples=0", "eval.bpd=false"]
assert main(train) == 0
bad = ["train", "run_dir=" + run + "2", "diffusion.weighting=ext_sqrt_snr", "diffusion.weighting_args.sigma=1"]
assert main(bad) == 2  # not its argument: a one-line error from its signature
assert main(["sample", "--ckpt", run, "--n", "4", "--steps", "3", "--out", sys.argv[1] + "/samples"]) == 0
print("CONFIG", open(run + "/config.yaml").read())
"""


def test_each_extension_point_is_one_new_file(tmp_path):
    for rel, src in EXTENSIONS.items():
        path = tmp_path / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(src))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unknown config key 'diffusion.weighting_args.sigma' (weighting 'ext_sqrt_snr' takes: scale)" in out.stderr
    config = out.stdout.split("CONFIG", 1)[1]
    for value in ("ext_convnet", "ext_sqrt_snr", "ext_low_half", "ext_two_v", "ext_ddim_half_eta"):
        assert value in config
    assert list((tmp_path / "samples").glob("*.png")), "sampling with the new solver wrote nothing"


DATA_AND_ACTION = {
    "data/ext_stripes.py": """
        import torch

        from fasttrain.data.kinds import DataInfo, DataKind, Reference, Traits, register
        from fasttrain.data.memory import MemoryStream

        @register("ext_stripes")
        class Stripes(DataKind):
            traits = Traits(images=True, pixels=True, resident=True)

            def resident_items(self, d):
                return 64

            def build(self, d, at, backend):
                y = torch.arange(64) % 2
                rows = (torch.arange(d.image_size) % 2 == 0)[None, None, :, None] ^ (y == 1)[:, None, None, None]
                x = torch.where(rows, 1.0, -1.0).expand(64, 1, d.image_size, d.image_size).contiguous()
                stream = MemoryStream(x, y, d.batch_size, at.seed, at.device, at.rank, at.world_size)
                return stream, DataInfo(1, d.image_size, 2, 64)

            def reference(self, cfg, spec, ref_path, n):
                return Reference(None, None, "none (stripes)")
    """,
    "periodic/ext_every_two.py": """
        import json

        from fasttrain.periodic import Periodic, register

        @register("ext_every_two")
        class EveryTwo(Periodic):
            order = 60
            reads = ("step", "run_dir")
            saves = ("ext-steps.json",)

            def due(self, step, last):
                return step % 2 == 0

            def __call__(self, run):
                path = run.run_dir / "ext-steps.json"
                path.write_text(json.dumps((json.loads(path.read_text()) if path.exists() else []) + [run.step]))
    """,
}

CHILD_DATA = """
import sys
import fasttrain.data as d, fasttrain.periodic as p
from fasttrain.registry import discover
d.__path__.append(sys.argv[1] + "/data")
p.__path__.append(sys.argv[1] + "/periodic")
discover("fasttrain.data"); discover("fasttrain.periodic")  # what the packages do when they are imported
from fasttrain.cli import main
run = sys.argv[1] + "/run"
assert main(["train", "run_dir=" + run, "data.name=ext_stripes", "model.args.ch=8", "train.steps=4", "sample.num=0",
             "train.progress=false", "eval.num_samples=0", "eval.bpd=false", "train.plots=false"]) == 0
assert main(["sample", "--ckpt", run, "--n", "4", "--steps", "3", "--out", sys.argv[1] + "/samples"]) == 0
"""


def test_a_data_kind_and_a_periodic_action_are_one_new_file_each(tmp_path):
    """A data kind dropped into fasttrain/data/ trains and samples by name (its traits decide the rest: an
    image model, class-conditional, images written as PNGs); an action dropped into fasttrain/periodic/
    acts at its own period, with no other edit."""
    for rel, src in DATA_AND_ACTION.items():
        path = tmp_path / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(src))
    out = subprocess.run([sys.executable, "-c", CHILD_DATA, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "ext-steps.json").read_text() == "[2, 4]"
    assert len(list((tmp_path / "samples").glob("0*.png"))) == 4


def test_registry_names_arguments_and_errors():
    reg = Registry("widget", positional=1)

    @reg.register("a")
    def a(schedule, k: int = 3, name: str = "x"):
        return k

    assert reg.names() == ("a",) and "a" in reg
    assert reg.args("a") == {"k": 3, "name": "x"}
    assert reg.build("a", None, k=5) == 5
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(a)
    with pytest.raises(ValueError, match="unknown widget 'b'; choose from a"):
        reg.get("b")
    with pytest.raises(ValueError, match="unknown argument 'w.j' \\(widget 'a' takes: k, name\\)"):
        reg.check_args("a", {"j": 1}, where="w")
    with pytest.raises(ValueError, match="bad value for 'k': 2.5 \\(an integer\\)"):
        reg.check_args("a", {"k": 2.5})
    assert type_problem(1.0, float("nan")) == "a finite number" and type_problem(True, 1) == "true or false"
