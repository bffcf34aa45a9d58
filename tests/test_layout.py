"""The layout the folders promise (docs/architecture.md, "Layout"): no import circles in fasttrain/ or kernels/
(module-level and function-level imports alike, relative and absolute), the AOT check tool kept out of the
production kernels, a short top level, and a package `__init__.py` that names every module of its package.

The import graph is read from the source with `ast` (every `import` and `from ... import` anywhere in a
file, inside functions too): `from P import x` is an edge to the module P.x where that is a module, else
to P; `import a.b.c` to a.b.c. A package's `__init__` being imported on the way to one of its modules is
not counted (that edge is Python's, not the code's: a package that names its surface imports its modules)."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ((ROOT / "fasttrain", "fasttrain"), (ROOT / "kernels", "fasttrain.kernels"))
MAX_TOP_LEVEL = 15


def modules(sources=SOURCES) -> dict[str, Path]:
    """Module name → file, for every .py under the source folders (kernels/ is fasttrain.kernels)."""
    out = {}
    for base, package in sources:
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _known(name: str, mods: dict) -> str | None:
    """The module `name` is or lies in (an attribute of a module: the module)."""
    while name and name not in mods:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imported(name: str, path: Path, mods: dict) -> set[str]:
    """The project modules that module `name` (the file `path`) imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
        else:
            continue
        for t in targets:
            m = _known(t, mods)
            if m is not None and m != name:
                out.add(m)
    return out


def graph(mods: dict) -> dict[str, set[str]]:
    return {name: imported(name, path, mods) for name, path in mods.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def project():
    mods = modules()
    return mods, graph(mods)


def test_the_graph_reader_sees_module_and_function_level_imports(project):
    mods, g = project
    assert len(mods) > 100
    assert "fasttrain.step" in g["fasttrain.train"]                                   # module level, relative
    assert "fasttrain.cli.commands" in g["fasttrain.cli"]                            # inside a function
    assert "fasttrain.kernels.noise" in g["fasttrain.diffusion.lookahead"]           # absolute
    assert "fasttrain.kernels.triton_noise_spec" in g["fasttrain.kernels.noise_std"]  # inside the op
    assert "fasttrain.periodic" in g["fasttrain.periodic.log"]                       # a package's own names


def test_the_circle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(textwrap.dedent("""
        def f():
            from pkg import c
    """))
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    found = circles(graph(modules(((pkg, "pkg"),))))
    assert found == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_no_import_circles_in_fasttrain_or_kernels(project):
    _, g = project
    found = circles(g)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_production_kernels_do_not_import_the_aot_check_tool(project):
    mods, g = project
    tool = {m for m in mods if m.startswith("fasttrain.kernels.aot")}
    assert tool == {"fasttrain.kernels.aot", "fasttrain.kernels.aot_inspect", "fasttrain.kernels.aot_specs"}
    bad = {m: sorted(g[m] & tool) for m in mods if m.startswith("fasttrain.kernels") and m not in tool and g[m] & tool}
    assert not bad, f"production kernels importing the AOT check: {bad}"


def test_the_top_level_fits_on_one_screen():
    top = sorted(p.name for p in (ROOT / "fasttrain").glob("*.py") if p.name != "__init__.py")
    assert 5 <= len(top) <= MAX_TOP_LEVEL, f"{len(top)} top-level modules in fasttrain/: {top}"


def _packages():
    pkgs = [p for p in (ROOT / "fasttrain").rglob("*") if p.is_dir() and any(p.glob("*.py"))]
    return sorted(pkgs + [ROOT / "kernels"])


def test_every_package_has_an_init_that_names_its_modules():
    pkgs = _packages()
    assert len(pkgs) >= 12
    problems = []
    for pkg in pkgs:
        init = pkg / "__init__.py"
        if not init.is_file():
            problems.append(f"{pkg.relative_to(ROOT)} has no __init__.py")
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if not doc:
            problems.append(f"{init.relative_to(ROOT)} has no docstring naming its surface")
            continue
        for m in sorted(pkg.glob("*.py")):
            stem = m.stem
            if stem.startswith("__"):
                continue
            if f"{stem}.py" not in doc and f"`{stem}`" not in doc:
                problems.append(f"{init.relative_to(ROOT)} does not name {stem}.py")
    assert not problems, "; ".join(problems)
