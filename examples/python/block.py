#!/usr/bin/env python3
"""block.py: N -> M restore of a BLOCK-distributed NumPy array.

A fresh run commits a 1-D array of --n float64 elements, element g holding
g + 0.5, cut into BLOCK parts over its ranks, and keeps it (PERSIST). The
next run, with any process count, restores its own BLOCK part of the same
array and checks every element:

    mpirun -np 4 python3 block.py   # "PYTHON COMMITTED ranks=4"
    mpirun -np 3 python3 block.py   # "PYTHON VERIFIED ranks=3 from=4"
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

import icheck


def block_part(n, size, rank):
    base, extra = divmod(n, size)
    count = base + (rank < extra)
    first = rank * base + min(rank, extra)
    return first, count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--app", default="python-block", help="application name at the service")
    parser.add_argument("--n", type=int, default=100_003, help="elements of the global array")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    writers = np.array([size], dtype=np.int32)

    if not icheck.init(args.app, comm):
        first, count = block_part(args.n, size, rank)
        x = np.arange(first, first + count, dtype=np.float64) + 0.5
        icheck.add_global("x", x, args.n, icheck.BLOCK)
        icheck.add_replicated("writers", writers, icheck.CONSTANT)
        icheck.commit()
        if rank == 0:
            print(f"PYTHON COMMITTED ranks={size}", flush=True)
        icheck.finalize(icheck.PERSIST)
        return 0

    icheck.restart()
    x = np.empty(icheck.local_count("x"), dtype=np.float64)
    icheck.add_global("x", x, args.n, icheck.BLOCK)
    icheck.add_replicated("writers", writers, icheck.CONSTANT)
    # A restore target of another element type is refused before anything is written.
    try:
        icheck.restore("x", np.zeros(x.size, dtype=np.int64))
    except TypeError:
        if rank == 0:
            print("PYTHON TYPE CHECKED", flush=True)
    icheck.restore("x", x)
    icheck.restore("writers", writers)
    first, count = block_part(args.n, size, rank)
    wrong = int(x.size != count) + int(np.count_nonzero(x != np.arange(first, first + x.size) + 0.5))
    wrong = comm.allreduce(wrong, op=MPI.SUM)
    if wrong:
        if rank == 0:
            print(f"PYTHON WRONG elements={wrong}", flush=True)
        comm.Abort(1)
    if rank == 0:
        print(f"PYTHON VERIFIED ranks={size} from={writers[0]}", flush=True)
    icheck.finalize(icheck.CLEANUP)
    return 0


if __name__ == "__main__":
    sys.exit(main())
