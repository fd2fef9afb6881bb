#!/usr/bin/env bash
# Downloads the pure-Python wheels scripts/gpu-check.sh installs on a GPU host that lacks them (a lent machine has no
# network): FLA (fla-core, flash-linear-attention; the versions the interpreted FLA suite tests) and einops, ~1.3 MB,
# into .cache/gpu-wheels (git-ignored: carry it to the host with the checkout). Run it where pip reaches an index.
#
#   bash scripts/gpu-wheels.sh          # PYTHON (default python3) runs pip; TREEPACK_GPU_WHEELS overrides the folder
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${TREEPACK_GPU_WHEELS:-$ROOT/.cache/gpu-wheels}
mkdir -p "$DEST"
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --retries 0 --timeout 5 --disable-pip-version-check -q -d "$DEST" \
  fla-core==0.5.2 flash-linear-attention==0.5.2 einops
ls -l "$DEST"
