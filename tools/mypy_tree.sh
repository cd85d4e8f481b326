#!/usr/bin/env bash
# Type-check the installed package as its imports name it: ckptless, ckptless.launcher, ckptless.chaos.
#
# Why: launcher/ and chaos/ are installed as ckptless.launcher and ckptless.chaos (pyproject's
# package-dir), and the code imports them by those names. `mypy ckptless launcher chaos` checks them as
# top-level packages `launcher` and `chaos`, so every `from ckptless.launcher... import` was an
# unresolved import (Any under ignore_missing_imports): cross-module types there went unchecked (issue 40's
# review found an assignment to a removed NodeState field that passed). This builds the package's tree
# from symlinks in a temporary directory and checks it whole with `-p ckptless`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-"$repo/.venv/bin/python"}
py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # (absolute: the check runs from the tree)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/ckptless"
for entry in "$repo"/ckptless/*; do
    ln -s "$entry" "$tree/ckptless/$(basename "$entry")"
done
ln -s "$repo/launcher" "$tree/ckptless/launcher"
ln -s "$repo/chaos" "$tree/ckptless/chaos"
cp "$repo/pyproject.toml" "$tree/"
cd "$tree" && "$py" -m mypy --cache-dir "$repo/.mypy_cache/tree" -p ckptless
