#!/usr/bin/env python3
"""heat1d.py: a 1-D heat equation over MPI ranks with NumPy, checkpointed
with icheck's Python bindings; the Python twin of examples/heat2d.

    mpirun -np 4 python3 heat1d.py --app heat --n 4096 --iters 200 --every 20
    mpirun -np 4 python3 heat1d.py --app heat ... --fail-at 130   # killed
    mpirun -np 4 python3 heat1d.py --app heat ...                 # restarts

Prints "RESTARTED at iteration N" after a restart and, at the end,
"CHECKSUM x": a position-weighted sum of the cells' bits, equal only if
every cell is. The rod is a BLOCK-distributed array (icheck.add_global), so
a run restarts with another process count too (icheck run --policy shrink),
and the checksum does not depend on the count.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import icheck


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--app", default="heat1d-py", help="application name at the service")
    parser.add_argument("--n", type=int, default=4096, help="cells of the rod")
    parser.add_argument("--iters", type=int, default=200, help="time steps")
    parser.add_argument("--every", type=int, default=20, help="commit every this many steps")
    parser.add_argument("--fail-at", type=int, default=-1, help="rank 0 kills itself after this step")
    parser.add_argument("--asynchronous", action="store_true", help="commit asynchronously")
    parser.add_argument("--probe-every", type=int, default=0, help="probe for new agents every this many commits")
    parser.add_argument("--step-ms", type=float, default=0.0, help="sleep this long per step (a longer job)")
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    base, extra = divmod(args.n, size)
    cells = base + (rank < extra)
    first = rank * base + min(rank, extra)
    # The rank's cells with one halo cell either side: a wave along the
    # rod (so that every cell counts in the checksum) and a hot left end.
    u = np.zeros(cells + 2)
    u[1:-1] = np.sin(0.05 * np.arange(first, first + cells))
    if rank == 0:
        u[0] = 100.0
    step = np.zeros(1, dtype=np.int64)
    interior = u[1:-1]  # a contiguous view: icheck reads and restores it in place

    restarting = icheck.init(args.app, comm)
    icheck.add_global("u", interior, args.n, icheck.BLOCK)
    # Every process holds the same step: rank 0's is restored everywhere.
    icheck.add_replicated("step", step, icheck.CONSTANT)
    if args.asynchronous:
        icheck.enable_asynchronous(True)
    if restarting:
        icheck.restart()
        icheck.restore("u", interior)
        icheck.restore("step", step)
        if rank == 0:
            print(f"RESTARTED at iteration {step[0]}", flush=True)
        step[0] += 1
    elif rank == 0:
        print("FRESH start", flush=True)

    left = rank - 1 if rank > 0 else MPI.PROC_NULL
    right = rank + 1 if rank < size - 1 else MPI.PROC_NULL
    commits = 0
    while step[0] <= args.iters:
        comm.Sendrecv(u[1:2], dest=left, recvbuf=u[-1:], source=right)
        comm.Sendrecv(u[-2:-1], dest=right, recvbuf=u[0:1], source=left)
        interior[:] = interior + 0.25 * (u[:-2] - 2.0 * interior + u[2:])
        if step[0] % args.every == 0:
            icheck.commit()
            commits += 1
            if rank == 0:
                print(f"COMMITTED iteration {step[0]}", flush=True)
            if args.probe_every and commits % args.probe_every == 0:
                agents = icheck.probe(remaining_commits=(args.iters - int(step[0])) // args.every)
                if rank == 0:
                    print(f"PROBE agents={agents}" if agents else "PROBE unchanged", flush=True)
        if args.step_ms:
            time.sleep(args.step_ms / 1000.0)
        if step[0] == args.fail_at and rank == 0:
            print(f"FAULT injected at iteration {step[0]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        step[0] += 1
    if args.asynchronous:
        icheck.wait()

    # Exact and independent of the decomposition: sum (mod 2^64) of each
    # cell's bits times an odd weight of its global position.
    weights = 2 * np.arange(first, first + cells, dtype=np.uint64) + np.uint64(1)
    local = np.array([np.sum(interior.view(np.uint64) * weights, dtype=np.uint64)], dtype=np.uint64)
    total = np.zeros(1, dtype=np.uint64)
    comm.Reduce(local, total, op=MPI.SUM, root=0)
    if rank == 0:
        print(f"CHECKSUM {int(total[0]):016x}", flush=True)
    icheck.finalize(icheck.CLEANUP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
