#!/usr/bin/env bash
# Builds libfabric 2.x into a private prefix, so icheck can be built and tested
# against a 2.x API beside Debian 12's libfabric 1.17 (which stays the system
# library). The source is Debian 13's own: the orig tarball of its libfabric
# package, fetched from deb.debian.org and checked against Debian's SHA-256.
# Only the providers icheck tests with are built (tcp, shm, sockets, rxm, udp).
#
# Idempotent: when the prefix is complete it only prints it, in milliseconds.
# Prints the prefix on stdout; progress goes to stderr.
# Usage: prefix=$(bash .ci/libfabric2.sh)
#        ICHECK_LIBFABRIC2_PREFIX=/some/dir bash .ci/libfabric2.sh
set -euo pipefail

VERSION=2.1.0
SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
URL=http://deb.debian.org/debian/pool/main/libf/libfabric/libfabric_${VERSION}.orig.tar.xz
if [ "$(id -u)" -eq 0 ]; then default_prefix=/opt/icheck/libfabric-$VERSION; else default_prefix=$HOME/.cache/icheck/libfabric-$VERSION; fi
PREFIX=${ICHECK_LIBFABRIC2_PREFIX:-$default_prefix}
STAMP=$PREFIX/.icheck-complete

if [ -f "$STAMP" ]; then
  echo "$PREFIX"
  exit 0
fi

# Build tools: the Debian tarball is a git export without a configure script.
source "$(dirname "${BASH_SOURCE[0]}")/packages.sh"
install_missing "libfabric $VERSION" autoconf automake libtool make gcc curl xz-utils

work=$(mktemp -d /tmp/icheck-libfabric2.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "libfabric $VERSION: fetching $URL" >&2
curl -fsS --retry 3 -m 300 -o "$work/src.tar.xz" "$URL"
echo "$SHA256  $work/src.tar.xz" | sha256sum -c --quiet - >&2 || {
  echo "libfabric $VERSION: $URL does not match Debian's SHA-256 $SHA256" >&2
  exit 1
}
tar -C "$work" -xf "$work/src.tar.xz"
cd "$work/libfabric-$VERSION"
log=$work/build.log
echo "libfabric $VERSION: configuring and building into $PREFIX (about a minute on 2 cores)" >&2
rm -rf "$PREFIX"
if ! {
  ./autogen.sh &&
    ./configure --prefix="$PREFIX" --disable-static --enable-only \
      --enable-tcp --enable-shm --enable-sockets --enable-rxm --enable-udp &&
    make -j"$(nproc)" &&
    make install
} >"$log" 2>&1; then
  tail -40 "$log" >&2
  echo "libfabric $VERSION: build failed (last lines above)" >&2
  exit 1
fi
touch "$STAMP"
echo "libfabric $VERSION: ready in $PREFIX" >&2
echo "$PREFIX"
