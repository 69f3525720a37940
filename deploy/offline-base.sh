#!/usr/bin/env bash
# Build a local base image for deploy/Dockerfile and the Prometheus service without pulling any image:
# a Debian 12 root made with debootstrap (Python 3.11, OpenJDK 17 for PySpark, Debian's prometheus, systemd for
# the test of the unit file under a real systemd) plus a
# venv /opt/sedax holding SeDAX's dependencies from wheels built on this machine, loaded with `docker import`.
#
#   deploy/offline-base.sh            build the image unless it exists; prints its tag as the last line
#   deploy/offline-base.sh --tag      only print the tag
#
# The tag is sedax-offline-base:<hash of this script and the dependency list>, so re-runs with the same
# inputs return at once, and a changed recipe builds a new tag (older tags are removed).
# Use it with:  SEDAX_BASE_IMAGE=<tag> SEDAX_PIP_OPTS="--no-index --no-build-isolation" PROMETHEUS_IMAGE=<tag>
#
# Needs: root (debootstrap, chroot), docker, debootstrap, a Python 3.11 with pip (SEDAX_PYTHON, default the
# repository's .venv/bin/python or python3) and access to a Debian mirror (SEDAX_DEBIAN_MIRROR) and PyPI.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
script="$repo/deploy/offline-base.sh"
mirror=${SEDAX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
python=${SEDAX_PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x $repo/.venv/bin/python ]]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
repository=sedax-offline-base
# Debian packages: python3 for the brokers, the JRE for Spark, prometheus for the Prometheus service; systemd and
# procps (/bin/kill, which the unit's ExecReload= runs) for tests/test_systemd.py, where a container whose PID 1 is
# systemd runs deploy/systemd/sedax-broker.service (the compose services never start it).
packages=python3,python3-venv,ca-certificates,openjdk-17-jre-headless,prometheus,systemd,procps

# The install requirements and the plot extra, plus what building the sedax wheel offline needs.
requirements=$("$python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = [*project["dependencies"], *project["optional-dependencies"]["plot"], "setuptools>=68", "wheel"]
print("\n".join(reqs))
PY
)
hash=$( { cat "$script"; echo "$requirements"; } | sha256sum | cut -c1-16)
tag="$repository:$hash"

if [[ ${1:-} == --tag ]]; then
    echo "$tag"
    exit 0
fi
# One build at a time: the compose test and the systemd test may ask at once (two pytest workers); the second
# waits here and then finds the image built.  The lock is on this script itself, so nothing is left behind.
exec 9<"$script"
flock 9
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag"
    exit 0
fi

fail() { echo "offline-base.sh: error: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || fail "building $tag needs root (debootstrap, chroot): run it with sudo"
command -v debootstrap >/dev/null || fail "debootstrap is missing: apt-get install debootstrap"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "$python is not Python 3.11; the wheels must match Debian 12's python3 (set SEDAX_PYTHON)"

work=$(mktemp -d /tmp/sedax-offline-base.XXXXXX)
wheels_pid=""
# --one-file-system: a failed second stage may leave /proc or /sys mounted inside the root.
trap '[[ -n $wheels_pid ]] && kill "$wheels_pid" 2>/dev/null; rm -rf --one-file-system "$work"' EXIT
root="$work/root"
started=$SECONDS

# Wheels are built on the host (its pip cache makes this quick) while debootstrap downloads.
mapfile -t reqs <<<"$requirements"
"$python" -m pip wheel -q --wheel-dir "$work/wheels" "${reqs[@]}" >"$work/wheels.log" 2>&1 &
wheels_pid=$!

phase() { echo "offline-base.sh: [$((SECONDS - started)) s] $*" >&2; }
phase "debootstrap bookworm from $mirror ..."
# Two stages so dpkg can be told, before it unpacks anything, not to fsync every file: the root is thrown
# away if anything fails, and per-file fsync is slow on slow disks.
if ! debootstrap --foreign --variant=minbase --include="$packages" bookworm "$root" "$mirror" \
        >"$work/debootstrap.log" 2>&1 \
    || ! echo force-unsafe-io >"$root/etc/dpkg/dpkg.cfg.d/unsafe-io" \
    || ! chroot "$root" /debootstrap/debootstrap --second-stage >>"$work/debootstrap.log" 2>&1; then
    tail -20 "$work/debootstrap.log" >&2
    fail "debootstrap failed (log above)"
fi
rm "$root/etc/dpkg/dpkg.cfg.d/unsafe-io"
if ! wait "$wheels_pid"; then
    cat "$work/wheels.log" >&2
    fail "building the wheels failed (log above)"
fi
wheels_pid=""

phase "installing $(ls "$work/wheels" | wc -l) wheels into /opt/sedax ..."
mv "$work/wheels" "$root/tmp/wheels"
# A clean environment: the host's PIP_* settings (index, find-links) mean nothing inside the new root.
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
in_root python3 -m venv /opt/sedax
# Byte-compiled once here, on all cores (pip compiles on one): the images run as a user that cannot write
# /opt/sedax, so every process would otherwise compile what it imports.
in_root /opt/sedax/bin/pip install -q --no-index --no-cache-dir --disable-pip-version-check --no-compile \
    --find-links /tmp/wheels "${reqs[@]}"
in_root /opt/sedax/bin/python -m compileall -q -j 0 /opt/sedax/lib >/dev/null
# Package caches and documentation are not needed at run time; moment-timezone (214 MB of time-zone data for
# the old Prometheus console pages) is not needed either: the test and the compose setup use the HTTP API.
rm -rf "$root"/tmp/wheels "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/doc \
    "$root"/usr/share/man "$root"/usr/share/locale "$root"/usr/share/javascript/moment-timezone

phase "docker import $tag ..."
tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.sedax.offline-base=$hash" \
    - "$tag" >/dev/null

# Earlier recipes' images are superseded; one still used by a container stays until that container is gone.
docker images "$repository" --format '{{.Repository}}:{{.Tag}}' | grep -vxF "$tag" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "offline-base.sh: built $tag in $((SECONDS - started)) s" >&2
echo "$tag"
