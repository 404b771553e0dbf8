#!/usr/bin/env bash
# Installs whatever this project needs and is missing on a Debian 12 machine.
# Idempotent: when everything is present it only checks, in well under a second.
set -euo pipefail

PACKAGES=(
  build-essential pkg-config libclang-dev clang   # bindgen and the libfabric shim
  libfabric-dev libfabric-bin                     # the RDMA fabric (tcp, shm, sockets, ...)
  openmpi-bin libopenmpi-dev gfortran             # MPI applications, C and Fortran
  iproute2 procps                                 # network namespaces, process tools in tests
  python3-venv python3-pip python3-setuptools     # the Python package (pip install ./python)
  python3-numpy python3-mpi4py                    # ... and what it runs on
  cmake                                           # find_package(icheck) in the CMake test
  slurm-wlm munge                                 # a test-local Slurm (examples/rust/tests/slurm.rs)
)

source "$(dirname "${BASH_SOURCE[0]}")/packages.sh"
install_missing "icheck setup" "${PACKAGES[@]}"

if ! command -v cargo >/dev/null 2>&1; then
  for dir in "$HOME/.cargo/bin" /usr/local/cargo/bin; do
    [ -x "$dir/cargo" ] && export PATH="$dir:$PATH"
  done
fi
command -v cargo >/dev/null 2>&1 || {
  echo "icheck setup: cargo not found; install a Rust toolchain (https://rustup.rs) and re-run" >&2
  exit 1
}

# A host whose own name does not resolve (a container or chroot without an
# /etc/hosts entry) makes every MPI_Init wait on DNS: 5-10 s per process in a
# fresh Debian root, enough to break the tests' timing. Said, not changed:
# /etc/hosts is the machine's.
if ! getent hosts "$(hostname)" >/dev/null 2>&1; then
  echo "icheck setup: warning: this host's name '$(hostname)' does not resolve; every MPI_Init will wait on name lookups. Add a line '127.0.1.1 $(hostname)' to /etc/hosts." >&2
fi
