//! The controller's applications as state without I/O: what it records
//! of each (registration, agents, versions, commit history, adaptation),
//! the step that records a complete version, and the agent count a
//! resized application gets.
//!
//! Architecture invariant: nothing here sends, sleeps or reads a clock; the
//! time a version completed comes in as an argument, and what the
//! controller must tell managers (ranks to drop) comes back as data.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use icheck_core::config::DynamicConfig;
use icheck_core::decide;
use icheck_core::protocol::{
    self, AgentChange, AgentInfo, ClientReply, CommitSample, TransferMode, VersionRecord, COMMIT_HISTORY,
};

use super::copies::CopyBook;
use icheck_core::credentials::{Capability, Owner};

/// What a registering client proves: the capability it presents (if any)
/// and its Unix user (`reported` by the client, `seen` as the socket's
/// owner when the controller can tell).
#[derive(Clone, Debug)]
pub(super) struct Claim<'a> {
    pub(super) presented: Option<&'a str>,
    pub(super) reported: u32,
    pub(super) seen: Option<u32>,
}

/// The ownership check of a registration. A new application (no `owner`)
/// is owned by the registering user, with the capability the client
/// presents (the library draws it and keeps it before it asks, so a reply
/// lost on the way cannot orphan the application) or a fresh one. A known
/// application must present its capability, from the user that registered
/// it. Returns the capability to hand back and the owner to record.
pub(super) fn admit_owner(app: &str, owner: Option<&Owner>, claim: &Claim<'_>) -> Result<(Capability, Owner), String> {
    if let Some(seen) = claim.seen.filter(|seen| *seen != claim.reported) {
        return Err(format!(
            "the client registering {app:?} says it runs as uid {}, but its connection belongs to uid {seen}",
            claim.reported
        ));
    }
    let uid = claim.seen.unwrap_or(claim.reported);
    let Some(owner) = owner else {
        let capability = match claim.presented {
            Some(presented) => Capability::parse(presented, "the presented capability").map_err(|e| e.to_string())?,
            None => Capability::generate().map_err(|e| e.to_string())?,
        };
        let owner = Owner { verifier: capability.verifier(), uid };
        return Ok((capability, owner));
    };
    let Some(presented) = claim.presented else {
        return Err(format!(
            "application {app:?} exists and this client presented no capability: the name belongs to another \
             job, or the capability file of this one is gone (see client.capability_dir / ICHECK_CAPABILITY_DIR); \
             an administrator can `icheck delete {app}`"
        ));
    };
    if !owner.verifier.admits(presented) {
        return Err(format!("application {app:?}: the capability presented is not this application's"));
    }
    if owner.uid != uid {
        return Err(format!("application {app:?} belongs to uid {}, not to uid {uid}", owner.uid));
    }
    let capability = Capability::parse(presented, "the presented capability").map_err(|e| e.to_string())?;
    Ok((capability, *owner))
}

/// Whether `presented` is the capability of `app` (owned by `owner`), from
/// the owner's Unix user where the connection's owner is seen
/// (`seen_uid`): the check of every request about a registered application.
pub(super) fn check_capability(
    app: &str,
    owner: Option<&Owner>,
    presented: &str,
    seen_uid: Option<u32>,
) -> Result<(), String> {
    match owner {
        Some(owner) if owner.verifier.admits(presented) => match seen_uid.filter(|uid| *uid != owner.uid) {
            Some(uid) => Err(format!("application {app:?} belongs to uid {}, this client to uid {uid}", owner.uid)),
            None => Ok(()),
        },
        _ => Err(format!("application {app:?}: wrong or missing capability")),
    }
}

/// An application as the controller knows it.
pub(super) struct AppEntry {
    pub(super) registration: protocol::AppRegistration,
    /// Who owns it: every request about it must present its capability.
    pub(super) owner: Option<Owner>,
    /// Live agents; an agent whose thread or manager died is removed.
    pub(super) agents: Vec<AgentInfo>,
    /// Node of each agent slot at registration (rank-mapping order): where
    /// the application's checkpoint files are.
    pub(super) homes: Vec<String>,
    pub(super) latest: Option<VersionRecord>,
    pub(super) persisted: bool,
    /// Its PFS copies: under way, waiting, done, failed and skipped.
    pub(super) copies: CopyBook,
    /// Finished with IC_CLEANUP: the newest version is being flushed to the
    /// PFS; the agents stop (discarding memory) once it is there.
    pub(super) finishing: bool,
    /// Adaptation (Algorithm 5) across probes; survives re-registration.
    pub(super) adaptation: Adaptation,
    /// Replayed from the journal and not yet reconciled with the stores:
    /// its journaled complete versions, oldest first. No version counts
    /// (`latest` stays empty) until the managers confirmed one.
    pub(super) unconfirmed: Option<Vec<super::journal::JournaledVersion>>,
    /// Versions no longer counted as complete, each with why.
    pub(super) dropped: Vec<String>,
    /// Ranks whose files stayed on nodes that lost their agents.
    pub(super) abandoned: Vec<Abandoned>,
    /// Its redundancy across nodes: which version is protected, by whom.
    pub(super) protection: super::protection::ProtectionBook,
    /// How its commits move their bytes, as its library reported with its
    /// newest version (status only: not journaled, the next version
    /// reports it again).
    pub(super) transfer: Option<protocol::TransferReport>,
    /// Nodes the job reported it could not reach although they heartbeat
    /// to the controller (a partition only the job sees), with when: its
    /// agents are placed elsewhere until [`UNREACHED_NODE_AVOIDED_FOR`]
    /// has passed. Not journaled: a controller that restarts forgets them,
    /// and the job reports them again.
    pub(super) unreached: BTreeMap<String, Instant>,
}

/// How long a node the job could not reach stays out of its placements.
/// Long enough that an agent change or a scale-up of the same run does not
/// put its agents back behind the cut (each try costs the job a stalled
/// request); short enough that a mended path is used again.
pub(super) const UNREACHED_NODE_AVOIDED_FOR: Duration = Duration::from_secs(600);

/// Whether a node reported unreachable `since` ago is still avoided.
fn avoided_after(since: Duration) -> bool {
    since < UNREACHED_NODE_AVOIDED_FOR
}

/// Files of ranks left behind on a node whose agents were lost (the node
/// went silent, or its manager's connection closed). They hold the
/// newest complete version at the time; once a newer one completes on
/// other agents they are obsolete, and are dropped so that a node that
/// comes back (SIGCONT, a healed partition) does not keep memory for them.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Abandoned {
    /// The node.
    pub(super) node: String,
    /// Newest complete version when the agents were lost.
    pub(super) after: u64,
    /// Ranks (mapping units) whose agent was there.
    pub(super) ranks: BTreeSet<u32>,
}

/// What the controller learns about an application's agent count over its
/// commits and probes.
#[derive(Clone, Debug, Default)]
pub(super) struct Adaptation {
    /// Newest commits, oldest first.
    pub(super) commits: VecDeque<CommitSample>,
    /// Changes made on probes.
    pub(super) changes: Vec<AgentChange>,
    /// Algorithm 5's memory.
    pub(super) scaling: decide::ScalingState,
    /// Newest complete version when the agents last changed (or were
    /// placed): only later commits judge the current agents.
    pub(super) changed_after: u64,
    /// Seconds the last placement or change took: the t_probe of eq. 6.11.
    pub(super) reconfigure_secs: f64,
    /// Mapping units (processes in MR, nodes in SHMR) the agent count was
    /// chosen for; a malleable application that resized differs (§7.2).
    pub(super) sized_for: u32,
}

impl Adaptation {
    /// Commit seconds measured since the agents last changed, oldest first.
    pub(super) fn since_change(&self) -> Vec<f64> {
        self.commits.iter().filter(|c| c.version > self.changed_after).map(|c| c.commit_secs).collect()
    }
}

/// What recording a version changed.
#[derive(Debug, PartialEq)]
pub(super) struct Recorded {
    /// The version is the first after a resize from this many processes:
    /// the old ranks' files no agent on their node serves any more are
    /// these (rank, node) pairs, to be dropped.
    pub(super) resized: Option<(u32, Vec<(u32, String)>)>,
    /// The version is due for a PFS copy by the application's interval.
    pub(super) due: bool,
}

impl AppEntry {
    /// Records `version` of `name` as complete at `completed_unix_ms`:
    /// refused unless newer than the recorded one; it becomes the newest
    /// version and joins the commit history. The sample's `agents` is
    /// ignored: the history counts the application's agents now.
    pub(super) fn record(
        &mut self,
        name: &str,
        sample: CommitSample,
        epoch: u32,
        completed_unix_ms: u64,
    ) -> Result<Recorded, String> {
        let CommitSample { version, bytes, commit_secs, .. } = sample;
        if let Some(latest) = self.latest.as_ref().filter(|l| l.version >= version) {
            return Err(format!(
                "version {version} of {name:?} is not newer than the recorded version {}",
                latest.version
            ));
        }
        let ranks = self.registration.ranks;
        let written_before = self.latest.as_ref().map(|l| l.ranks);
        self.latest = Some(VersionRecord { version, ranks, epoch, bytes, commit_secs, completed_unix_ms });
        let resized =
            written_before.filter(|b| *b != ranks && self.registration.mode == TransferMode::Mr).map(|before| {
                // The old ranks' files that no agent on their node serves any
                // more (ranks beyond the new count, ranks now mapped to
                // another node) are dropped.
                let count = self.agents.len() as u32;
                let agents = &self.agents;
                let serves = |node: &str, rank: u32| {
                    rank < ranks && agents[decide::agent_for_rank(rank, ranks, count) as usize].node == node
                };
                let nodes: BTreeSet<&str> = agents.iter().map(|a| a.node.as_str()).collect();
                let stale = nodes
                    .into_iter()
                    .flat_map(|node| {
                        (0..before.max(ranks)).filter(move |r| !serves(node, *r)).map(move |r| (r, node.to_string()))
                    })
                    .collect();
                (before, stale)
            });
        let history = &mut self.adaptation.commits;
        if history.len() == COMMIT_HISTORY {
            history.pop_front();
        }
        history.push_back(CommitSample { agents: self.agents.len() as u32, ..sample });
        let interval = u64::from(self.registration.pfs_interval);
        Ok(Recorded { resized, due: interval > 0 && version.is_multiple_of(interval) })
    }
}

impl AppEntry {
    /// The agent slots the job reported unreachable (`unreachable`: agent
    /// ids) whose node is in `heartbeating`: their nodes are avoided from
    /// `now` on. An agent the controller lost already (its node is silent)
    /// is not among them: a probe replaces lost agents anyway.
    pub(super) fn cut_off_slots(
        &mut self,
        unreachable: &[u64],
        heartbeating: impl Fn(&str) -> bool,
        now: Instant,
    ) -> Vec<usize> {
        let slots: Vec<usize> = (self.agents.iter().enumerate())
            .filter(|(_, a)| unreachable.contains(&a.id) && heartbeating(&a.node))
            .map(|(slot, _)| slot)
            .collect();
        for slot in &slots {
            self.unreached.insert(self.agents[*slot].node.clone(), now);
        }
        slots
    }

    /// Nodes its agents must not be placed on at `now` (those it reported
    /// unreachable within [`UNREACHED_NODE_AVOIDED_FOR`]); older reports
    /// are forgotten.
    pub(super) fn avoided_nodes(&mut self, now: Instant) -> BTreeSet<String> {
        self.unreached.retain(|_, reported| avoided_after(now.saturating_duration_since(*reported)));
        self.unreached.keys().cloned().collect()
    }

    /// The nodes [`avoided_nodes`](Self::avoided_nodes) names at `now`,
    /// each with the time since its newest report (for the status).
    pub(super) fn avoided_since(&self, now: Instant) -> Vec<(String, Duration)> {
        (self.unreached.iter())
            .map(|(node, reported)| (node.clone(), now.saturating_duration_since(*reported)))
            .filter(|(_, since)| avoided_after(*since))
            .collect()
    }

    /// Each rank's (mapping unit's) home: the node of its slot in `homes`,
    /// where its files are whatever agents were lost since. None without
    /// slots.
    pub(super) fn rank_homes(&self) -> impl Iterator<Item = (u32, &str)> + '_ {
        let (units, slots) = (decide::mapping_units(&self.registration), self.homes.len() as u32);
        let ranks = if slots == 0 { 0 } else { units };
        (0..ranks).map(move |r| (r, self.homes[decide::agent_for_rank(r, units, slots) as usize].as_str()))
    }

    /// The application's agents on `node` are gone: they leave its agent
    /// list (its next probe or registration places new ones; `homes`
    /// keeps the old slots), and the ranks they served are remembered as
    /// [`Abandoned`] there. Returns how many agents were lost.
    pub(super) fn lose_node(&mut self, node: &str) -> usize {
        let ranks: BTreeSet<u32> = self.rank_homes().filter(|(_, home)| *home == node).map(|(r, _)| r).collect();
        let before = self.agents.len();
        self.agents.retain(|agent| agent.node != node);
        if !ranks.is_empty() {
            let after = self.latest.as_ref().map_or(0, |l| l.version);
            self.abandoned.push(Abandoned { node: node.to_string(), after, ranks });
        }
        before - self.agents.len()
    }

    /// Abandoned files that a newer complete version made obsolete, on
    /// nodes `reachable` says can be told: (node, ranks) to drop there. A
    /// rank an agent on that node serves again is kept. What cannot be
    /// told yet stays remembered.
    pub(super) fn take_obsolete(&mut self, reachable: impl Fn(&str) -> bool) -> Vec<(String, Vec<u32>)> {
        let newest = self.latest.as_ref().map_or(0, |l| l.version);
        let (units, count) = (decide::mapping_units(&self.registration), self.agents.len() as u32);
        let agents = &self.agents;
        let served_on = |node: &str, rank: u32| {
            count > 0 && agents[decide::agent_for_rank(rank, units, count) as usize].node == node
        };
        let mut obsolete = Vec::new();
        self.abandoned.retain(|left| {
            if left.after >= newest || !reachable(&left.node) {
                return true;
            }
            let ranks: Vec<u32> = left.ranks.iter().copied().filter(|r| !served_on(&left.node, *r)).collect();
            if !ranks.is_empty() {
                obsolete.push((left.node.clone(), ranks));
            }
            false
        });
        obsolete
    }

    /// §6.4.2, what a probe does. Agents lost with their manager are
    /// replaced first; an application whose agent list (`known`) is stale
    /// gets the current one; agents on draining nodes (their indices in
    /// `draining`) move next; a resized application's agents follow its new
    /// size; otherwise, when the agent count is dynamic, Algorithm 5 and
    /// eq. 6.11/6.12 decide with `remaining` commits to go, never below
    /// `floor` agents (the distinct nodes the redundancy policy spreads its
    /// pieces over). `Err` is the answer itself (nothing to carry out).
    /// `at_init`: the probe of a job's `init` that cannot reach an agent,
    /// for which only lost agents count (a job about to restart gives
    /// Algorithm 5 nothing to go on, and moving its ranks off an agent it
    /// cannot reach would wait on that agent).
    pub(super) fn probe_plan(
        &mut self,
        known: &[u64],
        moving: Moving,
        remaining: u32,
        floor: u32,
        config: &DynamicConfig,
        at_init: bool,
    ) -> Result<ProbePlan, ClientReply> {
        let current = self.agents.len() as u32;
        if self.agents.len() != self.homes.len() {
            tracing::warn!(lost = self.homes.len() - self.agents.len(), "agents were lost; placing new ones");
            return Ok(ProbePlan::Replace(self.registration.clone()));
        }
        if !self.agents.iter().map(|a| a.id).eq(known.iter().copied()) {
            return Err(ClientReply::Agents(self.agents.clone()));
        }
        let Moving { cut_off, draining } = moving;
        if !cut_off.is_empty() {
            // At init too: the new agents take the restart's version over
            // from the cut-off ones, which their nodes can still reach.
            let replace: BTreeSet<usize> = cut_off.into_iter().chain(draining).collect();
            return Ok(ProbePlan::Relocate { current, replace: replace.into_iter().collect() });
        }
        if at_init {
            return Err(ClientReply::Unchanged);
        }
        if !draining.is_empty() {
            return Ok(ProbePlan::Relocate { current, replace: draining });
        }
        if let Some(plan) = resize_plan(self, config) {
            return plan;
        }
        if !config.is_dynamic_as {
            return Err(ClientReply::Unchanged);
        }
        let adaptation = &mut self.adaptation;
        let decision = decide::scaling_decision(
            &adaptation.since_change(),
            current,
            adaptation.scaling,
            config.factor,
            decide::agent_limit(&self.registration, config),
            adaptation.reconfigure_secs,
            remaining,
        );
        match decision {
            decide::ScalingDecision::Wait => Err(ClientReply::Unchanged),
            decide::ScalingDecision::Keep(scaling) => {
                if scaling.settled && !adaptation.scaling.settled {
                    tracing::info!(agents = current, "agent count settled");
                }
                adaptation.scaling = scaling;
                Err(ClientReply::Unchanged)
            }
            decide::ScalingDecision::NotWorthIt { wanted } => {
                tracing::info!(
                    agents = current,
                    wanted,
                    remaining,
                    t_probe = adaptation.reconfigure_secs,
                    "keeping the agents: the change would not pay back before the application ends (eq. 6.12)"
                );
                Err(ClientReply::Unchanged)
            }
            decide::ScalingDecision::Change { to, state } if to < floor => {
                // Fewer agents than nodes the pieces need: the next version
                // could not be protected.
                tracing::info!(agents = current, wanted = to, floor, "keeping the agents the redundancy policy needs");
                adaptation.scaling = state;
                match current > floor {
                    true => Ok(ProbePlan::Scale { current, to: floor, scaling: state }),
                    false => Err(ClientReply::Unchanged),
                }
            }
            decide::ScalingDecision::Change { to, state } => Ok(ProbePlan::Scale { current, to, scaling: state }),
        }
    }
}

/// Agent slots (indices) a probe finds on nodes they must leave.
#[derive(Debug, Default)]
pub(super) struct Moving {
    /// Slots the job cannot reach, on nodes that still heartbeat.
    pub(super) cut_off: Vec<usize>,
    /// Slots on draining nodes.
    pub(super) draining: Vec<usize>,
}

/// What a probe does, decided under the state lock.
pub(super) enum ProbePlan {
    /// Agents were lost: place the application again.
    Replace(protocol::AppRegistration),
    /// Agents on draining nodes or cut off from the job (these indices)
    /// move elsewhere.
    Relocate { current: u32, replace: Vec<usize> },
    /// Algorithm 5 wants `to` agents.
    Scale { current: u32, to: u32, scaling: decide::ScalingState },
    /// The application resized to `units`; Algorithm 7 wants `to` agents.
    Resize { current: u32, to: u32, units: u32 },
}

/// §7.2: an application whose mapping units changed since its agents were
/// chosen gets Algorithm 7's count (MA-RA: the same; MA-MA: the same ratio)
/// once a version with the new size is complete, since the new agents take
/// over that version's ranks. `Some(Err(Unchanged))` means "wait".
pub(super) fn resize_plan(app: &mut AppEntry, config: &DynamicConfig) -> Option<Result<ProbePlan, ClientReply>> {
    let units = decide::mapping_units(&app.registration);
    let before = app.adaptation.sized_for;
    if before == 0 || before == units {
        return None;
    }
    if app.latest.as_ref().map(|l| l.ranks) != Some(app.registration.ranks) {
        return Some(Err(ClientReply::Unchanged));
    }
    let current = app.agents.len() as u32;
    let limit = decide::agent_limit(&app.registration, config);
    let to = decide::agents_after_resize(config.agent_change_strategy, current, before, units, limit);
    if to == current {
        tracing::info!(agents = current, from = before, to = units, strategy = ?config.agent_change_strategy, "agents stay after the resize");
        app.adaptation.sized_for = units;
        return Some(Err(ClientReply::Unchanged));
    }
    Some(Ok(ProbePlan::Resize { current, to, units }))
}

#[cfg(test)]
pub(super) mod tests {
    use icheck_core::config::AgentChangeStrategy;
    use icheck_core::fabric::{FabricAddress, RemoteRegion};
    use icheck_core::pfs::CompressionPolicy;
    use icheck_core::protocol::AppRegistration;

    use super::*;

    /// An agent on `node`, as the controller's pure tests need one.
    pub(in crate::controller) fn agent(id: u64, node: &str) -> AgentInfo {
        AgentInfo {
            id,
            node: node.into(),
            address: FabricAddress(vec![1]),
            provider: "tcp".into(),
            probe: RemoteRegion { addr: 0, key: 0, len: 0 },
            control: "127.0.0.1:1".into(),
        }
    }

    #[test]
    fn only_the_owner_with_its_capability_registers_a_known_application() {
        let fresh = Claim { presented: None, reported: 1000, seen: Some(1000) };
        let (capability, owner) = admit_owner("a", None, &fresh).unwrap();
        assert_eq!(owner.uid, 1000);
        assert!(owner.verifier.admits(capability.expose()));
        // A new application may bring the capability its library drew.
        let drawn = Capability::generate().unwrap();
        let bringing = Claim { presented: Some(drawn.expose()), ..fresh.clone() };
        assert_eq!(admit_owner("b", None, &bringing).unwrap().0, drawn);
        let malformed = Claim { presented: Some("short"), ..fresh.clone() };
        assert!(admit_owner("b", None, &malformed).is_err());
        // The owner again, with its capability.
        let again = Claim { presented: Some(capability.expose()), ..fresh.clone() };
        assert_eq!(admit_owner("a", Some(&owner), &again).unwrap().0, capability);
        // No capability, another one, or another user: refused.
        let none = admit_owner("a", Some(&owner), &fresh).unwrap_err();
        assert!(none.contains("no capability") && none.contains("icheck delete a"), "{none}");
        let other = Capability::generate().unwrap();
        let wrong = Claim { presented: Some(other.expose()), ..fresh.clone() };
        assert!(admit_owner("a", Some(&owner), &wrong).unwrap_err().contains("not this application's"));
        let stranger = Claim { presented: Some(capability.expose()), reported: 1001, seen: Some(1001) };
        assert!(admit_owner("a", Some(&owner), &stranger).unwrap_err().contains("belongs to uid 1000"));
        // A client lying about its user, where the socket tells.
        let liar = Claim { presented: Some(capability.expose()), reported: 1000, seen: Some(1001) };
        assert!(admit_owner("a", Some(&owner), &liar).unwrap_err().contains("connection belongs to uid 1001"));
        // Where the socket cannot be seen (another host), the report counts.
        let remote = Claim { presented: Some(capability.expose()), reported: 1000, seen: None };
        assert!(admit_owner("a", Some(&owner), &remote).is_ok());
        assert!(check_capability("a", Some(&owner), capability.expose(), Some(1000)).is_ok());
        assert!(check_capability("a", Some(&owner), capability.expose(), None).is_ok());
        assert!(check_capability("a", Some(&owner), other.expose(), Some(1000)).is_err());
        assert!(check_capability("a", None, capability.expose(), None).is_err());
        // A stolen capability, used from another user's socket.
        let stolen = check_capability("a", Some(&owner), capability.expose(), Some(1001)).unwrap_err();
        assert!(stolen.contains("this client to uid 1001"), "{stolen}");
    }

    /// An MR application of `ranks` processes with one agent per node of `nodes`.
    fn app(ranks: u32, nodes: &[&str], pfs_interval: u32) -> AppEntry {
        AppEntry {
            owner: None,
            registration: AppRegistration {
                name: "a".into(),
                ranks,
                nodes: 1,
                ranks_per_node: ranks,
                mode: TransferMode::Mr,
                pfs_interval,
                compression: CompressionPolicy::Never,
                encrypted: false,
                redundancy: None,
            },
            agents: nodes.iter().enumerate().map(|(i, n)| agent(i as u64, n)).collect(),
            homes: nodes.iter().map(|n| n.to_string()).collect(),
            latest: None,
            persisted: false,
            copies: CopyBook::new(None),
            finishing: false,
            adaptation: Adaptation { sized_for: ranks, ..Adaptation::default() },
            unconfirmed: None,
            dropped: Vec::new(),
            abandoned: Vec::new(),
            protection: Default::default(),
            transfer: None,
            unreached: BTreeMap::new(),
        }
    }

    fn sample(version: u64) -> CommitSample {
        CommitSample { version, bytes: 1 << 20, commit_secs: 0.5, agents: 0 }
    }

    /// A node goes silent: its agents leave the list (so the next probe
    /// replaces them) and its ranks' files are remembered; they are
    /// dropped only once a newer version completed elsewhere, only where
    /// the node can be told, and never for a rank an agent there serves.
    #[test]
    fn files_left_on_a_lost_node_are_dropped_once_a_newer_version_completes() {
        let mut entry = app(4, &["n1", "n2"], 0);
        let sample = |version| CommitSample { version, bytes: 1, commit_secs: 0.1, agents: 0 };
        entry.record("a", sample(1), 0, 0).unwrap();
        assert_eq!(entry.lose_node("n2"), 1);
        assert_eq!(entry.agents.iter().map(|a| a.node.as_str()).collect::<Vec<_>>(), vec!["n1"]);
        assert_eq!(entry.abandoned[0].ranks, BTreeSet::from([2, 3]));
        // Nothing newer yet: the files on n2 hold the newest version.
        assert!(entry.take_obsolete(|_| true).is_empty());
        // New agents (one back on n2 would keep its ranks; here on n3).
        entry.agents = vec![agent(10, "n1"), agent(11, "n3")];
        entry.record("a", sample(2), 0, 0).unwrap();
        assert!(entry.take_obsolete(|node| node != "n2").is_empty(), "n2 cannot be told yet");
        assert_eq!(entry.take_obsolete(|_| true), vec![("n2".to_string(), vec![2, 3])]);
        assert!(entry.abandoned.is_empty());

        // Replaced on the same node: its ranks there are served again.
        let mut entry = app(2, &["n1", "n2"], 0);
        entry.record("a", sample(1), 0, 0).unwrap();
        entry.lose_node("n2");
        entry.agents = vec![agent(10, "n1"), agent(12, "n2")];
        entry.record("a", sample(2), 0, 0).unwrap();
        assert!(entry.take_obsolete(|_| true).is_empty());
        assert!(entry.abandoned.is_empty());
    }

    #[test]
    fn only_newer_versions_are_recorded_and_the_history_is_bounded() {
        let mut app = app(4, &["n1"], 2);
        let first = app.record("a", sample(1), 0, 1000).unwrap();
        assert_eq!(first, Recorded { resized: None, due: false });
        assert!(app.record("a", sample(2), 0, 2000).unwrap().due, "every 2nd version is copied");
        let err = app.record("a", sample(2), 0, 3000).unwrap_err();
        assert!(err.contains("version 2 of \"a\" is not newer than the recorded version 2"), "{err}");
        assert_eq!(app.latest.as_ref().map(|l| (l.version, l.completed_unix_ms)), Some((2, 2000)));
        for version in 3..(3 + COMMIT_HISTORY as u64) {
            app.record("a", sample(version), 0, version).unwrap();
        }
        assert_eq!(app.adaptation.commits.len(), COMMIT_HISTORY);
        assert_eq!(app.adaptation.commits.back().map(|c| c.agents), Some(1), "samples count the agents");
    }

    #[test]
    fn the_first_version_after_a_shrink_drops_the_ranks_no_agent_serves_any_more() {
        // 4 ranks on two agents (n1: ranks 0-1, n2: ranks 2-3), resized to 2
        // ranks (n1: rank 0, n2: rank 1).
        let mut app = app(4, &["n1", "n2"], 0);
        app.record("a", sample(1), 0, 0).unwrap();
        app.registration.ranks = 2;
        let recorded = app.record("a", sample(2), 1, 0).unwrap();
        let (before, stale) = recorded.resized.expect("a resize");
        assert_eq!(before, 4);
        let expect = [(1, "n1"), (2, "n1"), (3, "n1"), (0, "n2"), (2, "n2"), (3, "n2")];
        let expect: Vec<(u32, String)> = expect.iter().map(|(r, n)| (*r, n.to_string())).collect();
        assert_eq!(stale, expect);
        assert_eq!(app.latest.as_ref().map(|l| (l.ranks, l.epoch)), Some((2, 1)));
        assert!(app.record("a", sample(3), 1, 0).unwrap().resized.is_none(), "only the first version after it");
    }

    #[test]
    fn a_resized_application_gets_new_agents_once_a_version_of_its_new_size_is_complete() {
        let config = DynamicConfig {
            agent_change_strategy: AgentChangeStrategy::MalleableAgents,
            max_agents_app: 64,
            ..DynamicConfig::default()
        };
        let mut app = app(4, &["n1", "n2"], 0);
        assert!(resize_plan(&mut app, &config).is_none(), "not resized");
        app.record("a", sample(1), 0, 0).unwrap();
        app.registration.ranks = 8;
        assert!(matches!(resize_plan(&mut app, &config), Some(Err(ClientReply::Unchanged))), "no 8-rank version yet");
        app.record("a", sample(2), 1, 0).unwrap();
        let Some(Ok(ProbePlan::Resize { current, to, units })) = resize_plan(&mut app, &config) else {
            panic!("no resize plan")
        };
        assert_eq!((current, to, units), (2, 4, 8), "MA-MA keeps the ratio of ranks to agents");
    }

    #[test]
    fn a_probe_replaces_lost_agents_first_then_refreshes_then_relocates() {
        let config = DynamicConfig::default();
        let mut app = app(4, &["n1", "n2"], 0);
        // The application knows agents 0 and 1; nothing to do without a dynamic agent count.
        assert!(matches!(
            app.probe_plan(&[0, 1], Moving::default(), 10, 1, &config, false),
            Err(ClientReply::Unchanged)
        ));
        // Its list is stale: it gets the current one.
        let Err(ClientReply::Agents(agents)) = app.probe_plan(&[0, 7], Moving::default(), 10, 1, &config, false) else {
            panic!()
        };
        assert_eq!(agents.len(), 2);
        // n2 drains: its agent moves.
        let plan = app.probe_plan(&[0, 1], draining(1), 10, 1, &config, false);
        assert!(matches!(plan, Ok(ProbePlan::Relocate { current: 2, ref replace }) if replace == &[1]));
        // An init that cannot reach an agent: only lost agents count.
        let at_init = app.probe_plan(&[0, 1], draining(1), 10, 1, &config, true);
        assert!(matches!(at_init, Err(ClientReply::Unchanged)));
        // An agent is lost: replacing comes before everything else.
        app.agents.pop();
        assert!(matches!(app.probe_plan(&[0, 1], draining(0), 10, 1, &config, false), Ok(ProbePlan::Replace(_))));
        assert!(matches!(app.probe_plan(&[0, 1], draining(0), 10, 1, &config, true), Ok(ProbePlan::Replace(_))));
    }

    fn draining(slot: usize) -> Moving {
        Moving { draining: vec![slot], ..Moving::default() }
    }

    #[test]
    fn agents_the_job_cannot_reach_on_heartbeating_nodes_move_and_their_nodes_are_avoided_a_while() {
        let config = DynamicConfig::default();
        let mut app = app(4, &["n1", "n2", "n3"], 0);
        let t0 = Instant::now();
        // Agent 1 (n2) and agent 2 (n3) were not reached; n3 is silent, so
        // only n2 is a cut the job alone sees (a probe replaces n3's agent
        // once the controller gives it up). Unknown ids are ignored.
        let cut_off = app.cut_off_slots(&[1, 2, 99], |node| node != "n3", t0);
        assert_eq!(cut_off, vec![1]);
        assert_eq!(app.avoided_nodes(t0), BTreeSet::from(["n2".to_string()]));
        // They move, with draining ones, in a probe and at init alike.
        let moving = || Moving { cut_off: vec![1], draining: vec![0, 1] };
        let plan = app.probe_plan(&[0, 1, 2], moving(), 10, 1, &config, false);
        assert!(
            matches!(plan, Ok(ProbePlan::Relocate { current: 3, ref replace }) if replace == &[0, 1]),
            "{:?}",
            plan.is_ok()
        );
        let at_init = app.probe_plan(&[0, 1, 2], moving(), 10, 1, &config, true);
        assert!(matches!(at_init, Ok(ProbePlan::Relocate { current: 3, ref replace }) if replace == &[0, 1]));
        // A job with a stale list first gets the current one.
        assert!(matches!(app.probe_plan(&[0, 1], moving(), 10, 1, &config, false), Err(ClientReply::Agents(_))));
        // The node is avoided until the report is old, then used again.
        let later = t0 + UNREACHED_NODE_AVOIDED_FOR - Duration::from_secs(1);
        assert_eq!(
            app.avoided_since(later),
            vec![("n2".to_string(), UNREACHED_NODE_AVOIDED_FOR - Duration::from_secs(1))]
        );
        assert!(app.avoided_since(t0 + UNREACHED_NODE_AVOIDED_FOR).is_empty(), "the status shows only avoided nodes");
        assert_eq!(app.avoided_nodes(later).len(), 1);
        assert!(app.avoided_nodes(t0 + UNREACHED_NODE_AVOIDED_FOR).is_empty());
        assert!(app.unreached.is_empty(), "old reports are forgotten");
    }

    #[test]
    fn a_dynamic_agent_count_waits_for_commits_then_grows_when_it_pays_back() {
        let config = DynamicConfig { is_dynamic_as: true, ..DynamicConfig::default() };
        let mut app = app(4, &["n1"], 0);
        assert!(
            matches!(app.probe_plan(&[0], Moving::default(), 10, 1, &config, false), Err(ClientReply::Unchanged)),
            "no commits"
        );
        for version in 1..=(decide::WARM_UP_COMMITS as u64 + 2) {
            app.record("a", sample(version), 0, 0).unwrap();
        }
        // A change that costs 1,000 s cannot pay back within 2 commits of 0.5 s.
        app.adaptation.reconfigure_secs = 1000.0;
        assert!(matches!(app.probe_plan(&[0], Moving::default(), 2, 1, &config, false), Err(ClientReply::Unchanged)));
        // With no end in sight (0: unknown), Algorithm 5 grows the agents,
        // but not for an init that cannot reach an agent.
        assert!(matches!(app.probe_plan(&[0], Moving::default(), 0, 1, &config, true), Err(ClientReply::Unchanged)));
        let Ok(ProbePlan::Scale { current, to, .. }) = app.probe_plan(&[0], Moving::default(), 0, 1, &config, false)
        else {
            panic!("no growth")
        };
        assert_eq!(current, 1);
        assert!(to > 1 && to <= 4, "{to} agents for 4 ranks");
    }

    /// Algorithm 5 undoes a growth that did not help, but never below the
    /// nodes the redundancy policy spreads its pieces over.
    #[test]
    fn a_probe_does_not_shrink_the_agents_below_what_redundancy_needs() {
        let config = DynamicConfig { is_dynamic_as: true, ..DynamicConfig::default() };
        let grown = || {
            let mut app = app(4, &["n1", "n2", "n3", "n4"], 0);
            // Grown from 2 to 4 agents, and commits got slower (0.5 s against 0.1 s).
            app.adaptation.scaling = decide::ScalingState { before_last_change: Some(0.1), settled: false };
            for version in 1..=(decide::WARM_UP_COMMITS as u64 + 2) {
                app.record("a", sample(version), 0, 0).unwrap();
            }
            app
        };
        let ids = [0, 1, 2, 3];
        let Ok(ProbePlan::Scale { current: 4, to: 2, .. }) =
            grown().probe_plan(&ids, Moving::default(), 0, 1, &config, false)
        else {
            panic!("without a floor the growth is undone")
        };
        let Ok(ProbePlan::Scale { current: 4, to: 3, .. }) =
            grown().probe_plan(&ids, Moving::default(), 0, 3, &config, false)
        else {
            panic!("rs:2+1 keeps three agents")
        };
        let mut app = grown();
        assert!(matches!(app.probe_plan(&ids, Moving::default(), 0, 4, &config, false), Err(ClientReply::Unchanged)));
        assert!(app.adaptation.scaling.settled, "and the count settles, as an undone change does");
    }
}
