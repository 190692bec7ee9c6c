#!/usr/bin/env bash
# Install the Debian packages that end-to-end tests drive for real. Idempotent; needs root to install.
#
#   prometheus   the server and promtool (tests/daemon/test_prometheus.py)
#   podman, runc, catatonit, mmdebstrap   build and run the image, play Kubernetes pods
#                (tests/daemon/test_container.py)
#   slurm-wlm, munge   a real one-node Slurm cluster (tests/slurm/, benchmarks/bench_slurm.py)
#   iproute2     `ip netns` and veth pairs for two-node jobs (tests/multinode/, benchmarks/bench_multinode.py)
#   bindfs       a real FUSE mount, refused as a checkpoint root (tests/client/test_checkpoint_fuse_root.py)
#   nodejs, npm  Node.js for the Azure emulator Azurite (scripts/install-emulators.sh, tests/storage/);
#                skipped when `node` and `npm` are already there (e.g. NodeSource's nodejs, npm included)
#
# The README and docs/development.md list the same packages (tests/test_docs.py checks it).
# Without root, missing packages are reported loudly and the tests that need them skip.
set -euo pipefail

declare -A command_of=([prometheus]=promtool [podman]=podman [runc]=runc [catatonit]=catatonit
                       [mmdebstrap]=mmdebstrap [slurm-wlm]=slurmctld [munge]=munged
                       [iproute2]=ip [bindfs]=bindfs [nodejs]=node [npm]=npm)
missing=()
for package in "${!command_of[@]}"; do
    PATH="$PATH:/usr/sbin:/usr/libexec/podman" command -v "${command_of[$package]}" >/dev/null \
        || missing+=("$package")
done
[[ ${#missing[@]} -eq 0 ]] && { echo "system packages ready"; exit 0; }

if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "WARNING: cannot install ${missing[*]} (needs root and apt-get): the tests that drive them WILL SKIP" >&2
    exit 0
fi
echo "installing ${missing[*]} from Debian"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "system packages ready"
