#!/usr/bin/env bash
# Make the Dockerfile's base image from Debian's own packages, for a Docker engine that cannot
# reach an image registry: debootstrap a minimal bookworm and `docker import` it under the tag
# the Dockerfile's FROM names, so the build resolves it locally and pulls nothing.
#
#   sudo scripts/make_base_image.sh                  # -> debian:bookworm-slim, unless it exists
#   sudo scripts/make_base_image.sh --force TAG      # rebuild, under another tag
#
# Needs root, debootstrap and Debian's mirror (DEBIAN_MIRROR, default deb.debian.org).
# The result is what the registry's debian:bookworm-slim is: bookworm's minbase variant, apt
# set up for containers (no caches, no docs, no man pages, daemons not started by postinst),
# so the tag can stand in for it. About 30 s and 100 MB.
set -euo pipefail

force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
tag="${1:-debian:bookworm-slim}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

if [[ $force == 0 ]] && docker image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag exists (--force rebuilds it)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap: apt-get install debootstrap" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }

root="$(mktemp -d /tmp/radixmesh-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT
t0=$SECONDS
debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"

# apt inside containers: the mirror with updates and security, nothing cached or recommended.
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb $security $suite-security main
EOF
cat >"$root/etc/apt/apt.conf.d/90container" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOF
# No docs, man pages or translations in layers installed later (copyright files stay).
cat >"$root/etc/dpkg/dpkg.cfg.d/90container" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
# A package's postinst must not start its daemon during a build (as in Debian's official images).
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
find "$root/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$root"/usr/share/{man,info,locale}/* "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* \
       "$root"/var/log/* "$root"/tmp/*

tar --numeric-owner -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' \
  --message "debootstrap --variant=minbase $suite $mirror" - "$tag" >/dev/null
echo "base image $tag: $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}') in $((SECONDS - t0)) s"
