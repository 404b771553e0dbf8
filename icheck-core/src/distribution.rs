//! Where the elements of a distributed 1-D array live (issue 8, §7.4): pure
//! index arithmetic for BLOCK and block-CYCLIC distributions, and the plan
//! that moves an array written by `from` processes to `to` processes. No
//! I/O here; the library and the agents execute the plans.

use std::ops::Range;

/// How a global array of `global` elements is spread over processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
            let (range, rank, offset) = &owners[i];
            let end = range.end.min(wanted.end);
            pieces.push(Piece { from_rank: *rank, from_offset: offset + (at - range.start), to_offset, len: end - at });
            to_offset += end - at;
            at = end;
            i += 1;
        }
    }
    pieces
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

    /// Every element lands where the new distribution says, read from
    /// where the old one put it: checked by global index for every pair of
    /// distributions and process counts.
    #[test]
    fn plans_move_every_element_to_its_new_owner() {
        let kinds = [Distribution::Block, Distribution::Cyclic { width: 1 }, Distribution::Cyclic { width: 3 }];
        for global in [0u64, 1, 7, 24, 101] {
            for from in kinds {
                for to in kinds {
                    for from_procs in [1u32, 3, 4] {
                        // Old local arrays hold their elements' global indices.
                        let old: Vec<Vec<u64>> = (0..from_procs)
                            .map(|r| from.ranges(global, from_procs, r).into_iter().flatten().collect())
                            .collect();
                        for to_procs in [1u32, 3, 4, 6] {
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
