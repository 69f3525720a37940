#!/usr/bin/env bash
# Checks the README's test command on a fresh machine: a Debian 12 root made with debootstrap holding Python 3.11
# (Debian's python3) and nothing else, loaded as a throw-away image; in a container of it, as root, apt installs
# git, the repository is cloned afresh and the README's second command runs exactly as written (read from
# README.md), with CI=true.  The container has no Docker engine and no nftables, so those tests skip; Docker's
# default seccomp profile refuses `unshare -rm`, which the full-disk storage tests need.
#
#   sudo deploy/fresh-machine-check.sh [LOG]          LOG defaults to fresh-machine-check.log
#
# The clone is of the committed HEAD.  FRESH_PYTEST_ARGS (e.g. test files) is appended to that line, to run
# again only the tests that failed.
# Settings: SEDAX_DEBIAN_MIRROR (default deb.debian.org), FRESH_CPUS (docker --cpus, default 1),
# FRESH_CA_BUNDLE (a CA bundle for pip inside the container, for a network that re-signs TLS; exported there
# as PIP_CERT).  Needs root, docker and debootstrap; the image and the root are removed at the end.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
log=$(realpath -m "${1:-fresh-machine-check.log}")
mirror=${SEDAX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
fail() { echo "fresh-machine-check.sh: error: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || fail "debootstrap needs root: run it with sudo"
command -v debootstrap >/dev/null || fail "debootstrap is missing: apt-get install debootstrap"

# The README's second command, taken from the file so that exactly what a reader copies is run.
line=$(awk '/^```sh$/ {n++; next} /^```$/ {next} n == 2 {print; exit}' "$repo/README.md")
[[ $line == *pytest* ]] || fail "README.md's second sh block is not the test command: $line"
[[ -n ${FRESH_PYTEST_ARGS:-} ]] && line="$line $FRESH_PYTEST_ARGS"

tag=sedax-fresh-check:$$
work=$(mktemp -d /tmp/sedax-fresh.XXXXXX)
trap 'docker rmi -f "$tag" >/dev/null 2>&1 || true; rm -rf --one-file-system "$work"' EXIT
started=$SECONDS
echo "fresh-machine-check.sh: debootstrap bookworm (minbase + python3) ..." >&2
debootstrap --variant=minbase --include=python3 bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
# The sources of Debian's own container image: the release, its updates and security.
cat >"$work/root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
rm -rf "$work"/root/var/cache/apt/*.bin "$work"/root/var/lib/apt/lists/*
tar --numeric-owner -C "$work/root" -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$tag" >/dev/null
rm -rf --one-file-system "$work/root"
echo "fresh-machine-check.sh: image ready after $((SECONDS - started)) s; running the README's test command, log: $log" >&2

ca=()
[[ -n ${FRESH_CA_BUNDLE:-} ]] && ca=(-v "$FRESH_CA_BUNDLE:/etc/fresh-ca.pem:ro" -e PIP_CERT=/etc/fresh-ca.pem)
script="set -eu; python3 --version
apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends git >/dev/null
git clone -q /src /work/sedax && cd /work/sedax && git log -1 --format='commit %H'
echo \"\$ $line\"; start=\$(date +%s)
set +e; $line; rc=\$?
echo \"exit \$rc after \$((\$(date +%s) - start)) s\"; exit \$rc"
rc=0
docker run --rm --cpus "${FRESH_CPUS:-1}" -e CI=true "${ca[@]}" -v "$repo:/src:ro" "$tag" bash -c "$script" \
    >"$log" 2>&1 || rc=$?
tail -5 "$log" >&2
echo "fresh-machine-check.sh: exit $rc, $((SECONDS - started)) s in all" >&2
exit "$rc"
