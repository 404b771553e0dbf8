//! Where the elements of distributed data live when the process count
//! changes (§7.4): pure index arithmetic for BLOCK, block-CYCLIC and
//! PREDEFINED 2-D grid distributions, the plan that moves an array written
//! by `from` processes to `to` processes, and the metadata a checkpoint
//! records per label so a run with another process count can restore it
//! (`Adapt`). No I/O here; the library executes the plans.

#![forbid(unsafe_code)]

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// How a global array of `global` elements is spread over a given number of
/// processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Distribution {
    /// Contiguous near-equal parts in rank order: with N elements over P
    /// processes the first N mod P hold one element more.
    Block,
    /// Blocks of `width` elements dealt round robin over the processes
    /// (width 1 is the plain cyclic distribution).
    Cyclic {
        /// Elements per block.
        width: u64,
    },
    /// A `rows × cols` array (row-major global index `i * cols + j`) cut
    /// into BLOCK parts along both dimensions over a `dims[0] × dims[1]`
    /// process grid; rank `r` holds block (`r / dims[1]`, `r % dims[1]`),
    /// stored row-major.
    Grid {
        /// Rows of the global array.
        rows: u64,
        /// Columns of the global array.
        cols: u64,
        /// Process grid: rows × columns of processes.
        dims: [u32; 2],
    },
}

impl Distribution {
    /// The global index ranges process `rank` of `procs` holds, in the order
    /// of its local array.
    pub fn ranges(self, global: u64, procs: u32, rank: u32) -> Vec<Range<u64>> {
        assert!(procs > 0 && rank < procs, "rank {rank} of {procs}");
        let (p, r) = (u64::from(procs), u64::from(rank));
        match self {
            Distribution::Block => {
                let (base, extra) = (global / p, global % p);
                let start = r * base + r.min(extra);
                let len = base + u64::from(r < extra);
                // One range (or none): a block rank holds one contiguous part.
                std::iter::once(start..start + len).filter(|r| !r.is_empty()).collect()
            }
            Distribution::Cyclic { width } => {
                let width = width.max(1);
                let stride = width * p;
                (0..)
                    .map(|round| round * stride + r * width)
                    .take_while(|start| *start < global)
                    .map(|start| start..(start + width).min(global))
                    .collect()
            }
            Distribution::Grid { rows, cols, dims } => {
                assert_eq!(dims[0] * dims[1], procs, "grid {dims:?} for {procs} processes");
                let my_rows = Distribution::Block.ranges(rows, dims[0], rank / dims[1]);
                let my_cols = Distribution::Block.ranges(cols, dims[1], rank % dims[1]);
                let (Some(my_rows), Some(my_cols)) = (my_rows.first(), my_cols.first()) else { return Vec::new() };
                // One range per local row, in row order: the local block is row-major.
                my_rows.clone().map(|i| i * cols + my_cols.start..i * cols + my_cols.end).collect()
            }
        }
    }

    /// Elements process `rank` of `procs` holds: what it allocates before a
    /// restore or a redistribution.
    pub fn local_count(self, global: u64, procs: u32, rank: u32) -> u64 {
        self.ranges(global, procs, rank).iter().map(|r| r.end - r.start).sum()
    }
}

/// One contiguous piece of a redistribution: `len` elements from offset
/// `from_offset` of process `from_rank`'s old local array to offset
/// `to_offset` of the new process's local array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Old owner.
    pub from_rank: u32,
    /// Element offset in the old owner's local array.
    pub from_offset: u64,
    /// Element offset in the new owner's local array.
    pub to_offset: u64,
    /// Elements.
    pub len: u64,
}

/// What process `to_rank` of `to_procs` receives of an array of `global`
/// elements that `from_procs` processes wrote under `from`, to hold it
/// under `to`: pieces in the order of its new local array, covering it
/// exactly once.
pub fn receive_plan(
    global: u64,
    from: Distribution,
    from_procs: u32,
    to: Distribution,
    to_procs: u32,
    to_rank: u32,
) -> Vec<Piece> {
    // The old owners' ranges, each with its local offset, sorted by start.
    let mut owners: Vec<(Range<u64>, u32, u64)> = Vec::new();
    for rank in 0..from_procs {
        let mut offset = 0;
        for range in from.ranges(global, from_procs, rank) {
            let len = range.end - range.start;
            owners.push((range, rank, offset));
            offset += len;
        }
    }
    owners.sort_by_key(|(range, _, _)| range.start);
    let mut pieces = Vec::new();
    let mut to_offset = 0;
    for wanted in to.ranges(global, to_procs, to_rank) {
        let mut at = wanted.start;
        // The first old range that ends after `at`.
        let mut i = owners.partition_point(|(range, _, _)| range.end <= at);
        while at < wanted.end {
            // Elements no old part holds (inconsistent layouts) get no
            // piece; callers check that the pieces cover the new part.
            let Some((range, rank, offset)) = owners.get(i) else { break };
            if range.start > at {
                at = range.start.min(wanted.end);
                continue;
            }
            let end = range.end.min(wanted.end);
            pieces.push(Piece { from_rank: *rank, from_offset: offset + (at - range.start), to_offset, len: end - at });
            to_offset += end - at;
            at = end;
            i += 1;
        }
    }
    pieces
}

/// Why data cannot be laid out for a process count.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DistributionError {
    /// A PREDEFINED array has no processor mapping for this count.
    #[error("no processor mapping covers {procs} processes (mappings exist for {supported:?}); add one with add_processor_mapping")]
    UnsupportedCount {
        /// The process count asked for.
        procs: u32,
        /// The counts the mappings cover.
        supported: Vec<u32>,
    },
    /// A processor mapping does not fit its array or its process count.
    #[error("processor mapping for {procs} processes: {reason}")]
    BadMapping {
        /// The process count of the mapping.
        procs: u32,
        /// What is wrong.
        reason: String,
    },
}

/// The PREDEFINED distribution's processor mappings (`add_processor_mapping`):
/// a `rows × cols` global array and, per process count the application
/// supports, the process grid it is cut over.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessorMapping {
    /// Rows of the global array.
    pub rows: u64,
    /// Columns of the global array.
    pub cols: u64,
    /// (process count, process grid), one per supported count.
    pub grids: Vec<(u32, [u32; 2])>,
}

impl ProcessorMapping {
    /// An empty mapping for a `rows × cols` array.
    pub fn new(rows: u64, cols: u64) -> ProcessorMapping {
        ProcessorMapping { rows, cols, grids: Vec::new() }
    }

    /// Adds (or replaces) the grid `dims` for `procs` processes; `global`
    /// must be the array's element count.
    pub fn add(&mut self, procs: u32, dims: [u32; 2], global: u64) -> Result<(), DistributionError> {
        let bad = |reason: String| DistributionError::BadMapping { procs, reason };
        if procs == 0 || u64::from(dims[0]) * u64::from(dims[1]) != u64::from(procs) {
            return Err(bad(format!("grid {}x{} does not have {procs} processes", dims[0], dims[1])));
        }
        if global != self.rows * self.cols {
            return Err(bad(format!(
                "{global} elements given, the array is {}x{} = {} elements",
                self.rows,
                self.cols,
                self.rows * self.cols
            )));
        }
        self.grids.retain(|(p, _)| *p != procs);
        self.grids.push((procs, dims));
        self.grids.sort_unstable();
        Ok(())
    }

    /// The distribution for `procs` processes.
    pub fn for_procs(&self, procs: u32) -> Result<Distribution, DistributionError> {
        let grid = self.grids.iter().find(|(p, _)| *p == procs).ok_or_else(|| DistributionError::UnsupportedCount {
            procs,
            supported: self.grids.iter().map(|(p, _)| *p).collect(),
        })?;
        let dims = grid.1;
        if u64::from(dims[0]) * u64::from(dims[1]) != u64::from(procs) {
            // Only a damaged record gets here: `add` checks this.
            return Err(DistributionError::BadMapping {
                procs,
                reason: format!("grid {}x{} does not have {procs} processes", dims[0], dims[1]),
            });
        }
        Ok(Distribution::Grid { rows: self.rows, cols: self.cols, dims })
    }
}

/// How a distributed array (`add_adapt_global`) is laid out, as a
/// checkpoint records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum GlobalLayout {
    /// BLOCK.
    Block,
    /// Block-CYCLIC with this width.
    Cyclic {
        /// Elements per block.
        width: u64,
    },
    /// PREDEFINED grids per process count.
    Predefined(ProcessorMapping),
    /// MANUAL: the whole array (the old processes' parts concatenated in
    /// rank order) goes to process `root`; the application distributes it.
    Manual {
        /// The process that receives the whole array.
        root: u32,
    },
}

impl GlobalLayout {
    /// The distribution for `procs` processes; `None` for MANUAL arrays,
    /// whose parts have any size.
    pub fn for_procs(&self, procs: u32) -> Result<Option<Distribution>, DistributionError> {
        match self {
            GlobalLayout::Block => Ok(Some(Distribution::Block)),
            GlobalLayout::Cyclic { width } => Ok(Some(Distribution::Cyclic { width: (*width).max(1) })),
            GlobalLayout::Predefined(mapping) => mapping.for_procs(procs).map(Some),
            GlobalLayout::Manual { .. } => Ok(None),
        }
    }
}

/// How replicated data (`add_adapt`) is restored in a run with another
/// process count (§7.4.1.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Attribute {
    /// The same on every process: every new process gets rank 0's value.
    Constant,
    /// The process count: restored as the new count.
    Size,
    /// The rank: restored as the new rank.
    Rank,
    /// Restored as `value` (bytes of the label's type); with
    /// `joining_only`, only processes that did not exist when the version
    /// was written get it, the others their own stored value.
    Default {
        /// The value's bytes.
        value: Vec<u8>,
        /// Only for joining processes.
        joining_only: bool,
    },
    /// Recalculated by the application's callback instead of read.
    Volatile,
}

/// What a checkpoint records about a label so that a run with another
/// process count can restore it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Adapt {
    /// Replicated data.
    Replicated(Attribute),
    /// A distributed 1-D array of `global` elements.
    Global {
        /// Elements over all processes.
        global: u64,
        /// How they are spread.
        layout: GlobalLayout,
    },
}

/// Which of `agents` agents serves `rank` of `ranks` (§7.2.1): contiguous
/// blocks of ranks per agent, the first `ranks mod agents` agents taking one
/// rank more. With `ranks` nodes instead of processes this is the SHMR (N:M)
/// mapping.
pub fn agent_for_rank(rank: u32, ranks: u32, agents: u32) -> u32 {
    assert!(agents > 0 && rank < ranks, "agent_for_rank({rank}, {ranks}, {agents})");
    let (base, extra) = (ranks / agents, ranks % agents);
    // The first `extra` agents serve base+1 ranks each.
    let big = extra * (base + 1);
    if rank < big {
        rank / (base + 1)
    } else {
        extra + (rank - big) / base.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_gives_the_first_ranks_one_more() {
        let counts =
            |global, procs| (0..procs).map(|r| Distribution::Block.local_count(global, procs, r)).collect::<Vec<_>>();
        assert_eq!(counts(10, 4), [3, 3, 2, 2]);
        assert_eq!(counts(3, 6), [1, 1, 1, 0, 0, 0]);
        assert_eq!(Distribution::Block.ranges(10, 4, 2).first(), Some(&(6..8)));
        assert!(Distribution::Block.ranges(3, 6, 4).is_empty());
    }

    #[test]
    fn cyclic_deals_blocks_round_robin() {
        let cyclic = Distribution::Cyclic { width: 2 };
        assert_eq!(cyclic.ranges(11, 3, 0), [0..2, 6..8]);
        assert_eq!(cyclic.ranges(11, 3, 1), [2..4, 8..10]);
        assert_eq!(cyclic.ranges(11, 3, 2), [4..6, 10..11]);
        assert_eq!(Distribution::Cyclic { width: 1 }.local_count(7, 3, 0), 3);
    }

    #[test]
    fn grids_cut_both_dimensions_into_blocks() {
        let grid = Distribution::Grid { rows: 4, cols: 5, dims: [2, 2] };
        // Rank 1 holds rows 0..2, columns 3..5.
        assert_eq!(grid.ranges(20, 4, 1), [3..5, 8..10]);
        assert_eq!(grid.ranges(20, 4, 2), [10..13, 15..18]);
        assert_eq!(grid.local_count(20, 4, 3), 4);
        let mut mapping = ProcessorMapping::new(40, 40);
        mapping.add(8, [2, 4], 1600).expect("2x4");
        mapping.add(16, [4, 4], 1600).expect("4x4");
        assert_eq!(mapping.for_procs(16), Ok(Distribution::Grid { rows: 40, cols: 40, dims: [4, 4] }));
        let err = mapping.for_procs(6).expect_err("no grid for 6").to_string();
        assert!(err.contains("6 processes") && err.contains("[8, 16]"), "{err}");
        assert!(mapping.add(8, [3, 3], 1600).is_err(), "9 is not 8");
        assert!(mapping.add(8, [2, 4], 1601).is_err(), "wrong element count");
    }

    #[test]
    fn inconsistent_layouts_leave_gaps_instead_of_panicking() {
        // A damaged record: the old grid holds 4 elements, the array 10.
        let old = Distribution::Grid { rows: 2, cols: 2, dims: [1, 1] };
        let plan = receive_plan(10, old, 1, Distribution::Block, 1, 0);
        assert_eq!(plan.iter().map(|p| p.len).sum::<u64>(), 4);
    }

    /// Every element lands where the new distribution says, read from
    /// where the old one put it: checked by global index for every pair of
    /// distributions and process counts.
    #[test]
    fn plans_move_every_element_to_its_new_owner() {
        let grids = [(1u32, [1u32, 1u32]), (3, [3, 1]), (4, [2, 2]), (6, [2, 3])];
        let mut mapping = ProcessorMapping::new(6, 7);
        for (procs, dims) in grids {
            mapping.add(procs, dims, 42).expect("valid grid");
        }
        for global in [0u64, 1, 7, 24, 42, 101] {
            let mut layouts =
                vec![GlobalLayout::Block, GlobalLayout::Cyclic { width: 1 }, GlobalLayout::Cyclic { width: 3 }];
            if global == 42 {
                layouts.push(GlobalLayout::Predefined(mapping.clone()));
            }
            for from_layout in &layouts {
                for to_layout in &layouts {
                    for from_procs in [1u32, 3, 4] {
                        let from = from_layout.for_procs(from_procs).expect("covered").expect("structured");
                        // Old local arrays hold their elements' global indices.
                        let old: Vec<Vec<u64>> = (0..from_procs)
                            .map(|r| from.ranges(global, from_procs, r).into_iter().flatten().collect())
                            .collect();
                        for to_procs in [1u32, 3, 4, 6] {
                            let to = to_layout.for_procs(to_procs).expect("covered").expect("structured");
                            for rank in 0..to_procs {
                                let mut local = vec![u64::MAX; to.local_count(global, to_procs, rank) as usize];
                                for p in receive_plan(global, from, from_procs, to, to_procs, rank) {
                                    let src = &old[p.from_rank as usize][p.from_offset as usize..][..p.len as usize];
                                    local[p.to_offset as usize..][..p.len as usize].copy_from_slice(src);
                                }
                                let want: Vec<u64> = to.ranges(global, to_procs, rank).into_iter().flatten().collect();
                                assert_eq!(
                                    local, want,
                                    "{global} elements {from:?}/{from_procs} -> {to:?}/{to_procs} rank {rank}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
