#!/usr/bin/env bash
# Write the seed corpus (fuzz/corpus/<target>/seed-*): small valid containers, chunk payloads,
# round_trip parameter strings and KV Exact / KV Exact4 pages, built with the current
# weightszip-core. Deterministic; safe to re-run (it overwrites the seed files and leaves the
# fuzzer's own corpus files alone).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cargo run --quiet --release --manifest-path "$here/Cargo.toml" --example seed_corpus -- "$here/corpus"
