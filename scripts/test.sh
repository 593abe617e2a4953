#!/usr/bin/env bash
# Set up (fuse3, a C compiler and the kernel's headers, .venv with test
# dependencies and the native extension) and run the whole test suite:
# the native crate's lints (rustfmt, clippy) and unit tests, ruff and mypy,
# then unit, contract (moto S3 over HTTP, GCS and Azure emulators) and
# integration tests on real FUSE mounts. Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/bootstrap.sh" test
cd "$repo"
# No cloud SDK may probe an instance-metadata address from a test run.
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_EC2_METADATA_DISABLED=true
export NO_GCE_CHECK=true GCE_METADATA_HOST=127.0.0.1:1
(cd native && cargo fmt --check && cargo clippy --locked --all-targets -- -D warnings && cargo test --locked)
# The kernel's requests as the native plane decodes them, under libFuzzer for a
# bounded time. cargo fuzz wants a nightly compiler for its -Z flags and its
# sanitizers: the stable one takes the flags (RUSTC_BOOTSTRAP), without a sanitizer.
fuzz_log="$(mktemp)"
if ! (cd native && RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer none requests -- -max_total_time=20 >"$fuzz_log" 2>&1); then
    cat "$fuzz_log"
    exit 1
fi
echo "fuzz: $(grep '^Done' "$fuzz_log") decoding requests, no crash"
rm -f "$fuzz_log"
.venv/bin/ruff check cachefsd tests benchmarks
.venv/bin/ruff format --check cachefsd tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
