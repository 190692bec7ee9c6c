#!/usr/bin/env bash
# Build the spotguard image (deploy/docker/Dockerfile) without reaching any image registry or, inside
# the build, any package index: the wheels are made here, on the host, and copied in.
#
#   scripts/build-image.sh [--tag spotguard:latest] [--extras cloud] [--base IMAGE | --base-from-debian]
#                          [--engine docker|podman]
#
# --base-from-debian makes a minimal Debian bookworm with python3 by mmdebstrap (Debian packages only)
# and imports it as localhost/spotguard-base:bookworm, once. Engine defaults: docker, else podman
# (with runc and cgroupfs where crun or systemd cgroups do not work, as on some VMs: set ENGINE_ARGS).
set -euo pipefail
cd "$(dirname "$0")/.."

tag=spotguard:latest extras=cloud base="" from_debian=0
engine=$(command -v docker || command -v podman || true)
while [[ $# -gt 0 ]]; do
    case $1 in
        --tag) tag=$2; shift ;;
        --extras) extras=$2; shift ;;
        --base) base=$2; shift ;;
        --base-from-debian) from_debian=1 ;;
        --engine) engine=$(command -v "$2"); shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[[ -n "$engine" ]] || { echo "neither docker nor podman found" >&2; exit 1; }
read -r -a engine_args <<<"${ENGINE_ARGS:-}"
run_engine() { "$engine" "${engine_args[@]}" "$@"; }

if [[ $from_debian == 1 ]]; then
    base=localhost/spotguard-base:bookworm
    if ! run_engine image exists "$base" 2>/dev/null && ! run_engine image inspect "$base" >/dev/null 2>&1; then
        echo "making $base with mmdebstrap"
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm - \
            | run_engine import - "$base"
    fi
fi

python=${PYTHON:-$(command -v python3)}
[[ -x .venv/bin/python ]] && python=.venv/bin/python
context=build/image
rm -rf "$context"; mkdir -p "$context/wheels"
# torch is pinned to the host's version: an open range pulls the newest CUDA build (several GB).
constraints=()
if torch=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null); then
    echo "torch==$torch" >"$context/constraints.txt"
    constraints=(--constraint "$context/constraints.txt")
fi
echo "building the wheelhouse for spotguard[$extras]"
"$python" -m pip wheel --quiet --disable-pip-version-check "${constraints[@]}" \
    --wheel-dir "$context/wheels" ".[$extras]"

format=()
[[ $(basename "$engine") == podman ]] && format=(--format docker)   # keeps HEALTHCHECK
run_engine build "${format[@]}" --tag "$tag" --build-arg "EXTRAS=$extras" \
    ${base:+--build-arg "BASE=$base"} -f deploy/docker/Dockerfile "$context"
echo "built $tag"
