#!/usr/bin/env bash
# Everything a fresh Debian/Ubuntu machine needs to run cachefsd from this
# checkout: fuse3 (fusermount3, which mounts) and a virtual environment in
# .venv with the package installed, its native data plane (native/, Rust)
# built into it by maturin with the machine's cargo; for the tests, also a C compiler and
# the kernel's headers, and the Azure Storage emulator (Azurite, from npm,
# into .node/). Sourced by demo.sh and test.sh.
# Usage: bootstrap.sh [extra]   (extra: "test" adds the test dependencies)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-}"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

packages=()
if ! command -v fusermount3 >/dev/null 2>&1; then
    packages+=(fuse3)
fi
# The tests compile a C program against the kernel's <linux/fuse.h>
# (tests/contract/test_fuse_protocol.py).
if [ "$extra" = test ] && ! { command -v cc && [ -f /usr/include/linux/fuse.h ]; } >/dev/null 2>&1; then
    packages+=(gcc libc6-dev linux-libc-dev)
fi
# The tests run the native plane's request decoding under cargo fuzz.
if [ "$extra" = test ] && ! cargo fuzz --version >/dev/null 2>&1; then
    echo "bootstrap: installing cargo-fuzz from crates.io" >&2
    cargo install --quiet --locked cargo-fuzz
fi
# The tests run Azurite on node (cachefsd/testing/azurite.py).
if [ "$extra" = test ] && ! command -v npm >/dev/null 2>&1; then
    packages+=(nodejs npm)
fi
if [ "${#packages[@]}" -gt 0 ]; then
    echo "bootstrap: installing ${packages[*]} from Debian" >&2
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${packages[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "bootstrap: cargo (the Rust toolchain) is needed to build the native data plane: install it (rustup or Debian's cargo)" >&2
    exit 1
fi

if [ ! -x "$repo/.venv/bin/python" ]; then
    echo "bootstrap: creating $repo/.venv" >&2
    python3 -m venv "$repo/.venv"
fi
target="$repo"
if [ -n "$extra" ]; then target="$repo[$extra]"; fi
# The editable install follows the Python code; the package's metadata (its
# dependencies) and the native extension need a reinstall. Skip pip while
# pyproject.toml and native/ are those of the last install and it had the
# extra asked for (a test install serves the demo too).
stamp="$repo/.venv/.cachefsd-installed"
project="$(cd "$repo" && find pyproject.toml native/Cargo.* native/src -type f -print \
    | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)"
installed="$(cat "$stamp" 2>/dev/null || true)"
if [ "$installed" != "$project $extra" ] && { [ -n "$extra" ] || [ "${installed%% *}" != "$project" ]; }; then
    echo "bootstrap: installing cachefsd${extra:+ with [$extra]} into .venv" >&2
    "$repo/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$target"
    echo "$project $extra" >"$stamp"
fi

# Azurite into .node/ (gitignored), pinned: 3.35 is the last release that
# runs on the node 18/20 of Debian and Ubuntu (3.36 wants node 21).
azurite_version=3.35.0
azurite_stamp="$repo/.node/.azurite-$azurite_version"
if [ "$extra" = test ] && [ ! -f "$azurite_stamp" ]; then
    echo "bootstrap: installing Azurite $azurite_version into .node" >&2
    npm install --prefix "$repo/.node" --no-audit --no-fund --loglevel=error "azurite@$azurite_version" >/dev/null
    touch "$azurite_stamp"
fi
