//! Redundancy across checkpoint nodes, as pure logic: the policy an
//! application asks for, where its copies and parity shards go (the
//! [`Plan`]), the data-loss model, and the Reed-Solomon coding of one
//! stripe.
//!
//! A rank's version stays whole at its agent (its primary copy). On top:
//! * `partner:C` keeps C−1 more copies of every rank, each on another node;
//! * `rs:K+M` groups the ranks K at a time, each member's primary on a
//!   distinct node, and keeps M parity shards of every group on M further
//!   nodes. Members are zero-padded to the longest. A group with fewer
//!   than K ranks (too few ranks or nodes) is coded over the ranks it has:
//!   zero shards would cost encoding time and protect nothing, and the
//!   parity takes the same memory either way. Any M lost nodes of a group
//!   are survived, at M/K of the data in memory (more in a narrower group).
//! * A group of one rank, where M ≥ 2 and K + M nodes are there, is
//!   *sliced*: the rank is cut into K slices on its checksum chunks'
//!   boundaries (`Manifest::slices`), slices 1..K are copied to K − 1
//!   other nodes (slice 0 is in the primary), and the M parity shards are
//!   coded over the slices. It holds (K − 1 + M)/K of the rank beside the
//!   primary (`rs:4+2`: 1.25) where M whole parity shards would hold M (a
//!   repetition code, as `partner:M+1`), and survives any M lost nodes of
//!   the K + M. (With M = 1 both hold one rank's worth: it is not sliced.)
//!
//! Architecture invariant: nothing here performs I/O; placement works on
//! agent slots (index, node, failure domain) and returns data.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use rusty_erasure::{Coder, DecodePlan, Matrix};
use serde::{Deserialize, Serialize};

/// Most copies `partner` keeps (the primary included).
pub const MAX_COPIES: u8 = 4;
/// Most data shards of a Reed-Solomon group.
pub const MAX_DATA_SHARDS: u8 = 32;
/// Most parity shards of a Reed-Solomon group.
pub const MAX_PARITY_SHARDS: u8 = 8;

/// How an application's versions are protected against lost checkpoint nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Redundancy {
    /// The primary copy only: a lost node loses its ranks' versions.
    #[default]
    None,
    /// `copies` copies of every rank (the primary included), each on a
    /// distinct node.
    Partner {
        /// Copies, 2 to [`MAX_COPIES`].
        copies: u8,
    },
    /// Reed-Solomon over groups of `data` ranks with `parity` parity shards,
    /// every shard of a group on a distinct node.
    ReedSolomon {
        /// Data shards (ranks) per group.
        data: u8,
        /// Parity shards per group.
        parity: u8,
    },
}

/// Why a policy or a placement cannot be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedundancyError {
    /// The policy text is not one of the forms.
    #[error("redundancy {given:?} is not understood: use \"none\", \"partner\", \"partner:C\" (C copies, 2 to {MAX_COPIES}) or \"rs:K+M\" (K data and M parity shards, K up to {MAX_DATA_SHARDS}, M up to {MAX_PARITY_SHARDS})")]
    Syntax {
        /// What was given.
        given: String,
    },
    /// Too few distinct nodes hold the application's agents.
    #[error("redundancy {policy} needs {needed} checkpoint nodes holding the application's agents; it has {have}")]
    TooFewNodes {
        /// The policy.
        policy: Redundancy,
        /// Distinct nodes it needs.
        needed: usize,
        /// Distinct nodes there are.
        have: usize,
    },
    /// Shards that cannot be coded (lengths differ or are odd, too few survive).
    #[error("Reed-Solomon coding: {0}")]
    Coding(String),
}

impl Redundancy {
    /// Whether versions get anything beyond their primary copy.
    pub fn is_none(&self) -> bool {
        *self == Redundancy::None
    }

    /// Node losses a protected version survives.
    pub fn tolerates(&self) -> usize {
        match *self {
            Redundancy::None => 0,
            Redundancy::Partner { copies } => usize::from(copies) - 1,
            Redundancy::ReedSolomon { parity, .. } => usize::from(parity),
        }
    }

    /// Memory beyond the primary copies, as a fraction of the version.
    pub fn overhead(&self) -> f64 {
        match *self {
            Redundancy::None => 0.0,
            Redundancy::Partner { copies } => f64::from(copies) - 1.0,
            Redundancy::ReedSolomon { data, parity } => f64::from(parity) / f64::from(data),
        }
    }

    /// Distinct nodes the application's agents should span for the policy
    /// to hold at its stated overhead (placement asks for this many agents
    /// where nodes allow).
    pub fn wanted_nodes(&self) -> usize {
        match *self {
            Redundancy::None => 1,
            Redundancy::Partner { copies } => usize::from(copies),
            Redundancy::ReedSolomon { data, parity } => usize::from(data) + usize::from(parity),
        }
    }

    /// Distinct nodes without which the policy cannot hold at all.
    pub fn needed_nodes(&self) -> usize {
        match *self {
            Redundancy::None => 1,
            Redundancy::Partner { copies } => usize::from(copies),
            // A group of one member and its parity.
            Redundancy::ReedSolomon { parity, .. } => 1 + usize::from(parity),
        }
    }
}

impl fmt::Display for Redundancy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Redundancy::None => write!(f, "none"),
            Redundancy::Partner { copies } => write!(f, "partner:{copies}"),
            Redundancy::ReedSolomon { data, parity } => write!(f, "rs:{data}+{parity}"),
        }
    }
}

impl FromStr for Redundancy {
    type Err = RedundancyError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || RedundancyError::Syntax { given: text.to_string() };
        let text = text.trim();
        let lower = text.to_ascii_lowercase();
        if lower == "none" {
            return Ok(Redundancy::None);
        }
        if lower == "partner" {
            return Ok(Redundancy::Partner { copies: 2 });
        }
        if let Some(copies) = lower.strip_prefix("partner:") {
            let copies: u8 = copies.parse().map_err(|_| bad())?;
            if !(2..=MAX_COPIES).contains(&copies) {
                return Err(bad());
            }
            return Ok(Redundancy::Partner { copies });
        }
        let (data, parity) = lower.strip_prefix("rs:").and_then(|s| s.split_once('+')).ok_or_else(bad)?;
        let data: u8 = data.parse().map_err(|_| bad())?;
        let parity: u8 = parity.parse().map_err(|_| bad())?;
        if !(1..=MAX_DATA_SHARDS).contains(&data) || !(1..=MAX_PARITY_SHARDS).contains(&parity) {
            return Err(bad());
        }
        Ok(Redundancy::ReedSolomon { data, parity })
    }
}

impl Serialize for Redundancy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Redundancy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One agent slot as placement sees it: its node and failure domain
/// (`NodeGroup`, e.g. a rack), in the application's rank-mapping order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// Node the agent runs on.
    pub node: String,
    /// The node's failure domain, where the configuration names one.
    pub group: Option<String>,
}

/// A Reed-Solomon group: up to K ranks, each with its primary on a distinct
/// node, and the agent slots holding its parity shards (index = shard).
/// An empty one (no members, no pieces) only keeps a number unused
/// ([`Plan::number_groups_from`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// The member ranks in shard order (at most K; `None`, a shard of
    /// zeros, is understood but no longer planned).
    pub members: Vec<Option<u32>>,
    /// The slot holding each parity shard.
    pub parity: Vec<usize>,
    /// A sliced group (one member, cut into K slices): the slots holding
    /// slices 1..K, in order ([`PieceId::Slice`]); slice 0 is in the
    /// member's primary. Empty for a group coded over whole ranks.
    pub slices: Vec<usize>,
}

impl Group {
    /// The code's data shards: K slices of a sliced group's one member,
    /// else one per present member.
    pub fn data_shards(&self) -> usize {
        match self.slices.len() {
            0 => self.members.iter().flatten().count(),
            n => n + 1,
        }
    }
}

/// Where a version's redundancy goes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// `partner`: per rank, the slots holding its extra copies.
    pub copies: BTreeMap<u32, Vec<usize>>,
    /// `rs`: the groups.
    pub groups: Vec<Group>,
}

impl Plan {
    /// Numbers the groups from `first` on, leaving the numbers below it to
    /// no group (empty ones hold their places): a version planned anew
    /// while its record still names the pieces of an earlier plan gets
    /// piece names of its own (`PieceId::Parity` and `PieceId::Slice`
    /// carry the group's number), so none of those pieces is written over
    /// with another meaning before the new plan is complete.
    pub fn number_groups_from(&mut self, first: usize) {
        self.groups.splice(0..0, std::iter::repeat_with(Group::default).take(first));
    }

    /// The group `rank` is a member of, with its shard index.
    pub fn group_of(&self, rank: u32) -> Option<(usize, usize)> {
        self.groups
            .iter()
            .enumerate()
            .find_map(|(g, group)| group.members.iter().position(|m| *m == Some(rank)).map(|shard| (g, shard)))
    }

    /// Every piece the plan places, with the slot that holds it.
    pub fn pieces(&self) -> Vec<(usize, PieceId)> {
        let mut pieces = Vec::new();
        for (rank, holders) in &self.copies {
            pieces.extend(holders.iter().map(|slot| (*slot, PieceId::Copy { rank: *rank })));
        }
        for (g, group) in self.groups.iter().enumerate() {
            for (index, slot) in group.parity.iter().enumerate() {
                pieces.push((*slot, PieceId::Parity { group: g as u32, index: index as u8 }));
            }
            for (index, slot) in group.slices.iter().enumerate() {
                pieces.push((*slot, PieceId::Slice { group: g as u32, index: index as u8 + 1 }));
            }
        }
        pieces
    }

    /// The slots of each unit, the first being a primary's: a rank's
    /// primary and its copies (`partner`), a group's members' primaries,
    /// parity shards and slices (`rs`), a rank's primary alone (`none`).
    fn unit_slots(&self, policy: Redundancy, ranks: u32, count: usize) -> Vec<Vec<usize>> {
        let primary = |rank: u32| crate::distribution::agent_for_rank(rank, ranks, count as u32) as usize;
        match policy {
            Redundancy::None => (0..ranks).map(|r| vec![primary(r)]).collect(),
            Redundancy::Partner { .. } => (0..ranks)
                .map(|r| {
                    std::iter::once(primary(r)).chain(self.copies.get(&r).into_iter().flatten().copied()).collect()
                })
                .collect(),
            Redundancy::ReedSolomon { .. } => (self.groups.iter())
                .map(|group| {
                    let members = group.members.iter().flatten().map(|r| primary(*r));
                    members.chain(group.parity.iter().copied()).chain(group.slices.iter().copied()).collect()
                })
                .collect(),
        }
    }

    /// The sets of nodes whose simultaneous loss each unit survives only up
    /// to its tolerance: (nodes of the unit, losses it survives). A version
    /// is lost when some unit loses more of its nodes than it tolerates.
    pub fn units(&self, policy: Redundancy, ranks: u32, slots: &[Slot]) -> Vec<(BTreeSet<String>, usize)> {
        (self.unit_slots(policy, ranks, slots.len()).into_iter())
            .map(|unit| {
                let nodes: BTreeSet<String> = unit.iter().map(|s| slots[*s].node.clone()).collect();
                let tolerated = match policy {
                    Redundancy::None => 0,
                    Redundancy::Partner { .. } => nodes.len() - 1,
                    Redundancy::ReedSolomon { parity, .. } => usize::from(parity),
                };
                (nodes, tolerated)
            })
            .collect()
    }

    /// Whether the plan, made for `policy` and `ranks` ranks on as many
    /// slots as `slots` has, still keeps each unit's slots on distinct
    /// nodes when the slots lie where `slots` says (some on other nodes
    /// than when it was made: replacements after a lost node). Then it
    /// protects as it did, and only the pieces on slots that changed need
    /// building; a new plan could group the ranks otherwise (the grouping
    /// follows the nodes) and give a piece still in place another meaning.
    pub fn still_apart(&self, policy: Redundancy, ranks: u32, slots: &[Slot]) -> bool {
        self.unit_slots(policy, ranks, slots.len()).iter().all(|unit| {
            let nodes: Option<BTreeSet<&str>> = unit.iter().map(|s| slots.get(*s).map(|s| s.node.as_str())).collect();
            nodes.is_some_and(|nodes| nodes.len() == unit.len())
        })
    }
}

/// A piece of redundancy an agent holds for a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PieceId {
    /// A whole copy of a rank's version.
    Copy {
        /// The rank (node index in SHMR mode).
        rank: u32,
    },
    /// Parity shard `index` of group `group`.
    Parity {
        /// The group, in the plan's order.
        group: u32,
        /// The parity shard.
        index: u8,
    },
    /// Slice `index` (1..K) of the one member of sliced group `group`: a
    /// copy of that part of the rank ([`Group::slices`]).
    Slice {
        /// The group, in the plan's order.
        group: u32,
        /// The slice (0 is the primary's own).
        index: u8,
    },
}

impl fmt::Display for PieceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PieceId::Copy { rank } => write!(f, "copy of rank {rank}"),
            PieceId::Parity { group, index } => write!(f, "parity shard {index} of group {group}"),
            PieceId::Slice { group, index } => write!(f, "slice {index} of group {group}"),
        }
    }
}

/// Places `policy`'s redundancy for `ranks` ranks whose agents are `slots`
/// (rank r's primary is at `slots[agent_for_rank(r)]`). Every piece goes to
/// a node other than those it protects, preferring other failure domains,
/// and the load is spread over the slots.
pub fn plan(policy: Redundancy, ranks: u32, slots: &[Slot]) -> Result<Plan, RedundancyError> {
    let distinct: BTreeSet<&str> = slots.iter().map(|s| s.node.as_str()).collect();
    if policy.is_none() || ranks == 0 || slots.is_empty() {
        return Ok(Plan::default());
    }
    let too_few = || RedundancyError::TooFewNodes { policy, needed: policy.needed_nodes(), have: distinct.len() };
    if distinct.len() < policy.needed_nodes() {
        return Err(too_few());
    }
    let count = slots.len() as u32;
    let primary = |rank: u32| crate::distribution::agent_for_rank(rank, ranks, count) as usize;
    // Pieces each slot holds so far: new ones go to the least loaded.
    let mut load = vec![0usize; slots.len()];
    // `count` holders on nodes other than `protected` (the slots whose data
    // they protect) and other than each other.
    let mut holders = |protected: &mut dyn Iterator<Item = usize>, count: u8| {
        let (mut nodes, mut groups): (BTreeSet<&str>, BTreeSet<Option<&str>>) =
            protected.map(|s| (slots[s].node.as_str(), slots[s].group.as_deref())).unzip();
        let mut chosen = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let candidates = (0..slots.len()).filter(|s| !nodes.contains(slots[*s].node.as_str()));
            // Another failure domain first, then the lightest load, then order.
            let best = candidates
                .min_by_key(|s| {
                    let same_group = slots[*s].group.is_some() && groups.contains(&slots[*s].group.as_deref());
                    (same_group, load[*s], *s)
                })
                .ok_or_else(too_few)?;
            load[best] += 1;
            nodes.insert(slots[best].node.as_str());
            groups.insert(slots[best].group.as_deref());
            chosen.push(best);
        }
        Ok(chosen)
    };
    let mut plan = Plan::default();
    match policy {
        Redundancy::None => {}
        Redundancy::Partner { copies } => {
            for rank in 0..ranks {
                plan.copies.insert(rank, holders(&mut std::iter::once(primary(rank)), copies - 1)?);
            }
        }
        Redundancy::ReedSolomon { data, parity } => {
            // The ranks of each node, in order: a group takes one rank from
            // each of the K nodes with the most left.
            let mut by_node: BTreeMap<&str, std::collections::VecDeque<u32>> = BTreeMap::new();
            for rank in 0..ranks {
                by_node.entry(slots[primary(rank)].node.as_str()).or_default().push_back(rank);
            }
            while by_node.values().any(|q| !q.is_empty()) {
                let mut fullest: Vec<&str> = by_node.iter().filter(|(_, q)| !q.is_empty()).map(|(n, _)| *n).collect();
                fullest.sort_by_key(|n| std::cmp::Reverse(by_node[n].len()));
                // Narrower groups where the nodes leave no room for the
                // parity beside K members, or the ranks run out.
                fullest.truncate(usize::from(data).min(distinct.len() - usize::from(parity)));
                let mut taken: Vec<u32> =
                    fullest.iter().filter_map(|n| by_node.get_mut(n).and_then(|q| q.pop_front())).collect();
                taken.sort();
                // One rank alone is sliced where that holds less than M
                // whole parity shards would and its K + M nodes are there.
                let sliced =
                    taken.len() == 1 && data >= 2 && parity >= 2 && distinct.len() >= usize::from(data + parity);
                let slice_slots = match sliced {
                    true => holders(&mut taken.iter().map(|r| primary(*r)), data - 1)?,
                    false => Vec::new(),
                };
                let mut protected = taken.iter().map(|r| primary(*r)).chain(slice_slots.iter().copied());
                let parity_slots = holders(&mut protected, parity)?;
                let members: Vec<Option<u32>> = taken.into_iter().map(Some).collect();
                plan.groups.push(Group { members, parity: parity_slots, slices: slice_slots });
            }
        }
    }
    Ok(plan)
}

/// Probability that a version is lost when every node fails independently
/// with probability `p`: some unit of `units` (see [`Plan::units`]) loses
/// more nodes than it tolerates. Exact over every failure pattern of up to
/// 20 distinct nodes; beyond that, units are taken as independent (which
/// overstates the loss slightly when units share nodes).
pub fn loss_probability(units: &[(BTreeSet<String>, usize)], p: f64) -> f64 {
    let p = p.clamp(0.0, 1.0);
    let nodes: Vec<&String> = units.iter().flat_map(|(n, _)| n).collect::<BTreeSet<_>>().into_iter().collect();
    if nodes.is_empty() {
        return 0.0;
    }
    if nodes.len() > 20 {
        let survive: f64 = units.iter().map(|(n, t)| 1.0 - more_than(n.len(), *t, p)).product();
        return 1.0 - survive;
    }
    let index: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let masks: Vec<(u32, usize)> =
        units.iter().map(|(n, t)| (n.iter().map(|node| 1u32 << index[node]).sum(), *t)).collect();
    let n = nodes.len();
    let mut lost = 0.0;
    for failed in 0u32..(1u32 << n) {
        if masks.iter().any(|(mask, tolerated)| (failed & mask).count_ones() as usize > *tolerated) {
            let down = failed.count_ones() as i32;
            lost += p.powi(down) * (1.0 - p).powi(n as i32 - down);
        }
    }
    lost
}

/// Probability that more than `t` of `n` independent nodes fail.
fn more_than(n: usize, t: usize, p: f64) -> f64 {
    let mut at_most = 0.0;
    let mut choose = 1.0;
    for k in 0..=t.min(n) {
        if k > 0 {
            choose = choose * (n - k + 1) as f64 / k as f64;
        }
        at_most += choose * p.powi(k as i32) * (1.0 - p).powi((n - k) as i32);
    }
    (1.0 - at_most).max(0.0)
}

/// The probability that a version is lost with `policy` on `nodes`
/// checkpoint nodes (one agent and one rank per node, the canonical
/// placement), each failing independently with probability `p`.
pub fn exposure(policy: Redundancy, nodes: usize, p: f64) -> Result<f64, RedundancyError> {
    let slots: Vec<Slot> = (0..nodes).map(|i| Slot { node: format!("n{i}"), group: None }).collect();
    let plan = plan(policy, nodes as u32, &slots)?;
    Ok(loss_probability(&plan.units(policy, nodes as u32, &slots), p))
}

/// The parity rows of the code of `originals` data and `parity` parity
/// shards, row-major (`parity` rows of `originals` coefficients).
///
/// A Cauchy matrix over GF(2^8) (ISA-L's `gf_gen_cauchy1_matrix`: every
/// square submatrix is invertible, so any `parity` lost shards of the K+M
/// are rebuilt), with its columns and then its rows scaled so that the first
/// row and the first column are all ones. Scaling rows and columns by
/// nonzero constants keeps every square submatrix invertible, and it makes
/// parity shard 0 the XOR of the data shards and, for a group of one data
/// shard, every parity shard a copy of it (the repetition code the agents
/// build without a coder's pass: `one_data_shard_is_repeated`).
fn parity_rows(originals: usize, parity: usize) -> Vec<u8> {
    use rusty_erasure::gf::{inv, mul};
    let cauchy = |i: usize, j: usize| inv(((originals + i) ^ j) as u8);
    let column_scale: Vec<u8> = (0..originals).map(|j| inv(cauchy(0, j))).collect();
    let mut rows = Vec::with_capacity(parity * originals);
    for i in 0..parity {
        let row_scale = inv(mul(cauchy(i, 0), column_scale[0]));
        rows.extend((0..originals).map(|j| mul(row_scale, mul(cauchy(i, j), column_scale[j]))));
    }
    rows
}

/// The coder of `originals` data and `parity` parity shards: the systematic
/// matrix (identity over [`parity_rows`]) with the fastest kernels this CPU
/// has (GFNI, AVX2 or SSSE3, chosen once by `rusty_erasure`).
fn coder(originals: usize, parity: usize) -> Result<Coder, RedundancyError> {
    let shape = || format!("{originals} data and {parity} parity shards");
    if originals == 0
        || parity == 0
        || originals > usize::from(MAX_DATA_SHARDS)
        || parity > usize::from(MAX_PARITY_SHARDS)
    {
        return Err(RedundancyError::Coding(format!("{} are out of range", shape())));
    }
    let mut systematic = vec![0u8; (originals + parity) * originals];
    (0..originals).for_each(|i| systematic[i * originals + i] = 1);
    systematic[originals * originals..].copy_from_slice(&parity_rows(originals, parity));
    let matrix = Matrix::from_bytes(originals + parity, originals, systematic)
        .map_err(|e| RedundancyError::Coding(format!("{}: {e}", shape())))?;
    rusty_erasure::coder(matrix).map_err(|e| RedundancyError::Coding(format!("{}: {e}", shape())))
}

/// The one length of a stripe's shards, which must be equal, even and not
/// empty (a group's shard length is rounded up to even: `ParityMeta`).
fn stripe_len<'a>(shards: impl IntoIterator<Item = &'a [u8]>) -> Result<usize, RedundancyError> {
    let mut lengths = shards.into_iter().map(<[u8]>::len);
    let len = lengths.next().unwrap_or(0);
    if len == 0 || len % 2 != 0 {
        return Err(RedundancyError::Coding(format!("shards of {len} bytes (they must be even and not empty)")));
    }
    if let Some(other) = lengths.find(|other| *other != len) {
        return Err(RedundancyError::Coding(format!("shards of {len} and {other} bytes in one stripe")));
    }
    Ok(len)
}

/// The parity shards of one stripe: `originals` are the K data shards
/// (equal, even lengths); returns the M parity shards.
pub fn encode(parity: usize, originals: &[&[u8]]) -> Result<Vec<Vec<u8>>, RedundancyError> {
    let len = stripe_len(originals.iter().copied())?;
    let mut shards = vec![vec![0u8; len]; parity];
    let mut out: Vec<&mut [u8]> = shards.iter_mut().map(Vec::as_mut_slice).collect();
    StripeEncoder::default().encode_into(originals, &mut out)?;
    Ok(shards)
}

/// Encodes stripe after stripe with one coder (its tables built once per
/// shape), into the caller's memory ([`StripeEncoder::encode_into`]: a
/// shard's file, a buffer the fabric writes from) or handing each parity
/// shard over ([`StripeEncoder::encode`]).
#[derive(Default)]
pub struct StripeEncoder {
    coder: Option<(Coder, (usize, usize))>,
    scratch: Vec<Vec<u8>>,
}

impl fmt::Debug for StripeEncoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StripeEncoder").field("shape", &self.coder.as_ref().map(|c| c.1)).finish()
    }
}

impl StripeEncoder {
    fn coder(&mut self, originals: usize, parity: usize) -> Result<&Coder, RedundancyError> {
        if self.coder.as_ref().is_none_or(|(_, shape)| *shape != (originals, parity)) {
            self.coder = Some((coder(originals, parity)?, (originals, parity)));
        }
        Ok(&self.coder.as_ref().expect("just made").0)
    }

    /// Encodes one stripe of `originals` (the K data shards, of equal even
    /// lengths) into `parity` shards; `each(j, shard)` receives shard j.
    pub fn encode(
        &mut self,
        parity: usize,
        originals: &[&[u8]],
        mut each: impl FnMut(usize, &[u8]),
    ) -> Result<(), RedundancyError> {
        let len = stripe_len(originals.iter().copied())?;
        // With one data shard every parity shard of this code equals it (a
        // repetition code): a group of one rank needs copies, not a pass.
        if let [only] = originals {
            (0..parity).for_each(|j| each(j, only));
            return Ok(());
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize_with(parity, Vec::new);
        scratch.iter_mut().for_each(|shard| shard.resize(len, 0));
        let mut out: Vec<&mut [u8]> = scratch.iter_mut().map(Vec::as_mut_slice).collect();
        let encoded = self.encode_into(originals, &mut out);
        if encoded.is_ok() {
            scratch.iter().enumerate().for_each(|(j, shard)| each(j, shard));
        }
        self.scratch = scratch;
        encoded
    }

    /// Encodes one stripe of `originals` (the K data shards, of equal even
    /// lengths) into `out`, one parity shard per slice, each as long as a
    /// data shard: straight into the memory that keeps or sends them.
    pub fn encode_into(&mut self, originals: &[&[u8]], out: &mut [&mut [u8]]) -> Result<(), RedundancyError> {
        let len = stripe_len(originals.iter().copied())?;
        if out.iter().any(|shard| shard.len() != len) {
            return Err(RedundancyError::Coding(format!(
                "parity shards of a length other than the data's {len} bytes"
            )));
        }
        self.coder(originals.len(), out.len())?
            .encode(originals, out)
            .map_err(|e| RedundancyError::Coding(e.to_string()))
    }
}

/// Rebuilds the missing data shards of one stripe from any K of the K+M:
/// `originals[i]` and `parity[j]` are the surviving shards (`None`: lost).
/// Returns every missing data shard by index.
pub fn decode(
    originals: &[Option<&[u8]>],
    parity: &[Option<&[u8]>],
) -> Result<BTreeMap<usize, Vec<u8>>, RedundancyError> {
    let mut restored = BTreeMap::new();
    StripeDecoder::default().decode(originals, parity, |i, shard| {
        restored.insert(i, shard.to_vec());
    })?;
    Ok(restored)
}

/// [`decode`], stripe after stripe with one decoder: the decoding matrix of
/// a loss pattern (which shards survive, which are rebuilt) is inverted
/// once and reused while the pattern holds, as it does over a whole rank.
#[derive(Default)]
pub struct StripeDecoder {
    coder: Option<(Coder, (usize, usize))>,
    plan: Option<(DecodePlan, Vec<bool>, Vec<usize>)>,
    scratch: Vec<Vec<u8>>,
}

impl fmt::Debug for StripeDecoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StripeDecoder").field("shape", &self.coder.as_ref().map(|c| c.1)).finish()
    }
}

impl StripeDecoder {
    /// Restores the missing data shards of one stripe (`originals[i]` and
    /// `parity[j]` are the survivors, `None` the lost ones, all of one even
    /// length); `each(i, shard)` receives each missing data shard i.
    pub fn decode(
        &mut self,
        originals: &[Option<&[u8]>],
        parity: &[Option<&[u8]>],
        mut each: impl FnMut(usize, &[u8]),
    ) -> Result<(), RedundancyError> {
        let missing: Vec<usize> = (0..originals.len()).filter(|i| originals[*i].is_none()).collect();
        if missing.is_empty() {
            return Ok(());
        }
        let survivors = originals.iter().flatten().count() + parity.iter().flatten().count();
        if survivors < originals.len() {
            return Err(RedundancyError::Coding(format!(
                "{} of {} data shards are lost and only {} parity shards survive",
                missing.len(),
                originals.len(),
                parity.iter().flatten().count()
            )));
        }
        let shards: Vec<Option<&[u8]>> = originals.iter().chain(parity).copied().collect();
        let len = stripe_len(shards.iter().flatten().copied())?;
        let present: Vec<bool> = shards.iter().map(Option::is_some).collect();
        let shape = (originals.len(), parity.len());
        if self.coder.as_ref().is_none_or(|(_, current)| *current != shape) {
            self.coder = Some((coder(shape.0, shape.1)?, shape));
            self.plan = None;
        }
        let coder = &self.coder.as_ref().expect("just made").0;
        let coding = |e: rusty_erasure::RecoverError| RedundancyError::Coding(e.to_string());
        if self.plan.as_ref().is_none_or(|(_, p, m)| *p != present || *m != missing) {
            self.plan = Some((coder.decode_plan(&present, &missing).map_err(coding)?, present, missing.clone()));
        }
        let plan = &self.plan.as_ref().expect("just made").0;
        self.scratch.resize_with(missing.len(), Vec::new);
        self.scratch.iter_mut().for_each(|shard| shard.resize(len, 0));
        let mut out: Vec<&mut [u8]> = self.scratch.iter_mut().map(Vec::as_mut_slice).collect();
        coder.recover_with(plan, &shards, &mut out).map_err(coding)?;
        for (i, shard) in missing.into_iter().zip(&self.scratch) {
            each(i, shard);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_data_shard_is_repeated() {
        let data: Vec<u8> = (0..8192u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for parity in 1..=3 {
            let coded = encode(parity, &[&data]).unwrap();
            let mut repeated = Vec::new();
            StripeEncoder::default().encode(parity, &[&data], |j, shard| repeated.push((j, shard.to_vec()))).unwrap();
            assert_eq!(repeated.len(), parity);
            for (j, shard) in repeated {
                assert_eq!(shard, coded[j], "parity {j} of {parity}: the coder's shard and the copy differ");
            }
        }
        assert!(StripeEncoder::default().encode(2, &[&data[..3]], |_, _| ()).is_err(), "odd length");
    }

    fn pseudo_random_shards(k: usize, len: usize, seed: usize) -> Vec<Vec<u8>> {
        (0..k)
            .map(|i| {
                (0..len)
                    .map(|b| ((b * 31 + i * 7919 + seed * 104_729) as u32).wrapping_mul(2_654_435_761) as u8)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn parity_written_into_the_callers_memory_is_the_coders() {
        let shard_bytes = 64 * 37 + 2;
        let mut encoder = StripeEncoder::default();
        for (k, m) in (2..=9).flat_map(|k| (1..=5).map(move |m| (k, m))).chain([(16, 4), (32, 8), (17, 3)]) {
            let data = pseudo_random_shards(k, shard_bytes, k * 10 + m);
            let originals: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let expected = encode(m, &originals).unwrap();
            // Garbage in the destination must not matter, and one encoder
            // reused across shapes codes like a fresh one.
            for _ in 0..2 {
                let mut out = vec![vec![0xa5u8; shard_bytes]; m];
                let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                encoder.encode_into(&originals, &mut slices).unwrap();
                assert_eq!(out, expected, "rs:{k}+{m}");
            }
            // Parity shard 0 is the XOR of the data shards (the first row of
            // the normalised Cauchy matrix is all ones).
            let xor: Vec<u8> = (0..shard_bytes).map(|b| data.iter().fold(0, |x, shard| x ^ shard[b])).collect();
            assert_eq!(expected[0], xor, "rs:{k}+{m}: parity 0 is not the XOR of the data");
        }
        let data = pseudo_random_shards(4, 96, 1);
        let originals: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let mut short = [vec![0u8; 96], vec![0u8; 64]];
        let mut slices: Vec<&mut [u8]> = short.iter_mut().map(Vec::as_mut_slice).collect();
        assert!(encoder.encode_into(&originals, &mut slices).is_err(), "a parity buffer shorter than the data");
        let uneven: Vec<&[u8]> = vec![&data[0][..96], &data[1][..94]];
        assert!(encoder.encode_into(&uneven, &mut []).is_err(), "data shards of two lengths");
        assert!(encode(9, &originals).is_err(), "more parity shards than the most a group has");
    }

    #[test]
    fn every_pattern_of_up_to_m_losses_is_decoded_bit_exact() {
        // The code is MDS: any K of the K+M shards give the data back. Every
        // loss pattern of every shape up to 6+3, and 8+4 and 32+8 sampled.
        let len = 64 * 3 + 2;
        let shapes = (1..=6).flat_map(|k| (1..=3).map(move |m| (k, m))).chain([(8, 4), (32, 8)]);
        for (k, m) in shapes {
            let data = pseudo_random_shards(k, len, k + m);
            let originals: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let parity = encode(m, &originals).unwrap();
            let n = k + m;
            let mut decoder = StripeDecoder::default();
            let patterns: Vec<u64> = if n <= 12 {
                (0u64..1 << n).filter(|lost| lost.count_ones() as usize <= m).collect()
            } else {
                (0..500u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20).collect()
            };
            for pattern in patterns {
                let mut lost: Vec<usize> = (0..n).filter(|i| pattern >> (i % 64) & 1 == 1).collect();
                lost.truncate(m);
                let survivors: Vec<Option<&[u8]>> =
                    (0..k).map(|i| (!lost.contains(&i)).then_some(originals[i])).collect();
                let recovery: Vec<Option<&[u8]>> =
                    (0..m).map(|j| (!lost.contains(&(k + j))).then_some(parity[j].as_slice())).collect();
                let mut restored = Vec::new();
                decoder.decode(&survivors, &recovery, |i, shard| restored.push((i, shard.to_vec()))).unwrap();
                let wanted: Vec<usize> = lost.iter().copied().filter(|i| *i < k).collect();
                assert_eq!(restored.iter().map(|(i, _)| *i).collect::<Vec<_>>(), wanted, "rs:{k}+{m} lost {lost:?}");
                for (i, shard) in restored {
                    assert!(shard == data[i], "rs:{k}+{m} lost {lost:?}: shard {i} differs");
                }
            }
        }
    }

    fn slots(nodes: &[&str]) -> Vec<Slot> {
        nodes.iter().map(|n| Slot { node: n.to_string(), group: None }).collect()
    }

    #[test]
    fn policies_parse_print_and_refuse_nonsense() {
        for (text, policy) in [
            ("none", Redundancy::None),
            ("partner", Redundancy::Partner { copies: 2 }),
            ("partner:3", Redundancy::Partner { copies: 3 }),
            ("rs:2+1", Redundancy::ReedSolomon { data: 2, parity: 1 }),
            ("RS:4+2", Redundancy::ReedSolomon { data: 4, parity: 2 }),
        ] {
            assert_eq!(text.parse::<Redundancy>().unwrap(), policy, "{text}");
            assert_eq!(policy.to_string().parse::<Redundancy>().unwrap(), policy);
        }
        for bad in ["", "partner:1", "partner:9", "rs:0+1", "rs:2+0", "rs:2", "xor", "rs:2+1+1"] {
            let err = bad.parse::<Redundancy>().unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")) && err.contains("rs:K+M"), "{bad}: {err}");
        }
        assert_eq!(Redundancy::ReedSolomon { data: 4, parity: 2 }.overhead(), 0.5);
        assert_eq!(Redundancy::Partner { copies: 2 }.tolerates(), 1);
    }

    #[test]
    fn partner_copies_go_to_other_nodes_and_spread() {
        let plan = plan(Redundancy::Partner { copies: 2 }, 4, &slots(&["a", "b", "c", "d"])).unwrap();
        for (rank, holders) in &plan.copies {
            assert_eq!(holders.len(), 1);
            assert_ne!(holders[0], *rank as usize, "rank {rank}'s copy is on its own node");
        }
        let mut load: Vec<usize> = plan.copies.values().flatten().copied().collect();
        load.sort();
        assert_eq!(load, [0, 1, 2, 3], "one copy per node");
        let three = plan_three();
        assert!(three.copies.values().all(|h| h.len() == 2 && h[0] != h[1]));
    }

    fn plan_three() -> Plan {
        plan(Redundancy::Partner { copies: 3 }, 6, &slots(&["a", "b", "c"])).unwrap()
    }

    #[test]
    fn too_few_nodes_is_an_error_naming_the_policy() {
        let err = plan(Redundancy::Partner { copies: 2 }, 4, &slots(&["a", "a"])).unwrap_err().to_string();
        assert!(err.contains("partner:2") && err.contains("needs 2") && err.contains("has 1"), "{err}");
        let err = plan(Redundancy::ReedSolomon { data: 2, parity: 2 }, 4, &slots(&["a", "b"])).unwrap_err();
        assert!(matches!(err, RedundancyError::TooFewNodes { needed: 3, have: 2, .. }), "{err}");
    }

    #[test]
    fn reed_solomon_groups_span_distinct_nodes_and_parity_lies_elsewhere() {
        // Eight ranks on four agents (two each), rs:2+1.
        let s = slots(&["a", "b", "c", "d"]);
        let plan = plan(Redundancy::ReedSolomon { data: 2, parity: 1 }, 8, &s).unwrap();
        let home = |r: u32| s[crate::distribution::agent_for_rank(r, 8, 4) as usize].node.clone();
        let mut covered = BTreeSet::new();
        for group in &plan.groups {
            let nodes: BTreeSet<String> = group.members.iter().flatten().map(|r| home(*r)).collect();
            assert_eq!(nodes.len(), group.members.iter().flatten().count(), "members on distinct nodes: {group:?}");
            for slot in &group.parity {
                assert!(!nodes.contains(&s[*slot].node), "parity beside a member: {group:?}");
            }
            covered.extend(group.members.iter().flatten().copied());
        }
        assert_eq!(covered, (0..8).collect(), "every rank is in a group");
        assert_eq!(plan.groups.len(), 4, "8 ranks in groups of 2");
        // One agent only: groups of one rank, no zero shards, parity elsewhere.
        let lone = plan_lone();
        assert!(lone.groups.iter().all(|g| g.members == [Some(g.members[0].unwrap())]), "{lone:?}");
        // Six ranks in groups of four: the last group has the two left over.
        let s = slots(&["a", "b", "c", "d", "e", "f", "g", "h"]);
        let wide = super::plan(Redundancy::ReedSolomon { data: 4, parity: 2 }, 6, &s).unwrap();
        let sizes: Vec<usize> = wide.groups.iter().map(|g| g.members.len()).collect();
        assert_eq!(sizes, [4, 2], "{wide:?}");
    }

    #[test]
    fn one_rank_under_rs_with_two_or_more_parity_shards_is_sliced_across_k_plus_m_nodes() {
        let names = ["a", "b", "c", "d", "e", "f"];
        let rs42 = Redundancy::ReedSolomon { data: 4, parity: 2 };
        let s = slots(&names);
        let one = plan(rs42, 1, &s).unwrap();
        let [group] = one.groups.as_slice() else { panic!("{one:?}") };
        assert_eq!((group.members.as_slice(), group.slices.len(), group.parity.len()), ([Some(0)].as_slice(), 3, 2));
        assert_eq!(group.data_shards(), 4);
        // The primary, three slices and two parity shards on six nodes.
        let primary = crate::distribution::agent_for_rank(0, 1, 6) as usize;
        let nodes: BTreeSet<&str> = std::iter::once(primary)
            .chain(group.slices.iter().chain(&group.parity).copied())
            .map(|x| names[x])
            .collect();
        assert_eq!(nodes.len(), 6, "{one:?}");
        let pieces = one.pieces();
        assert!(pieces.contains(&(group.slices[2], PieceId::Slice { group: 0, index: 3 })), "{pieces:?}");
        assert_eq!(pieces.len(), 5);
        // Its unit is all six nodes, and survives two of them.
        assert_eq!(one.units(rs42, 1, &s), [(names.iter().map(|n| n.to_string()).collect(), 2)]);
        // Fewer nodes than K + M, or one parity shard: whole ranks, as before.
        assert!(plan(rs42, 1, &slots(&names[..5])).unwrap().groups[0].slices.is_empty());
        let rs41 = Redundancy::ReedSolomon { data: 4, parity: 1 };
        assert!(plan(rs41, 1, &slots(&names[..5])).unwrap().groups[0].slices.is_empty());
        // Five ranks: a group of four and a sliced one of the fifth.
        let s = slots(&["a", "b", "c", "d", "e", "f", "g"]);
        let five = plan(rs42, 5, &s).unwrap();
        let shapes: Vec<(usize, usize)> = five.groups.iter().map(|g| (g.members.len(), g.slices.len())).collect();
        assert_eq!(shapes, [(4, 0), (1, 3)], "{five:?}");
    }

    #[test]
    fn a_plan_is_still_apart_until_a_slot_moves_beside_another_of_its_unit() {
        let rs21 = Redundancy::ReedSolomon { data: 2, parity: 1 };
        let s = slots(&["a", "b", "c", "d"]);
        let placed = plan(rs21, 4, &s).unwrap();
        assert!(placed.still_apart(rs21, 4, &s));
        // Any one slot moved to a fresh node: still apart.
        for slot in 0..4 {
            let mut moved = s.clone();
            moved[slot].node = "e".into();
            assert!(placed.still_apart(rs21, 4, &moved), "slot {slot} on a fresh node");
        }
        // A group's parity moved onto one of its members' nodes: not apart.
        let group = &placed.groups[0];
        let member = crate::distribution::agent_for_rank(group.members[0].unwrap(), 4, 4) as usize;
        let mut beside = s.clone();
        beside[group.parity[0]].node = s[member].node.clone();
        assert!(!placed.still_apart(rs21, 4, &beside), "{placed:?}");
        // Fewer slots than the plan names: not apart.
        assert!(!placed.still_apart(rs21, 4, &s[..3]));
        // Partner: a copy beside its rank's primary.
        let partner = Redundancy::Partner { copies: 2 };
        let copies = plan(partner, 4, &s).unwrap();
        let mut beside = s.clone();
        beside[copies.copies[&0][0]].node = "a".into();
        assert!(copies.still_apart(partner, 4, &s) && !copies.still_apart(partner, 4, &beside));
    }

    #[test]
    fn groups_numbered_from_a_later_number_keep_their_pieces_units_and_members() {
        let rs21 = Redundancy::ReedSolomon { data: 2, parity: 1 };
        let s = slots(&["a", "b", "c", "d"]);
        let placed = plan(rs21, 4, &s).unwrap();
        let mut later = placed.clone();
        later.number_groups_from(3);
        assert_eq!(later.groups.len(), placed.groups.len() + 3);
        let shifted = |piece: PieceId| match piece {
            PieceId::Parity { group, index } => PieceId::Parity { group: group + 3, index },
            other => other,
        };
        let expected: Vec<(usize, PieceId)> = placed.pieces().into_iter().map(|(slot, p)| (slot, shifted(p))).collect();
        assert_eq!(later.pieces(), expected);
        for rank in 0..4 {
            let (group, shard) = placed.group_of(rank).unwrap();
            assert_eq!(later.group_of(rank), Some((group + 3, shard)));
        }
        // The empty groups are units of no node: the loss model is unchanged.
        let p = 0.05;
        assert_eq!(loss_probability(&later.units(rs21, 4, &s), p), loss_probability(&placed.units(rs21, 4, &s), p));
        assert!(later.still_apart(rs21, 4, &s));
    }

    fn plan_lone() -> Plan {
        plan(Redundancy::ReedSolomon { data: 2, parity: 1 }, 2, &slots(&["a", "b"])).unwrap()
    }

    #[test]
    fn failure_domains_are_preferred_when_named() {
        let s = vec![
            Slot { node: "a".into(), group: Some("rack1".into()) },
            Slot { node: "b".into(), group: Some("rack1".into()) },
            Slot { node: "c".into(), group: Some("rack2".into()) },
        ];
        let plan = plan(Redundancy::Partner { copies: 2 }, 3, &s).unwrap();
        assert_eq!(plan.copies[&0], [2], "rank 0 on rack1: its copy on rack2");
        assert_eq!(plan.copies[&1], [2]);
        assert_ne!(s[plan.copies[&2][0]].node, "c");
    }

    #[test]
    fn the_loss_model_matches_closed_forms() {
        let p = 0.01;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(exposure(Redundancy::None, 4, p).unwrap(), 1.0 - (1.0 - p).powi(4)));
        assert!(close(exposure(Redundancy::Partner { copies: 2 }, 2, p).unwrap(), p * p));
        // rs:2+1 on three nodes: lost when two or three fail.
        let two_of_three = 3.0 * p * p * (1.0 - p) + p.powi(3);
        assert!(close(exposure(Redundancy::ReedSolomon { data: 2, parity: 1 }, 3, p).unwrap(), two_of_three));
        // More protection, less exposure.
        let none = exposure(Redundancy::None, 6, p).unwrap();
        let partner = exposure(Redundancy::Partner { copies: 2 }, 6, p).unwrap();
        let rs42 = exposure(Redundancy::ReedSolomon { data: 4, parity: 2 }, 6, p).unwrap();
        assert!(rs42 < partner && partner < none, "{rs42} {partner} {none}");
        assert_eq!(exposure(Redundancy::None, 3, 0.0).unwrap(), 0.0);
        // Past 20 nodes the independent approximation stays close.
        let wide = exposure(Redundancy::Partner { copies: 2 }, 24, p).unwrap();
        assert!(wide > 0.0 && wide < 24.0 * p * p * 1.01, "{wide}");
    }

    #[test]
    fn any_m_lost_shards_are_rebuilt_bit_exact() {
        let data: Vec<Vec<u8>> =
            (0..4u8).map(|i| (0..4096).map(|b| (b as u8).wrapping_mul(31) ^ i).collect()).collect();
        let originals: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let parity = encode(2, &originals).unwrap();
        for lost in [[0, 1], [2, 3], [0, 3]] {
            let survivors: Vec<Option<&[u8]>> =
                originals.iter().enumerate().map(|(i, s)| (!lost.contains(&i)).then_some(*s)).collect();
            let parity: Vec<Option<&[u8]>> = parity.iter().map(|p| Some(p.as_slice())).collect();
            let rebuilt = decode(&survivors, &parity).unwrap();
            for i in lost {
                assert_eq!(rebuilt[&i], data[i], "shard {i}");
            }
        }
        let one_parity: Vec<Option<&[u8]>> = vec![Some(parity[0].as_slice()), None];
        let three_lost = [None, None, None, Some(originals[3])];
        let err = decode(&three_lost, &one_parity).unwrap_err().to_string();
        assert!(err.contains("3 of 4 data shards are lost"), "{err}");
    }

    #[test]
    fn a_reused_decoder_restores_stripe_after_stripe_whatever_was_lost() {
        let stripe = |seed: u8, len: usize| -> Vec<Vec<u8>> {
            (0..4u8).map(|i| (0..len).map(|b| (b as u8).wrapping_mul(13).wrapping_add(seed) ^ i).collect()).collect()
        };
        let mut decoder = StripeDecoder::default();
        // Different losses, lengths and parity counts through one decoder.
        for (seed, len, parity_count, lost) in [(1, 4096, 2, vec![0, 1]), (2, 8192, 2, vec![3]), (3, 2048, 1, vec![2])]
        {
            let data = stripe(seed, len);
            let originals: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let parity = encode(parity_count, &originals).unwrap();
            let survivors: Vec<Option<&[u8]>> =
                originals.iter().enumerate().map(|(i, s)| (!lost.contains(&i)).then_some(*s)).collect();
            let parity: Vec<Option<&[u8]>> = parity.iter().map(|p| Some(p.as_slice())).collect();
            let mut restored = Vec::new();
            decoder.decode(&survivors, &parity, |i, shard| restored.push((i, shard.to_vec()))).unwrap();
            assert_eq!(restored.iter().map(|(i, _)| *i).collect::<Vec<_>>(), lost, "stripe {seed}");
            for (i, shard) in restored {
                assert_eq!(shard, data[i], "stripe {seed}, shard {i}");
            }
        }
    }

    #[test]
    fn a_reused_encoder_codes_like_a_fresh_one_across_shapes() {
        let data: Vec<Vec<u8>> = (0..4u8).map(|i| (0..8192).map(|b| (b as u8).wrapping_mul(7) ^ i).collect()).collect();
        let mut encoder = StripeEncoder::default();
        // Full stripes, a short last stripe, a narrower group, then back.
        for (k, m, len) in [(4, 2, 8192), (4, 2, 8192), (4, 2, 1024), (2, 1, 8192), (4, 2, 8192)] {
            let originals: Vec<&[u8]> = data[..k].iter().map(|d| &d[..len]).collect();
            let mut got = vec![Vec::new(); m];
            encoder.encode(m, &originals, |j, shard| got[j] = shard.to_vec()).unwrap();
            assert_eq!(got, encode(m, &originals).unwrap(), "{k}+{m} over {len} bytes");
        }
    }
}
