"""The architecture's contracts (docs/architecture.md), each asserted: the kernel backend is decided at
set-up and an impossible one is one line before any file is written; no module outside data/ compares
data-set names; the step's order is written in the step function only; every periodic action is
registered and declared; the objective declares what its callers use."""
import ast
from pathlib import Path

import pytest
import torch

from fasttrain.cli import main
from fasttrain.config import DataConfig
from fasttrain.data import DATA_KINDS, Traits, build_data, data_kind
from fasttrain.diffusion.lookahead import LookAhead
from fasttrain.diffusion.objective import kernel_backend
from fasttrain.errors import ConfigError, InvalidInput
from fasttrain.kernels import native

PACKAGE = Path(__file__).resolve().parents[1] / "fasttrain"

TINY = ["train.progress=false", "sample.num=0", "eval.num_samples=0", "eval.bpd=false", "train.threads=1",
        "model.args.ch=8", "train.steps=2"]


# -- one boundary between fasttrain and the kernels ------------------------------------------------------
@pytest.mark.parametrize("backend, needle", [("triton", "needs CUDA tensors"), ("native", "not available")])
def test_an_impossible_backend_is_one_line_before_any_file_is_written(tmp_path, capsys, monkeypatch, backend,
                                                                      needle):
    if backend == "native":  # a machine where fasttrain._C was not built
        monkeypatch.setattr(native, "available", lambda device: False)
    elif torch.cuda.is_available():
        pytest.skip("triton runs on this machine's CUDA device")
    run = tmp_path / "run"
    assert main(["train", f"run_dir={run}", f"diffusion.backend={backend}"] + TINY) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fasttrain: error: bad value for 'diffusion.backend'"), err
    assert needle in err[0]
    assert not run.exists()  # the run folder was never claimed: no lock, no config, no crash.pt


def test_the_backend_is_decided_once_at_the_boundary():
    assert kernel_backend("torch", "cpu") == "torch"
    assert kernel_backend("auto", "cpu") == ("native" if native.available("cpu") else "torch")
    with pytest.raises(ConfigError, match=r"^bad value for 'diffusion.backend': 'interpret' \(.*CPU tensors"):
        kernel_backend("interpret", torch.device("cuda"), key="diffusion.backend")  # CUDA data
    with pytest.raises(InvalidInput, match="needs CUDA tensors") as e:
        kernel_backend("triton", "cpu")
    assert not isinstance(e.value, ConfigError)


# -- data sets with declared traits ---------------------------------------------------------------------
def _string_constants(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *(_string_constants(e) for e in node.elts))
    return set()


def test_no_module_outside_data_compares_data_set_names():
    """Outside fasttrain/data/ a data set is asked for its traits (data/kinds.py), never compared by
    name: no comparison with a data set's name (==, !=, in) and no table keyed by one."""
    names = set(DATA_KINDS.names())
    assert {"digits", "folder", "latents", "synthetic", "moons"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "data" or path.name == "remote_pipeline.py":
            continue  # export/remote_pipeline.py: the file shipped in exports (diffusers' callback tensor "latents")
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            operands += [k for k in node.keys if k is not None] if isinstance(node, ast.Dict) else []
            for side in operands:
                named = {n.id for n in ast.walk(side) if isinstance(n, ast.Name)} & {"TOYS", "DATASETS"}
                if _string_constants(side) & names or named:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []


def test_every_data_kind_declares_its_traits_and_builds_what_they_say():
    for name in DATA_KINDS.names():
        kind = data_kind(name)
        assert isinstance(kind.traits, Traits) and kind.name == name
        assert kind.traits.conditioning in ("class", "none", "text")
        assert not (kind.traits.latents and kind.traits.pixels)
        if kind.traits.resident and kind.trainable:  # built-in: build one batch and check the declaration
            stream, info = build_data(DataConfig(name=name, batch_size=4, image_size=8, channels=3))
            x0, y = next(stream)
            assert (x0.ndim == 4) == kind.traits.images and (info.image_size is not None) == kind.traits.images
            assert (info.num_classes > 0) == (kind.traits.conditioning == "class")
            text = kind.traits.conditioning == "text"  # batches carry caption groups of the cached encodings
            assert (info.text_table is not None) == text and (info.text is not None) == text
            assert not text or int(y.max()) < len(info.text_table.counts)


# -- the step as one function over named parts ----------------------------------------------------------
STEP_ORDER = {"backward", "zero_grad", "clip_grad_norm_", "skip_if_not_finite", "before_update", "after_update"}


def test_no_step_order_outside_the_step_function():
    """The step's order (backward, the finite skip, the optimizer step, the EMA, the look-ahead hooks) is
    written in fasttrain/step.py only: no other module calls these, except the diagnostics that take
    gradients of their own probes (interference.py: per-bucket gradients) and the modules that train
    networks of their own: the adaptive sampler's policy (adaptive.py), the digits classifier (features.py)."""
    own_gradients = {"diffusion/interference.py", "diffusion/adaptive.py", "generation/features.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel == "step.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr, owner = node.func.attr, ast.unparse(node.func.value)
            if attr in STEP_ORDER and rel not in own_gradients:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
            if attr == "step" and owner.split(".")[-1] in ("opt", "optimizer", "scaler") and rel not in own_gradients:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
            if attr == "update" and owner.split(".")[-1] == "ema":
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []


def test_the_step_function_runs_a_step_directly(tmp_path):
    """Called without a trainer, on named parts: labels dropped from their own stream (not the
    timesteps'), the optimizer and the EMA stepped once, the skipped-step counters kept."""
    from fasttrain import diffusion as fd
    from fasttrain.conditioning import ClassLabels
    from fasttrain.diffusion.denoiser import Denoiser, PredictionOutput
    from fasttrain.models import build_model
    from fasttrain.optim.ema import EMA
    from fasttrain.step import Generators, StepParts, train_step
    from fasttrain.train_state import TrainState

    sched = fd.schedule("linear", T=100)
    net = Denoiser(build_model("mlp", in_channels=2, num_classes=3, hidden=16, depth=1),
                   PredictionOutput("eps", sched), sched)
    obj = fd.DiffusionObjective(sched, "eps", backend="torch")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []

    class Spy(LookAhead):
        every, acts_before = 1, True

        def before_update(self, ctx):
            seen.append(("before", ctx.labels.clone(), [p.detach().clone() for p in net.parameters()]))

        def after_update(self, ctx):
            seen.append(("after", ctx.step))

    def run(label_seed):
        gens = Generators(torch.Generator().manual_seed(1), torch.Generator().manual_seed(label_seed))
        parts = StepParts(net, obj, opt, gens, ema=EMA(net), conditioning=ClassLabels(3, 0.5, gens.labels),
                          counters=TrainState(torch.device("cpu")), hooks=[Spy()])
        x0, y = torch.randn(8, 2), torch.arange(8) % 3
        return parts, train_step(parts, [(x0, y)], step=4, lr=0.1), gens

    before = [p.detach().clone() for p in net.parameters()]
    parts, (loss, gnorm), gens = run(label_seed=2)
    assert torch.isfinite(loss) and torch.isfinite(gnorm) and parts.ema.n == 1 and int(parts.counters.skipped) == 0
    kind, labels, at_hook = seen[0]
    assert kind == "before" and seen[1] == ("after", 4) and (labels == 3).any() and (labels < 3).any()
    assert all(torch.equal(a, b) for a, b in zip(before, at_hook))  # the hook ran before the update
    assert not any(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # one update, all weights
    _, _, other = run(label_seed=3)  # another label-dropout stream: the timestep stream is drawn alike
    assert torch.equal(gens.timesteps.get_state(), other.timesteps.get_state())
    assert not torch.equal(gens.labels.get_state(), torch.Generator().manual_seed(2).get_state())


# -- periodic actions as declared components ------------------------------------------------------------
def test_every_periodic_action_is_registered_and_declared(tmp_path):
    """The five actions the run loop had hard-wired are registered components with a unique order and
    declared reads and outputs; the trainer runs exactly the registered ones, decides none of their
    periods, and every part an action declares it reads is a named part of the run (periodic.RunParts),
    filled in on a trainer that has run; an action sees only those parts, never the trainer."""
    from fasttrain.configure import load_config
    from fasttrain.periodic import PARTS, PERIODIC, Periodic, RunParts, view
    from fasttrain.train import Trainer

    assert {"stats_sync", "log", "nonfinite", "checkpoint", "evaluation"} <= set(PERIODIC.names())
    source = (PACKAGE / "train.py").read_text()
    for key in ("log_every", "ckpt_every", "stats_every", "max_nonfinite", "eval.every"):
        assert key not in source, key
    tr = Trainer(load_config("default", [f"run_dir={tmp_path}", "train.log_every=1", "train.ckpt_every=1"] + TINY))
    try:
        tr.fit()
        assert sorted(type(a).name for a in tr.actions) == sorted(PERIODIC.names())
        assert [a.order for a in tr.actions] == sorted({a.order for a in tr.actions})  # unique, in order
        for a in tr.actions:
            assert isinstance(a, Periodic) and isinstance(a.reads, tuple) and isinstance(a.saves, tuple)
            for name in a.reads:
                assert name in PARTS
                # the parts a run has only when their option is on (diagnostics, phema.every, diffusion.align)
                optional = ("interference", "phema", "alignment")
                assert getattr(tr.views[a], name) is not None or name in optional, (a.name, name)
        log = next(a for a in tr.actions if a.name == "log")
        with pytest.raises(AttributeError, match="reads 'model' but does not declare it"):
            tr.views[log].model  # noqa: B018
        with pytest.raises(AttributeError, match="reads 'optimizer' but does not declare it"):
            tr.views[log].optimizer  # noqa: B018  (a trainer attribute, no part of a run)
        assert isinstance(view(tr.run_parts, log), type(tr.views[log])) and tr.run_parts.step == tr.step
        assert not hasattr(RunParts, "opt") and "cfg" not in PARTS
    finally:
        tr.close()
    assert (tmp_path / "last.pt").is_file() and (tmp_path / "metrics.jsonl").is_file()


def test_an_action_reading_what_no_run_has_is_refused_before_the_run(monkeypatch):
    """A periodic action declaring a trainer attribute that is no part of a run (here the optimizer) is one
    error naming it when the actions are built, not an AttributeError in the middle of a run."""
    from fasttrain import periodic
    from fasttrain.registry import Registry

    reg = Registry("periodic action")
    monkeypatch.setattr(periodic, "PERIODIC", reg)

    @reg.register("peeks")
    class Peeks(periodic.Periodic):
        reads = ("state", "opt")

    with pytest.raises(TypeError, match="'peeks' reads 'opt', which is no part of a run"):
        periodic.build(None)


# -- the objective declares what its callers use --------------------------------------------------------
def test_every_attribute_callers_use_of_the_objective_is_declared_on_the_base_class():
    """What the trainer, the step, the periodic actions, the look-aheads, the diagnostics, the plots and
    the bundle read of an objective exists on `Objective` itself (a method, a property or an attribute
    its constructor sets), so a new prediction kind sees its whole contract in one class."""
    from fasttrain import diffusion as fd
    from fasttrain.diffusion.objective import Objective

    sched = fd.schedule("linear", T=100)
    base = Objective(sched, torch.ones(100), "uniform", sampler_args=None, stats=True, stat_kinds=("raw", "weighted"),
                     learned_weighting=False, backend="torch", seed=0)
    owners = {"objective", "self.objective", "parts.objective", "run.objective", "ctx.objective", "tr.objective"}
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in owners:
                used.add(node.attr)
    assert {"sync_stats", "probe_loss", "effective_weight", "kernels", "metrics"} <= used
    undeclared = sorted(a for a in used if not hasattr(Objective, a) and not hasattr(base, a))
    assert undeclared == []
    for name in ("from_config", "forward", "probe_loss", "effective_weight", "output_head"):
        assert getattr(Objective, name).__doc__, name
