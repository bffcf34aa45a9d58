#!/usr/bin/env bash
# The wheelhouse the GPU check carries to the lent GPU machine (no network there): downloads HERE the
# Python 3.12 wheels (pure, or manylinux x86_64) of bench/gpu_wheels.txt's pins, --no-deps, one version
# each, into wheels/ (git-ignored: /wheels/ in .gitignore), lists their names and sizes, and checks that
#   - every wheel is py3 or cp312 and any or manylinux x86_64,
#   - wheels/ plus the tracked tree stay within 40 MiB (64 MiB travel in one call),
#   - pip installs them into a clean --target folder (this Python), and would for Python 3.12
#     (pip --dry-run --python-version 3.12), a Python 3.12 byte-compiles them where one is found,
#   - each installs an importable module from that folder (this Python),
#   - everything our code imports that the machine lacks is carried (bench/gpu_machine.py --lacks;
#     NVIDIA DALI excepted: its wheel alone is far larger than what travels).
# On the machine bench/gpu_plan.py installs them with
#   python3 -m pip install --no-index --no-deps --no-compile --target /tmp/fasttrain-site wheels/*.whl
# and puts /tmp/fasttrain-site first on PYTHONPATH. The device call carries the folder: carry ["wheels"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=wheels
LIMIT_MIB=40
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mapfile -t PINS < <(sed 's/#.*//' bench/gpu_wheels.txt | tr -s ' \t' '\n' | grep -v '^$')
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${PINS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" - "$DEST" "$LIMIT_MIB" "${PINS[@]}" <<'EOF'
import re, subprocess, sys
from pathlib import Path

dest, limit, pins = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
rows, bad = [], []
for whl in sorted(dest.glob("*.whl")):
    name, version, *_, py, abi, plat = whl.stem.split("-")
    if norm(name) not in want or want[norm(name)] != version:
        whl.unlink()  # not pinned (another version, a removed pin): one version each, or the install stops
        print(f"removed {whl.name} (not in bench/gpu_wheels.txt)")
        continue
    if not ({"py3", "cp312"} & set(py.split("."))) or abi not in ("none", "abi3", "cp312") \
            or not (plat == "any" or ("manylinux" in plat and plat.endswith("x86_64"))):
        bad.append(whl.name)
    rows.append((whl.name, whl.stat().st_size))
missing = [f"{n}=={v}" for n, v in want.items() if not any(norm(r[0].split("-")[0]) == n for r in rows)]
tracked = sum(Path(f).stat().st_size for f in subprocess.run(["git", "ls-files", "-z"], capture_output=True,
              check=True).stdout.decode().split("\0") if f and Path(f).is_file())
total = sum(s for _, s in rows)
print("| wheel | MiB |\n|---|---|")
for n, s in rows:
    print(f"| {n} | {s / 2**20:.2f} |")
print(f"wheels {total / 2**20:.1f} MiB + tracked tree {tracked / 2**20:.1f} MiB = {(total + tracked) / 2**20:.1f} MiB "
      f"(limit {limit:.0f} MiB)")
if bad or missing or total + tracked > limit * 2**20:
    sys.exit(f"gpu_wheels.sh: error: {'not py3/cp312 manylinux: ' + ', '.join(bad) + '; ' if bad else ''}"
             f"{'not downloaded: ' + ', '.join(missing) + '; ' if missing else ''}"
             f"{'over the limit' if total + tracked > limit * 2**20 else ''}")
EOF
# a clean --target install with this Python, and pip's answer for Python 3.12
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "$DEST"/*.whl
"$PY" -m pip install -q --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" --target "$tmp/site312" "$DEST"/*.whl
echo "pip: installs into a clean --target folder, and would for Python 3.12"
PY312=
for c in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY312=$c; break; fi
done
if [ -n "$PY312" ]; then
  "$PY312" -m compileall -q "$tmp/site" >/dev/null && echo "python3.12 ($("$PY312" -V 2>&1)): every file byte-compiles"
else
  echo "no Python 3.12 here: the byte-compile check with 3.12 was left out"
fi
PYTHONPATH="$tmp/site" "$PY" - "$tmp/site" <<'EOF'
import importlib, importlib.metadata, sys
from pathlib import Path

site = Path(sys.argv[1]).resolve()
for dist in importlib.metadata.distributions(path=[str(site)]):
    top = (dist.read_text("top_level.txt") or "").split() or sorted(
        {str(f).split("/")[0].removesuffix(".py") for f in dist.files or [] if "dist-info" not in str(f)
         and not str(f).startswith("..") and (str(f).endswith(".py") or "/" in str(f))})
    own = dist.metadata["Name"].replace("-", "_").lower()
    for name in [own] if own in top else top[:1]:
        mod = importlib.import_module(name)
        where = Path(mod.__file__).resolve()
        assert site in where.parents, f"{name} came from {where}, not the wheelhouse"
        print(f"imports from the wheelhouse: {dist.metadata['Name']} {dist.version} ({name})")
EOF
"$PY" bench/gpu_machine.py --lacks | tee "$tmp/lacks"
if grep "NOT CARRIED" "$tmp/lacks" | grep -v "^nvidia-dali" ; then
  echo "gpu_wheels.sh: error: our code imports packages the GPU machine lacks that bench/gpu_wheels.txt does not carry" >&2
  exit 1
fi
