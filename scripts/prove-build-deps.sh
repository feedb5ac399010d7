#!/usr/bin/env bash
# Proves the README's Debian build prerequisites: builds the `outbox` binary (default features,
# `cargo build --locked -p txoutbox`) in a clean Debian root that has only Debian's minimal base and
# the packages the README lists (the line after `<!-- build-prerequisites -->`), with this
# machine's Rust toolchain and downloaded crates mounted into it. Needs root, debootstrap and
# Debian's mirror; takes a few minutes (a cold build). Prints the packages, the build's last lines
# and `outbox --version`; exits non-zero when the build fails.
#
#   sudo bash scripts/prove-build-deps.sh [ROOT_DIR]   # default /var/tmp/outbox-build-root
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
root=${1:-/var/tmp/outbox-build-root}
suite=${DEBIAN_SUITE:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" -ne 0 ]; then
  echo "run as root (debootstrap and chroot): sudo bash $0"
  exit 2
fi
command -v debootstrap >/dev/null || {
  echo "debootstrap is missing: apt-get install debootstrap"
  exit 2
}
# The packages, as the README states them (one place).
# shellcheck disable=SC2046,SC2116 # word splitting squeezes the list
packages=$(echo $(grep -A3 '<!-- build-prerequisites -->' README.md | grep -m1 'apt-get install' \
  | sed -E 's/.*apt-get install( -y)?//; s/#.*//'))
if [ -z "$packages" ]; then
  echo "README.md has no apt-get line after <!-- build-prerequisites -->"
  exit 2
fi
echo "packages from README.md: $packages"
# The image builds with the same list.
# shellcheck disable=SC2046,SC2116
image=$(echo $(grep -m1 'apt-get install' outbox-bin/deploy/Dockerfile \
  | sed -E 's/.*--no-install-recommends//; s/\\$//'))
if [ "$image" != "$packages" ]; then
  echo "outbox-bin/deploy/Dockerfile installs [$image], the README lists [$packages]"
  exit 1
fi

rustup_home=${RUSTUP_HOME:-$HOME/.rustup}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
toolchain=$(rustup show active-toolchain | cut -d' ' -f1)
mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() { # bind SOURCE TARGET [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounts+=("$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}

if [ ! -x "$root/usr/bin/apt-get" ]; then
  rm -rf "$root"
  debootstrap --variant=minbase "$suite" "$root" "$mirror"
fi
mount -t proc proc "$root/proc"
mounts+=("$root/proc")
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" apt-get update -qq
# shellcheck disable=SC2086 # the package list splits into words
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages
chroot "$root" dpkg-query -W -f '${Package}\n' | sort >"$root/packages.txt"
echo "the root holds $(wc -l <"$root/packages.txt") packages (Debian's minbase and those above)"

bind "$repo" "$root/src" ro
bind "$rustup_home" "$root/rustup" ro
# The crates this machine downloaded (the build runs offline); cargo writes its lock there.
bind "$cargo_home/registry" "$root/cargo/registry"
mkdir -p "$root/build"
status=0
chroot "$root" env -i PATH="/rustup/toolchains/$toolchain/bin:/usr/bin:/bin" HOME=/root \
  RUSTUP_HOME=/rustup CARGO_HOME=/cargo RUSTUP_TOOLCHAIN="$toolchain" \
  sh -c 'cd /src && cargo build --locked --offline -p txoutbox --target-dir /build/target' \
  >"$root/build/log" 2>&1 || status=$?
tail -n 5 "$root/build/log"
if [ "$status" -ne 0 ]; then
  grep -E '^(error|warning: .*failed)' -A 20 "$root/build/log" | head -n 60
  echo "the build failed in a root with only these packages: $packages"
  exit 1
fi
chroot "$root" /build/target/debug/outbox --version
echo "built in a clean Debian $suite root with only: $packages"
