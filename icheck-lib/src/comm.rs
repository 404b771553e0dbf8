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
}

#[cfg(feature = "mpi")]
pub use self::mpi_comm::MpiComm;

#[cfg(feature = "mpi")]
mod mpi_comm {
    use mpi::collective::SystemOperation;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;

    /// An MPI communicator (rsmpi). The library works on its own duplicate,
    /// so its collectives never match the application's messages.
    pub struct MpiComm {
        comm: SimpleCommunicator,
        nodes: u32,
        max_per_node: u32,
    }

    impl MpiComm {
        /// Duplicates `comm` for the library's use (collective).
        pub fn new<C: Communicator>(comm: &C) -> MpiComm {
            let comm = comm.duplicate();
            let node = comm.split_shared(comm.rank());
            let leader = i32::from(node.rank() == 0);
            let mut nodes = 0i32;
            comm.all_reduce_into(&leader, &mut nodes, SystemOperation::sum());
            let mut max_per_node = 0i32;
            comm.all_reduce_into(&node.size(), &mut max_per_node, SystemOperation::max());
            MpiComm { comm, nodes: nodes as u32, max_per_node: max_per_node as u32 }
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
    }
}
