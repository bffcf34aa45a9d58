"""The kernels are a layer below the diffusion package (docs/architecture.md: kernels take tables,
never schedule or prediction objects): fasttrain.kernels (the folder kernels/) imports only the
standard library, torch, triton, numpy, its own modules and the compiled extension fasttrain._C."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
ALLOWED_ROOTS = {"torch", "triton", "numpy"}
ALLOWED = {"fasttrain._C"}  # the compiled extension (CMakeLists.txt), part of the kernel layer


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield from ((f"{node.module}.{alias.name}" if node.module else alias.name, node.level)
                        for alias in node.names)


def test_kernels_import_nothing_from_the_rest_of_fasttrain():
    import sys

    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) >= 8
    bad = []
    for f in files:
        for name, level in imports(f):
            root = name.split(".")[0]
            if name in ALLOWED and level == 0:
                continue
            if level > 1 or (level == 0 and root not in ALLOWED_ROOTS and root not in sys.stdlib_module_names):
                bad.append(f"{f.relative_to(KERNELS)}: {'.' * level}{name}")
    assert not bad, "kernels/ reaches outside itself: " + "; ".join(bad)
