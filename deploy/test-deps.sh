#!/usr/bin/env bash
# Installs what the test suite needs beyond Python's own packages, on Debian or Ubuntu (apt), and only what is
# missing, so a second run costs a few `command -v` checks.  The README's test command runs it first; a
# newcomer runs that line, and .ci/run calls exactly the same line.
#
#   openssl                  the development CA and broker certificates (sedax certs, the TLS tests)
#   python3-venv             `python3 -m venv` on a Debian Python without ensurepip
#   openjdk-17-jre-headless  Java for PySpark (sedax analyze, local and standalone Spark tests)
#   prometheus               a real Prometheus scraping a cluster (tests/test_metrics.py)
#   systemd, procps          systemd-analyze, which checks the shipped unit file (tests/test_systemd.py; nothing
#                            is started with it), and /bin/kill, which the unit's ExecReload= runs and
#                            `systemd-analyze verify` looks for
#   debootstrap              the compose test's local base image (nothing can be pulled); only where a Docker
#                            engine answers, since elsewhere that test is skipped
#
# Not root: the same through sudo.  Not apt: says what is missing and stops (exit 1).
set -euo pipefail

need=()
command -v openssl >/dev/null || need+=(openssl)
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v prometheus >/dev/null || need+=(prometheus)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ -x /bin/kill ] || need+=(procps)
if command -v docker >/dev/null && docker info >/dev/null 2>&1 && ! command -v debootstrap >/dev/null; then
    need+=(debootstrap)
fi
((${#need[@]})) || exit 0

if ! command -v apt-get >/dev/null; then
    echo "deploy/test-deps.sh: missing ${need[*]}; install them with your package manager, then run the tests again" >&2
    exit 1
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "deploy/test-deps.sh: installing ${need[*]} needs root or sudo" >&2; exit 1; }
    sudo=(sudo)
fi
echo "deploy/test-deps.sh: installing ${need[*]}" >&2
"${sudo[@]}" apt-get update -q >/dev/null
# No recommends: prometheus would bring its node exporter, the JRE a desktop stack.
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
