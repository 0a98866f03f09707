#!/usr/bin/env bash
# Install equishard with its test and docs extras into .venv and run the whole test
# suite: the linter (ruff, with Equinox's rule set), the static type checker over
# equishard/ and tests/, the documentation site's strict build (any warning fails it: a
# broken link or include, a name the API reference cannot find; tests/test_docs.py runs
# the guides' code), then pytest on every core (pytest-xdist; each worker simulates its
# own 8 CPU devices; tests of one file share a worker, so they share compiled functions).
# Exit code 5, "no tests ran", counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[dev,docs]"
.venv/bin/ruff check .
.venv/bin/pyright
site_dir="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
.venv/bin/python -m pytest -n auto --dist loadfile "$@"
