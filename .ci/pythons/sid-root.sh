#!/usr/bin/env bash
# Makes a Debian sid root (debootstrap --variant=minbase) holding CPython 3.14 and 3.15 from sid's binary
# packages (python3.14, python3.15 with -dev and -venv) and a C compiler, in a cache outside the clone.
# Their builds need sid's libc, hence a root entered with chroot rather than an install on this machine.
# A rerun finds the finished root and does nothing. Prints the root's path last.
#   CAI_DLPACK_CACHE  cache folder (default ~/.cache/cai-dlpack)
#   DEBIAN_MIRROR     archive to read (default: the first deb.debian.org-style URI in this machine's apt sources)
set -euo pipefail
cache=${CAI_DLPACK_CACHE:-$HOME/.cache/cai-dlpack}
root=$cache/sid-root
if [ -f "$root/.cai-dlpack-ready" ]; then echo "$root"; exit 0; fi
command -v debootstrap >/dev/null ||
  { echo "sid-root: 'debootstrap' is missing (Debian: apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "sid-root: debootstrap and chroot need root" >&2; exit 1; }
mirror=${DEBIAN_MIRROR:-$(grep -h -o -E 'https?://[^ ]*/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null | head -n 1 | tr -d ' ' || true)}
mirror=${mirror:-http://deb.debian.org/debian}
rm -rf "$root"; mkdir -p "$cache"
nice debootstrap --variant=minbase --include=ca-certificates sid "$root" "$mirror" >&2
# The host's name servers, so pip inside the root reaches the package index.
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends \
  python3.14 python3.14-dev python3.14-venv python3.15 python3.15-dev python3.15-venv gcc libc6-dev >&2
chroot "$root" apt-get clean
for v in 3.14 3.15; do chroot "$root" "python$v" -c "import venv, sys; print(sys.version)" >&2; done
touch "$root/.cai-dlpack-ready"
echo "$root"
