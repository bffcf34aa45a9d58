"""The README is a front door: short, with the two set-up commands, and every docs/ page reachable from
it; links between the pages resolve."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> list[Path]:
    return [(page.parent / m.group(1)).resolve() for m in LINK.finditer(page.read_text())
            if not m.group(1).startswith(("http://", "https://"))]


def test_readme_is_at_most_300_lines_with_the_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    commands = [line for line in text.splitlines() if line.startswith("python3 -m venv .venv && ")]
    assert len(commands) == 2
    assert commands[0].endswith("-e . && .venv/bin/fasttrain train")
    assert commands[1].endswith("ruff check . && .venv/bin/python -m pytest -q -n 2")
    # .ci/run runs the README's test command (one pytest-xdist worker per core of the 2-core CI machine)
    assert ".venv/bin/python -m pytest -q -n 2\n" in (ROOT / ".ci" / "run").read_text()


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves():
    pages = sorted((ROOT / "docs").glob("*.md"))
    linked = set(_links(ROOT / "README.md"))
    assert [p.name for p in pages if p.resolve() not in linked] == []
    broken = [(page.name, str(target)) for page in [ROOT / "README.md", *pages] for target in _links(page)
              if not target.exists()]
    assert broken == []


FILE = re.compile(r"[\w./-]+\.(?:py|md|sh|yaml)\b")
SOURCES = ("fasttrain", "kernels", "tests", "bench", "docs")


def _named_files(text: str) -> set[str]:
    """Every file a page names inside backticks (`fasttrain/step.py`, `diffusion/schedule.py`, `noise.py: noise()`)."""
    return {f for span in re.findall(r"`([^`]+)`", text) for f in FILE.findall(span)}


def _exists(name: str) -> bool:
    if "/" in name:
        return any((ROOT / base / name).is_file() for base in ("", "fasttrain", "fasttrain/data", "kernels")) or \
            (ROOT / name).is_file()
    return any(next((ROOT / base).rglob(name), None) is not None for base in SOURCES)


def test_every_file_the_architecture_page_and_the_readme_layout_name_exists():
    """docs/architecture.md names the file of each claim; a moved or renamed file is found here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = _named_files(text)
    assert len(named) > 80
    missing = sorted(n for n in named if not _exists(n))
    assert missing == [], missing


def test_the_architecture_page_lists_every_data_kind_and_the_readme_every_package():
    from fasttrain.data import DATA_KINDS

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Data kinds", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert listed == set(DATA_KINDS), sorted(set(DATA_KINDS) ^ listed)
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    packages = sorted(p.name for p in (ROOT / "fasttrain").iterdir() if (p / "__init__.py").is_file())
    assert len(packages) >= 12
    assert [p for p in packages if f"{p}/" not in layout] == []
