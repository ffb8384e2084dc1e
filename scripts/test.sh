#!/usr/bin/env bash
# Installs the test dependencies and the package (building the Rust extension), then runs every
# test: rustfmt's check, clippy with warnings as errors, the Rust tests, pytest. The README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip >/dev/null
python -m pip install -e ".[test]"
if cargo fmt --version >/dev/null 2>&1; then  # the layout of rustfmt.toml, the fuzz crate included
    cargo fmt --all -- --check
    (cd fuzz && cargo fmt -- --check)
else
    echo "warning: rustfmt is not installed (rustup component add rustfmt): formatting not checked" >&2
fi
cargo clippy --workspace --all-targets -- -D warnings
cargo test --workspace --release
python -m pytest -q -p no:cacheprovider
