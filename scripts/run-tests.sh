#!/usr/bin/env bash
# The test suite: everything as the current user; then, when RAAS_UNPRIV_USER names an existing
# unprivileged account (CI creates one), the rootless-sandbox tests again as that user, since HPC
# users are not root.
set -euo pipefail
cd "$(dirname "$0")/.."
unpriv=""
if [ -n "${RAAS_UNPRIV_USER:-}" ] && [ "$(id -u)" = 0 ] && id "$RAAS_UNPRIV_USER" >/dev/null 2>&1; then
  unpriv=$RAAS_UNPRIV_USER
  # One image cache both users can read (root's home is private); root builds, the user reuses.
  export RAAS_IMAGE_CACHE="${RAAS_IMAGE_CACHE:-/var/cache/raas/images}"
  mkdir -p "$RAAS_IMAGE_CACHE"
  chmod 755 "$RAAS_IMAGE_CACHE" "$(dirname "$RAAS_IMAGE_CACHE")"
  # The venv's interpreter may live under root's home (pyenv): let the user traverse (not list) there.
  d=$(dirname "$(readlink -f .venv/bin/python)")
  while [ "$d" != / ]; do chmod o+x "$d" 2>/dev/null || true; d=$(dirname "$d"); done
fi
# Build the shared test image up front (once; cached across runs) so no test's time limit pays for it.
bash scripts/build-test-image.sh
# In parallel (pytest-xdist): most tests wait on sandboxes, servers and subprocesses, not on the CPU.
# RAAS_TEST_WORKERS=0 runs them all in this one process. --dist loadfile keeps a file's tests (and its
# module fixtures) on one worker. --durations: where the suite spends its time shows in every CI log.
workers="${RAAS_TEST_WORKERS:-2}"
xdist=(-n "$workers")
if [ "$workers" != 0 ]; then xdist+=(--dist loadfile); fi
.venv/bin/pytest -p no:cacheprovider --durations=25 "${xdist[@]}" -m "not vllm" "$@"
if [ -n "$unpriv" ]; then
  echo "== rootless sandbox tests as $unpriv"
  home=$(getent passwd "$unpriv" | cut -d: -f6)
  # That user's own PATH (the venv, then the system's directories), not root's: what root's PATH puts
  # first (pyenv or conda shims, ~/.cargo/bin) lives in root's home, where that user may not execute.
  as_user=(runuser -u "$unpriv" -- env HOME="$home" RAAS_HOME="$home/.cache/raas" RAAS_IMAGE_CACHE="$RAAS_IMAGE_CACHE"
    PATH="$PWD/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
  "${as_user[@]}" .venv/bin/pytest -p no:cacheprovider "${xdist[@]}" -m "not vllm" tests/sandbox -k "apptainer or bwrap"
  "${as_user[@]}" .venv/bin/pytest -p no:cacheprovider "${xdist[@]}" -m "not vllm" tests/tasks/swe
fi
