#!/bin/sh
# Makes sure an aarch64 cross compiler, its C library and qemu-user are here,
# for `make ctest-aarch64` (interpose/aarch64.mk). Installs them with apt-get
# when they are missing and that is possible (Debian-like, root, a network);
# otherwise says why not (stderr). Exit status: 0 ready, with the qemu binary
# to run aarch64 programs with on stdout; 1 not possible here (the caller skips
# the aarch64 tests), so a machine without them still passes `make test`.
CROSS_CC=aarch64-linux-gnu-gcc
SYSROOT=/usr/aarch64-linux-gnu
PACKAGES="gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"

find_qemu() {
    command -v qemu-aarch64 || command -v qemu-aarch64-static
}

ready() {
    command -v "$CROSS_CC" >/dev/null && [ -e "$SYSROOT/lib/libc.so.6" ] && find_qemu >/dev/null
}

skip() {
    echo "aarch64 tests skipped: $*" >&2
    exit 1
}

if ! ready; then
    command -v apt-get >/dev/null ||
        skip "no $CROSS_CC or qemu-aarch64 here and no apt-get to install them (not Debian-like);" \
             "install an aarch64 cross gcc and qemu-user by hand"
    [ "$(id -u)" = 0 ] ||
        skip "no $CROSS_CC or qemu-aarch64 here and installing needs root: sudo apt-get install $PACKAGES"
    echo "aarch64: installing $PACKAGES with apt-get" >&2
    log=$(mktemp) || skip "cannot create a temporary file for apt-get's log"
    trap 'rm -f "$log"' EXIT
    # Bounded: a machine without a network fails here in seconds, not minutes.
    apt_get() {
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -q -o Acquire::Retries=0 \
            -o Acquire::http::Timeout=20 -o DPkg::Lock::Timeout=120 "$@" >"$log" 2>&1
    }
    # The package lists of a fresh image are often empty: update once when
    # the install finds nothing.
    apt_get install -y --no-install-recommends $PACKAGES ||
        { apt_get update && apt_get install -y --no-install-recommends $PACKAGES; } ||
        skip "apt-get install $PACKAGES failed (no network or no such packages?):" \
             "$(tail -n 1 "$log")"
    ready || skip "installed $PACKAGES, yet $CROSS_CC, $SYSROOT or qemu-aarch64 is missing"
fi
find_qemu
