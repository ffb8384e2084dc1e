#!/usr/bin/env bash
# Fuzz smoke test: build every cargo-fuzz target in fuzz/ and run each for a fixed time.
#
#   scripts/fuzz_smoke.sh [SECONDS_PER_TARGET]      (default 20)
#
# Non-interactive, for CI. Installs cargo-fuzz (`cargo install cargo-fuzz --locked`) when it is
# missing. Works on a stable toolchain: RUSTC_BOOTSTRAP=1 lets stable rustc take the -Z flags
# cargo-fuzz passes (a nightly toolchain works too: RUSTUP_TOOLCHAIN=nightly). Needs a C++
# compiler for libfuzzer-sys (build-essential or clang).
#
# The committed seeds (fuzz/corpus/<target>/seed-*) are read only; inputs the fuzzer discovers go
# to a scratch directory that is deleted afterwards, so the working tree stays clean. A crash,
# panic, timeout or OOM leaves its reproducer in fuzz/artifacts/<target>/ and makes the script
# exit 1 after all targets have run.
#
# Environment:
#   FUZZ_SANITIZER  address (default) or none (faster, but blind to memory errors in the decoder's
#                   `unsafe` hot loop).
#   FUZZ_TARGETS    space-separated subset of targets (default: all, from `cargo fuzz list`).
#   FUZZ_TIMEOUT    seconds one input may run before it counts as a hang (default 60).
#   FUZZ_RSS_MB     memory limit in MiB, also the largest single allocation (default 2048).
set -euo pipefail

secs="${1:-20}"
case "$secs" in '' | *[!0-9]*) echo "usage: $0 [SECONDS_PER_TARGET]" >&2; exit 2 ;; esac
sanitizer="${FUZZ_SANITIZER:-address}"
timeout="${FUZZ_TIMEOUT:-60}"
rss_mb="${FUZZ_RSS_MB:-2048}"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/fuzz"
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== cargo-fuzz not found: installing it"
    cargo install cargo-fuzz --locked
fi
echo "== $(cargo fuzz --version), $(rustc --version), sanitizer: $sanitizer"
if ! command -v c++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then
    echo "error: no C++ compiler (c++ or clang++): libfuzzer-sys needs one to build libFuzzer" >&2
    exit 2
fi

targets="$(echo ${FUZZ_TARGETS:-$(cargo fuzz list)})"

# Seeds are committed; write them only if a target has none (e.g. a fresh checkout without them).
for t in $targets; do
    if ! compgen -G "corpus/$t/seed-*" >/dev/null; then
        echo "== no seeds for $t: running fuzz/seed_corpus.sh"
        ./seed_corpus.sh
        break
    fi
done

echo "== building: $targets"
cargo fuzz build --sanitizer "$sanitizer"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/wz-fuzz.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

failed=()
for t in $targets; do
    mkdir -p "$scratch/$t" "corpus/$t" "artifacts/$t"
    echo "== $t: ${secs}s"
    set +e
    cargo fuzz run --sanitizer "$sanitizer" "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$secs" -timeout="$timeout" -rss_limit_mb="$rss_mb" \
        -print_final_stats=1 2>&1 | tee "$scratch/$t.log" | grep -vE '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse)'
    rc=${PIPESTATUS[0]}
    set -e
    runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$scratch/$t.log" | tail -1)"
    speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$scratch/$t.log" | tail -1)"
    echo "== $t: exit $rc, ${runs:-?} runs, ${speed:-?} exec/s"
    if [ "$rc" -ne 0 ]; then
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "== FAILED: ${failed[*]}; reproducers:" >&2
    for t in "${failed[@]}"; do
        ls -l "artifacts/$t" >&2 || true
    done
    exit 1
fi
echo "== all targets ran ${secs}s without a finding"
