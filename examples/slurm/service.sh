#!/bin/bash
# For administrators: the icheck service on a Slurm cluster. The controller
# runs here (a service or login node); the managers run as Slurm jobs on the
# checkpoint partition, two to start with, up to eight when checkpoint
# memory runs short (is_dynamic_hs = true in the state directory's
# dynamic.toml). The state directory and the icheck binary must be at the
# same paths on the checkpoint nodes (a shared file system).
#
#   examples/slurm/service.sh up      # start
#   examples/slurm/service.sh down    # stop: cancels every manager job
set -euo pipefail
STATE=${ICHECK_STATE:-/shared/icheck}
case "${1:-}" in
up)
    mkdir -p "$STATE"
    # Scale out through Slurm (Algorithm 8) and give back drained nodes
    # (Algorithm 9): an administrator's `scontrol update NodeName=N
    # State=DRAIN` makes the controller move that node's versions away
    # and cancel its manager job.
    [ -e "$STATE/dynamic.toml" ] || printf 'is_dynamic_hs = true\n' > "$STATE/dynamic.toml"
    exec icheck up --detach --slurm --partition ckpt --nodes 2..8 \
        --sbatch-arg=--time=7-00:00:00 --state-dir "$STATE"
    ;;
down)
    exec icheck down --state-dir "$STATE"
    ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
