"""The GPU check's plan and its runner (bench/gpu_check.sh calls this): the parts, each with its own time
limit, run one after another on the lent GPU machine, each one's result written as it finishes.

    bash bench/gpu_check.sh               # the first call: install, then the headline figures, within 540 s
    bash bench/gpu_check.sh --second      # a second call: every part not yet done, within --budget
    bash bench/gpu_check.sh --plan        # print the plan (parts, limits, sums) and stop
    bash bench/gpu_check.sh --dry-run     # every part on the CPU, tiny shapes, few steps (tests/bench)

The first call (PARTS in order; the sum of its limits ≤ FIRST_BUDGET): the wheelhouse and the project
installed (fasttrain._C built with its CUDA ops for sm_90 alone), the machine's report, then (a) the
kernel benchmark against the memory bandwidth, (b) DiT-B/2 and DiT-XL/2 training steps in bf16 compiled,
machinery on and off, images/s and MFU, (c) the small-batch step at batch 8 (eager, compiled, compiled +
CUDA graph), (d) the mixed-prediction kernel; then, while time remains, (e) the peer loops and the GPU
tests. A part runs only if its limit fits in what is left of the budget, so a part that runs long costs
only itself. `--second` runs, in order, every part that has not yet finished well (bench/results/
gpu-check.json records each call), the second call's own parts included.

Each part's output goes to bench/results/gpu-log-<part>.txt, and after each part the run's record
(bench/results/gpu-check.{json,md}: the plan, each part's status and time, the tables it wrote) is
rewritten; where $OUT is set (the lent machine) these go there too: gpu-check.md, gpu-check.log (every
part's output) and gpu-results.tar.gz (every file under bench/results written by this call), rewritten after
each part, since only what is under $OUT when a call ends comes back.

The dry run (`--dry-run`) runs every part's dry command: the same script and flags with tiny shapes and
few steps, on the CPU (CUDA hidden), the results in a temporary folder (FASTTRAIN_BENCH_RESULTS), compiled
steps traced by dynamo but run eagerly (TORCH_COMPILE_OVERRIDE_BACKENDS), and every process under the
machine's import rules (bench/gpu_machine.py: a package the machine lacks and no wheel carries fails to
import; with wheels/ present they are installed into a temporary --target folder and loaded from there).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WHEELS = REPO / "wheels"
FIRST_BUDGET = 540   # seconds: one call is at most 600 s there, the rest is the runner's own margin
SITE = "/tmp/fasttrain-site"  # the wheelhouse's --target folder on the machine
TINY_DIT = ["model.args.hidden=32", "model.args.depth=1", "model.args.heads=2"]  # the dry run's DiT widths


@dataclasses.dataclass
class Part:
    name: str
    what: str
    limit: int               # seconds on the machine
    cmd: list[str]           # after the interpreter; "{site}" is the wheelhouse's folder
    dry: list[str] | None    # the dry run's command (None: the same)
    call: str = "first"      # first (always), extra (in the first call while time remains), second
    env: dict = dataclasses.field(default_factory=dict)
    fatal: bool = False      # the run stops if it fails (nothing after it could work)
    dry_limit: int = 300     # seconds for its dry command on a loaded 2-core machine


def _tp(*args: str) -> list[str]:
    return ["bench/throughput.py", *args]


# -- the parts, in the order they run -------------------------------------------------------------------
DIT_STEP = ["--data", "synthetic", "--channels", "4", "--image-size", "32", "--variants", "plain,lsm_min_snr",
            "--no-options", "--interference-steps", "0", "--direct-calls", "0"]
BF16_COMPILED = ["parallel.precision=bf16", "parallel.compile=blocks"]
TINY_STEPS = ["--steps", "2", "--round", "1", "--warmup", "1"]
PYTEST_GPU = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", "tests/diffusion",
              "tests/parallel/test_graphs.py",
              "tests/pretrained/test_lora.py::test_on_cuda_the_base_is_held_in_bf16_by_default_and_the_run_trains_and_samples",
              "--ignore=tests/kernels/test_aot.py"]

PARTS = [
    Part("install-wheels", "the wheelhouse (wheels/, bench/gpu_wheels.txt) into {site}", 15,
         ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
          "--target", "{site}", "{wheels}"], None, fatal=True),
    Part("install-fasttrain", "the project, without build isolation, fasttrain._C with CUDA ops for sm_90 only", 60,
         ["-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation", "-e", "."],
         ["-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--no-build-isolation", "-e", "."],
         env={"FASTTRAIN_CUDA_ARCHS": "90"}, fatal=True),
    Part("machine", "versions, GPU, nvcc, the native extension, each carried package imported", 15,
         ["bench/gpu_machine.py", "--report", "--site", "{site}"], None),
    Part("a-kernels", "(a) noise + loss + weighting + statistics, fwd and bwd: bytes/s against the copy "
         "bandwidth, beside eager and torch.compile; B 256 latents (DiT-B/2, XL/2), 512 px latents, pixels", 80,
         ["bench/bench_diffusion_loss.py", "--shapes", "latent-dit,latent-512,pixel", "--rounds", "15", "--calls",
          "50", "--out", "kernels-bandwidth-cuda"],
         ["bench/bench_diffusion_loss.py", "--shapes", "3x2x4x4", "--rounds", "1", "--calls", "1", "--interpret",
          "--out", "kernels-bandwidth-cuda"]),
    Part("b1-dit-b2", "(b) DiT-B/2, batch 256, bf16, compiled blocks: plain step vs sampler + weighting + stats", 85,
         _tp("--model", "dit_b2", "--batch", "256", *DIT_STEP, "--steps", "30", "--round", "10", "--warmup", "5",
             "--out", "throughput-cuda-dit_b2", "--set", *BF16_COMPILED),
         _tp("--model", "dit_b2", "--batch", "2", *DIT_STEP, *TINY_STEPS, "--out", "throughput-cuda-dit_b2",
             "--set", *BF16_COMPILED, *TINY_DIT)),
    Part("b2-dit-xl2", "(b) DiT-XL/2, batch 128 (256 needs activation checkpointing in 141 GB), bf16, compiled", 110,
         _tp("--model", "dit_xl2", "--batch", "128", *DIT_STEP, "--steps", "12", "--round", "6", "--warmup", "3",
             "--out", "throughput-cuda-dit_xl2", "--set", *BF16_COMPILED),
         _tp("--model", "dit_xl2", "--batch", "2", *DIT_STEP, *TINY_STEPS, "--out", "throughput-cuda-dit_xl2",
             "--set", *BF16_COMPILED, *TINY_DIT)),
    Part("c1-small-dit-b2", "(c) DiT-B/2 at batch 8: eager, compiled, compiled + CUDA graph", 60,
         _tp("--tables", "small", "--small-models", "dit_b2", "--batches", "8", "--steps", "60", "--round", "20",
             "--warmup", "8", "--out", "throughput-cuda-small-dit_b2"),
         _tp("--tables", "small", "--small-models", "dit_b2", "--batches", "2", *TINY_STEPS,
             "--out", "throughput-cuda-small-dit_b2", "--set", *TINY_DIT)),
    Part("c2-small-unet", "(c) the default run's tiny UNet at batch 8: eager, compiled, compiled + CUDA graph", 45,
         _tp("--tables", "small", "--small-models", "unet_tiny", "--batches", "8", "--steps", "60", "--round", "20",
             "--warmup", "8", "--out", "throughput-cuda-small-unet_tiny"),
         _tp("--tables", "small", "--small-models", "unet_tiny", "--batches", "2", *TINY_STEPS,
             "--out", "throughput-cuda-small-unet_tiny")),
    Part("d-mixed", "(d) the mixed-prediction loss kernel (Triton) against eager and the torch backend", 35,
         ["bench/bench_mixed_loss.py", "--out", "mixed-loss-cuda"],
         ["bench/bench_mixed_loss.py", "--shape", "3x4x3x3", "--rounds", "1", "--interpret", "--out",
          "mixed-loss-cuda"]),
    # (e): in the first call while time remains, else in the second
    Part("e1-peer-diffusers", "(e) fasttrain's step vs diffusers' train_unconditional.py loop, eager and compiled",
         150, ["bench/peer_diffusers.py", "--threads", "8", "--steps", "50", "--rounds", "3"],
         ["bench/peer_diffusers.py", "--threads", "1", "--steps", "1", "--rounds", "1", "--no-compile"], "extra"),
    Part("e2-peer-t2i", "(e) fasttrain's text-to-image step vs diffusers' train_text_to_image.py loop", 150,
         ["bench/peer_text_to_image.py", "--device", "cuda", "--threads", "8", "--rounds", "5", "--steps", "20"],
         ["bench/peer_text_to_image.py", "--threads", "1", "--rounds", "1", "--steps", "1", "--warmup", "1",
          "--weightings", "mse", "--equal-steps", "1", "--memory-steps", "1", "--batch", "2", "--size", "8",
          "--length", "8", "--channels", "16,32", "--captions", "4"], "extra"),
    Part("e3-gpu-tests", "(e) the GPU tests: kernels, diffusion, CUDA graphs, the LoRA step on CUDA", 240,
         PYTEST_GPU + ["-m", "not slow", "-n", "8"], PYTEST_GPU + ["--collect-only"], "extra"),
    # the second call's own parts
    Part("s1-small-rest", "the rest of the small-batch table: DiT-S/2, DiT-B/2, tiny UNet at batch 32 and 256", 200,
         _tp("--tables", "small", "--batches", "32", "256", "--steps", "40", "--round", "20", "--warmup", "8",
             "--out", "throughput-cuda-small"),
         _tp("--tables", "small", "--small-models", "unet_tiny", "--batches", "3", *TINY_STEPS,
             "--out", "throughput-cuda-small"), "second"),
    Part("s2-machinery-b2", "every machinery row and option on DiT-B/2, batch 256, bf16, compiled", 240,
         _tp("--model", "dit_b2", "--batch", "256", "--data", "synthetic", "--channels", "4", "--image-size", "32",
             "--steps", "200", "--round", "20", "--warmup", "5", "--interference-steps", "0", "--direct-calls", "300",
             "--out", "throughput-cuda-machinery-dit_b2", "--set", *BF16_COMPILED),
         _tp("--model", "dit_b2", "--batch", "2", "--data", "synthetic", "--channels", "4", "--image-size", "32",
             *TINY_STEPS, "--interference-steps", "0", "--direct-calls", "1",
             "--out", "throughput-cuda-machinery-dit_b2", "--set", *BF16_COMPILED, *TINY_DIT), "second"),
    Part("s3-dit-xl2-256", "DiT-XL/2 at batch 256 with selective activation checkpointing", 150,
         _tp("--model", "dit_xl2", "--batch", "256", *DIT_STEP, "--steps", "12", "--round", "6", "--warmup", "3",
             "--out", "throughput-cuda-dit_xl2-256", "--set", *BF16_COMPILED, "parallel.ac=selective"),
         _tp("--model", "dit_xl2", "--batch", "2", *DIT_STEP, *TINY_STEPS, "--out", "throughput-cuda-dit_xl2-256",
             "--set", *BF16_COMPILED, "parallel.ac=selective", *TINY_DIT), "second"),
    Part("s4-kernels-pytest", "the pytest-benchmark of the diffusion math (kernels-cuda.md, launches per call)", 120,
         ["-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/bench_diffusion_loss.py", "--benchmark-only"],
         ["-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/bench_diffusion_loss.py", "--benchmark-only",
          "--collect-only"],
         "second"),
]


def plan_lines(parts: list[Part], budget: int) -> list[str]:
    first = [p for p in parts if p.call == "first"]
    lines = ["| part | call | limit (s) | what |", "|---|---|---|---|"]
    lines += [f"| {p.name} | {p.call} | {p.limit} | {p.what.format(site=SITE)} |" for p in parts]
    lines += ["", f"first call: {sum(p.limit for p in first)} s of limits (budget {budget} s); the extra parts "
              f"({sum(p.limit for p in parts if p.call == 'extra')} s) run after them while time remains; the second "
              f"call's own parts: {sum(p.limit for p in parts if p.call == 'second')} s"]
    return lines


class Runner:
    def __init__(self, args, results: Path, env: dict):
        self.args, self.results, self.env = args, results, env
        self.t0 = time.time()
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") and not args.dry_run else None
        self.state_file = results / "gpu-check.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {"calls": []}
        self.call = {"call": "dry-run" if args.dry_run else ("second" if args.second else "first"),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget, "parts": {}}
        self.state["calls"].append(self.call)
        self.log = (self.out / "gpu-check.log").open("a") if self.out else None

    def done_before(self) -> set[str]:
        return {n for c in self.state["calls"][:-1] if c["call"] != "dry-run"
                for n, r in c["parts"].items() if r["status"] == "ok"}

    def command(self, part: Part) -> list[str] | None:
        cmd = part.dry if self.args.dry_run and part.dry is not None else part.cmd
        out = []
        for a in cmd:
            if a == "{wheels}":
                found = sorted(glob.glob(str(WHEELS / "*.whl")))
                if not found:
                    return None
                out += found
            else:
                out.append(a.replace("{site}", self.env.get("FASTTRAIN_GPU_SITE", SITE)))
        return [sys.executable, *out]

    def run_part(self, part: Part) -> dict:
        cmd = self.command(part)
        limit = part.dry_limit if self.args.dry_run else part.limit
        logname = f"gpu-log-{part.name}.txt"
        if cmd is None:
            why = "no wheels/*.whl (bench/gpu_wheels.sh downloads them; the device call carries wheels/)"
            status = "skipped" if self.args.dry_run else "failed"
            self.say(f"=== {part.name}: {status}: {why}")
            return {"status": status, "why": why, "seconds": 0}
        self.say(f"\n=== {part.name} (limit {limit} s): {' '.join(cmd[1:])}")
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **part.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace")
        with open(self.results / logname, "w") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            reader = threading.Thread(target=self._pump, args=(proc.stdout, log), daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                rc, status = proc.returncode, "timeout"
            reader.join(timeout=10)
        seconds = round(time.time() - start, 1)
        self.say(f"=== {part.name}: {status} (rc {rc}) in {seconds} s")
        return {"status": status, "rc": rc, "seconds": seconds, "limit": limit, "log": logname,
                "command": " ".join(cmd[1:])}

    def _pump(self, stream, log) -> None:
        for line in stream:
            log.write(line)
            log.flush()
            self.say(line.rstrip("\n"), echo=not self.args.quiet)

    def say(self, text: str, echo: bool = True) -> None:
        if echo:
            print(text, flush=True)
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()

    def elapsed(self) -> float:
        return time.time() - self.t0

    def record(self, parts: list[Part]) -> None:
        """gpu-check.{json,md} in the results folder, and (on the machine) $OUT's copies and tarball."""
        lines = [f"# GPU check: {self.call['call']} call of {self.call['started']}", "",
                 f"elapsed {self.elapsed():.0f} s of a {self.args.budget} s budget", "",
                 *plan_lines(parts, self.args.budget), "", "| part | status | seconds | limit |", "|---|---|---|---|"]
        lines += [f"| {n} | {r['status']}{': ' + r['why'] if r.get('why') else ''} | {r.get('seconds', '')} | "
                  f"{r.get('limit', '')} |" for n, r in self.call["parts"].items()]
        for n, r in self.call["parts"].items():
            for f in r.get("wrote", []):
                if f.endswith(".md") and f != "gpu-check.md":
                    lines += ["", f"## {n}: {f}", "", (self.results / f).read_text()]
        _replace(self.results / "gpu-check.json", json.dumps(self.state, indent=2))
        _replace(self.results / "gpu-check.md", "\n".join(lines) + "\n")
        if self.out:
            shutil.copy(self.results / "gpu-check.md", self.out / "gpu-check.md")
            tmp = self.out / "gpu-results.tar.gz.tmp"
            with tarfile.open(tmp, "w:gz") as tar:
                for f in sorted(self.results.iterdir()):
                    if f.is_file() and f.stat().st_mtime >= self.t0 - 1 and not f.name.startswith("."):
                        tar.add(f, arcname=f"bench/results/{f.name}")
            os.replace(tmp, self.out / "gpu-results.tar.gz")

    def written_since(self, start: float) -> list[str]:
        return sorted(f.name for f in self.results.iterdir()
                      if f.is_file() and f.stat().st_mtime >= start and not f.name.startswith("."))


def _replace(path: Path, text: str) -> None:
    """`path` replaced whole by `text` (a hidden temporary beside it, then renamed): the run's record is
    rewritten after every part, so an interrupt leaves the last complete one. Not _env.Results: the runner
    starts before fasttrain is installed, and imports neither it nor torch."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def environment(args, results: Path) -> dict:
    # not a pytest's variables: a dry run started by the test suite's xdist worker would hand its children
    # PYTEST_XDIST_WORKER (pytest-benchmark then refuses --benchmark-only; conftest.py sets one thread)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update({"PYTHONUNBUFFERED": "1", "FASTTRAIN_BENCH_RESULTS": str(results)})
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".inductor-cache"))
    if not args.dry_run:
        env["FASTTRAIN_GPU_SITE"] = SITE
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, env.get("PYTHONPATH")]))
        return env
    site = results / "site"
    env.update({"CUDA_VISIBLE_DEVICES": "", "TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager",
                "FASTTRAIN_GPU_SITE": str(site), "FASTTRAIN_GPU_SIM_LOG": str(results / "gpu-sim-imports.txt"),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "FASTTRAIN_BENCH_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH / "gpu_sim"), str(site),
                                                            env.get("PYTHONPATH")]))})
    env.pop("OUT", None)
    return env


def dry_checks(results: Path) -> list[str]:
    """After a dry run: what the imports' log says (a missing package is an error), and every pinned wheel
    present in wheels/ where that folder exists."""
    from gpu_machine import wheels

    problems, log = [], results / "gpu-sim-imports.txt"
    seen = sorted(set(log.read_text().splitlines())) if log.is_file() else []
    carried = sorted({ln.split()[1] for ln in seen if ln.startswith("carried ")})
    missing = sorted({" ".join(ln.split()[1:3]) for ln in seen if ln.startswith("missing ")})
    where = "loaded from the wheelhouse's install" if (results / "site").is_dir() else "no wheels/: this environment's"
    print(f"\ndry run: packages the GPU machine lacks that the parts imported, each carried by bench/gpu_wheels.txt "
          f"({where}): {', '.join(carried) or 'none'}")
    if missing:
        problems.append(f"imported but neither on the GPU machine nor carried: {'; '.join(missing)}")
    if WHEELS.is_dir():
        have = {p.name.split("-")[0].lower().replace("_", "-") + "==" + p.name.split("-")[1]
                for p in WHEELS.glob("*.whl")}
        lost = [f"{d}=={v}" for d, v in wheels().items() if f"{d}=={v}" not in have]
        if lost:
            problems.append(f"wheels/ lacks {', '.join(lost)} (run bench/gpu_wheels.sh)")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny shapes (no CUDA needed)")
    ap.add_argument("--second", action="store_true", help="every part not yet done, the second call's included")
    ap.add_argument("--plan", action="store_true", help="print the plan and stop")
    ap.add_argument("--budget", type=int, default=FIRST_BUDGET, help="seconds this call may take (default 540)")
    ap.add_argument("--only", default=None, help="comma-separated part names (a rerun of some parts)")
    ap.add_argument("--quiet", action="store_true", help="parts' output to their logs only")
    ap.add_argument("--keep", action="store_true", help="keep the dry run's results folder")
    args = ap.parse_args(argv)
    parts = PARTS
    if args.only:
        names = args.only.split(",")
        bad = [n for n in names if n not in {p.name for p in PARTS}]
        if bad:
            ap.error(f"unknown part {bad[0]!r} (parts: {', '.join(p.name for p in PARTS)})")
        parts = [p for p in PARTS if p.name in names or p.fatal]
    print("\n".join(plan_lines(PARTS, FIRST_BUDGET)))
    if sum(p.limit for p in PARTS if p.call == "first") > FIRST_BUDGET:
        raise SystemExit("gpu_plan.py: error: the first call's limits exceed its budget")
    if args.plan:
        return 0
    tmp = tempfile.mkdtemp(prefix="gpu-dry-") if args.dry_run else None
    results = Path(tmp) if tmp else BENCH / "results"
    results.mkdir(parents=True, exist_ok=True)
    env = environment(args, results)
    if not args.dry_run and not os.environ.get("OUT"):
        print("note: OUT is not set; results stay in bench/results/ only", flush=True)
    run = Runner(args, results, env)
    done = run.done_before() if args.second else set()
    failed = False
    for part in parts:
        if not args.dry_run:
            if part.call == "second" and not args.second and not args.only:
                continue
            if part.name in done and not part.fatal:
                run.call["parts"][part.name] = {"status": "done before", "seconds": 0}
                continue
            if run.elapsed() + part.limit > args.budget:
                run.call["parts"][part.name] = {"status": "skipped", "why": "no time left in this call's budget",
                                                "seconds": 0}
                run.say(f"=== {part.name}: skipped (limit {part.limit} s > {args.budget - run.elapsed():.0f} s left)")
                run.record(PARTS)
                continue
        start = time.time()
        res = run.run_part(part)
        res["wrote"] = [f for f in run.written_since(start) if not f.startswith("gpu-log-")]
        run.call["parts"][part.name] = res
        run.record(PARTS)
        failed |= res["status"] not in ("ok", "skipped")
        if part.fatal and res["status"] != "ok" and not (args.dry_run and res["status"] == "skipped"):
            run.say(f"=== stopping: {part.name} failed, and every later part needs it")
            break
    if args.dry_run:
        sys.path.insert(0, str(BENCH))
        problems = dry_checks(results)
        for p in problems:
            print(f"dry run: error: {p}")
        failed |= bool(problems)
        skipped = [n for n, r in run.call["parts"].items() if r["status"] == "skipped"]
        print(f"dry run: {sum(r['status'] == 'ok' for r in run.call['parts'].values())} of {len(parts)} parts ok"
              + (f" ({', '.join(skipped)} skipped: {run.call['parts'][skipped[0]]['why']})" if skipped else "")
              + f" in {run.elapsed():.0f} s; results in {results}")
        if not failed and not args.keep:
            shutil.rmtree(results, ignore_errors=True)
    bad = [n for n, r in run.call["parts"].items() if r["status"] not in ("ok", "skipped", "done before")]
    print(f"gpu check: {'FAILED parts: ' + ', '.join(bad) if failed else 'every part that ran is ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
