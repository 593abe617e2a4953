#!/usr/bin/env bash
# Set up (fuse3, .venv) and run `cachefsd demo`: a generated local dataset,
# mounted and read for two shuffled epochs. No cloud account needed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/bootstrap.sh"
exec "$repo/.venv/bin/cachefsd" demo "$@"
