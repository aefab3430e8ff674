#!/usr/bin/env bash
# Build the tests' shared sandbox image (once; cached by spec hash, so later calls are no-ops). Needs root
# and debootstrap; without them it does nothing, and the tests that need the image say why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null 2>&1; then
  .venv/bin/python -c 'from tests.conftest import TEST_IMAGE_SPEC as s; from raas.sandbox.images import build_rootfs; print("test image:", build_rootfs(s))'
fi
