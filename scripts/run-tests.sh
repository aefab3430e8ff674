#!/usr/bin/env bash
# The test suite: everything as the current user; then, when RAAS_UNPRIV_USER names an existing
# unprivileged account (CI creates one), the rootless-sandbox tests again as that user, since HPC
# users are not root.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest -p no:cacheprovider "$@"
if [ -n "${RAAS_UNPRIV_USER:-}" ] && [ "$(id -u)" = 0 ] && id "$RAAS_UNPRIV_USER" >/dev/null 2>&1; then
  echo "== rootless sandbox tests as $RAAS_UNPRIV_USER"
  home=$(getent passwd "$RAAS_UNPRIV_USER" | cut -d: -f6)
  runuser -u "$RAAS_UNPRIV_USER" -- env HOME="$home" RAAS_HOME="$home/.cache/raas" \
    RAAS_IMAGE_CACHE="${RAAS_IMAGE_CACHE:-$HOME/.cache/raas/images}" \
    .venv/bin/pytest -p no:cacheprovider -m "not vllm" tests/sandbox -k "apptainer or bwrap"
fi
