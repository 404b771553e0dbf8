#!/usr/bin/env bash
# install_missing WHO PACKAGE...: installs the Debian packages among PACKAGE
# that are not installed yet (with sudo when not root), saying so on stderr
# under the name WHO. Only checks, in milliseconds, when all are present.
# Sourced by setup.sh and libfabric2.sh.
install_missing() {
  local who=$1 pkg sudo=""
  shift
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  echo "$who: installing ${missing[*]}" >&2
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
