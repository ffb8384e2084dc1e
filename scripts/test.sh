#!/usr/bin/env bash
# Installs the test dependencies and the package (building the Rust extension), then runs every
# test: clippy with warnings as errors, the Rust tests, pytest. The README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip >/dev/null
python -m pip install -e ".[test]"
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --release
python -m pytest -q -p no:cacheprovider
