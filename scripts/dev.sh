#!/usr/bin/env bash
# Create or reuse the virtual environment .venv, install torch (CPU wheel) and memtree into it
# (only when pyproject.toml, the torch pin or the interpreter changed since the last install),
# then run one job:  demo  -> python -m memtree demo
#                    test  -> mkdocs build --strict (docs extra), mypy (setup.cfg: memtree/, strict),
#                             then the whole pytest suite with the doctests (extra arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-test}
shift || true
[ -x .venv/bin/python ] || python3 -m venv .venv
case "$job" in
  demo) spec="." ;;
  test) spec=".[test,docs]" ;;
  *) echo "usage: bash scripts/dev.sh demo|test [pytest args]" >&2; exit 2 ;;
esac
torch_pin="torch==2.13.0"
# pip runs only when what it would install changed: the stamp records the extras, the torch pin,
# pyproject.toml and the interpreter (memtree itself is installed editable: code changes need no pip)
stamp=".venv/.dev-stamp-$job"
key="$spec $torch_pin $(sha256sum pyproject.toml | cut -d' ' -f1) $(.venv/bin/python -c 'import sys; print(sys.version)')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  echo "dev.sh: installing $torch_pin (CPU) and memtree$([ "$spec" = . ] || echo "${spec#.}") into .venv (first run, or pyproject.toml changed)..." >&2
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$torch_pin" -e "$spec" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2
    echo "scripts/dev.sh: installing into .venv failed (see above)" >&2
    exit 1
  fi
  rm -f "$log"
  echo "$key" >"$stamp"
fi
case "$job" in
  demo) exec .venv/bin/python -m memtree demo "$@" ;;
  test)
    # the documentation must build without warnings (mkdocs.yml, docs/, docstrings) before the tests
    echo "dev.sh: building the docs (mkdocs build --strict)..." >&2
    site=$(mktemp -d) docs_log=$(mktemp)
    if ! NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict -d "$site" >"$docs_log" 2>&1; then
      cat "$docs_log" >&2
      echo "scripts/dev.sh: mkdocs build --strict failed (see above)" >&2
      rm -rf "$site" "$docs_log"
      exit 1
    fi
    rm -rf "$site" "$docs_log"
    # static types: the files and flags of setup.cfg's [mypy] sections
    echo "dev.sh: checking types (mypy, strict)..." >&2
    mypy_log=$(mktemp)
    if ! .venv/bin/python -m mypy >"$mypy_log" 2>&1; then
      cat "$mypy_log" >&2
      echo "scripts/dev.sh: mypy found errors (see above)" >&2
      rm -f "$mypy_log"
      exit 1
    fi
    rm -f "$mypy_log"
    echo "dev.sh: running the tests (pytest)..." >&2
    exec .venv/bin/python -m pytest "$@" ;;
esac
