"""ctypes declarations of libicheck's C API (include/icheck.h)."""

import ctypes
import ctypes.util
import os
from pathlib import Path

from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_double,
    c_int,
    c_int64,
    c_size_t,
    c_uint64,
    c_void_p,
)

# Element types (ICHECK_CHAR ... ICHECK_BINARY).
CHAR, INT, LONG, FLOAT, DOUBLE, BINARY = 1, 2, 3, 4, 5, 6
# icheck_init's status.
FRESH, RESTART = 0, 1
# icheck_finalize modes.
CLEANUP, PERSIST = 0, 1
# Attributes of replicated data (icheck_add_adapt).
CONSTANT, SIZE, RANK, DEFAULT, DEFAULT_JOINING, VOLATILE = 1, 2, 3, 4, 5, 6
# Distributions (icheck_add_adapt_global).
BLOCK, CYCLIC, PREDEFINED, MANUAL = 1, 2, 3, 4

# The collective operations libicheck calls back (icheck_comm_ops in
# icheck-ffi/c/icheck_mpi.c; IcheckCommOps in icheck-ffi/src/comm.rs).
BarrierFn = CFUNCTYPE(c_int, c_void_p, c_int)
AllreduceFn = CFUNCTYPE(c_int, c_void_p, POINTER(c_uint64), c_int, c_int)
BcastFn = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_int)
AllgatherFn = CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_void_p, c_int)
DestroyFn = CFUNCTYPE(None, c_void_p)


class CommOps(Structure):
    _fields_ = [
        ("ctx", c_void_p),
        ("rank", c_int),
        ("size", c_int),
        ("node_rank", c_int),
        ("node_index", c_int),
        ("nodes", c_int),
        ("max_per_node", c_int),
        ("barrier", BarrierFn),
        ("allreduce_u64", AllreduceFn),
        ("bcast", BcastFn),
        ("allgather", AllgatherFn),
        ("destroy", DestroyFn),
    ]


class Hints(Structure):
    _fields_ = [("remaining_commits", c_int)]


def _candidates():
    """Where libicheck may be, in the order tried."""
    given = os.environ.get("ICHECK_LIBRARY")
    if given:
        yield given
    bundled = Path(__file__).resolve().parent / "libicheck.so"
    if bundled.is_file():
        yield str(bundled)
    found = ctypes.util.find_library("icheck")
    if found:
        yield found
    for prefix in ("/usr/local", "/opt/icheck"):
        path = Path(prefix) / "lib" / "libicheck.so"
        if path.is_file():
            yield str(path)


def load():
    """Opens libicheck and declares its functions' signatures."""
    tried = []
    for candidate in _candidates():
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError as error:
            tried.append(f"{candidate}: {error}")
    else:
        detail = "; ".join(tried) if tried else "none found"
        raise ImportError(
            "icheck: cannot load libicheck.so (tried ICHECK_LIBRARY, the copy bundled at "
            f"pip install time, the system's library paths: {detail}); install it with "
            "`make install` or point ICHECK_LIBRARY at it"
        )
    declare = [
        ("icheck_init_with_ops", c_int, [c_char_p, c_char_p, POINTER(CommOps), POINTER(c_int)]),
        ("icheck_init_serial", c_int, [c_char_p, c_char_p, POINTER(c_int)]),
        ("icheck_add", c_int, [c_char_p, c_void_p, c_size_t, c_int]),
        ("icheck_add_adapt", c_int, [c_char_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p, c_void_p]),
        ("icheck_add_adapt_global", c_int, [c_char_p, c_void_p, c_size_t, c_int, c_int64, c_int, c_int64, c_void_p]),
        ("icheck_local_count", c_int64, [c_char_p]),
        ("icheck_redistribute", c_int, [c_char_p, c_void_p, c_size_t]),
        ("icheck_commit", c_int, []),
        ("icheck_enable_asynchronous", c_int, [c_int]),
        ("icheck_wait", c_int, []),
        ("icheck_restart", c_int, []),
        ("icheck_label_type", c_int, [c_char_p]),
        ("icheck_restore", c_int, [c_char_p, c_void_p, c_size_t]),
        ("icheck_restart_all", c_int, []),
        ("icheck_probe_agents", c_int, [POINTER(Hints)]),
        ("icheck_protected_version", c_int, [POINTER(c_int64)]),
        ("icheck_wait_protected", c_int, [c_int64, c_double]),
        ("icheck_finalize", c_int, [c_int]),
        ("icheck_strerror", c_char_p, [c_int]),
        ("icheck_last_error", c_char_p, []),
        ("icheck_abi_version", c_int, []),
    ]
    for name, restype, argtypes in declare:
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    lib.path = candidate
    return lib
