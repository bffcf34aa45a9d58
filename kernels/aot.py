"""Ahead-of-time compile of every Triton kernel specialisation fasttrain's launchers can produce, for
sm_80 (A100) and sm_90 (H100/H200), on a machine without a GPU, with the checks a first GPU user
would otherwise be the first to run: it compiles (the interpreter accepts code the compiler rejects),
it does not spill, and its row streams (`Spec.streams` below) load and store in the widest
vectors their alignment allows (128-bit for aligned rows).

    python -m fasttrain.kernels.aot [--set ci|full] [--arch 80 90] [--jobs N] [--json PATH]

Where the list comes from: each Triton module (triton_noise, triton_diffusion_loss,
triton_mixed_loss, triton_noise_spec) has `specializations(aot)`, the launches its launcher can make (dtypes,
options, shapes that reach each tile and alignment class), written in the vocabulary of aot_specs.py
(`Spec`, the dtype pairs, row sizes, noise options), which this tool passes in: the kernels never import
this tool. Each launch runs the launcher
itself on CPU tensors with the kernel call intercepted, and Triton's own binder turns the call into
(signature, constexprs, divisibility attributes), exactly as a GPU launch would; duplicates collapse.
So the tile, the constexprs and the argument list come from the launcher, and a new option only needs
a line in its module's `specializations()`. `--set ci`: a subset in which every argument type and
alignment and every constexpr value of every kernel appears at least once, tile sizes by their
smallest, median and largest value (ci_subset; the CI test, tests/kernels/test_aot.py); `--set full`:
all of them (bench/kernels_aot.py writes their table).

Must run without TRITON_INTERPRET (with it, @triton.jit makes interpreter functions that cannot be
compiled): the test runs this in a subprocess with the variable removed. No CUDA driver is needed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import NamedTuple

# aot_specs: the vocabulary each Triton module's specializations(aot) enumerates its launches with, passed
# in by `capture` (the production kernels import nothing of this tool); its names stay reachable here
from . import aot_inspect, aot_specs
from .aot_specs import DTYPE_PAIRS, IMAGE, NOISE_OPTIONS, SAME_DTYPES, SEEDS, Spec, row_sizes  # noqa: F401

MODULES = ("fasttrain.kernels.triton_noise", "fasttrain.kernels.triton_diffusion_loss",
           "fasttrain.kernels.triton_mixed_loss", "fasttrain.kernels.triton_noise_spec")
ARCHS = (80, 90)


class Job(NamedTuple):
    """One specialisation of one kernel, as Triton's binder specialises a launch."""
    module: str
    kernel: str
    axes: dict        # the launch (Spec.axes)
    vec: int          # Spec.vec: contiguous aligned elements per row
    streams: tuple    # Spec.streams: the pointers holding rows
    signature: dict   # argument name → Triton type ('*bf16', 'i32', 'constexpr')
    constexprs: dict  # (index,) → value
    attrs: dict       # (index,) → [['tt.divisibility', 16]] or []
    options: dict     # launch options (num_warps, ...) the launcher passed

    def label(self) -> str:
        names = list(self.signature)
        cx = " ".join(f"{names[i]}={v}" for (i,), v in self.constexprs.items())
        return f"{self.kernel}[{' '.join(f'{k}={v}' for k, v in self.axes.items())} | {cx}]"

    def key(self) -> str:
        cx = sorted((i, v) for (i,), v in self.constexprs.items())
        at = sorted((i, v) for (i,), v in self.attrs.items())
        return json.dumps([self.module, self.kernel, self.signature, cx, at, sorted(self.options.items())])


class _Recorder:
    """Stands in for a JITFunction while a launcher runs: records kernel[grid](*args, **kwargs)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))


def capture(module_name: str) -> list[Job]:
    """The Jobs of one module: run each Spec's launch with the module's kernels intercepted, and bind
    each recorded call with the kernel's own binder (Triton's runtime specialisation: pointer dtype
    and 16-byte alignment, int32/int64, % 16, ints equal to 1 become constexprs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    mod = importlib.import_module(module_name)
    kernels = {n: v for n, v in vars(mod).items() if isinstance(v, JITFunction) and v.fn.__module__ == mod.__name__}
    backend = make_backend(GPUTarget("cuda", ARCHS[0], 32))
    jobs, seen = [], set()
    for spec in mod.specializations(aot_specs):
        calls: list = []
        try:
            for name in kernels:
                setattr(mod, name, _Recorder(name, calls))
            spec.launch()
        finally:
            for name, k in kernels.items():
                setattr(mod, name, k)
        if not calls:
            raise RuntimeError(f"{module_name}: a specialisation launched no kernel: {spec.axes}")
        for name, args, kwargs in calls:
            k = kernels[name]
            binder = create_function_from_signature(k.signature, k.params, backend)
            bound, sp, opts = binder(*args, **kwargs)
            _, signature, constexprs, attrs = k._pack_args(backend, kwargs, bound, sp, opts)
            options = {o: v for o, v in kwargs.items() if o not in k.arg_names}
            job = Job(module_name, name, spec.axes, spec.vec, spec.streams, signature, constexprs, attrs, options)
            if job.key() not in seen:
                seen.add(job.key())
                jobs.append(job)
    return jobs


def features(job: Job) -> set:
    """What a job exercises: each argument's type and alignment, each constexpr's value."""
    names = list(job.signature)
    args = [(i, n, ty) for i, (n, ty) in enumerate(job.signature.items()) if ty != "constexpr"]
    out = {(job.kernel, n, ty) for i, n, ty in args}
    out |= {(job.kernel, n, "16-byte aligned" if job.attrs.get((i,)) else "unaligned") for i, n, ty in args}
    out |= {(job.kernel, names[i], repr(v)) for (i,), v in job.constexprs.items()}
    return out


def ci_features(jobs: list[Job]) -> set:
    """What the CI subset covers: every feature, except that an int constexpr with more than 5 values
    (a tile size ranging over powers of two) is covered by its smallest, median and largest value; the
    full set compiles each."""
    values: dict = {}
    for j in jobs:
        names = list(j.signature)
        for (i,), v in j.constexprs.items():
            values.setdefault((j.kernel, names[i]), set()).add(v)
    skip = set()
    for (k, n), vs in values.items():
        if len(vs) > 5 and all(type(v) is int for v in vs):
            vs = sorted(vs)
            skip |= {(k, n, repr(v)) for v in vs if v not in (vs[0], vs[len(vs) // 2], vs[-1])}
    return set().union(*map(features, jobs)) - skip


def ci_subset(jobs: list[Job]) -> list[Job]:
    """A small subset of the jobs covering ci_features: first, per kernel, row stream and its dtype fp32
    or bf16, the first job in list order whose rows of that dtype can move 128 bits (aligned, vec × bits >= 128:
    each module lists its typical full-tile launches first), so the 128-bit check surely runs on both;
    then, greedily, the job with most features still uncovered (ties in list order)."""
    chosen, typical = [], set()
    for i, j in enumerate(jobs):
        for k, (n, ty) in enumerate(j.signature.items()):
            wide = (n in j.streams and ty in ("*fp32", "*bf16") and j.attrs.get((k,))
                    and j.vec * aot_inspect.BITS[ty[1:]] >= 128)
            if wide and (j.kernel, n, ty) not in typical:
                typical.add((j.kernel, n, ty))
                if i not in chosen:
                    chosen.append(i)
    todo = ci_features(jobs) - set().union(set(), *(features(jobs[i]) for i in chosen))
    while todo:
        best = max(range(len(jobs)), key=lambda i: (len(features(jobs[i]) & todo), -i))
        chosen.append(best)
        todo -= features(jobs[best])
    return [jobs[i] for i in sorted(chosen)]


def unexercised_flags(jobs: list[Job]) -> list[str]:
    """Boolean constexprs that keep one value over a kernel's whole list: an option added to a
    launcher but not to its module's specializations()."""
    values: dict = {}
    for j in jobs:
        names = list(j.signature)
        for (i,), v in j.constexprs.items():
            values.setdefault((j.module, j.kernel, names[i]), set()).add(v)
    return [f"{k}.{c}: only {sorted(vs)} in {m.rsplit('.', 1)[-1]}.specializations(); add the launches that set it"
            for (m, k, c), vs in values.items() if all(isinstance(v, bool) for v in vs) and len(vs) == 1]


# -- compiling ---------------------------------------------------------------------------------------
_JOBS: list[Job] = []  # the work list, inherited by forked workers


def compile_job(index: int, arch: int) -> dict:
    """Compile one job for one target and inspect it; errors are returned, not raised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_manager

    job = _JOBS[index]
    kernel = getattr(importlib.import_module(job.module), job.kernel)
    names = list(job.signature)
    row = dict(index=index, module=job.module, kernel=job.kernel, axes=job.axes, label=job.label(), arch=arch,
               constexprs={names[i]: v for (i,), v in job.constexprs.items()})
    src = ASTSource(fn=kernel, signature=job.signature, constexprs=job.constexprs, attrs=job.attrs)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        triton.knobs.nvidia.dump_ptxas_log = True  # the ptxas -v report of a fresh compile, on stdout
        with contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(job.options))
    except Exception as e:  # every failure is a finding, reported with its kernel and target
        msg = str(e).strip()
        row["error"] = f"{type(e).__name__}: {msg[:2000]}"
        return row
    row["seconds"] = round(time.perf_counter() - t0, 3)
    cache = get_cache_manager(ck.hash)
    report = log.getvalue()
    if "bytes stack frame" in report:
        cache.put(report, "ptxas.log", binary=False)
    else:  # from Triton's cache: the report kept with it, or ptxas again
        path = cache.get_file("ptxas.log")
        if path:
            with open(path) as f:
                report = f.read()
        else:
            ptx_arch = next(ln.split()[1] for ln in ck.asm["ptx"].splitlines() if ln.startswith(".target"))
            report = aot_inspect.ptxas_report(ck.asm["ptx"], ptx_arch)
            cache.put(report, "ptxas.log", binary=False)
    row.update(aot_inspect.parse_ptxas(report))
    row["triton_smem"] = ck.metadata.shared
    row["num_warps"] = ck.metadata.num_warps
    aligned = {names[i] for (i,), a in job.attrs.items() if ["tt.divisibility", 16] in a}
    row["accesses"] = aot_inspect.pointer_accesses(ck.asm["ptx"], job.signature, job.streams, aligned, job.vec,
                                                   kernel.fn.__code__.co_filename)
    return row


def problems(row: dict) -> list[str]:
    """What fails the check, each naming kernel, specialisation and target."""
    where = f"{row['label']} sm_{row['arch']}"
    if "error" in row:
        return [f"{where}: does not compile: {row['error']}"]
    out = []
    if row["spill_stores"] or row["spill_loads"]:
        out.append(f"{where}: spills ({row['spill_stores']} bytes stored, {row['spill_loads']} loaded; "
                   f"{row['registers']} registers)")
    for s in row["accesses"]:
        if "expected" in s and s["widths"] != [s["expected"]]:
            out.append(f"{where}: line {s['line']} {s['op']}({s['pointer']}) ({s['dtype']}) moves "
                       f"{'/'.join(map(str, s['widths']))}-bit accesses, {s['expected']}-bit expected "
                       f"({s['per_thread']} bits per thread)")
    return out


def run(jobs: list[Job], archs=ARCHS, n_jobs: int = 1) -> list[dict]:
    """Compile every job for every target: rows in job order, then target order."""
    global _JOBS
    _JOBS = jobs
    work = [(i, a) for i in range(len(jobs)) for a in archs]
    rows = []
    # fork: the workers inherit the imports and the job list (spawn would pay for `import torch` again)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(n_jobs, mp_context=get_context("fork"))) if n_jobs > 1 else None
        for row in (pool.map(compile_job, *zip(*work)) if pool else (compile_job(i, a) for i, a in work)):
            rows.append(row)
            if len(rows) % 50 == 0:
                print(f"aot: {len(rows)} of {len(work)} compiled", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("ci", "full"), default="ci")
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compiling processes")
    ap.add_argument("--modules", nargs="+", default=list(MODULES), help="modules with specializations()")
    ap.add_argument("--json", help="write the rows, the problems and the timing here")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter's functions cannot be compiled", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    all_jobs = [j for m in a.modules for j in capture(m)]
    jobs = ci_subset(all_jobs) if a.set == "ci" else all_jobs
    t1 = time.perf_counter()
    rows = run(jobs, a.arch, a.jobs)
    wall = time.perf_counter() - t0
    found = unexercised_flags(all_jobs) + [p for r in rows for p in problems(r)]
    compiled = [r for r in rows if "seconds" in r]
    values: dict = {}
    for j in all_jobs:
        names = list(j.signature)
        for (i,), v in j.constexprs.items():
            values.setdefault(f"{j.kernel}.{names[i]}", set()).add(v)
    summary = dict(set=a.set, specialisations=len(jobs), of=len(all_jobs), compiles=len(rows),
                   capture_seconds=round(t1 - t0, 1), wall_seconds=round(wall, 1),
                   compile_seconds=round(sum(r["seconds"] for r in compiled), 1), jobs=a.jobs,
                   constexpr_values={k: sorted(v) for k, v in values.items()})
    print(f"aot: {summary['specialisations']} of {summary['of']} specialisations × {len(a.arch)} targets = "
          f"{len(rows)} compiles in {summary['wall_seconds']} s ({summary['compile_seconds']} s compiling, "
          f"{a.jobs} processes); {len(found)} problems")
    for p in found:
        print("  " + p)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(summary=summary, problems=found, rows=rows), f, indent=1, default=str)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
