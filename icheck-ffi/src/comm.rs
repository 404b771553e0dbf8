//! The MPI communicator as libicheck sees it: a table of collective
//! operations that `icheck_mpi.c` (compiled with the application's own
//! `mpicc`) fills in, so this library links no MPI and assumes no MPI ABI.

use std::ffi::{c_int, c_void};

use icheck_lib::Communicator;

/// C layout of `icheck_comm_ops` in `c/icheck_mpi.c` (keep them equal).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IcheckCommOps {
    /// The C side's state, passed back to every call.
    pub ctx: *mut c_void,
    /// This process's rank and the group size.
    pub rank: c_int,
    /// Processes in the group.
    pub size: c_int,
    /// Rank on the node (0 = node leader).
    pub node_rank: c_int,
    /// Index of the node.
    pub node_index: c_int,
    /// Nodes the group spans.
    pub nodes: c_int,
    /// Processes on the busiest node.
    pub max_per_node: c_int,
    /// Barrier over the group or the node.
    pub barrier: Option<unsafe extern "C" fn(*mut c_void, c_int) -> c_int>,
    /// In-place all-reduce of one u64: op 0 sum, 1 min, 2 max.
    pub allreduce_u64: Option<unsafe extern "C" fn(*mut c_void, *mut u64, c_int, c_int) -> c_int>,
    /// Broadcast of `len` bytes from rank 0 of the group or node.
    pub bcast: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> c_int>,
    /// All-gather of `len` bytes per process (the same `len` everywhere).
    pub allgather: Option<unsafe extern "C" fn(*mut c_void, *const c_void, usize, *mut c_void, c_int) -> c_int>,
    /// Frees `ctx`.
    pub destroy: Option<unsafe extern "C" fn(*mut c_void)>,
}

/// A [`Communicator`] over an [`IcheckCommOps`] table; destroys the C
/// context when dropped.
pub struct CallbackComm {
    ops: IcheckCommOps,
}

impl CallbackComm {
    /// Takes over `ops` if every operation is present.
    pub fn new(ops: IcheckCommOps) -> Option<CallbackComm> {
        let complete = ops.barrier.is_some()
            && ops.allreduce_u64.is_some()
            && ops.bcast.is_some()
            && ops.allgather.is_some()
            && ops.destroy.is_some()
            && ops.size > 0
            && ops.nodes > 0;
        if complete {
            Some(CallbackComm { ops })
        } else {
            // Still free what we were given.
            if let Some(destroy) = ops.destroy {
                // SAFETY: destroy takes the ctx it was given with, once.
                unsafe { destroy(ops.ctx) };
            }
            None
        }
    }

    /// A failed collective leaves the group inconsistent: nothing sensible
    /// can follow, as with MPI's default error handler.
    fn checked(code: c_int, what: &str) {
        if code != 0 {
            eprintln!("icheck: MPI {what} failed with error {code}; aborting");
            std::process::abort();
        }
    }

    fn allreduce(&self, value: u64, op: c_int, node_only: bool) -> u64 {
        let mut value = value;
        let f = self.ops.allreduce_u64.expect("checked in new");
        // SAFETY: the C side reads and writes one u64 in place.
        Self::checked(unsafe { f(self.ops.ctx, &mut value, op, c_int::from(node_only)) }, "allreduce");
        value
    }

    fn bcast(&self, mut bytes: Vec<u8>, node_only: bool) -> Vec<u8> {
        let f = self.ops.bcast.expect("checked in new");
        let mut len = bytes.len() as u64;
        // SAFETY: 8 writable bytes.
        Self::checked(unsafe { f(self.ops.ctx, (&mut len as *mut u64).cast(), 8, c_int::from(node_only)) }, "bcast");
        bytes.resize(len as usize, 0);
        // SAFETY: `bytes` has `len` writable bytes on every process.
        Self::checked(
            unsafe { f(self.ops.ctx, bytes.as_mut_ptr().cast(), bytes.len(), c_int::from(node_only)) },
            "bcast",
        );
        bytes
    }

    fn group_size(&self, node_only: bool) -> usize {
        if node_only {
            self.allreduce(1, 0, true) as usize
        } else {
            self.ops.size as usize
        }
    }
}

impl Drop for CallbackComm {
    fn drop(&mut self) {
        if let Some(destroy) = self.ops.destroy {
            // SAFETY: the context is destroyed exactly once, here.
            unsafe { destroy(self.ops.ctx) };
        }
    }
}

impl Communicator for CallbackComm {
    fn rank(&self) -> u32 {
        self.ops.rank as u32
    }
    fn size(&self) -> u32 {
        self.ops.size as u32
    }
    fn barrier(&self) {
        let f = self.ops.barrier.expect("checked in new");
        // SAFETY: the C side's barrier over its communicator.
        Self::checked(unsafe { f(self.ops.ctx, 0) }, "barrier");
    }
    fn all_true(&self, value: bool) -> bool {
        self.allreduce(u64::from(value), 1, false) == 1
    }
    fn sum(&self, value: u64) -> u64 {
        self.allreduce(value, 0, false)
    }
    fn broadcast_from_root(&self, bytes: Vec<u8>) -> Vec<u8> {
        self.bcast(bytes, false)
    }
    fn node_counts(&self) -> (u32, u32) {
        (self.ops.nodes as u32, self.ops.max_per_node as u32)
    }
    fn node_rank(&self) -> u32 {
        self.ops.node_rank as u32
    }
    fn node_index(&self) -> u32 {
        self.ops.node_index as u32
    }
    fn node_barrier(&self) {
        let f = self.ops.barrier.expect("checked in new");
        // SAFETY: the C side's barrier over the node communicator.
        Self::checked(unsafe { f(self.ops.ctx, 1) }, "barrier");
    }
    fn node_all_gather(&self, bytes: Vec<u8>) -> Vec<Vec<u8>> {
        // Equal-size pieces: gather the lengths, then pad to the longest.
        let members = self.group_size(true);
        let f = self.ops.allgather.expect("checked in new");
        let len = bytes.len() as u64;
        let mut lens = vec![0u64; members];
        // SAFETY: 8 bytes sent, 8 * members received.
        Self::checked(
            unsafe { f(self.ops.ctx, (&len as *const u64).cast(), 8, lens.as_mut_ptr().cast(), 1) },
            "allgather",
        );
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = bytes.clone();
        padded.resize(longest, 0);
        let mut all = vec![0u8; longest * members];
        // SAFETY: `longest` bytes sent, `longest * members` received.
        Self::checked(
            unsafe { f(self.ops.ctx, padded.as_ptr().cast(), longest, all.as_mut_ptr().cast(), 1) },
            "allgather",
        );
        lens.iter().enumerate().map(|(i, n)| all[i * longest..i * longest + *n as usize].to_vec()).collect()
    }
    fn node_broadcast(&self, bytes: Vec<u8>) -> Vec<u8> {
        self.bcast(bytes, true)
    }
}
