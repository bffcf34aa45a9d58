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
