//! An application's redundancy as the controller tracks it, without I/O:
//! which version is protected (every piece of its plan in place) and by
//! which agents, which one is being protected, and what the rebuild after
//! a lost node must fetch from where.
//!
//! Architecture invariant: nothing here sends or waits. The controller
//! asks [`ProtectionBook::begin`] for the pieces to request and reports each
//! answer to [`ProtectionBook::piece_done`]; a version counts as protected
//! only when every piece of its plan was built.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

use icheck_core::decide;
use icheck_core::protocol::{AgentInfo, PieceTask, RebuildSource, StoredPiece, VersionRecord};
use icheck_core::redundancy::{self, PieceId, Plan, Redundancy, Slot};

use super::journal::JournaledProtection;

/// A version whose pieces are all in place.
#[derive(Clone, Debug)]
pub(super) struct Protected {
    /// The version's record: the newest complete version again if a
    /// rebuild falls back to it (a node lost before a newer version was
    /// protected).
    pub(super) record: VersionRecord,
    pub(super) plan: Plan,
    /// The application's agents when it was protected (rank-mapping order):
    /// the primaries and the pieces' holders.
    pub(super) agents: Vec<AgentInfo>,
    /// Ranks (or SHMR nodes) of the version.
    pub(super) units: u32,
    /// The policy the plan was made for.
    pub(super) policy: Redundancy,
}

impl Protected {
    /// The version.
    pub(super) fn version(&self) -> u64 {
        self.record.version
    }

    /// The slot (index into `agents`) of `rank`'s primary; `agents` must
    /// not be empty.
    pub(super) fn primary_slot(&self, rank: u32) -> usize {
        decide::agent_for_rank(rank, self.units, self.agents.len() as u32) as usize
    }

    /// The pieces its plan places on `node`.
    pub(super) fn pieces_on(&self, node: &str) -> Vec<PieceId> {
        let at = |slot: usize| self.agents.get(slot).is_some_and(|a| a.node == node);
        self.plan.pieces().into_iter().filter(|(slot, _)| at(*slot)).map(|(_, piece)| piece).collect()
    }

    /// What the journal keeps of it.
    pub(super) fn journaled(&self) -> JournaledProtection {
        JournaledProtection {
            record: self.record.clone(),
            policy: self.policy,
            plan: self.plan.clone(),
            agents: self.agents.clone(),
            units: self.units,
        }
    }
}

#[derive(Clone, Debug)]
struct Protecting {
    record: VersionRecord,
    plan: Plan,
    agents: Vec<AgentInfo>,
    units: u32,
    policy: Redundancy,
    /// Its number ([`ProtectionBook::attempts`]): answers to an earlier
    /// attempt at the same version are not its own.
    attempt: u64,
    outstanding: BTreeSet<(u64, PieceId)>,
    /// The agent building each outstanding piece held by another (an
    /// encoder writing its shards to their holders): its node's loss ends
    /// the protection too, since no answer will come from it.
    built_by: std::collections::BTreeMap<(u64, PieceId), u64>,
}

/// What the controller knows of one application's redundancy.
#[derive(Clone, Debug, Default)]
pub(super) struct ProtectionBook {
    pub(super) policy: Redundancy,
    protecting: Option<Protecting>,
    pub(super) protected: Option<Protected>,
    /// Why the newest version is not protected (or was lost), for the status.
    pub(super) problem: Option<String>,
    /// A rebuild after a lost node runs: registrations and probes wait.
    pub(super) rebuilding: bool,
    /// Another node was lost while the rebuild ran: it runs again.
    pub(super) look_again: bool,
    /// A version a lost node took with it (a rebuild failed): the version
    /// and why, which a registration reports when no PFS copy replaces it.
    pub(super) lost: Option<(u64, String)>,
    /// When the controller asked for the pieces of the version under way
    /// (its clock, passed in): what the protection took, once done.
    pub(super) began: Option<(u64, std::time::Instant)>,
    /// The newest protections: version and seconds from its record to its
    /// last piece, oldest first (at most [`PROTECTION_HISTORY`]).
    pub(super) history: std::collections::VecDeque<(u64, f64)>,
    /// After a controller restart: the protection the journal recorded,
    /// which counts once reconciliation confirms its version
    /// ([`confirm`](Self::confirm)).
    pub(super) journaled: Option<Protected>,
    /// Reconciliation found the protected version missing ranks on nodes
    /// that did not come back: the controller starts its rebuild.
    pub(super) rebuild_due: bool,
    /// Reconciliation settled the newest version with nothing to rebuild:
    /// the controller looks whether it needs protecting, or agents started
    /// where its files are (`rebuild::agents_back_in_place`), since no
    /// protection of it may have been under way when the controller died.
    /// Set too when a node the application has a home on answers again
    /// with its agent there gone (`recheck_homed_on`).
    pub(super) recheck_due: bool,
    /// Nodes lost to the protected version although their managers run
    /// (they came back without its files): a rebuild treats them as dead.
    pub(super) wiped: BTreeSet<String>,
    /// Nodes of the protected version noticed lost (manager gone or
    /// silent) and not rebuilt yet, each with its manager connection at
    /// that moment (still open only when it went silent). A rebuild counts
    /// them lost even when their managers run again by the time it looks,
    /// unless they came back with their files, which the connection at the
    /// loss tells apart from a new manager: two nodes lost a few
    /// milliseconds apart are noticed one by one, and the second may be
    /// back (empty) before a rebuild gets to it.
    pub(super) lost_since: std::collections::BTreeMap<String, Option<u64>>,
    /// Nodes of the protected version whose ranks a rebuild has already
    /// placed elsewhere. Their pieces are not rebuilt until the version is
    /// protected anew, so until then a further rebuild of the same version
    /// counts them lost too.
    pub(super) rebuilt: BTreeSet<String>,
    /// A newer version completed while one was being protected: it is
    /// protected once that protection ends ([`defer`](Self::defer)).
    waiting: Option<u64>,
    /// The version under way is the protected one planned anew: once it
    /// is protected, the old plan's pieces of it are deleted
    /// (`ControllerToManager::DropStalePieces`).
    pub(super) replanned: Option<u64>,
    /// Nodes that answered again on the connection they had when they were
    /// marked down: their managers never started anew, so they announced
    /// no pieces, yet they may hold pieces that a rebuild made elsewhere
    /// while they were away, or of versions older than one protected
    /// meanwhile. Once the protection settles
    /// ([`take_returned`](Self::take_returned)) each is told what to
    /// delete, and leaves this set.
    pub(super) returned: BTreeSet<String>,
    /// Protections begun so far, which numbers them ([`PieceTask::attempt`]).
    pub(super) attempts: u64,
}

/// A protection under way for longer than this (or than its version's
/// bytes take at [`SLOWEST_PROTECTION_RATE`], if longer) no longer holds a
/// newer version back: a piece whose answer never comes must not leave
/// every later version unprotected, and the newer version replaces it.
pub(super) const PROTECTION_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Bytes per second below which a protection counts as stuck: far below
/// any fabric (this machine's tcp loopback protects about 2 GB/s), so a
/// large version's protection is never replaced while it moves.
const SLOWEST_PROTECTION_RATE: u64 = 50_000_000;

/// How long the protection of a version of `bytes` (all ranks) may take
/// before a newer version replaces it.
fn patience(bytes: u64) -> std::time::Duration {
    PROTECTION_PATIENCE.max(std::time::Duration::from_secs(bytes / SLOWEST_PROTECTION_RATE))
}

/// Protections remembered for the status.
pub(super) const PROTECTION_HISTORY: usize = 16;

/// A node and the pieces of the protected version its record keeps there.
pub(super) type NodeKeeps = (String, Vec<PieceId>);

/// A piece to request: the agent to build it (id and node) and the task.
pub(super) type PieceRequest = (u64, String, PieceTask);

impl ProtectionBook {
    /// The book of an application the journal remembers protected.
    pub(super) fn from_journal(journaled: &JournaledProtection) -> ProtectionBook {
        let JournaledProtection { record, policy, plan, agents, units } = journaled.clone();
        ProtectionBook {
            policy,
            journaled: Some(Protected { record, plan, agents, units, policy }),
            ..ProtectionBook::default()
        }
    }

    /// Reconciliation settled the application's newest version (`latest`):
    /// the journaled protection counts if it is that version's, or an older
    /// one's (the newest completed before it was protected: the primaries
    /// hold the protected one back and its pieces stay until a newer one
    /// is journaled protected), and is forgotten if it is of a version
    /// newer than `latest` (dropped with its files). Forgetting the older
    /// one left nothing for a rebuild to fall back to after a controller
    /// restart or takeover (the fault campaign found it).
    pub(super) fn confirm(&mut self, latest: Option<u64>) {
        if let Some(journaled) = self.journaled.take() {
            if latest.is_some_and(|latest| journaled.version() <= latest) && self.protected.is_none() {
                self.protected = Some(journaled);
            }
        }
    }

    /// Starts protecting `version`, stored on `agents` (rank-mapping order,
    /// `units` ranks): the pieces to request, or none (policy `none`, the
    /// plan cannot be had, which [`problem`](Self::problem) says, or the
    /// version is protected already with nothing on the slots that changed,
    /// which [`protected`](Self::protected) then names on `agents`).
    ///
    /// The protected version again, on agents some of which replaced lost
    /// ones (a rebuild), is *repaired*: its plan is kept where it still
    /// keeps every unit on distinct nodes, and only the pieces on the slots
    /// whose agents changed are built. The pieces in place stay as they
    /// are: a new plan could group the ranks otherwise and rewrite a piece
    /// in place with another meaning, and a node lost while that ran left
    /// the protected record naming pieces that no longer held what it said
    /// (a rebuild then refused them: "the parity of group 1 does not
    /// describe rank 2").
    pub(super) fn begin(
        &mut self,
        record: &VersionRecord,
        units: u32,
        agents: &[AgentInfo],
        groups: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<PieceRequest> {
        let version = record.version;
        self.protecting = None;
        self.replanned = None;
        self.attempts += 1;
        let attempt = self.attempts;
        // Whatever waited is protected now, or superseded by this version.
        self.waiting = None;
        if self.policy.is_none() || agents.is_empty() {
            self.problem = None;
            return Vec::new();
        }
        let slots: Vec<Slot> = agents.iter().map(|a| Slot { node: a.node.clone(), group: groups(&a.node) }).collect();
        let policy = self.policy;
        let again = self.protected.as_ref().filter(|p| {
            p.version() == version
                && p.policy == policy
                && p.units == units
                && p.agents.len() == agents.len()
                && p.plan.still_apart(policy, units, &slots)
        });
        // Copies still held by the same agent under the record's plan (only
        // when planning the protected version anew): a rank's copy holds the
        // same bytes in any plan, so it is not written again, which would
        // leave it unreadable meanwhile. (The same agent, not just the same
        // node name: a node started again empty holds nothing.)
        let mut copies_kept = BTreeSet::new();
        // Slots whose pieces are in place (only when repairing).
        let (plan, in_place): (Plan, Vec<bool>) = match again {
            Some(p) => (p.plan.clone(), p.agents.iter().zip(agents).map(|(was, is)| was.id == is.id).collect()),
            None => match redundancy::plan(policy, units, &slots) {
                Ok(mut plan) => {
                    // The protected version planned anew (its plan no
                    // longer keeps its units apart): the new groups are
                    // numbered after the record's, whose pieces stay as
                    // they are until this plan is complete. (Copies keep
                    // their names: a rank's copy holds the same bytes in
                    // any plan.)
                    if let Some(old) = self.protected.as_ref().filter(|p| p.version() == version) {
                        plan.number_groups_from(old.plan.groups.len());
                        self.replanned = Some(version);
                        let copies = old.plan.pieces().into_iter().filter(|(_, p)| matches!(p, PieceId::Copy { .. }));
                        copies_kept = copies.filter_map(|(slot, p)| Some((old.agents.get(slot)?.id, p))).collect();
                    }
                    (plan, vec![false; agents.len()])
                }
                Err(err) => {
                    self.problem = Some(format!("version {version} is not protected: {err}"));
                    return Vec::new();
                }
            },
        };
        // Placed: whatever kept it from protection before (a lost node, a
        // rebuild) is over; the pieces under way say the rest.
        self.problem = None;
        let count = agents.len() as u32;
        let primary = |rank: u32| agents[decide::agent_for_rank(rank, units, count) as usize].clone();
        let parity = match self.policy {
            Redundancy::ReedSolomon { parity, .. } => parity,
            _ => 0,
        };
        let mut requests = Vec::new();
        let mut outstanding = BTreeSet::new();
        let mut built_by = std::collections::BTreeMap::new();
        for (slot, piece) in plan.pieces() {
            let holder = &agents[slot];
            if in_place[slot] || copies_kept.contains(&(holder.id, piece)) {
                continue;
            }
            outstanding.insert((holder.id, piece));
            // Who builds it: its holder, but for a sliced group's parity the
            // rank's primary's agent, which reads the slices from its own
            // memory instead of sending them all over the fabric first.
            let mut builder = holder.clone();
            let (members, also) = match piece {
                PieceId::Copy { rank } => (vec![Some((rank, primary(rank)))], Vec::new()),
                PieceId::Parity { group, index } => {
                    let group = &plan.groups[group as usize];
                    let members = group_members(group, &primary);
                    // With K ≥ 2 data shards (members or slices), shard 0's
                    // holder encodes the group once and writes the other
                    // shards to their holders (who answer through it):
                    // K + M − 1 shards cross the fabric instead of M × K. A
                    // group of one whole member moves as much either way,
                    // and its M holders encode at once, as does each holder
                    // of a shard a repair builds while others stay.
                    let every_shard = group.parity.iter().all(|s| !in_place[*s]);
                    match (group.data_shards() >= 2 && every_shard, index) {
                        (true, 0) if !group.slices.is_empty() => {
                            builder = primary(group.members[0].unwrap_or_default());
                            (members, group.parity.iter().map(|s| agents[*s].clone()).collect())
                        }
                        (true, 0) => (members, group.parity[1..].iter().map(|s| agents[*s].clone()).collect()),
                        (true, _) => continue,
                        (false, _) => (members, Vec::new()),
                    }
                }
                // Its holder reads its slice from the primary.
                PieceId::Slice { group, .. } => (group_members(&plan.groups[group as usize], &primary), Vec::new()),
            };
            let task = PieceTask { version, attempt, piece, members, parity, also };
            for answer in task.answers(builder.id) {
                if answer.0 != builder.id {
                    built_by.insert(answer, builder.id);
                }
            }
            requests.push((builder.id, builder.node.clone(), task));
        }
        let record = record.clone();
        let agents = agents.to_vec();
        if outstanding.is_empty() {
            // Repaired: no piece lay on the slots that changed (or planned
            // anew with every copy where it was).
            self.now_protected(Protected { record, plan, agents, units, policy });
            return requests;
        }
        self.protecting = Some(Protecting { record, plan, agents, units, policy, attempt, outstanding, built_by });
        requests
    }

    /// One piece was built (or not) for protection `attempt` of `version`.
    /// Returns the version that just became protected, if this was its
    /// last piece. An answer to another attempt changes nothing: two
    /// nodes lost a few milliseconds apart make the rebuild protect the
    /// same version twice, and the first attempt's encoder, reading from
    /// the second lost node, fails after the second attempt began (CI saw
    /// it end that attempt and leave the version unprotected).
    pub(super) fn piece_done(
        &mut self,
        agent: u64,
        version: u64,
        attempt: u64,
        piece: PieceId,
        result: Result<u64, String>,
    ) -> Option<u64> {
        if !self.awaits(version, attempt) {
            return None;
        }
        let protecting = self.protecting.as_mut()?;
        if !protecting.outstanding.remove(&(agent, piece)) {
            return None;
        }
        if let Err(reason) = result {
            self.problem = Some(format!("version {version} is not protected: {reason}"));
            self.protecting = None;
            return None;
        }
        if !protecting.outstanding.is_empty() {
            return None;
        }
        let Protecting { record, plan, agents, units, policy, .. } = self.protecting.take().expect("matched above");
        self.now_protected(Protected { record, plan, agents, units, policy });
        Some(version)
    }

    /// `protected` has every piece in place.
    fn now_protected(&mut self, protected: Protected) {
        self.protected = Some(protected);
        self.problem = None;
        self.lost = None;
        // Losses counted against the record this one replaces.
        self.lost_since.clear();
        self.rebuilt.clear();
    }

    /// Whether `version`, just complete, waits for the protection under way
    /// rather than replace it (`now`: the controller's clock). One
    /// protection at a time per application: when versions complete faster
    /// than they are protected, starting one per version made them run side
    /// by side on the agents' threads, each slower than the last, and pile
    /// up behind the job. Only the newest waits; the older waiting one is
    /// skipped (its protection would be superseded at once).
    pub(super) fn defer(&mut self, version: u64, now: std::time::Instant) -> bool {
        let running_for = self.began.map(|(_, at)| now.saturating_duration_since(at));
        let patient = (self.protecting.as_ref())
            .filter(|p| p.record.version < version)
            .is_some_and(|p| running_for.is_some_and(|t| t < patience(p.record.bytes)));
        // (A protection under way implies a policy other than `none`.)
        if patient {
            self.waiting = Some(version);
        }
        self.waiting == Some(version)
    }

    /// The version to protect next, if the protection under way just ended
    /// (built or failed) with a newer one waiting ([`defer`](Self::defer)).
    pub(super) fn next_due(&mut self) -> Option<u64> {
        match self.protecting {
            Some(_) => None,
            None => self.waiting.take(),
        }
    }

    /// `node` was lost (its manager's connection closed, or it went
    /// silent): a protection with pieces outstanding there ends, as failed,
    /// since no answer will come for them (it would otherwise hold newer
    /// versions back until [`PROTECTION_PATIENCE`]). What waited is
    /// dropped too: protection starts again once the application has its
    /// agents back (registration, rebuild, next commit). Returns the
    /// version whose protection ended.
    pub(super) fn node_lost(&mut self, node: &str) -> Option<u64> {
        let protecting = self.protecting.as_ref()?;
        let there = |id: u64| protecting.agents.iter().any(|a| a.id == id && a.node == node);
        let builder = |answer: &(u64, PieceId)| protecting.built_by.get(answer).copied().unwrap_or(answer.0);
        if !protecting.outstanding.iter().any(|answer| there(answer.0) || there(builder(answer))) {
            return None;
        }
        let version = protecting.record.version;
        self.problem =
            Some(format!("version {version} is not protected: node {node} was lost while its pieces were built"));
        self.protecting = None;
        self.waiting = None;
        Some(version)
    }

    /// The version waiting for the protection under way, if any.
    pub(super) fn waiting(&self) -> Option<u64> {
        self.waiting
    }

    /// The version being protected, if any.
    pub(super) fn protecting(&self) -> Option<u64> {
        self.protecting.as_ref().map(|p| p.record.version)
    }

    /// Whether protection `attempt` of `version` is the one under way (its
    /// answers count).
    pub(super) fn awaits(&self, version: u64, attempt: u64) -> bool {
        self.protecting.as_ref().is_some_and(|p| p.record.version == version && p.attempt == attempt)
    }

    /// What of `held` (this application's pieces that `node` announced
    /// when its manager started again) no record places there: pieces of
    /// versions older than the protected one, and pieces of the protected
    /// version that a rebuild made elsewhere while the node was away. Per
    /// stale version, the pieces of it the node keeps (the arguments of
    /// `DropStalePieces`). Nothing while a protection or a rebuild is under
    /// way, since it decides where pieces go; newer versions' pieces are
    /// left to their protection.
    pub(super) fn stale_on(&self, node: &str, held: &[StoredPiece]) -> BTreeMap<u64, Vec<PieceId>> {
        let mut stale = BTreeMap::new();
        let Some((version, keep)) = self.settled_pieces_on(node) else { return stale };
        for piece in held.iter().filter(|p| p.version < version || (p.version == version && !keep.contains(&p.piece))) {
            stale
                .entry(piece.version)
                .or_insert_with(|| if piece.version == version { keep.clone() } else { Vec::new() });
        }
        stale
    }

    /// The protected version and the pieces of it that its record places
    /// on `node`, while no protection or rebuild is under way (either
    /// decides where pieces go); `None` then, or with nothing protected.
    pub(super) fn settled_pieces_on(&self, node: &str) -> Option<(u64, Vec<PieceId>)> {
        let protected = self.settled()?;
        Some((protected.version(), protected.pieces_on(node)))
    }

    /// Once the protection settles, the nodes that answered again
    /// ([`returned`](Self::returned)), which it forgets, each with the
    /// pieces of the protected version (also returned) that its record
    /// keeps there; `None` while nothing is to be told.
    pub(super) fn take_returned(&mut self) -> Option<(u64, Vec<NodeKeeps>)> {
        if self.returned.is_empty() {
            return None;
        }
        let protected = self.settled()?;
        let keep = self.returned.iter().map(|node| (node.clone(), protected.pieces_on(node))).collect();
        let version = protected.version();
        self.returned.clear();
        Some((version, keep))
    }

    /// The protected version's record while no protection or rebuild is
    /// under way.
    pub(super) fn settled(&self) -> Option<&Protected> {
        self.protected.as_ref().filter(|_| self.protecting.is_none() && !self.rebuilding)
    }

    /// Nodes holding the protected version's primaries or pieces.
    pub(super) fn nodes(&self) -> BTreeSet<String> {
        self.protected.iter().flat_map(|p| p.agents.iter().map(|a| a.node.clone())).collect()
    }

    /// Probability that the newest version is lost when every node fails
    /// independently with `p`: its plan's when it is protected, else every
    /// primary's node alone (`agents`, `units` as stored now).
    pub(super) fn exposure(&self, latest: Option<u64>, units: u32, agents: &[AgentInfo], p: f64) -> Option<f64> {
        let latest = latest?;
        let slots = |agents: &[AgentInfo]| -> Vec<Slot> {
            agents.iter().map(|a| Slot { node: a.node.clone(), group: None }).collect()
        };
        match &self.protected {
            Some(protected) if protected.version() == latest => {
                let slots = slots(&protected.agents);
                Some(redundancy::loss_probability(&protected.plan.units(self.policy, protected.units, &slots), p))
            }
            _ if agents.is_empty() || units == 0 => None,
            _ => {
                let slots = slots(agents);
                Some(redundancy::loss_probability(&Plan::default().units(Redundancy::None, units, &slots), p))
            }
        }
    }
}

/// A group's members as its tasks list them, each with its primary's
/// agent: a sliced group's one rank K times, one entry per slice
/// (`protocol::data_shard_ranges`).
fn group_members(group: &redundancy::Group, primary: &dyn Fn(u32) -> AgentInfo) -> Vec<Option<(u32, AgentInfo)>> {
    let member = |m: &Option<u32>| m.map(|rank| (rank, primary(rank)));
    match group.slices.len() {
        0 => group.members.iter().map(member).collect(),
        slices => vec![group.members.first().and_then(member); slices + 1],
    }
}

/// What rebuilding the protected version after losing `dead` nodes takes:
/// for every rank whose primary was there, where to rebuild it from.
/// An error names every rank that cannot be rebuilt and the lost nodes.
pub(super) fn rebuild_sources(
    protected: &Protected,
    dead: &BTreeSet<String>,
) -> Result<Vec<(u32, usize, RebuildSource)>, String> {
    let Protected { plan, agents, units, record, policy } = protected;
    let policy = *policy;
    let version = record.version;
    let slot_of = |rank: u32| protected.primary_slot(rank);
    let alive = |slot: usize| !dead.contains(&agents[slot].node);
    let mut sources = Vec::new();
    let mut lost = Vec::new();
    for rank in 0..*units {
        let slot = slot_of(rank);
        if alive(slot) {
            continue;
        }
        let source = match policy {
            Redundancy::None => None,
            Redundancy::Partner { .. } => {
                let holders: Vec<AgentInfo> = plan
                    .copies
                    .get(&rank)
                    .into_iter()
                    .flatten()
                    .filter(|s| alive(**s))
                    .map(|s| agents[*s].clone())
                    .collect();
                (!holders.is_empty()).then_some(RebuildSource::Copies(holders))
            }
            Redundancy::ReedSolomon { .. } => plan.group_of(rank).and_then(|(g, shard)| {
                let group = &plan.groups[g];
                let parity: Vec<Option<AgentInfo>> =
                    group.parity.iter().map(|s| alive(*s).then(|| agents[*s].clone())).collect();
                if !group.slices.is_empty() {
                    // Slice 0 went with the primary: K of the other slices
                    // and the parity shards decode it.
                    let slices: Vec<Option<AgentInfo>> =
                        group.slices.iter().map(|s| alive(*s).then(|| agents[*s].clone())).collect();
                    let survivors = slices.iter().flatten().count() + parity.iter().flatten().count();
                    return (survivors > slices.len()).then_some(RebuildSource::Slices {
                        group: g as u32,
                        slices,
                        parity,
                    });
                }
                let members: Vec<Option<(u32, Option<AgentInfo>)>> = group
                    .members
                    .iter()
                    .map(|m| m.map(|r| (r, alive(slot_of(r)).then(|| agents[slot_of(r)].clone()))))
                    .collect();
                let survivors = members.iter().filter(|m| m.as_ref().is_none_or(|(_, a)| a.is_some())).count()
                    + parity.iter().flatten().count();
                (survivors >= group.members.len()).then_some(RebuildSource::Decode {
                    group: g as u32,
                    shard: shard as u8,
                    members,
                    parity,
                })
            }),
        };
        match source {
            Some(source) => sources.push((rank, slot, source)),
            None => lost.push(rank),
        }
    }
    if lost.is_empty() {
        return Ok(sources);
    }
    let dead: Vec<&str> = dead.iter().map(String::as_str).collect();
    Err(format!(
        "version {version} cannot be rebuilt: ranks {lost:?} were on lost nodes {dead:?}, and redundancy {policy} \
         keeps too little of them on the surviving nodes (it survives {} lost node(s) per rank or group)",
        policy.tolerates()
    ))
}

/// After a controller restart, reconciliation found the `missing` ranks
/// of `protected`'s version in no store. The nodes that did not come back
/// (`reported` holds those that did) and the nodes that came back without
/// their ranks (a wiped store) are lost to the version; it can still be
/// rebuilt when the other nodes hold enough of its pieces. Returns those
/// lost nodes, or why it cannot be rebuilt.
pub(super) fn rebuildable(
    protected: &Protected,
    missing: &[u32],
    reported: &BTreeSet<String>,
) -> Result<BTreeSet<String>, String> {
    if protected.agents.is_empty() {
        return Err(format!("version {} has no agents on record", protected.version()));
    }
    let mut lost: BTreeSet<String> =
        protected.agents.iter().map(|a| a.node.clone()).filter(|node| !reported.contains(node)).collect();
    for rank in missing {
        lost.insert(protected.agents[protected.primary_slot(*rank)].node.clone());
    }
    rebuild_sources(protected, &lost)?;
    Ok(lost)
}

/// The nodes holding primaries (ranks' own files) of `protected`.
pub(super) fn primary_nodes(protected: &Protected) -> BTreeSet<String> {
    if protected.agents.is_empty() {
        return BTreeSet::new();
    }
    (0..protected.units).map(|rank| protected.agents[protected.primary_slot(rank)].node.clone()).collect()
}

/// The nodes placed to hold pieces of `protected` (of application `app`)
/// whose stores do not announce them all: `announced(node)` gives what a
/// node's manager announced when it last registered, `None` if it has
/// not. A node started again empty, or that never came back, is among
/// them; a node holding parity alone has no ranks to tell it by.
pub(super) fn nodes_missing_pieces<'a>(
    protected: &Protected,
    app: &str,
    announced: impl Fn(&str) -> Option<&'a [StoredPiece]>,
) -> BTreeSet<String> {
    let version = protected.version();
    let has =
        |held: &[StoredPiece], piece| held.iter().any(|p| p.app == app && p.version == version && p.piece == piece);
    (protected.plan.pieces().into_iter())
        .filter_map(|(slot, piece)| protected.agents.get(slot).map(|a| (a.node.as_str(), piece)))
        .filter(|(node, piece)| !announced(node).is_some_and(|held| has(held, *piece)))
        .map(|(node, _)| node.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::apps::tests::agent;
    use super::*;
    use icheck_core::redundancy::Group;
    use std::collections::BTreeMap;

    fn record(version: u64) -> VersionRecord {
        VersionRecord { version, ranks: 4, epoch: 0, bytes: 1 << 20, commit_secs: 0.1, completed_unix_ms: 1 }
    }

    fn book(policy: &str) -> ProtectionBook {
        ProtectionBook { policy: policy.parse().unwrap(), ..ProtectionBook::default() }
    }

    #[test]
    fn a_version_is_protected_once_every_piece_is_built() {
        let agents = [agent(1, "a"), agent(2, "b"), agent(3, "c")];
        let mut book = book("rs:2+1");
        let requests = book.begin(&record(7), 4, &agents, &|_| None);
        assert!(!requests.is_empty());
        assert_eq!(book.protecting(), Some(7));
        let (last, rest) = requests.split_last().unwrap();
        for (agent, _, task) in rest {
            assert_eq!(book.piece_done(*agent, 7, book.attempts, task.piece, Ok(10)), None);
        }
        assert_eq!(book.piece_done(99, 7, book.attempts, last.2.piece, Ok(10)), None, "an agent that was not asked");
        assert_eq!(book.piece_done(last.0, 6, book.attempts, last.2.piece, Ok(10)), None, "an older version");
        assert_eq!(book.piece_done(last.0, 7, book.attempts, last.2.piece, Ok(10)), Some(7));
        assert_eq!(book.protected.as_ref().map(|p| p.version()), Some(7));
        assert!(book.exposure(Some(7), 4, &agents, 0.01).unwrap() < book.exposure(Some(8), 4, &agents, 0.01).unwrap());
    }

    #[test]
    fn a_returned_node_is_told_what_to_keep_only_once_the_protection_settles() {
        let agents = [agent(1, "a"), agent(2, "b"), agent(3, "c")];
        let mut book = book("rs:2+1");
        book.returned.insert("c".into());
        assert_eq!(book.take_returned(), None, "nothing protected yet");
        protect_all(&mut book, 3, 4, &agents);
        // A rebuild moved c's slot to d; c answers again meanwhile.
        let moved = [agent(1, "a"), agent(2, "b"), agent(4, "d")];
        let requests = book.begin(&record(3), 4, &moved, &|_| None);
        assert_eq!(book.take_returned(), None, "not while the slot is rebuilt");
        for (id, _, task) in &requests {
            for (holder, piece) in task.answers(*id) {
                book.piece_done(holder, 3, task.attempt, piece, Ok(1));
            }
        }
        let on_d = book.protected.as_ref().unwrap().pieces_on("d");
        assert!(!on_d.is_empty());
        assert_eq!(book.take_returned(), Some((3, vec![("c".to_string(), Vec::new())])), "c keeps nothing");
        assert_eq!(book.take_returned(), None, "told once");
        book.returned.insert("d".into());
        assert_eq!(book.take_returned(), Some((3, vec![("d".to_string(), on_d)])));
    }

    #[test]
    fn answers_to_an_earlier_attempt_at_the_same_version_do_not_count() {
        // CI's case: two nodes lost 2 ms apart; the rebuild protects version
        // 3 once per lost node, and the first attempt's encoder, reading
        // from the second lost node, fails after the second attempt began.
        let agents = [agent(1, "a"), agent(2, "b"), agent(3, "c")];
        let mut book = book("rs:2+1");
        let first = book.begin(&record(3), 4, &agents, &|_| None);
        let second = book.begin(&record(3), 4, &agents, &|_| None);
        let attempt = |requests: &[PieceRequest]| requests[0].2.attempt;
        assert_ne!(attempt(&first), attempt(&second));
        let answers = |requests: &[PieceRequest]| -> Vec<(u64, PieceId, u64)> {
            requests
                .iter()
                .flat_map(|(id, _, task)| task.answers(*id).into_iter().map(|(h, p)| (h, p, task.attempt)))
                .collect()
        };
        for (holder, piece, attempt) in answers(&first) {
            let late = book.piece_done(holder, 3, attempt, piece, Err("cannot connect to agent 3 on c".into()));
            assert_eq!(late, None);
        }
        assert_eq!(book.protecting(), Some(3), "the second attempt goes on");
        assert_eq!(book.problem, None);
        for (holder, piece, attempt) in answers(&first) {
            assert_eq!(book.piece_done(holder, 3, attempt, piece, Ok(1)), None, "nor does a late success count");
        }
        assert!(book.protected.is_none());
        let (last, rest) = answers(&second).split_last().map(|(l, r)| (*l, r.to_vec())).unwrap();
        for (holder, piece, attempt) in rest {
            assert_eq!(book.piece_done(holder, 3, attempt, piece, Ok(1)), None);
        }
        assert_eq!(book.piece_done(last.0, 3, last.2, last.1, Ok(1)), Some(3));
    }

    #[test]
    fn versions_completing_during_a_protection_wait_and_only_the_newest_is_protected_next() {
        let agents = [agent(1, "a"), agent(2, "b"), agent(3, "c")];
        let mut book = book("rs:2+1");
        let start = std::time::Instant::now();
        let requests = book.begin(&record(7), 4, &agents, &|_| None);
        book.began = Some((7, start));
        assert!(book.defer(8, start), "version 8 waits for 7's protection");
        assert!(book.defer(9, start), "and 9 takes its place");
        assert_eq!((book.protecting(), book.waiting()), (Some(7), Some(9)));
        assert_eq!(book.next_due(), None, "not while 7 is under way");
        for (agent, _, task) in &requests {
            book.piece_done(*agent, 7, book.attempts, task.piece, Ok(1));
        }
        assert_eq!(book.protected.as_ref().map(|p| p.version()), Some(7));
        assert_eq!(book.next_due(), Some(9));
        assert_eq!(book.next_due(), None, "taken once");
        // Nothing under way: a complete version is protected at once.
        assert!(!book.defer(10, start));

        // A failed piece ends the protection too.
        let requests = book.begin(&record(10), 4, &agents, &|_| None);
        book.began = Some((10, start));
        assert!(book.defer(11, start));
        let (agent, _, task) = &requests[0];
        book.piece_done(*agent, 10, book.attempts, task.piece, Err("no room".into()));
        assert_eq!(book.next_due(), Some(11));

        // A protection that never ends holds nothing back for ever.
        book.begin(&record(12), 4, &agents, &|_| None);
        book.began = Some((12, start));
        assert!(!book.defer(13, start + PROTECTION_PATIENCE), "it replaces a protection under way too long");
        // ... but a large version's protection is given the time its bytes take.
        assert_eq!(patience(1 << 20), PROTECTION_PATIENCE);
        assert_eq!(patience(10 * SLOWEST_PROTECTION_RATE * 60), 10 * PROTECTION_PATIENCE);
        // A replacing begin (new agents) drops what waited.
        assert!(book.defer(13, start));
        book.begin(&record(13), 4, &agents, &|_| None);
        assert_eq!(book.waiting(), None);
    }

    #[test]
    fn a_node_lost_with_pieces_outstanding_ends_the_protection_and_says_why() {
        let agents = [agent(1, "a"), agent(2, "b"), agent(3, "c")];
        let mut book = book("rs:2+1");
        let requests = book.begin(&record(7), 4, &agents, &|_| None);
        book.began = Some((7, std::time::Instant::now()));
        assert!(book.defer(8, std::time::Instant::now()));
        let holders: BTreeSet<&str> =
            requests.iter().map(|(id, _, _)| agents.iter().find(|a| a.id == *id).unwrap().node.as_str()).collect();
        let idle = ["a", "b", "c"]
            .into_iter()
            .find(|n| !holders.contains(n))
            .expect("rs:2+1 over 4 ranks: a node builds nothing");
        assert_eq!(book.node_lost(idle), None, "no piece of it was being built on {idle}");
        assert_eq!(book.protecting(), Some(7));
        let holder = *holders.iter().next().unwrap();
        assert_eq!(book.node_lost(holder), Some(7));
        assert_eq!((book.protecting(), book.waiting(), book.next_due()), (None, None, None));
        assert!(book.problem.as_deref().unwrap().contains(&format!("node {holder} was lost")), "{:?}", book.problem);
    }

    #[test]
    fn one_agent_encodes_each_group_and_answers_for_every_shard() {
        let agents: Vec<AgentInfo> = (1..=6).map(|i| agent(i, &format!("n{i}"))).collect();
        let mut book = book("rs:4+2");
        let requests = book.begin(&record(3), 4, &agents, &|_| None);
        assert_eq!(requests.len(), 1, "one encoder for the one group: {requests:?}");
        let (encoder, _, task) = &requests[0];
        assert_eq!(task.piece, PieceId::Parity { group: 0, index: 0 });
        assert_eq!(task.members.len(), 4);
        assert_eq!(task.also.len(), 1, "it writes shard 1 to its holder");
        let other = task.also[0].id;
        assert_ne!(other, *encoder);
        // Both shards must answer; the second holder's answer (sent by the
        // encoder's manager) completes the version.
        assert_eq!(book.piece_done(*encoder, 3, book.attempts, task.piece, Ok(8)), None);
        assert_eq!(book.piece_done(other, 3, book.attempts, PieceId::Parity { group: 0, index: 1 }, Ok(8)), Some(3));
        // rs:2+1 has nothing to write elsewhere.
        let mut book = super::tests::book("rs:2+1");
        assert!(book.begin(&record(4), 4, &agents, &|_| None).iter().all(|(_, _, task)| task.also.is_empty()));
        // A group of one whole rank (five nodes, too few to slice it): each
        // parity holder encodes its own shard.
        let mut book = super::tests::book("rs:4+2");
        let requests = book.begin(&record(5), 1, &agents[..5], &|_| None);
        assert_eq!(requests.len(), 2, "{requests:?}");
        assert!(requests.iter().all(|(_, _, task)| task.also.is_empty() && task.members.len() == 1));
        // On six nodes it is sliced: three slice holders read their slices,
        // and the primary's agent codes both parity shards over the four
        // slices from its own memory, keeping neither.
        let mut book = super::tests::book("rs:4+2");
        let requests = book.begin(&record(6), 1, &agents, &|_| None);
        let pieces: Vec<PieceId> = requests.iter().map(|(_, _, task)| task.piece).collect();
        let slices = (1..=3).map(|index| PieceId::Slice { group: 0, index });
        assert_eq!(pieces, [PieceId::Parity { group: 0, index: 0 }].into_iter().chain(slices).collect::<Vec<_>>());
        let rank_0 = |task: &PieceTask| task.members.iter().all(|m| m.as_ref().is_some_and(|(rank, _)| *rank == 0));
        assert!(requests.iter().all(|(_, _, task)| task.members.len() == 4 && rank_0(task)));
        let (encoder, _, encoding) = &requests[0];
        let primary = agents[decide::agent_for_rank(0, 1, 6) as usize].id;
        assert_eq!((*encoder, encoding.also.len(), encoding.keeps_nothing()), (primary, 2, true));
        let holders: BTreeSet<u64> =
            requests.iter().map(|(id, _, _)| *id).chain(encoding.also.iter().map(|a| a.id)).collect();
        assert_eq!(holders.len(), 6, "the encoder and five pieces on six agents");
        for (id, _, task) in &requests[1..] {
            assert_eq!(book.piece_done(*id, 6, book.attempts, task.piece, Ok(8)), None);
        }
        assert_eq!(book.piece_done(*encoder, 6, book.attempts, encoding.piece, Ok(8)), None, "it holds no shard");
        for (answer, done) in encoding.answers(*encoder).into_iter().zip([None, Some(6)]) {
            assert_eq!(book.piece_done(answer.0, 6, book.attempts, answer.1, Ok(8)), done, "{answer:?}");
        }
        // Its node lost while it encodes: no answer will come from it.
        book.begin(&record(7), 1, &agents, &|_| None);
        let primary_node = agents.iter().find(|a| a.id == primary).unwrap().node.clone();
        assert_eq!(book.node_lost(&primary_node), Some(7));
    }

    /// Protects version `version` of `units` ranks on `agents` with every
    /// piece answered at once: the pieces' (holder, piece), in order.
    fn protect_all(book: &mut ProtectionBook, version: u64, units: u32, agents: &[AgentInfo]) -> Vec<(u64, PieceId)> {
        let requests = book.begin(&record(version), units, agents, &|_| None);
        let answers: Vec<(u64, PieceId)> = requests.iter().flat_map(|(id, _, task)| task.answers(*id)).collect();
        for (holder, piece) in &answers {
            book.piece_done(*holder, version, book.attempts, *piece, Ok(1));
        }
        assert_eq!(book.protected.as_ref().map(|p| p.version()), Some(version));
        answers
    }

    #[test]
    fn a_rebuilt_version_keeps_its_plan_and_builds_only_the_pieces_of_the_replaced_slots() {
        // The fault campaign's and CI's case: five ranks under rs:4+2, one
        // rank per node. The grouping follows the nodes' names, so the
        // replacement on local-7 would have made rank 4 the sliced one in
        // place of rank 2, and rewritten group 1's pieces on the survivors
        // with that meaning while the record still said rank 2.
        let nodes = ["local-1", "local-2", "local-6", "local-3", "local-4", "local-5"];
        let agents: Vec<AgentInfo> = nodes.iter().enumerate().map(|(i, n)| agent(i as u64 + 1, n)).collect();
        let mut book = book("rs:4+2");
        let all = protect_all(&mut book, 3, 5, &agents);
        let plan = book.protected.as_ref().unwrap().plan.clone();
        let mut replaced = agents.clone();
        replaced[4] = agent(7, "local-7");
        let slots = |agents: &[AgentInfo]| -> Vec<Slot> {
            agents.iter().map(|a| Slot { node: a.node.clone(), group: None }).collect()
        };
        let fresh = redundancy::plan(book.policy, 5, &slots(&replaced)).unwrap();
        assert_ne!(fresh.groups, plan.groups, "a new plan would group the ranks otherwise");
        let requests = book.begin(&record(3), 5, &replaced, &|_| None);
        let answers: Vec<(u64, PieceId)> = requests.iter().flat_map(|(id, _, task)| task.answers(*id)).collect();
        let on_slot_4: Vec<(u64, PieceId)> =
            all.iter().filter(|(holder, _)| *holder == 5).map(|(_, piece)| (7, *piece)).collect();
        assert!(!on_slot_4.is_empty(), "slot 4 held pieces: {all:?}");
        assert_eq!(answers, on_slot_4, "only the replaced slot's pieces are built");
        // Each is built by its own holder (its group's other shards stay).
        assert!(requests.iter().all(|(id, _, task)| *id == 7 && task.also.is_empty()), "{requests:?}");
        assert_eq!(book.replanned, None, "repaired under its own plan: nothing of it is stale");
        for (holder, piece) in &answers {
            book.piece_done(*holder, 3, book.attempts, *piece, Ok(1));
        }
        let protected = book.protected.as_ref().unwrap();
        assert_eq!((&protected.plan, &protected.agents), (&plan, &replaced));
        assert!(book.rebuilt.is_empty() && book.protecting().is_none());
        // A replacement beside a survivor: the plan no longer keeps its
        // pieces apart, and a new one is made (every piece built), its
        // groups numbered after the record's, so that no piece the record
        // names is written over while it is built.
        let mut doubled = replaced.clone();
        doubled[4] = agent(8, "local-1");
        let requests = book.begin(&record(3), 5, &doubled, &|_| None);
        let answers: Vec<(u64, PieceId)> = requests.iter().flat_map(|(id, _, task)| task.answers(*id)).collect();
        let holders: BTreeSet<u64> = answers.iter().map(|(holder, _)| *holder).collect();
        assert!(holders.len() > 1, "{requests:?}");
        assert_eq!(book.replanned, Some(3), "the old plan's pieces go once this one is complete");
        let old_groups = plan.groups.len() as u32;
        for (_, piece) in &answers {
            let group = match piece {
                PieceId::Parity { group, .. } | PieceId::Slice { group, .. } => *group,
                PieceId::Copy { .. } => unreachable!("rs:4+2 keeps no copies"),
            };
            assert!(group >= old_groups, "{piece} reuses a number of the record's plan: {answers:?}");
        }
        for (holder, piece) in &answers {
            book.piece_done(*holder, 3, book.attempts, *piece, Ok(1));
        }
        let replanned = &book.protected.as_ref().unwrap().plan;
        assert!(replanned.groups[..plan.groups.len()].iter().all(|g| *g == Group::default()), "{replanned:?}");
        // Its ranks are all in its own groups, and it still says what a
        // rebuild reads: rank 2's group lies past the empty ones.
        let (group, _) = replanned.group_of(2).unwrap();
        assert!(group >= plan.groups.len());
        let dead = BTreeSet::from(["local-6".to_string()]);
        let sources = rebuild_sources(book.protected.as_ref().unwrap(), &dead).unwrap();
        assert_eq!(sources.len(), 1, "{sources:?}");
    }

    #[test]
    fn a_replaced_slot_holding_no_piece_is_protected_at_once_on_the_new_agents() {
        // rs:2+1, four ranks on four nodes: two groups, each with its parity
        // on a node outside it; some slot holds no parity.
        let agents: Vec<AgentInfo> = (1..=4).map(|i| agent(i, &format!("n{i}"))).collect();
        let mut book = book("rs:2+1");
        let all = protect_all(&mut book, 3, 4, &agents);
        let idle =
            (0..4).find(|s| !all.iter().any(|(holder, _)| *holder == agents[*s].id)).expect("a slot without pieces");
        let mut replaced = agents.clone();
        replaced[idle] = agent(9, "n9");
        assert!(book.begin(&record(3), 4, &replaced, &|_| None).is_empty());
        assert_eq!(book.protected.as_ref().map(|p| &p.agents), Some(&replaced));
        assert!(book.protecting().is_none());
    }

    #[test]
    fn a_version_planned_anew_writes_no_copy_its_agent_already_holds() {
        // Partner copies of six ranks on six nodes; the last slot's
        // replacement goes beside the one before it (no free node), so
        // version 3 is planned anew.
        let agents: Vec<AgentInfo> = (1..=6).map(|i| agent(i, &format!("n{i}"))).collect();
        let mut book = book("partner");
        let before: BTreeSet<(u64, PieceId)> = protect_all(&mut book, 3, 6, &agents).into_iter().collect();
        let mut replaced = agents.clone();
        replaced[5] = agent(9, "n5");
        let requests = book.begin(&record(3), 6, &replaced, &|_| None);
        assert_eq!(book.replanned, Some(3), "beside a survivor: planned anew");
        let plan = &book.protecting.as_ref().expect("some copy moves").plan;
        let after: BTreeSet<(u64, PieceId)> =
            plan.pieces().into_iter().map(|(slot, piece)| (replaced[slot].id, piece)).collect();
        let kept: BTreeSet<_> = before.intersection(&after).copied().collect();
        assert!(!kept.is_empty(), "some copy stays with its agent: {before:?} {after:?}");
        let asked: BTreeSet<(u64, PieceId)> = requests.iter().flat_map(|(id, _, task)| task.answers(*id)).collect();
        assert_eq!(asked, after.difference(&kept).copied().collect(), "only the copies that moved are written");
        for (holder, piece) in &asked {
            book.piece_done(*holder, 3, book.attempts, *piece, Ok(1));
        }
        assert_eq!(book.protected.as_ref().map(|p| (&p.agents, p.plan.pieces().len())), Some((&replaced, after.len())));
    }

    #[test]
    fn a_returning_node_keeps_only_the_pieces_the_protected_record_places_on_it() {
        // rs:2+1, four ranks on four nodes, version 3 protected.
        let agents: Vec<AgentInfo> = (1..=4).map(|i| agent(i, &format!("n{i}"))).collect();
        let mut book = book("rs:2+1");
        let all = protect_all(&mut book, 3, 4, &agents);
        let (holder, mine) = all[0];
        let slot = agents.iter().position(|a| a.id == holder).unwrap();
        let node = agents[slot].node.clone();
        let elsewhere = all.iter().find(|(h, _)| *h != holder).expect("pieces on two nodes").1;
        let held = |pieces: &[(u64, PieceId)]| -> Vec<StoredPiece> {
            pieces
                .iter()
                .map(|(version, piece)| StoredPiece { app: "app".into(), version: *version, piece: *piece })
                .collect()
        };
        // An older version's pieces go (all of them); of version 3, what the
        // plan puts on another node; a newer version's are its protection's.
        let announced = held(&[(2, mine), (2, elsewhere), (3, mine), (3, elsewhere), (4, mine)]);
        let stale = book.stale_on(&node, &announced);
        assert_eq!(stale, BTreeMap::from([(2, Vec::new()), (3, vec![mine])]));
        assert!(book.stale_on(&node, &held(&[(3, mine)])).is_empty(), "what the record places there stays");

        // The node's slot was rebuilt on n9 while it was away: all of
        // version 3 there is stale.
        let mut replaced = agents.clone();
        replaced[slot] = agent(9, "n9");
        for (agent, _, task) in book.begin(&record(3), 4, &replaced, &|_| None) {
            for (holder, piece) in task.answers(agent) {
                assert!(book.stale_on(&node, &held(&[(3, mine)])).is_empty(), "nothing while a rebuild builds");
                book.piece_done(holder, 3, book.attempts, piece, Ok(1));
            }
        }
        assert_eq!(book.protecting(), None);
        assert_eq!(book.stale_on(&node, &held(&[(3, mine)])), BTreeMap::from([(3, Vec::new())]));
        assert_eq!(book.stale_on("n9", &held(&[(3, mine)])), BTreeMap::new());
    }

    #[test]
    fn a_failed_piece_leaves_the_version_unprotected_and_says_why() {
        let agents = [agent(1, "a"), agent(2, "b")];
        let mut book = book("partner");
        let requests = book.begin(&record(3), 2, &agents, &|_| None);
        let (agent, _, task) = &requests[0];
        assert_eq!(book.piece_done(*agent, 3, book.attempts, task.piece, Err("no room".into())), None);
        assert!(book.problem.as_deref().unwrap().contains("no room"));
        assert!(book.protected.is_none());
        let too_few = book.begin(&record(4), 2, &agents[..1], &|_| None);
        assert!(too_few.is_empty());
        assert!(book.problem.as_deref().unwrap().contains("needs 2"), "{:?}", book.problem);
    }

    #[test]
    fn a_journaled_protection_of_an_older_version_than_the_newest_still_counts() {
        let agents: Vec<AgentInfo> = ["a", "b", "c"].iter().enumerate().map(|(i, n)| agent(i as u64 + 1, n)).collect();
        let mut book = book("rs:2+1");
        for (agent, _, task) in book.begin(&record(5), 2, &agents, &|_| None) {
            book.piece_done(agent, 5, book.attempts, task.piece, Ok(1));
        }
        let journaled = book.protected.as_ref().unwrap().journaled();
        // Version 6 completed before it was protected: a rebuild falls back to 5.
        let mut restarted = ProtectionBook::from_journal(&journaled);
        restarted.confirm(Some(6));
        assert_eq!(restarted.protected.map(|p| p.version()), Some(5));
        assert!(restarted.journaled.is_none());
        // Nothing is confirmed (every journaled version dropped): nothing counts.
        let mut restarted = ProtectionBook::from_journal(&journaled);
        restarted.confirm(None);
        assert!(restarted.protected.is_none());
    }

    #[test]
    fn a_journaled_protection_counts_once_its_version_is_confirmed_and_names_what_a_rebuild_needs() {
        let agents: Vec<AgentInfo> =
            ["a", "b", "c", "d"].iter().enumerate().map(|(i, n)| agent(i as u64 + 1, n)).collect();
        let mut book = book("rs:2+1");
        for (agent, _, task) in book.begin(&record(5), 4, &agents, &|_| None) {
            book.piece_done(agent, 5, book.attempts, task.piece, Ok(1));
        }
        let journaled = book.protected.as_ref().unwrap().journaled();
        // Another version won the reconciliation: the protection is of no use.
        let mut restarted = ProtectionBook::from_journal(&journaled);
        assert_eq!(restarted.policy, book.policy);
        assert!(restarted.protected.is_none(), "not before reconciliation");
        restarted.confirm(Some(4));
        assert!(restarted.protected.is_none() && restarted.journaled.is_none());
        let mut restarted = ProtectionBook::from_journal(&journaled);
        restarted.confirm(Some(5));
        let protected = restarted.protected.clone().expect("version 5 confirmed: protected again");
        assert_eq!(protected.journaled(), journaled);

        let all: BTreeSet<String> = ["a", "b", "c", "d"].iter().map(|n| n.to_string()).collect();
        let without_b: BTreeSet<String> = all.iter().filter(|n| *n != "b").cloned().collect();
        // Node b never came back (rank 1 was there): rebuildable from its group.
        assert_eq!(rebuildable(&protected, &[1], &without_b).unwrap(), ["b".to_string()].into());
        // Node b came back without rank 1 (a wiped store): lost all the same.
        assert_eq!(rebuildable(&protected, &[1], &all).unwrap(), ["b".to_string()].into());
        // Ranks 0 and 1 form a group of rs:2+1: both lost is one too many.
        let err = rebuildable(&protected, &[0, 1], &all).unwrap_err();
        assert!(err.contains("ranks [0, 1]") && err.contains("cannot be rebuilt"), "{err}");
    }

    #[test]
    fn nodes_missing_pieces_are_those_whose_stores_do_not_announce_them() {
        // rs:2+1 over four ranks on four nodes: each group's parity shard
        // on a node holding none of its members.
        let agents = vec![agent(1, "a"), agent(2, "b"), agent(3, "c"), agent(4, "d")];
        let mut book = book("rs:2+1");
        for (agent, _, task) in book.begin(&record(5), 4, &agents, &|_| None) {
            book.piece_done(agent, 5, book.attempts, task.piece, Ok(1));
        }
        let protected = book.protected.clone().unwrap();
        assert_eq!(primary_nodes(&protected), ["a", "b", "c", "d"].map(String::from).into());
        let pieces = protected.plan.pieces();
        let held = |version| -> BTreeMap<String, Vec<StoredPiece>> {
            let mut held: BTreeMap<String, Vec<StoredPiece>> = BTreeMap::new();
            for (slot, piece) in &pieces {
                let stored = StoredPiece { app: "app".into(), version, piece: *piece };
                held.entry(agents[*slot].node.clone()).or_default().push(stored);
            }
            held
        };
        let all = held(5);
        let announced = |node: &str| all.get(node).map(Vec::as_slice);
        assert!(nodes_missing_pieces(&protected, "app", announced).is_empty());
        // Another application's or version's pieces are not these.
        assert_eq!(nodes_missing_pieces(&protected, "other", announced).len(), 2);
        let older = held(4);
        assert_eq!(nodes_missing_pieces(&protected, "app", |n: &str| older.get(n).map(Vec::as_slice)).len(), 2);
        // A holder started again empty, or that never registered.
        let holder = agents[pieces[0].0].node.clone();
        let mut wiped = all.clone();
        wiped.insert(holder.clone(), Vec::new());
        let missing = nodes_missing_pieces(&protected, "app", |n: &str| wiped.get(n).map(Vec::as_slice));
        assert_eq!(missing, [holder.clone()].into());
        wiped.remove(&holder);
        let missing = nodes_missing_pieces(&protected, "app", |n: &str| wiped.get(n).map(Vec::as_slice));
        assert_eq!(missing, [holder].into());
    }

    #[test]
    fn rebuild_sources_name_survivors_or_the_missing_ranks() {
        let agents = vec![agent(1, "a"), agent(2, "b"), agent(3, "c"), agent(4, "d")];
        for policy in ["partner", "rs:2+1"] {
            let mut book = book(policy);
            for (agent, _, task) in book.begin(&record(5), 4, &agents, &|_| None) {
                book.piece_done(agent, 5, book.attempts, task.piece, Ok(1));
            }
            let protected = book.protected.clone().unwrap();
            let one: BTreeSet<String> = ["b".to_string()].into();
            let sources = rebuild_sources(&protected, &one).unwrap();
            assert_eq!(sources.iter().map(|s| s.0).collect::<Vec<_>>(), [1], "{policy}: rank 1 was on b");
            let two: BTreeSet<String> = ["a".to_string(), "b".to_string(), "c".to_string()].into();
            let err = rebuild_sources(&protected, &two).unwrap_err();
            assert!(err.contains("ranks [") && err.contains("\"a\""), "{policy}: {err}");
        }
    }

    #[test]
    fn a_sliced_rank_is_rebuilt_from_its_surviving_slices_and_parity() {
        let agents: Vec<AgentInfo> = (1..=6).map(|i| agent(i, &format!("n{i}"))).collect();
        let mut book = book("rs:4+2");
        let requests = book.begin(&record(5), 1, &agents, &|_| None);
        for (id, _, task) in &requests {
            for (holder, piece) in task.answers(*id) {
                book.piece_done(holder, 5, book.attempts, piece, Ok(1));
            }
        }
        let protected = book.protected.clone().expect("protected");
        let group = &protected.plan.groups[0];
        let primary = agents[protected.primary_slot(0)].node.clone();
        let node = |slot: usize| agents[slot].node.clone();
        // The primary and one slice holder lost: the two parity shards and
        // the other two slices decode it.
        let dead: BTreeSet<String> = [primary.clone(), node(group.slices[1])].into();
        let sources = rebuild_sources(&protected, &dead).unwrap();
        let [(0, _, RebuildSource::Slices { group: 0, slices, parity })] = sources.as_slice() else {
            panic!("{sources:?}")
        };
        assert_eq!(slices.iter().map(Option::is_some).collect::<Vec<_>>(), [true, false, true]);
        assert!(parity.iter().all(Option::is_some));
        // A third loss among its six nodes is one too many.
        let three: BTreeSet<String> = [primary, node(group.slices[1]), node(group.parity[0])].into();
        let err = rebuild_sources(&protected, &three).unwrap_err();
        assert!(err.contains("ranks [0]"), "{err}");
        // Slice holders lost alone: no rank to rebuild (protection builds the slices again).
        let holders: BTreeSet<String> = [node(group.slices[0]), node(group.slices[2])].into();
        assert!(rebuild_sources(&protected, &holders).unwrap().is_empty());
    }
}
