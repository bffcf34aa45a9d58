"""What a compiled GPU kernel uses and how wide it reads, without a GPU: the ptxas report (registers,
spill bytes, stack frame, static shared memory), the width of each global load and store of a
Triton kernel's PTX per source line, and the same for the CUDA C++ kernels of a fatbin (cuobjdump).

The tools are the ones Triton ships (triton/backends/nvidia/bin: ptxas, cuobjdump), so no CUDA
toolkit is needed. Used by kernels/aot.py; nothing here needs torch or a driver.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import defaultdict


def tool(name: str) -> str:
    """Triton's bundled NVIDIA tool `name` (ptxas, cuobjdump, nvdisasm)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


# -- ptxas -v ----------------------------------------------------------------------------------------
def parse_ptxas(log: str) -> dict:
    """registers, spill_stores, spill_loads (bytes), stack (frame bytes), smem (static bytes) from a
    `ptxas -v` report of one entry function. A stack frame without spills is not a spill: libdevice's
    sinf/cosf (tl.randn's Box-Muller) keep a 28-byte table for their never-taken slow path there."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if not (frame and regs):
        raise ValueError(f"no ptxas -v resource report in:\n{log}")
    smem = re.search(r"Used \d+ registers[^\n]*?(\d+) bytes smem", log)
    return dict(registers=int(regs.group(1)), spill_stores=int(frame.group(2)), spill_loads=int(frame.group(3)),
                stack=int(frame.group(1)), smem=int(smem.group(1)) if smem else 0)


def ptxas_report(ptx: str, arch: str) -> str:
    """Run ptxas -v on PTX as Triton's compile does (its flags; `arch` as in the PTX .target, e.g.
    sm_90a) and return the report: for kernels that came from Triton's cache, whose compile printed none."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([tool("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src,
                              "-o", os.path.join(d, "k.o")], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed:\n{run.stderr}")
    return run.stderr


# -- global memory access widths in PTX ------------------------------------------------------------
ACCESS = re.compile(r"\b(ld|st|atom|red)\.global((?:\.[A-Za-z0-9_:]+)*)\s")  # .L1::evict_last, .v4, .b32
CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-z0-9_]+)*\s+\[[^]]+\],\s*\[[^]]+\],\s*"
                      r"(0x[0-9a-f]+|\d+)")


def access_bits(mods: str) -> int:
    """Bits one ld/st instruction moves: element width × vector length (.v2/.v4)."""
    vec = re.search(r"\.v(\d)", mods)
    width = re.search(r"\.[bfsu](\d+)\b", mods)
    return int(width.group(1)) * (int(vec.group(1)) if vec else 1) if width else 0


def accesses_by_line(ptx: str) -> dict:
    """{(source file, line): [(op, bits), ...]}: every global load ('ld'), store ('st'), atomic
    ('atom') and async copy into shared memory (counted as 'ld') of the PTX, by the source line its
    `.loc` names. Triton emits each load and store as an inline-asm block whose `.loc` lines drift by
    one per asm line, so the first `.loc` inside a block names the whole block."""
    files = {m.group(1): m.group(2) for m in re.finditer(r'\.file\s+(\d+)\s+"([^"]+)"', ptx)}
    out: dict = defaultdict(list)
    loc, in_asm, asm_loc = None, False, None
    for line in ptx.splitlines():
        if "// begin inline asm" in line:
            in_asm, asm_loc = True, None
        elif "// end inline asm" in line:
            in_asm = False
        m = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s+\d+", line)
        if m:
            here = (files.get(m.group(1), m.group(1)), int(m.group(2)))
            if in_asm:
                asm_loc = asm_loc or here
            loc = asm_loc if in_asm else here
            continue
        if loc is None:
            continue
        m = ACCESS.search(line)
        if m:
            op = "ld" if m.group(1) == "ld" else "st" if m.group(1) == "st" else "atom"
            out[loc].append((op, access_bits(m.group(2))))
        m = CP_ASYNC.search(line)
        if m:
            out[loc].append(("ld", 8 * int(m.group(1), 0)))
    return dict(out)


POINTER_OP = re.compile(r"tl\.(load|store|atomic_\w+)\(\s*(\w+)")
BITS = {"fp64": 64, "i64": 64, "fp32": 32, "i32": 32, "bf16": 16, "fp16": 16, "i16": 16, "i8": 8, "u8": 8, "i1": 8}


def pointer_accesses(ptx: str, signature: dict, streams: tuple, aligned: set, vec: int, source_file: str
                     ) -> list[dict]:
    """The loads and stores of `source_file`'s lines that name a pointer argument (`tl.load(x_ptr +
    ...)`), per line: the pointer, its element type, the access widths and the bits moved per thread.
    For the row streams (`streams`, triton_shared.Spec) also the width the data allows: expected =
    min(128, bits the line moves per thread, element bits × vec), vec being the contiguous aligned run
    of a row for a pointer Triton specialised as 16-byte aligned (`aligned`), 1 for any other. So a tile
    of several elements per thread must move them in the widest vectors the alignment allows: 128-bit
    (4 fp32 or 8 halves) for aligned rows; one element per thread is trivially as wide as it can be."""
    with open(source_file) as f:
        text = f.read().splitlines()
    rows = []
    for (path, line), acc in sorted(accesses_by_line(ptx).items()):
        # By file name: Triton's cache key holds the kernel's source and first line but not its path, so
        # PTX cached from another checkout of the same code names that checkout's file.
        if os.path.basename(path) != os.path.basename(source_file) or not 0 < line <= len(text):
            continue
        m = POINTER_OP.search(text[line - 1])
        if not m or m.group(1).startswith("atomic") or not signature.get(m.group(2), "").startswith("*"):
            continue
        ptr, dtype = m.group(2), signature[m.group(2)][1:]
        widths = sorted({bits for op, bits in acc if op in ("ld", "st")})
        if not widths:
            continue
        moved = sum(bits for op, bits in acc if op in ("ld", "st"))
        row = dict(line=line, pointer=ptr, op=m.group(1), dtype=dtype, widths=widths, per_thread=moved)
        if ptr in streams:
            row["expected"] = min(128, moved, BITS[dtype] * (vec if ptr in aligned else 1))
        rows.append(row)
    return rows


# -- the CUDA C++ kernels of a compiled object ---------------------------------------------------------
def demangle(names: list[str]) -> dict:
    """Mangled → readable C++ names (c++filt where there is one, else unchanged)."""
    try:
        run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, run.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def _cuobjdump_lines(text: str, function: str):
    """(architecture of the current section, the function a line names or None, the line) per line of
    cuobjdump's output."""
    arch = None
    for line in text.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        arch = m.group(1) if m else arch
        m = re.search(function, line)
        yield arch, m.group(1) if m else None, line


def native_resources(path: str) -> list[dict]:
    """Per (architecture, kernel) of the fatbin in `path` (an object or shared library): registers,
    stack, local, shared bytes (cuobjdump --dump-resource-usage) and the widths of its global loads
    and stores (SASS: LDG.E = 32-bit, .64, .128, .U16 = 16-bit). STACK and LOCAL 0 mean no spills."""
    res = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                         check=True).stdout
    rows, fn = [], None
    for arch, new_fn, line in _cuobjdump_lines(res, r"Function (\S+):"):
        fn = new_fn or fn
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and fn:
            rows.append(dict(arch=arch, function=fn, registers=int(m.group(1)), stack=int(m.group(2)),
                             shared=int(m.group(3)), local=int(m.group(4))))
            fn = None
    sass = subprocess.run([tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    widths: dict = defaultdict(lambda: defaultdict(int))
    fn = None
    for arch, new_fn, line in _cuobjdump_lines(sass, r"Function : (\S+)"):
        fn = new_fn or fn
        m = re.search(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)", line)
        if m and fn:
            mods = m.group(2).split(".")
            bits = next((int(x) for x in mods if x in ("64", "128")), 16 if ("U16" in mods or "S16" in mods) else
                        8 if ("U8" in mods or "S8" in mods) else 32)
            widths[(arch, fn)][f"{m.group(1).lower().replace('ldg', 'ld').replace('stg', 'st')}{bits}"] += 1
    names = demangle([r["function"] for r in rows])
    for r in rows:
        r["accesses"] = dict(sorted(widths.get((r["arch"], r["function"]), {}).items()))
        r["name"] = names[r["function"]]
    return rows
