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
