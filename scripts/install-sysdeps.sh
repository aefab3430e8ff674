#!/usr/bin/env bash
# Installs the system packages raas uses: bubblewrap (sandbox), debootstrap (image builds), and,
# where the shared installer is present, rootless Apptainer. Idempotent; needs root (or sudo) only
# when something is missing.
set -euo pipefail
need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v newuidmap >/dev/null 2>&1 || need+=(uidmap)
command -v make >/dev/null 2>&1 || need+=(make)
command -v git >/dev/null 2>&1 || need+=(git)
command -v gcc >/dev/null 2>&1 || need+=(gcc g++)
# cmake only builds llama.cpp from source (make install LLAMA_FROM_SOURCE=1); the default server is prebuilt.
if [ -n "${LLAMA_FROM_SOURCE:-}" ]; then command -v cmake >/dev/null 2>&1 || need+=(cmake); fi
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
if [ ${#need[@]} -gt 0 ]; then
  echo "install-sysdeps: installing ${need[*]}"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" ca-certificates >/dev/null
fi
# Apptainer is optional for `make run` (the main job uses bwrap); the tests use it when present.
if ! command -v apptainer >/dev/null 2>&1; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  if [ -f "$here/../shared/tools/install-apptainer.sh" ]; then
    $SUDO bash "$here/../shared/tools/install-apptainer.sh"
  else
    echo "install-sysdeps: apptainer not found; the apptainer backend will be unavailable (see README)" >&2
  fi
fi
