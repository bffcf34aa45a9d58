"""Each config section goes to its component whole (docs/architecture.md, "Config sections"): no hand-copied
keyword lists of the data fields (a data kind's `build` reads the `data` section itself), the options of
one reader spelled only in config.py and that reader, the run's schedule built by one function, and the
mixed prediction kind named only where it registers itself. Read from the source with `ast`."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from fasttrain.config import DataConfig, DiffusionConfig

PACKAGE = Path(__file__).resolve().parents[1] / "fasttrain"
DATA_FIELDS = {f.name for f in dataclasses.fields(DataConfig)}
# data fields one signature or call may name: a reader's own settings (data/dali.py's DaliStream takes six: its
# folder, batch, size, channels, crop and flip, as tests build it without a config)
MOST = 6


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def test_no_function_or_call_copies_the_data_fields_by_hand():
    """build_data once took 21 data fields as keywords and DataArgs 20 positionally: a new option touched
    four files. A function or call naming more than MOST of them is such a copy."""
    copies = []
    for rel, tree in _trees():
        if rel == "config.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                named = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} & DATA_FIELDS
            elif isinstance(node, ast.Call):
                named = {k.arg for k in node.keywords if k.arg} & DATA_FIELDS
            elif isinstance(node, ast.ClassDef):  # a dataclass of data fields beside DataConfig
                named = {t.target.id for t in node.body if isinstance(t, ast.AnnAssign)
                         and isinstance(t.target, ast.Name)} & DATA_FIELDS
            else:
                continue
            if len(named) > MOST:
                copies.append(f"{rel}:{node.lineno} names {len(named)} data fields ({', '.join(sorted(named))})")
    assert not copies, copies


def _attribute_reads(name: str) -> set[str]:
    out = set()
    for rel, tree in _trees():
        for node in ast.walk(tree):
            # (the command line's own flags of the same names, `args.min_bucket_reso`, are no data section)
            if isinstance(node, ast.Attribute) and node.attr == name and getattr(node.value, "id", "") != "args":
                out.add(rel)
    return out


def test_a_reader_s_options_are_spelled_in_config_and_that_reader_only():
    assert _attribute_reads("shuffle_buffer") == {"data/shards.py"}  # webdataset's shuffle buffer
    bucket = {"data/buckets.py"}  # the bucket settings: buckets.settings_of(cfg.data)
    for key in ("min_bucket_reso", "max_bucket_reso", "bucket_reso_steps"):
        assert _attribute_reads(key) == bucket, key


def test_the_run_s_schedule_is_built_by_one_function():
    """schedule.from_config(cfg.diffusion) builds the run's schedule; nothing else hands the section's
    schedule fields to the schedule builder (the network, the objective, the bundle and the config check
    each once did)."""
    assert {"schedule", "T", "zero_terminal_snr", "flow_shift"} <= {f.name for f in dataclasses.fields(DiffusionConfig)}
    builders = []
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            reads = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)}
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if "zero_terminal_snr" in reads and name in ("schedule", "make_schedule", "NoiseSchedule"):
                builders.append(f"{rel}:{node.lineno}")
    assert len(builders) == 1 and builders[0].startswith("diffusion/schedule.py:"), builders


def test_mixed_prediction_is_named_only_where_it_registers():
    """`diffusion.prediction=mixed` is found through the OBJECTIVES registry (diffusion/mixed.py registers
    it); no other module compares a prediction with "mixed" or reads the `diffusion.mixed` section (the
    kind's own `check_config` checks its keys, the T bound of argmin_buckets included)."""
    found = []
    for rel, tree in _trees():
        if rel in ("diffusion/mixed.py", "config.py"):  # the kind itself; the section's schema
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "mixed" and rel != "data/dali.py":  # DALI's device
                found.append(f"{rel}:{node.lineno}: the string 'mixed'")
            if isinstance(node, ast.Attribute) and node.attr == "mixed":
                found.append(f"{rel}:{node.lineno}: .mixed")
    assert not found, found
    source = (PACKAGE / "diffusion" / "mixed.py").read_text()
    assert '@register_objective("mixed")' in source
