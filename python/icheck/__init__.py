"""icheck: checkpoint an MPI application's NumPy arrays into the memory of
icheck's checkpoint nodes, and restart from them.

A thin layer over libicheck's C API (include/icheck.h) through ctypes:
arrays are registered by address, so the service reads them (and a restore
writes them) in place, without copies in Python.

    from mpi4py import MPI
    import numpy as np
    import icheck

    grid = np.zeros(1 << 20)
    step = np.zeros(1, dtype=np.int64)
    restarting = icheck.init("heat", MPI.COMM_WORLD)
    icheck.add("grid", grid)
    icheck.add("step", step)
    if restarting:
        icheck.restart()
        icheck.restore("grid", grid)
        icheck.restore("step", step)
    while step[0] < 1000:
        ...                       # compute
        if step[0] % 100 == 0:
            icheck.commit()       # collective
        step[0] += 1
    icheck.finalize(icheck.CLEANUP)

The service is found through $ICHECK_CONFIG (or the `config` argument);
libicheck through $ICHECK_LIBRARY, the copy bundled at `pip install`, or
the system's library path. Every failure raises icheck.Error, whose text
names the call, the code and the detail (label, sizes, peer).
"""

import ctypes
import sys
import threading
import traceback

import numpy

from . import _native
from ._native import (  # noqa: F401  (re-exported constants)
    BINARY,
    BLOCK,
    CHAR,
    CLEANUP,
    CONSTANT,
    CYCLIC,
    DEFAULT,
    DEFAULT_JOINING,
    DOUBLE,
    FLOAT,
    INT,
    LONG,
    MANUAL,
    PERSIST,
    RANK,
    SIZE,
)

__all__ = [
    "Error",
    "init",
    "add",
    "add_replicated",
    "add_global",
    "commit",
    "enable_asynchronous",
    "wait",
    "restart",
    "restore",
    "restart_all",
    "label_type",
    "local_count",
    "redistribute",
    "probe",
    "protected_version",
    "wait_protected",
    "finalize",
    "abi_version",
    "library_path",
]

_ERROR_NAMES = {
    -1: "ICHECK_ERR_NULL",
    -2: "ICHECK_ERR_ORDER",
    -3: "ICHECK_ERR_ARG",
    -4: "ICHECK_ERR_CONFIG",
    -5: "ICHECK_ERR_CONTROLLER",
    -6: "ICHECK_ERR_AGENT",
    -7: "ICHECK_ERR_FABRIC",
    -8: "ICHECK_ERR_LABEL",
    -9: "ICHECK_ERR_SIZE",
    -10: "ICHECK_ERR_TYPE",
    -11: "ICHECK_ERR_NO_CHECKPOINT",
    -12: "ICHECK_ERR_CORRUPT",
    -13: "ICHECK_ERR_INCOMPLETE",
    -14: "ICHECK_ERR_RANKS",
    -15: "ICHECK_ERR_UNSUPPORTED",
    -16: "ICHECK_ERR_INTERNAL",
    -17: "ICHECK_ERR_ADAPT",
    -18: "ICHECK_ERR_ACCESS",
}

# NumPy element types with a C counterpart; any other dtype is stored as
# ICHECK_BINARY (bytes), which restores bit-exact but cannot be distributed.
_TYPE_OF_DTYPE = {
    numpy.dtype(numpy.int8): CHAR,
    numpy.dtype(numpy.int32): INT,
    numpy.dtype(numpy.int64): LONG,
    numpy.dtype(numpy.float32): FLOAT,
    numpy.dtype(numpy.float64): DOUBLE,
}
_TYPE_SIZE = {CHAR: 1, INT: 4, LONG: 8, FLOAT: 4, DOUBLE: 8, BINARY: 1}
_TYPE_NAME = {CHAR: "int8", INT: "int32", LONG: "int64", FLOAT: "float32", DOUBLE: "float64", BINARY: "bytes"}


class Error(RuntimeError):
    """A failed icheck call: `code` is the ICHECK_ERR_* value, `name` its
    name, `detail` libicheck's description of this failure (or None)."""

    def __init__(self, call, code, detail):
        self.call = call
        self.code = code
        self.name = _ERROR_NAMES.get(code, f"code {code}")
        self.detail = detail
        reason = _lib().icheck_strerror(code).decode(errors="replace")
        text = f"{call}: {self.name} ({reason})"
        if detail:
            text += f": {detail}"
        super().__init__(text)


_lock = threading.Lock()
_library = None
# Arrays registered with the service: kept alive here, since the service
# reads and writes their memory until finalize.
_registered = {}
# The communicator operations libicheck calls back (kept alive until finalize).
_comm = None


def _lib():
    global _library
    with _lock:
        if _library is None:
            _library = _native.load()
        return _library


def library_path():
    """The libicheck file this package loaded."""
    return _lib().path


def _check(call, code):
    if code < 0:
        detail = _lib().icheck_last_error()
        raise Error(call, code, detail.decode(errors="replace") if detail else None)
    return code


def _text(value, what):
    if not isinstance(value, str):
        raise TypeError(f"icheck: {what} must be a str, not {type(value).__name__}")
    return value.encode()


def _region(array, label, what):
    """(address, count, type) of a NumPy array the service may read and write in place."""
    if not isinstance(array, numpy.ndarray):
        raise TypeError(f"icheck: {what}({label!r}): needs a numpy.ndarray, not {type(array).__name__}")
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        raise ValueError(
            f"icheck: {what}({label!r}): the array is not contiguous (a strided view?); "
            "pass numpy.ascontiguousarray(...) kept in a variable"
        )
    if not array.flags.writeable:
        raise ValueError(f"icheck: {what}({label!r}): the array is read-only; restore writes into it")
    kind = _TYPE_OF_DTYPE.get(array.dtype, BINARY)
    count = array.nbytes if kind == BINARY else array.size
    return array.ctypes.data, count, kind


def _mpi_ops(comm):
    """libicheck's collective operations over an mpi4py communicator, the
    Python twin of icheck-ffi/c/icheck_mpi.c."""
    from mpi4py import MPI

    if not isinstance(comm, MPI.Comm) or not comm.Is_intra():
        raise TypeError(f"icheck: init: comm must be an mpi4py intracommunicator, not {comm!r}")
    comm = comm.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    node_rank, node_size = node.Get_rank(), node.Get_size()
    leader = node_rank == 0
    nodes = comm.allreduce(int(leader), op=MPI.SUM)
    max_per_node = comm.allreduce(node_size, op=MPI.MAX)
    leaders = comm.Split(0 if leader else MPI.UNDEFINED, rank)
    node_index = 0
    if leaders != MPI.COMM_NULL:
        node_index = leaders.Get_rank()
        leaders.Free()
    node_index = node.bcast(node_index, root=0)
    groups = (comm, node)
    reductions = (MPI.SUM, MPI.MIN, MPI.MAX)

    def guarded(body):
        # An exception must not cross into C: report it and return an
        # error, on which libicheck aborts as MPI's default handler would.
        def call(*args):
            try:
                body(*args)
                return 0
            except BaseException:  # noqa: BLE001 - anything here is fatal
                traceback.print_exc()
                sys.stderr.flush()
                return 1

        return call

    def as_bytes(address, length):
        if not length:
            return numpy.empty(0, dtype=numpy.uint8)
        return numpy.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))

    @guarded
    def barrier(_ctx, node_only):
        groups[node_only].Barrier()

    @guarded
    def allreduce_u64(_ctx, value, op, node_only):
        buffer = numpy.ctypeslib.as_array(value, shape=(1,))
        groups[node_only].Allreduce(MPI.IN_PLACE, [buffer, MPI.UINT64_T], op=reductions[op])

    @guarded
    def bcast(_ctx, address, length, node_only):
        groups[node_only].Bcast([as_bytes(address, length), MPI.BYTE], root=0)

    @guarded
    def allgather(_ctx, send, length, receive, node_only):
        group = groups[node_only]
        group.Allgather([as_bytes(send, length), MPI.BYTE], [as_bytes(receive, length * group.Get_size()), MPI.BYTE])

    def destroy(_ctx):
        try:
            if not MPI.Is_finalized():
                node.Free()
                comm.Free()
        except BaseException:  # noqa: BLE001 - nothing to do about it at finalize
            traceback.print_exc()

    ops = _native.CommOps(
        None,
        rank,
        size,
        node_rank,
        node_index,
        nodes,
        max_per_node,
        _native.BarrierFn(barrier),
        _native.AllreduceFn(allreduce_u64),
        _native.BcastFn(bcast),
        _native.AllgatherFn(allgather),
        _native.DestroyFn(destroy),
    )
    return ops


def init(app_name, comm=None, config=None):
    """Connects to the service as application `app_name` (collective over
    `comm`, an mpi4py communicator; None for a program without MPI).
    `config` is the service's client configuration file (default
    $ICHECK_CONFIG, else /etc/icheck/icheck.toml). Returns True when a
    complete checkpoint exists, which restart() then fetches."""
    global _comm
    name = _text(app_name, "app_name")
    path = None if config is None else _text(str(config), "config")
    status = ctypes.c_int(0)
    if comm is None:
        _check("icheck_init", _lib().icheck_init_serial(path, name, ctypes.byref(status)))
    else:
        ops = _mpi_ops(comm)
        _comm = ops  # the callbacks must outlive every collective call
        _check("icheck_init", _lib().icheck_init_with_ops(path, name, ctypes.byref(ops), ctypes.byref(status)))
    return status.value == _native.RESTART


def add(label, array):
    """Adds (or replaces) `array`, a contiguous writable NumPy array, as
    `label`: every commit stores its current contents. The service reads
    it in place; icheck keeps a reference until finalize."""
    address, count, kind = _region(array, label, "add")
    _check("icheck_add", _lib().icheck_add(_text(label, "label"), address, count, kind))
    _registered[label] = array


def add_replicated(label, array, attribute=CONSTANT, default=None):
    """Adds replicated data that survives a change of the process count:
    CONSTANT (rank 0's value everywhere), SIZE, RANK, DEFAULT or
    DEFAULT_JOINING (then `default` is one element's value)."""
    address, count, kind = _region(array, label, "add_replicated")
    default_pointer = None
    if attribute in (DEFAULT, DEFAULT_JOINING):
        if default is None:
            raise ValueError(f"icheck: add_replicated({label!r}): attribute needs a default value")
        default_value = numpy.asarray([default], dtype=array.dtype)
        default_pointer = default_value.ctypes.data
    code = _lib().icheck_add_adapt(_text(label, "label"), address, count, kind, attribute, default_pointer, None, None)
    _check("icheck_add_adapt", code)
    _registered[label] = array


def add_global(label, local, global_count, distribution=BLOCK, param=0):
    """Adds this process's part `local` of a distributed 1-D array of
    `global_count` elements (BLOCK, CYCLIC with width `param`, or MANUAL
    to rank `param`), so that a run with another process count receives
    its own part (local_count, redistribute or restore)."""
    address, count, kind = _region(local, label, "add_global")
    if kind == BINARY:
        raise TypeError(
            f"icheck: add_global({label!r}): dtype {local.dtype} cannot be distributed; "
            "use int8, int32, int64, float32 or float64"
        )
    code = _lib().icheck_add_adapt_global(
        _text(label, "label"), address, count, kind, int(global_count), distribution, int(param), None
    )
    _check("icheck_add_adapt_global", code)
    _registered[label] = local


def commit():
    """Collective: stores every added array as the next version."""
    _check("icheck_commit", _lib().icheck_commit())


def enable_asynchronous(flag=True):
    """With True, commit() returns once the data is staged; wait() (or the
    next commit) completes it."""
    _check("icheck_enable_asynchronous", _lib().icheck_enable_asynchronous(int(bool(flag))))


def wait():
    """Collective: completes an asynchronous commit."""
    _check("icheck_wait", _lib().icheck_wait())


def restart():
    """Collective: prepares the restart from the newest complete version."""
    _check("icheck_restart", _lib().icheck_restart())


def label_type(label):
    """After restart(): the element type (icheck.DOUBLE, ...) `label` has
    in the restarted version."""
    return _check("icheck_label_type", _lib().icheck_label_type(_text(label, "label")))


def _restore_target(label, array, what):
    """(address, count) to restore `label` into `array`, checked against
    the label's type in the version so that nothing is written past it."""
    address, _, _ = _region(array, label, what)
    kind = label_type(label)
    size = _TYPE_SIZE.get(kind, 1)
    expected = _TYPE_OF_DTYPE.get(array.dtype, BINARY)
    if kind != BINARY and expected != kind:
        raise TypeError(
            f"icheck: {what}({label!r}): the checkpoint holds {_TYPE_NAME.get(kind, kind)} elements, "
            f"the array is {array.dtype}"
        )
    if array.nbytes % size:
        raise ValueError(f"icheck: {what}({label!r}): {array.nbytes} bytes is not a whole number of elements")
    return address, array.nbytes // size


def restore(label, array):
    """Restores `label` of the restarted version into `array`, in place
    (the same size and type as when it was committed)."""
    address, count = _restore_target(label, array, "restore")
    _check("icheck_restore", _lib().icheck_restore(_text(label, "label"), address, count))


def restart_all():
    """Collective: restarts if needed and restores every added array."""
    _check("icheck_restart_all", _lib().icheck_restart_all())


def local_count(label):
    """After restart(): the elements of `label` this process receives
    (for arrays added with add_global, sized for this run's process count)."""
    return _check("icheck_local_count", _lib().icheck_local_count(_text(label, "label")))


def redistribute(label, array):
    """Collective: after the process count changed, restarts if needed and
    restores this process's part of `label` into `array`
    (local_count(label) elements)."""
    restart_needed = False
    try:
        address, count = _restore_target(label, array, "redistribute")
    except Error as error:
        if error.code != -2:  # ICHECK_ERR_ORDER: the restart is still to come
            raise
        restart_needed = True
    if restart_needed:
        restart()
        address, count = _restore_target(label, array, "redistribute")
    _check("icheck_redistribute", _lib().icheck_redistribute(_text(label, "label"), address, count))


def probe(remaining_commits=0):
    """Collective: moves to new agents if the controller placed new ones.
    Returns 0 if nothing changed, else the new agent count."""
    hints = _native.Hints(int(remaining_commits))
    return _check("icheck_probe_agents", _lib().icheck_probe_agents(ctypes.byref(hints)))


def protected_version():
    """Collective: the newest version whose redundancy is in place (0: none)."""
    version = ctypes.c_int64(0)
    _check("icheck_protected_version", _lib().icheck_protected_version(ctypes.byref(version)))
    return version.value


def wait_protected(version, timeout=60.0):
    """Collective: waits until `version` (or a newer one) is protected, at
    most `timeout` seconds."""
    _check("icheck_wait_protected", _lib().icheck_wait_protected(int(version), float(timeout)))


def finalize(mode=PERSIST):
    """Collective: ends the session. PERSIST keeps the checkpoints in the
    service for the next run; CLEANUP deletes them."""
    global _comm
    _check("icheck_finalize", _lib().icheck_finalize(int(mode)))
    # Only now has libicheck let go of the arrays and the callbacks.
    _registered.clear()
    _comm = None


def abi_version():
    """The C ABI version of the loaded libicheck (MAJOR*10000 + MINOR*100 + PATCH)."""
    return _lib().icheck_abi_version()
