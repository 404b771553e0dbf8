//! What the controller's state does when a checkpoint node changes: a
//! manager registers (again) with what its store holds, goes silent and is
//! given up, or answers again; and, for a registration, whether an
//! application's newest version is out of reach because the nodes holding
//! it are silent or given up.
//!
//! Every function here changes or reads [`State`] under its lock and
//! queues messages to managers; none awaits.
//!
//! Architecture invariant: losing a node drops no version record by
//! itself. Its agents are marked for replacement and a protected version
//! is rebuilt from the other nodes; a record goes only when reconciliation
//! or a returning store shows the version's files gone. A version whose
//! ranks only given-up nodes held, with nothing protecting it, is reported
//! lost (to status and to a registration), not erased.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use icheck_core::decide;
use icheck_core::protocol::{self, AgentInfo, ControllerToManager, StoredPiece};

use super::apps::AppEntry;
use super::awaiting::RankRequest;
use super::journal::JournaledVersion;
use super::{protection, reconcile, ManagerBook, State};

/// Reconciles the journaled applications whose nodes have all registered
/// (or all of them, once `reconcile_by` passed) with what the stores hold;
/// once `reconcile_by` passed, journaled agents on nodes that never came
/// back are dropped (their applications get new agents on their next
/// registration or probe).
pub(super) fn reconcile_pending(state: &mut State, now: Instant) {
    let state = &mut *state;
    let late = now >= state.reconcile_by;
    for (name, app) in state.apps.iter_mut() {
        let waiting = app.homes.iter().any(|node| !state.holdings.contains_key(node));
        if app.unconfirmed.is_none() || (waiting && !late) {
            continue;
        }
        let versions = app.unconfirmed.take().unwrap_or_default();
        // Once no more managers are awaited, a protected version missing
        // ranks on nodes that did not come back is rebuilt, not dropped:
        // the journal says where its copies or parity shards are.
        let reported: BTreeSet<String> = state.holdings.keys().cloned().collect();
        let journaled = app.protection.journaled.as_ref();
        let mut lost_nodes = BTreeSet::new();
        let rebuildable = |version: &JournaledVersion, missing: &[u32]| {
            let Some(protected) = journaled.filter(|p| p.version() == version.record.version) else {
                return false;
            };
            match protection::rebuildable(protected, missing, &reported) {
                Ok(lost) => {
                    tracing::warn!(app = %name, version = protected.version(), ?missing, ?lost,
                        "ranks of the protected version are on nodes lost while no controller ran; rebuilding them");
                    lost_nodes = lost;
                    true
                }
                Err(reason) => {
                    tracing::warn!(app = %name, %reason, "the protected version cannot be rebuilt");
                    false
                }
            }
        };
        let outcome = reconcile::reconcile_or_rebuild(name, &versions, &state.holdings, rebuildable);
        for reason in &outcome.dropped {
            tracing::warn!(app = %name, "journaled version dropped: {reason}");
        }
        app.protection.confirm(outcome.latest.as_ref().map(|l| l.version));
        app.protection.rebuild_due = outcome.rebuild;
        app.protection.recheck_due = !outcome.rebuild && outcome.latest.is_some();
        // Its ranks all there, the protected version may still miss
        // pieces: a node holding parity alone, started again empty (or not
        // back) while no controller ran. Its slots are rebuilt as a lost
        // node's are.
        if let Some(protected) = app.protection.protected.as_ref().filter(|_| !outcome.rebuild) {
            let announced = |node: &str| state.piece_holdings.get(node).map(Vec::as_slice);
            // A node holding ranks too is judged by them (above): one that
            // lost its store lost those as well.
            let primaries = protection::primary_nodes(protected);
            let mut missing = protection::nodes_missing_pieces(protected, name, announced);
            missing.retain(|node| !primaries.contains(node));
            if !missing.is_empty() {
                tracing::warn!(app = %name, version = protected.version(), nodes = ?missing,
                    "nodes lost pieces of the protected version while no controller ran; rebuilding them");
                app.protection.problem = Some(format!(
                    "nodes {missing:?} lost their pieces of version {} while no controller ran; they are being rebuilt",
                    protected.version()
                ));
                app.protection.wiped.extend(missing.into_iter().filter(|node| reported.contains(node)));
                app.protection.rebuild_due = true;
            }
        }
        if let Some(latest) = outcome.latest.as_ref().filter(|_| outcome.rebuild) {
            // Until the rebuild protects it again, the status says so.
            app.protection.problem = Some(format!(
                "nodes {lost_nodes:?} were lost while no controller ran; the ranks of version {} there are being rebuilt",
                latest.version
            ));
            app.protection.wiped = lost_nodes.into_iter().filter(|node| reported.contains(node)).collect();
        }
        // Newer journaled versions were dropped: their files go from the
        // nodes that reported, so that the application, restarting from
        // the older one (perhaps on the same agents), writes those numbers
        // again (an agent never overwrites a stored complete version).
        let newest = versions.last().map(|v| v.record.version);
        if let Some(above) = outcome.latest.as_ref().map(|l| l.version).filter(|l| newest > Some(*l)) {
            let through = newest.unwrap_or(above);
            for node in app.homes.iter().filter(|node| reported.contains(*node)).collect::<BTreeSet<_>>() {
                state.nodes.send(node, ControllerToManager::DropNewer { app: name.clone(), above, through });
            }
        }
        match &outcome.latest {
            Some(latest) if outcome.rebuild => {
                tracing::info!(app = %name, version = latest.version, "newest complete version kept: its lost ranks are rebuilt")
            }
            Some(latest) => {
                tracing::info!(app = %name, version = latest.version, "newest complete version confirmed by the stores")
            }
            None if !versions.is_empty() => tracing::warn!(app = %name, "no journaled version is whole in the stores"),
            None => {}
        }
        app.latest = outcome.latest;
        app.dropped.extend(outcome.dropped);
    }
    if late && !state.startup_settled {
        state.startup_settled = true;
        for (name, app) in state.apps.iter_mut() {
            let before = app.agents.len();
            app.agents.retain(|agent| state.holdings.contains_key(&agent.node));
            if app.agents.len() < before {
                tracing::warn!(app = %name, lost = before - app.agents.len(), "journaled agents on nodes that did not come back are gone");
            }
        }
    }
}

/// A new manager process of `node` announced the pieces its store kept:
/// those that no record places there any more (a rebuild made them
/// elsewhere while it was away, or a newer version was protected) are
/// deleted. Before, they stayed until the node next held pieces of a
/// newer version, and for good for an application that never committed
/// again.
pub(super) fn drop_stale_pieces_on(state: &mut State, node: &str) {
    let Some(held) = state.piece_holdings.get(node) else { return };
    for (name, app) in state.apps.iter().filter(|(_, a)| a.unconfirmed.is_none()) {
        let mine: Vec<StoredPiece> = held.iter().filter(|p| &p.app == name).cloned().collect();
        for (version, keep) in app.protection.stale_on(node, &mine) {
            tracing::info!(app = %name, %node, version, kept = keep.len(), "deleting pieces no record places on the returning node");
            state.nodes.send(node, ControllerToManager::DropStalePieces { app: name.clone(), version, keep });
        }
    }
}

/// Tells each node that `name`'s book lists as returned
/// (`ProtectionBook::returned`: back on the connection it had when it was
/// marked down) to delete the application's pieces that no record places
/// there: the protected version's other than those its record
/// gives the node, and every older version's. Nothing while a protection
/// or rebuild is under way, or before reconciliation confirms the
/// application; called again when a protection or rebuild ends. Before, a
/// node that went silent long enough for its slot to be rebuilt elsewhere
/// and then answered again (a stall, a network cut that healed) kept
/// those pieces in its memory for good.
pub(super) fn drop_pieces_on_returned_nodes(state: &mut State, name: &str) {
    let Some(app) = state.apps.get_mut(name).filter(|app| app.unconfirmed.is_none()) else { return };
    let Some((version, returned)) = app.protection.take_returned() else { return };
    for (node, keep) in returned {
        tracing::info!(app = %name, %node, version, kept = keep.len(), "deleting pieces no record places on the node that answered again");
        state.nodes.send(&node, ControllerToManager::DropStalePieces { app: name.to_string(), version, keep });
        state.nodes.send(&node, ControllerToManager::DropPieces { app: name.to_string(), below: version });
    }
}

/// A manager registered `node` (again) with `stored` in its store: an
/// application whose newest complete version lost files there no longer
/// counts it (a restart then looks on the PFS); the status says why.
pub(super) fn check_returning_node(state: &mut State, node: &str, stored: &[protocol::StoredVersion]) {
    for (name, app) in state.apps.iter_mut().filter(|(_, a)| a.unconfirmed.is_none()) {
        // A rebuild under way replaces what the node lost.
        if app.protection.rebuilding && app.protection.nodes().contains(node) {
            continue;
        }
        let Some(latest) = app.latest.as_ref().filter(|l| l.ranks == app.registration.ranks) else { continue };
        let writers = decide::mapping_units(&app.registration);
        if let Some(reason) = reconcile::check_node(name, latest.version, writers, &app.homes, node, stored) {
            tracing::warn!(app = %name, "newest complete version dropped: {reason}");
            app.dropped.push(reason);
            app.latest = None;
        }
    }
}

/// A manager registered running `running`: journaled agents of its node
/// that it no longer runs are gone, and agents it runs that no application
/// (or start under way) claims are stopped, their files kept.
pub(super) fn adopt_agents(state: &mut State, node: &str, running: &[AgentInfo]) {
    let state = &mut *state;
    for (name, app) in state.apps.iter_mut() {
        let before = app.agents.len();
        app.agents.retain(|agent| agent.node != node || running.iter().any(|r| r.id == agent.id));
        if app.agents.len() < before {
            tracing::warn!(app = %name, %node, lost = before - app.agents.len(), "agents the manager no longer runs are gone");
        }
    }
    for agent in running {
        if claims_agent(state, agent.id) {
            tracing::info!(%node, agent = agent.id, "agent adopted from the manager's registration");
        } else if !being_placed(state, agent.id) {
            tracing::info!(%node, agent = agent.id, "stopping an agent no application uses");
            state.nodes.send(node, ControllerToManager::StopAgent { id: agent.id, discard: false });
        }
    }
}

/// The agents on `node` are gone (§6.5.2): every application with agents
/// there is marked for an agent change, which its next commit (through
/// the library asking for replacements) or probe carries out.
/// Gives up the agents on `node`. Returns the applications whose protected
/// version had a primary or a piece there: they are rebuilt at once.
pub(super) fn node_lost(state: &mut State, node: &str, why: &str) -> Vec<String> {
    let mut rebuilds = Vec::new();
    // Its manager will not answer what it was asked: the agent changes and
    // rebuilds waiting on it learn so now, not at their bounds.
    for _ in state.pending.node_lost(node, |id| format!("node {node} was lost ({why}) before agent {id} started")) {
        state.nodes.start_answered(node, false);
    }
    let unanswered = state.takeovers.node_lost(node, |RankRequest { agent, rank, .. }| {
        format!("node {node} was lost ({why}) before its agent {agent} answered for rank {rank}")
    });
    if !unanswered.is_empty() {
        tracing::warn!(%node, ?unanswered, "{why}: the take-overs and rebuilds sent there failed");
    }
    // Open still only when the node went silent: the same manager may answer again.
    let connection = state.nodes.open_connection(node);
    for (name, app) in state.apps.iter_mut() {
        let lost = app.lose_node(node);
        if let Some(version) = app.protection.node_lost(node) {
            tracing::warn!(app = %name, %node, version, "{why}: the protection under way had pieces there; it ended");
        }
        if app.protection.nodes().contains(node) {
            tracing::warn!(app = %name, %node, lost, "{why}: rebuilding its protected version on the other nodes");
            app.protection.lost_since.insert(node.to_string(), connection);
            // Until the rebuild protects it again, the status says so.
            app.protection.problem = Some(format!("node {node} was lost ({why}); its ranks are being rebuilt"));
            rebuilds.push(name.clone());
        } else if lost > 0 {
            tracing::warn!(app = %name, %node, lost, "{why}: its agents are replaced on the application's next commit or probe");
        }
    }
    rebuilds
}

/// `node` answers again after it was given up: the agents it still runs
/// belong to no application any more (they were replaced) and stop, and
/// files obsolete since are dropped.
pub(super) fn node_back(state: &mut State, node: &str) {
    stop_stale_agents(state, node, Duration::ZERO, "that was replaced while its node was silent");
    let names: Vec<String> = state.apps.keys().cloned().collect();
    for name in names {
        if let Some(app) = state.apps.get_mut(&name) {
            app.protection.returned.insert(node.to_string());
        }
        drop_pieces_on_returned_nodes(state, &name);
    }
    drop_obsolete_files(state);
    recheck_homed_on(state, node);
}

/// The newest version of `app` (named `name`) when ranks of it lay only on
/// nodes given up (down, and their managers will not be started again) and
/// no protected version stands for it: the version and why, as
/// `ProtectionBook::lost` holds it after a failed rebuild, so that the
/// registration restarts from the PFS copy or names what is lost. Before,
/// it placed new agents for those ranks and every restart failed reading a
/// PFS manifest that did not exist. A node merely silent, or being started
/// again, may come back with its memory: it does not count.
pub(super) fn ranks_lost_with_given_up_nodes(name: &str, app: &AppEntry, nodes: &ManagerBook) -> Option<(u64, String)> {
    let latest = app.latest.as_ref()?;
    let now = Instant::now();
    let held = unprotected_ranks_on(app, |home| nodes.is_given_up(home) && !nodes.is_alive(home, now))?;
    let why = format!(
        "version {} of {name:?} is lost: {} held it alone, and the node is given up (its manager is not started \
         again) before any redundancy protected the version; `icheck delete {name}` lets the application start \
         afresh",
        latest.version,
        describe_ranks_on(&held)
    );
    Some((latest.version, why))
}

/// Where `app` has no protected version (nothing could decode its ranks
/// elsewhere): its ranks whose home `node` matches, by node; `None` when
/// there are none.
pub(super) fn unprotected_ranks_on<'a>(
    app: &'a AppEntry,
    node: impl Fn(&str) -> bool,
) -> Option<BTreeMap<&'a str, Vec<u32>>> {
    if app.protection.protected.is_some() {
        return None;
    }
    let mut held: BTreeMap<&'a str, Vec<u32>> = BTreeMap::new();
    for (rank, home) in app.rank_homes().filter(|(_, home)| node(home)) {
        held.entry(home).or_default().push(rank);
    }
    (!held.is_empty()).then_some(held)
}

/// `held` ([`unprotected_ranks_on`]) as "ranks [..] on node X, ...".
pub(super) fn describe_ranks_on(held: &BTreeMap<&str, Vec<u32>>) -> String {
    let each: Vec<String> = held.iter().map(|(node, ranks)| format!("ranks {ranks:?} on node {node}")).collect();
    each.join(", ")
}

/// Why `name` cannot restart now when ranks of its newest version (`app`'s,
/// with no PFS copy of it and no protected version) lie only on nodes
/// that are silent: down, yet neither given up nor being started again,
/// so their managers may answer again with that version in memory.
/// Agents placed elsewhere would not find it, and every rank would fail
/// reading a PFS manifest that does not exist.
pub(super) fn ranks_on_silent_nodes(
    name: &str,
    app: &AppEntry,
    nodes: &ManagerBook,
    kill_after: Option<Duration>,
    now: Instant,
) -> Option<String> {
    let latest = app.latest.as_ref()?;
    let silent = |home: &str| {
        nodes.is_known(home) && !nodes.is_alive(home, now) && !nodes.is_given_up(home) && !nodes.is_relaunching(home)
    };
    let held = unprotected_ranks_on(app, silent)?;
    let quiet: Vec<String> = (held.keys())
        .map(|home| format!("{home} for {:.0} s", nodes.silent_for(home, now).unwrap_or_default().as_secs_f64()))
        .collect();
    let next = match kill_after {
        Some(after) => format!(
            "the controller kills a manager silent for {:.0} s (KillSilentManagerAfter) and starts it again with \
             its store: restart once `icheck status` shows the node alive",
            after.as_secs_f64()
        ),
        None => format!(
            "start that manager again (KillSilentManagerAfter is 0, so the controller does not), or `icheck delete \
             {name}` to start afresh"
        ),
    };
    Some(format!(
        "cannot restart {name:?} now: version {} is held only by {}, and the manager there is silent ({}), so \
         the version is out of reach without being lost; {next}",
        latest.version,
        describe_ranks_on(&held),
        quiet.join(", ")
    ))
}

/// `node`'s manager answers again (the same one after a silence, or a new
/// one with its store listed): each application under a policy with a home
/// there and an agent missing gets one pass of the rebuild task at the next
/// liveness tick, which starts the agent again where its files are and
/// protects the newest version (`rebuild::agents_back_in_place`). A node
/// lost while an application's first version was being protected ended
/// that protection, and with no protected version no rebuild ran for it:
/// the version stayed unprotected until the application registered again,
/// which a job that failed with the node never does (the fault campaign).
/// An application still being reconciled is left out: its reconciliation
/// marks it when it settles.
pub(super) fn recheck_homed_on(state: &mut State, node: &str) {
    for app in state.apps.values_mut().filter(|app| app.unconfirmed.is_none()) {
        let homed_here = app.homes.iter().any(|home| home == node);
        if homed_here && app.agents.len() != app.homes.len() && !app.protection.policy.is_none() {
            app.protection.recheck_due = true;
        }
    }
}

/// Whether some application has agent `id` among its agents.
fn claims_agent(state: &State, id: u64) -> bool {
    state.apps.values().any(|app| app.agents.iter().any(|a| a.id == id))
}

/// Whether agent `id` was started for a placement still under way: its
/// start not answered yet, or answered and the application not told.
fn being_placed(state: &State, id: u64) -> bool {
    state.pending.contains(&id) || state.placing.contains(&id)
}

/// How long an agent a manager reports running may stay claimed by no
/// application and no placement before the controller stops it: two status
/// periods would do; the point is only that a report measured just before
/// the controller's own stop does not draw a second one.
pub(super) const STALE_AGENT_GRACE: Duration = Duration::from_secs(2);

/// Stops the agents `node` reports running that no application claims and
/// no placement under way started, once they have been so for `grace`
/// (each is asked once), logging `why` they are stale. Run on every status
/// report with [`STALE_AGENT_GRACE`], and with zero when a node answers
/// again after it was given up (its agents were replaced meanwhile).
/// Before, the reports were searched only for ten seconds after such a
/// return, and an agent left over any other way (its start answered after
/// the placement gave up on it, the fault campaign's seed 11) ran on,
/// unseen by `icheck status`, with its memory, until the manager
/// registered again.
pub(super) fn stop_stale_agents(state: &mut State, node: &str, grace: Duration, why: &str) {
    let claimed: BTreeSet<u64> = (state.nodes.running_agents(node).into_iter())
        .filter(|id| claims_agent(state, *id) || being_placed(state, *id))
        .collect();
    let stale = state.nodes.stale_agents(node, Instant::now(), grace, |id| claimed.contains(&id));
    for id in stale {
        tracing::info!(%node, agent = id, "stopping an agent {why}");
        state.nodes.send(node, ControllerToManager::StopAgent { id, discard: false });
    }
}

/// Sends the drops of files on nodes that lost their agents which a newer
/// complete version made obsolete ([`AppEntry::take_obsolete`]).
pub(super) fn drop_obsolete_files(state: &mut State) {
    let state = &mut *state;
    let now = Instant::now();
    for (name, app) in state.apps.iter_mut() {
        for (node, ranks) in app.take_obsolete(|node| state.nodes.is_alive(node, now)) {
            tracing::info!(app = %name, %node, ?ranks, "dropping files a newer version on other agents made obsolete");
            state.nodes.send(&node, ControllerToManager::DropRanks { app: name.clone(), ranks });
        }
    }
}
