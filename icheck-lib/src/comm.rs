//! The communicator abstraction: what the library needs from the
//! application's process group. Every method is collective except
//! `rank`/`size`.

/// A group of application processes (an MPI communicator, or one process).
pub trait Communicator {
    /// This process's rank.
    fn rank(&self) -> u32;
    /// Number of processes.
    fn size(&self) -> u32;
    /// Waits for every process.
    fn barrier(&self);
    /// True on every process iff `value` is true on every process.
    fn all_true(&self, value: bool) -> bool;
    /// Sum of `value` over all processes, on every process.
    fn sum(&self, value: u64) -> u64;
    /// Rank 0's `bytes`, on every process (others' input is ignored).
    fn broadcast_from_root(&self, bytes: Vec<u8>) -> Vec<u8>;
    /// Compute nodes the group spans, and processes on the busiest node.
    fn node_counts(&self) -> (u32, u32);
    /// This process's rank among the processes of its node (0 = the node's
    /// leader).
    fn node_rank(&self) -> u32;
    /// Index of this process's node, 0 to nodes-1 (the same on all of a
    /// node's processes).
    fn node_index(&self) -> u32;
    /// Waits for the processes of this node (collective on the node).
    fn node_barrier(&self);
    /// Every node process's `bytes`, in node-rank order (collective on the node).
    fn node_all_gather(&self, bytes: Vec<u8>) -> Vec<Vec<u8>>;
    /// The node leader's `bytes` on every process of the node (collective
    /// on the node).
    fn node_broadcast(&self, bytes: Vec<u8>) -> Vec<u8>;
}

/// A non-MPI application: one process.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Communicator for SingleProcess {
    fn rank(&self) -> u32 {
        0
    }
    fn size(&self) -> u32 {
        1
    }
    fn barrier(&self) {}
    fn all_true(&self, value: bool) -> bool {
        value
    }
    fn sum(&self, value: u64) -> u64 {
        value
    }
    fn broadcast_from_root(&self, bytes: Vec<u8>) -> Vec<u8> {
        bytes
    }
    fn node_counts(&self) -> (u32, u32) {
        (1, 1)
    }
    fn node_rank(&self) -> u32 {
        0
    }
    fn node_index(&self) -> u32 {
        0
    }
    fn node_barrier(&self) {}
    fn node_all_gather(&self, bytes: Vec<u8>) -> Vec<Vec<u8>> {
        vec![bytes]
    }
    fn node_broadcast(&self, bytes: Vec<u8>) -> Vec<u8> {
        bytes
    }
}

#[cfg(feature = "mpi")]
pub use self::mpi_comm::MpiComm;

#[cfg(feature = "mpi")]
mod mpi_comm {
    use mpi::collective::SystemOperation;
    use mpi::datatype::PartitionMut;
    use mpi::topology::{Color, SimpleCommunicator};
    use mpi::traits::*;

    /// An MPI communicator (rsmpi). The library works on its own duplicate,
    /// so its collectives never match the application's messages.
    pub struct MpiComm {
        comm: SimpleCommunicator,
        /// The processes sharing this process's node (MPI_COMM_TYPE_SHARED).
        node: SimpleCommunicator,
        node_index: u32,
        nodes: u32,
        max_per_node: u32,
    }

    impl MpiComm {
        /// Duplicates a raw communicator handle (from C, or from Fortran
        /// through `MPI_Comm_f2c`) for the library's use (collective).
        ///
        /// # Safety
        /// `raw` must be a valid intra-communicator of an initialised MPI.
        pub unsafe fn from_raw_handle(raw: mpi::ffi::MPI_Comm) -> Option<MpiComm> {
            use mpi::raw::FromRaw;
            let mut dup = std::mem::MaybeUninit::<mpi::ffi::MPI_Comm>::uninit();
            // SAFETY: the caller guarantees `raw`; `dup` receives a new handle.
            let ret = unsafe { mpi::ffi::MPI_Comm_dup(raw, dup.as_mut_ptr()) };
            if ret != 0 {
                return None;
            }
            // SAFETY: MPI_Comm_dup succeeded, so it wrote the handle.
            let dup = unsafe { dup.assume_init() };
            // SAFETY: `dup` is a live intra-communicator that only we hold
            // (not MPI_COMM_WORLD or MPI_COMM_SELF); it is freed on drop.
            let ours = unsafe { SimpleCommunicator::from_raw(dup) };
            Some(MpiComm::new(&ours))
        }

        /// Duplicates `comm` for the library's use (collective).
        pub fn new<C: Communicator>(comm: &C) -> MpiComm {
            let comm = comm.duplicate();
            let node = comm.split_shared(comm.rank());
            let is_leader = node.rank() == 0;
            let mut nodes = 0i32;
            comm.all_reduce_into(&i32::from(is_leader), &mut nodes, SystemOperation::sum());
            let mut max_per_node = 0i32;
            comm.all_reduce_into(&node.size(), &mut max_per_node, SystemOperation::max());
            // Leaders number the nodes by their rank among leaders.
            let color = if is_leader { Color::with_value(0) } else { Color::undefined() };
            let mut node_index = comm.split_by_color(color).map_or(0, |leaders| leaders.rank());
            node.process_at_rank(0).broadcast_into(&mut node_index);
            MpiComm {
                comm,
                node,
                node_index: node_index as u32,
                nodes: nodes as u32,
                max_per_node: max_per_node as u32,
            }
        }
    }

    impl super::Communicator for MpiComm {
        fn rank(&self) -> u32 {
            self.comm.rank() as u32
        }
        fn size(&self) -> u32 {
            self.comm.size() as u32
        }
        fn barrier(&self) {
            self.comm.barrier();
        }
        fn all_true(&self, value: bool) -> bool {
            let mut all = 0i32;
            self.comm.all_reduce_into(&i32::from(value), &mut all, SystemOperation::min());
            all == 1
        }
        fn sum(&self, value: u64) -> u64 {
            let mut total = 0u64;
            self.comm.all_reduce_into(&value, &mut total, SystemOperation::sum());
            total
        }
        fn broadcast_from_root(&self, mut bytes: Vec<u8>) -> Vec<u8> {
            let root = self.comm.process_at_rank(0);
            let mut len = bytes.len() as u64;
            root.broadcast_into(&mut len);
            bytes.resize(len as usize, 0);
            root.broadcast_into(&mut bytes[..]);
            bytes
        }
        fn node_counts(&self) -> (u32, u32) {
            (self.nodes, self.max_per_node)
        }
        fn node_rank(&self) -> u32 {
            self.node.rank() as u32
        }
        fn node_index(&self) -> u32 {
            self.node_index
        }
        fn node_barrier(&self) {
            self.node.barrier();
        }
        fn node_all_gather(&self, bytes: Vec<u8>) -> Vec<Vec<u8>> {
            let size = self.node.size() as usize;
            let mut counts = vec![0i32; size];
            self.node.all_gather_into(&(bytes.len() as i32), &mut counts[..]);
            let displs: Vec<i32> = counts.iter().scan(0, |at, n| Some(std::mem::replace(at, *at + n))).collect();
            let mut all = vec![0u8; counts.iter().map(|n| *n as usize).sum()];
            {
                let mut partition = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
                self.node.all_gather_varcount_into(&bytes[..], &mut partition);
            }
            counts.iter().zip(&displs).map(|(n, at)| all[*at as usize..(*at + *n) as usize].to_vec()).collect()
        }
        fn node_broadcast(&self, mut bytes: Vec<u8>) -> Vec<u8> {
            let root = self.node.process_at_rank(0);
            let mut len = bytes.len() as u64;
            root.broadcast_into(&mut len);
            bytes.resize(len as usize, 0);
            root.broadcast_into(&mut bytes[..]);
            bytes
        }
    }
}
