//! Rebuild after a lost checkpoint node: the application's protected
//! version gets a replacement agent on another live node for every slot
//! that was there, each lost rank is rebuilt on it from copies or from its
//! group's surviving shards (agent to agent), the application's agents
//! become the rebuilt set, and the version is protected again on them.
//! The application is not involved; its registrations and probes wait
//! (bounded) until the rebuild ends, and then get the rebuilt agents.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use icheck_core::decide;
use icheck_core::protocol::{AgentInfo, ControllerToManager};

use super::journal::Event;
use super::reconcile;
use super::{
    ask_rank, await_ranks, await_starts, journal, nodes, protection, send_starts, start_protection, tell_agents,
    Placing, RankWaiter, Shared, State,
};
use crate::launcher::Launcher;

/// Longest a registration or probe waits for a rebuild under way.
pub(super) const REBUILD_WAIT: Duration = Duration::from_secs(180);

/// Starts a rebuild of each of `apps` (those whose protected version lost
/// a node), each on its own task.
pub(super) fn spawn(shared: &Arc<Shared>, apps: Vec<String>) {
    for name in apps {
        let shared = shared.clone();
        tokio::spawn(async move {
            // One rebuild per application at a time; a loss noticed while
            // one runs makes it look again when it ends.
            {
                let mut state = shared.state();
                let Some(app) = state.apps.get_mut(&name) else { return };
                if app.protection.rebuilding {
                    app.protection.look_again = true;
                    return;
                }
                app.protection.rebuilding = true;
            }
            loop {
                rebuild_once(&shared, &name).await;
                let mut state = shared.state();
                let Some(app) = state.apps.get_mut(&name) else { return };
                if !std::mem::take(&mut app.protection.look_again) {
                    app.protection.rebuilding = false;
                    super::drop_pieces_on_returned_nodes(&mut state, &name);
                    return;
                }
            }
        });
    }
}

/// Longest a rebuild waits for a lost node's manager to be started again.
const RELAUNCH_WAIT: Duration = Duration::from_secs(60);

/// Tries of a lost rank's rebuild before the version counts as lost. A
/// try can fail for a passing reason (a source agent busy past a bound, a
/// transfer cut by the same loss): one failed read used to lose the
/// version while every piece it needed was still there. The same agents
/// and sources are asked again; a rebuild whose sources are gone fails
/// every try, [`REBUILD_RETRY_PAUSE`] apart.
const REBUILD_TRIES: u32 = 3;

/// Pause between tries of a rebuild ([`REBUILD_TRIES`]).
const REBUILD_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// `rank R: why; ...` for ranks whose rebuild failed.
fn describe_failures(failed: &[(u32, String)]) -> String {
    failed.iter().map(|(rank, why)| format!("rank {rank}: {why}")).collect::<Vec<_>>().join("; ")
}

/// Longest a rebuild waits for a lost node's manager, being started again
/// or silent, to answer before it counts the node's memory as gone: a
/// manager that died on a live host left its store (tmpfs) whole, and one
/// that was only silent (stopped, cut off) lost nothing.
const COMEBACK_WAIT: Duration = Duration::from_secs(10);

/// Longest a rebuild waits for a node it asked the resource manager for.
const NEW_NODE_WAIT: Duration = Duration::from_secs(120);

/// The nodes of `name`'s protected version lost to it at `now` that no
/// rebuild has handled yet: down, back without its files
/// (`ProtectionBook::wiped`), or noticed lost since the version was
/// protected (`ProtectionBook::lost_since`), but not already rebuilt
/// elsewhere (`ProtectionBook::rebuilt`).
fn fresh_losses(state: &State, name: &str, now: Instant) -> BTreeSet<String> {
    let Some(app) = state.apps.get(name) else { return BTreeSet::new() };
    let Some(protected) = &app.protection.protected else { return BTreeSet::new() };
    let book = &app.protection;
    protected
        .agents
        .iter()
        .map(|a| a.node.clone())
        .filter(|n| !state.nodes.is_alive(n, now) || book.wiped.contains(n) || book.lost_since.contains_key(n))
        .filter(|n| !book.rebuilt.contains(n))
        .collect()
}

/// Waits (at most [`COMEBACK_WAIT`]) while a `dead` node's manager is
/// being started again or is silent on an open connection; true when every
/// one is back with its memory: the same manager answering again on the
/// same connection (stopped or cut off for a while, never restarted), or a
/// new one that registered the files of `name`'s newest complete version
/// its ranks homed there left. Nothing is to be rebuilt then.
async fn came_back_whole(shared: &Shared, name: &str, dead: &BTreeSet<String>) -> bool {
    let deadline = Instant::now() + COMEBACK_WAIT;
    // Each node's manager connection when it was lost: recorded then
    // (`ProtectionBook::lost_since`), else the one open now (the node is
    // down, or silent on it). Taken now for a node already back, a new
    // manager's connection would pass for the old one.
    let at_loss: BTreeMap<String, Option<u64>> = {
        let state = shared.state();
        let recorded = state.apps.get(name).map(|app| &app.protection.lost_since);
        dead.iter()
            .map(|node| {
                let at_loss = recorded.and_then(|lost| lost.get(node).copied());
                (node.clone(), at_loss.unwrap_or_else(|| state.nodes.open_connection(node)))
            })
            .collect()
    };
    loop {
        {
            let state = shared.state();
            let now = Instant::now();
            let coming = |node: &String| {
                state.nodes.is_relaunching(node)
                    || (state.nodes.open_connection(node).is_some() && !state.nodes.is_alive(node, now))
            };
            if now >= deadline || !dead.iter().any(coming) {
                return whole_again(&state, name, &at_loss, now);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether every node of `at_loss` (with its manager connection when it
/// was lost) is alive again at `now` with `name`'s newest complete version
/// as its ranks left it there (see [`came_back_whole`]).
fn whole_again(state: &State, name: &str, at_loss: &BTreeMap<String, Option<u64>>, now: Instant) -> bool {
    let Some(app) = state.apps.get(name) else { return false };
    let Some(latest) = app.latest.as_ref().filter(|l| l.ranks == app.registration.ranks) else { return false };
    let writers = decide::mapping_units(&app.registration);
    at_loss.iter().all(|(node, connection)| {
        let same_manager = connection.is_some() && state.nodes.open_connection(node) == *connection;
        let holds = || {
            state.holdings.get(node).is_some_and(|stored| {
                reconcile::check_node(name, latest.version, writers, &app.homes, node, stored).is_none()
            })
        };
        // A node that held pieces of the protected version (and perhaps no
        // rank of the newest) is whole only with those pieces: a node
        // holding parity alone, started again empty, passed for whole by
        // its ranks, and the version stayed unprotected.
        let kept_pieces = || {
            let Some(protected) = &app.protection.protected else { return true };
            let announced = |n: &str| state.piece_holdings.get(n).map(Vec::as_slice);
            !protection::nodes_missing_pieces(protected, name, announced).contains(node)
        };
        state.nodes.is_alive(node, now)
            && !app.protection.wiped.contains(node)
            && (same_manager || (holds() && kept_pieces()))
    })
}

/// How many live nodes hold nothing of `name`'s protected version except
/// on the `dead` ones (a lost node that came back holds nothing of it), and
/// whether a `dead` node's manager is being started again.
fn free_nodes(state: &State, name: &str, dead: &BTreeSet<String>) -> Option<(usize, bool)> {
    let app = state.apps.get(name)?;
    let protected = app.protection.protected.as_ref()?;
    // An earlier pass's replacements hold the version too.
    let survivors: BTreeSet<&str> =
        (protected.agents.iter().chain(&app.agents)).map(|a| a.node.as_str()).filter(|n| !dead.contains(*n)).collect();
    let free = (state.nodes.snapshot(Instant::now()).iter())
        .filter(|n| n.alive && !n.draining && !survivors.contains(n.node.as_str()))
        .count();
    Some((free, dead.iter().any(|n| state.nodes.is_relaunching(n))))
}

/// Waits until enough nodes hold nothing of the version to take the lost
/// nodes' slots, so the pieces stay on distinct nodes where sharing a
/// survivor would leave the version protected only as copies (or not at
/// all): at most [`RELAUNCH_WAIT`] while a lost node's manager is being
/// started again; then, with a launcher that can add nodes (Slurm), it
/// gives up each lost node still missing and asks the resource manager
/// for one in its place, and waits at most [`NEW_NODE_WAIT`] for it. A
/// replacement only keeps the service at the size it had, so
/// `manager_count` does not hold it back (the launcher's own most, `icheck
/// up --nodes A..B`, does). Returns without a free node for each slot when
/// none can come: the rebuild then shares a survivor.
async fn await_free_nodes(shared: &Shared, name: &str, dead: &BTreeSet<String>) {
    let relaunch_deadline = Instant::now() + RELAUNCH_WAIT;
    let mut deadline = relaunch_deadline;
    let mut asked = false;
    loop {
        let Some((free, relaunching)) = free_nodes(&shared.state(), name, dead) else { return };
        if free >= dead.len() {
            return;
        }
        let now = Instant::now();
        if !asked && (!relaunching || now >= relaunch_deadline) {
            let Some(launcher) = shared.launcher.clone().filter(|l| l.can_scale()) else { return };
            let granted = replace_lost(shared, launcher, name, dead.iter().take(dead.len() - free)).await;
            if granted.is_empty() {
                return;
            }
            if let Some(app) = shared.state().apps.get_mut(name) {
                app.protection.problem = Some(format!(
                    "nodes {dead:?} were lost; waiting for the resource manager's replacement(s) to rebuild on ({})",
                    granted.join("; ")
                ));
            }
            asked = true;
            deadline = now + NEW_NODE_WAIT;
        } else if now >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asks `launcher` for a node in place of each of `lost`, and gives each
/// replaced node up (its manager is not started there again); returns what
/// was granted, one line per node.
async fn replace_lost<'a>(
    shared: &Shared,
    launcher: Arc<dyn Launcher>,
    name: &str,
    lost: impl Iterator<Item = &'a String>,
) -> Vec<String> {
    let mut granted = Vec::new();
    for node in lost {
        let (ask, gone) = (launcher.clone(), node.clone());
        match tokio::task::spawn_blocking(move || ask.replace_node(&gone)).await {
            Ok(Ok(what)) => {
                tracing::warn!(app = name, %node, %what, "asked the resource manager for a node in place of a lost one");
                shared.state().nodes.give_up(node);
                granted.push(format!("{node}: {what}"));
            }
            Ok(Err(why)) => tracing::warn!(app = name, %node, %why, "cannot get a node in place of a lost one"),
            Err(err) => tracing::error!(app = name, %node, %err, "the request for a replacement node failed"),
        }
    }
    granted
}

/// Each slot's agent, found by its home: `agents` is the application's list
/// with the agents that died taken out (`AppEntry::lose_node`), so the
/// survivors are the other slots' agents in slot order, and an index into
/// it names another slot's agent once one before it went. `None` for a
/// slot whose agent is gone (of two slots on one node, the first is taken
/// to have survived: both serve the node's store).
fn agents_by_slot(homes: &[String], agents: &[AgentInfo]) -> Vec<Option<AgentInfo>> {
    let mut survivors = agents.iter().peekable();
    homes
        .iter()
        .map(|home| match survivors.peek() {
            Some(agent) if agent.node == *home => survivors.next().cloned(),
            _ => None,
        })
        .collect()
}

/// When one of `places` (nodes a pass placed replacements on) is down,
/// has `name`'s rebuild look again once this pass ends (and place their
/// slots elsewhere); returns whether one is.
fn look_again_if_lost(shared: &Shared, name: &str, places: &[String]) -> bool {
    let mut state = shared.state();
    let now = Instant::now();
    let lost = places.iter().any(|node| !state.nodes.is_alive(node, now));
    if let Some(app) = state.apps.get_mut(name).filter(|_| lost) {
        app.protection.look_again = true;
    }
    lost
}

/// New agents for the application's slots whose agents died while their
/// nodes live on (a manager that came back with its store, or an agent
/// that ended on its own: one whose endpoint a timed-out transfer closed
/// stops so that it is replaced), each on its slot's node, serving what
/// the node's store kept; the protected version's record names them
/// instead of the dead ones, and a newer complete version is protected on
/// them. Without this, a version completed but not yet protected stayed
/// unprotected until the application registered or probed again, which a
/// job that failed with them never does, and a later rebuild read the
/// node's copies or shards from a dead agent (the fault campaign found
/// both). Where the agents no longer line up with the slots, or a slot's
/// node is down or draining, the application's next registration replaces
/// them, as without redundancy; a failed start leaves the same to it.
/// With every agent there, a newest version that nothing protects (a
/// controller that died before protecting it, or a protection that ended
/// with a lost agent) is protected now.
async fn agents_back_in_place(shared: &Shared, name: &str) {
    let (waiters, mut agents, survivors) = {
        let mut state = shared.state();
        let state = &mut *state;
        let Some(app) = state.apps.get(name) else { return };
        if shared.dynamic().redundancy_for(&app.registration).is_none() {
            return;
        }
        let now = Instant::now();
        let usable = |node: &str| state.nodes.is_alive(node, now) && !state.nodes.is_draining(node);
        // Agents that died were taken out of the list (`AppEntry::lose_node`,
        // `AgentLost`): each slot's survivor by its home.
        let by_slot = agents_by_slot(&app.homes, &app.agents);
        let every_agent_placed = by_slot.iter().flatten().count() == app.agents.len();
        let agents: Option<Vec<Option<AgentInfo>>> = (by_slot.into_iter().zip(&app.homes))
            .map(|(agent, home)| match agent {
                Some(agent) => Some(Some(agent)),
                None => usable(home).then_some(None),
            })
            .collect();
        let unexplained = app.agents.len() != app.homes.len() && app.protection.problem.is_none();
        let (Some(agents), true, Some(owner)) = (agents, every_agent_placed, app.owner) else {
            if unexplained {
                // Out of line: the status says why the version waits.
                start_protection(shared, state, name);
            }
            return;
        };
        if agents.iter().all(Option::is_some) {
            // Every agent is there: a newest version that nothing protects
            // (none was under way when a controller died) is protected now.
            let protected = app.protection.protected.as_ref().map(|p| p.version());
            let idle = app.protection.protecting().is_none() && app.protection.waiting().is_none();
            if idle && app.latest.as_ref().map(|l| l.version) > protected {
                start_protection(shared, state, name);
            }
            return;
        }
        let places: Vec<String> =
            agents.iter().zip(&app.homes).filter(|(agent, _)| agent.is_none()).map(|(_, home)| home.clone()).collect();
        let spec = nodes::StartSpec {
            app: name,
            mem_budget: shared.dynamic().max_mem_node_bytes(),
            owner,
            complete: app.latest.as_ref().map(|l| l.version),
            encrypted: app.registration.encrypted,
            protected: app.protection.protected.as_ref().map(|p| p.version()),
        };
        let survivors = app.agents.clone();
        (send_starts(state, &spec, places), agents, survivors)
    };
    let places: Vec<&str> = waiters.iter().map(|(_, node, _)| node.as_str()).collect();
    tracing::info!(app = name, nodes = ?places, "starting the application's lost agents again where its files are");
    let _claim = Placing::of(shared, &waiters);
    let started = await_starts(shared, name, waiters).await;
    let mut state = shared.state();
    let state = &mut *state;
    let Some(app) = state.apps.get_mut(name) else { return };
    let started = match started {
        Ok(started) if app.agents == survivors => started,
        Ok(started) => {
            // The application was placed again meanwhile: its agents stand.
            tell_agents(&state.nodes, &started, |id| ControllerToManager::StopAgent { id, discard: false });
            return;
        }
        Err(why) => {
            app.protection.problem = Some(format!(
                "its lost agents could not be started again ({why}); its newest version is protected once the \
                 application registers again"
            ));
            return;
        }
    };
    let mut fresh = started.iter();
    let agents: Vec<AgentInfo> = agents.iter_mut().filter_map(|a| a.take().or_else(|| fresh.next().cloned())).collect();
    let placed = Event::Placed { registration: app.registration.clone(), agents: agents.clone(), owner: app.owner };
    if let Err(why) = journal(state, &placed) {
        tell_agents(&state.nodes, &started, |id| ControllerToManager::StopAgent { id, discard: false });
        tracing::warn!(app = name, %why, "the agents started again are not journaled; they are replaced at registration");
        return;
    }
    let Some(app) = state.apps.get_mut(name) else { return };
    // The protected version's record named the dead agents as holders of
    // what their nodes kept: a later rebuild reads from the new ones.
    let mut protected = None;
    if let Some(record) = app.protection.protected.as_mut() {
        for held in record.agents.iter_mut().filter(|held| !agents.iter().any(|a| a.id == held.id)) {
            if let Some(now) = started.iter().find(|a| a.node == held.node) {
                *held = now.clone();
            }
        }
        protected = Some(Event::Protected { app: name.to_string(), protection: record.journaled() });
    }
    let newer = app.latest.as_ref().map(|l| l.version) > app.protection.protected.as_ref().map(|p| p.version());
    app.agents = agents;
    if let Some(event) = protected {
        if let Err(why) = journal(state, &event) {
            tracing::warn!(app = name, %why, "the protected version's new holders are not journaled");
        }
    }
    // Protecting the protected version again would rewrite its pieces.
    if newer {
        start_protection(shared, state, name);
    }
}

/// One pass of [`after_loss`], with its outcome logged and recorded.
async fn rebuild_once(shared: &Shared, name: &str) {
    let started = Instant::now();
    match after_loss(shared, name).await {
        Ok(Some(ranks)) => {
            tracing::info!(app = %name, ranks, secs = started.elapsed().as_secs_f64(), "rebuilt after a lost node")
        }
        // Nothing to rebuild: the agents that died where the files are
        // (the nodes came back whole, or an agent ended) start again.
        Ok(None) => agents_back_in_place(shared, name).await,
        Err(reason) => {
            tracing::error!(app = %name, %reason, "rebuild after a lost node failed");
            if let Some(app) = shared.state().apps.get_mut(name) {
                // Agents are still missing: the newest version is
                // incomplete in agent memory.
                if app.agents.len() != app.homes.len() {
                    app.protection.lost = app.latest.as_ref().map(|l| (l.version, reason.clone()));
                }
                app.protection.problem = Some(reason);
            }
        }
    }
}

/// Rebuilds `name`'s protected version after its nodes died; `Ok(None)`
/// when there is nothing to do (no protected version, or no node of it is
/// down). Returns the ranks rebuilt.
async fn after_loss(shared: &Shared, name: &str) -> Result<Option<usize>, String> {
    // Lost now: a node whose manager is started again later still lost
    // its part of the version (it comes back empty, or is treated so).
    let mut fresh = fresh_losses(&shared.state(), name, Instant::now());
    if fresh.is_empty() {
        return Ok(None);
    }
    let (protected, dead, owner, waiters, lost_slots, stale, reused, fell_back) = loop {
        if came_back_whole(shared, name, &fresh).await {
            // The newest version is whole where it was; only the
            // application's agents there died with their managers.
            tracing::warn!(app = name, nodes = ?fresh, "the lost nodes came back with their memory: nothing to rebuild");
            if let Some(app) = shared.state().apps.get_mut(name) {
                app.protection.problem = None;
                app.protection.lost_since.retain(|n, _| !fresh.contains(n));
            }
            return Ok(None);
        }
        // Nodes an earlier pass rebuilt are still missing the version's
        // pieces they held: lost to it as well.
        let rebuilt = shared.state().apps.get(name).map(|a| a.protection.rebuilt.clone()).unwrap_or_default();
        let dead: BTreeSet<String> = fresh.union(&rebuilt).cloned().collect();
        await_free_nodes(shared, name, &dead).await;
        let mut state = shared.state();
        let state = &mut *state;
        let now = Instant::now();
        // A node lost while this pass waited (nodes lost together are
        // noticed one by one) joins it: planned without it, the rebuild
        // would read from it and leave its ranks unbuilt.
        let grown: Vec<String> = fresh_losses(state, name, now).difference(&fresh).cloned().collect();
        if !grown.is_empty() {
            tracing::warn!(app = name, nodes = ?grown, "more nodes were lost while the rebuild waited: it takes them in");
            fresh.extend(grown);
            continue;
        }
        let Some(app) = state.apps.get_mut(name) else { return Ok(None) };
        let Some(protected) = app.protection.protected.clone() else { return Ok(None) };
        let latest = app.latest.as_ref().map(|l| l.version);
        let newer = latest.is_some_and(|l| l > protected.version());
        // Whether a rank of the newest version was on a lost node (the
        // application's slots hold the newest version).
        let newest_lost = app.rank_homes().any(|(_, home)| dead.contains(home));
        if newer && !newest_lost {
            tracing::warn!(app = name, ?latest, lost = ?dead, "the lost nodes held none of the newest version's ranks");
            // Only pieces of the older version were there. With the same
            // placement, the lost slots just get replacement agents (below)
            // and the newest is protected on them; written on other agents,
            // it is protected on those that replace the lost ones at the
            // application's next registration or probe.
            if !app.homes.iter().eq(protected.agents.iter().map(|a| &a.node)) {
                app.protection.problem = Some(format!(
                    "nodes {dead:?} were lost with pieces of version {}; version {} is whole, and is protected once \
                     the application's lost agents are replaced",
                    protected.version(),
                    latest.unwrap_or_default()
                ));
                return Ok(None);
            }
        }
        // The newest version was not protected yet and lost ranks: the
        // agents hold back the protected one until it is
        // (`Shared::held_back`), so that one is rebuilt and becomes the
        // newest complete version again.
        let falls_back = newer && newest_lost;
        if latest != Some(protected.version()) && !newer {
            return Err(format!(
                "version {:?} was not protected yet when nodes {dead:?} were lost (version {} was); it may be \
                 lost, and a restart falls back to what the PFS holds",
                latest,
                protected.version()
            ));
        }
        if falls_back {
            tracing::warn!(
                app = name,
                newest = ?latest,
                protected = protected.version(),
                lost = ?dead,
                "the newest version was not protected yet: falling back to the protected one"
            );
        }
        let owner = app.owner.ok_or("the application has no recorded owner")?;
        let encrypted = app.registration.encrypted;
        // Checked before anything starts: which ranks can be rebuilt.
        protection::rebuild_sources(&protected, &dead)?;
        let lost_slots: Vec<usize> =
            (0..protected.agents.len()).filter(|s| dead.contains(&protected.agents[*s].node)).collect();
        // A slot an earlier pass rebuilt keeps its replacement while that
        // agent's node is alive and not lost now: its rank is there. The
        // list may have lost agents since (a node noticed lost), so each
        // slot's agent is found by its home, not by its index.
        let by_slot = agents_by_slot(&app.homes, &app.agents);
        let mut reused: BTreeMap<usize, AgentInfo> = lost_slots
            .iter()
            .filter_map(|s| {
                let current = by_slot.get(*s)?.as_ref()?;
                let replacement = current.id != protected.agents[*s].id
                    && rebuilt.contains(&protected.agents[*s].node)
                    && !fresh.contains(&current.node)
                    && state.nodes.is_alive(&current.node, now);
                replacement.then(|| (*s, current.clone()))
            })
            .collect();
        let lost_slots: Vec<usize> = lost_slots.into_iter().filter(|s| !reused.contains_key(s)).collect();
        // Slots on nodes not lost now whose agents are gone all the same:
        // an earlier pass found their node back whole with a new manager
        // (its store kept), and the application was not placed there again
        // yet. Put back, the old agent would be listed with no manager
        // running it; an agent the application got there since is kept,
        // else a fresh one on the same node serves what its store kept.
        let listed = |id: u64| app.agents.iter().any(|a| a.id == id);
        let positional = app.agents.len() == protected.agents.len();
        let mut stale = Vec::new();
        for (slot, old) in protected.agents.iter().enumerate() {
            if dead.contains(&old.node) || listed(old.id) {
                continue;
            }
            match app.agents.get(slot).filter(|a| positional && a.node == old.node) {
                Some(since) => {
                    reused.insert(slot, since.clone());
                }
                None => stale.push(slot),
            }
        }
        // Nodes holding the version: the survivors, and the replacements an
        // earlier pass placed (kept above).
        let survivors: BTreeSet<&str> = (protected.agents.iter().filter(|a| !dead.contains(&a.node)))
            .chain(reused.values())
            .map(|a| a.node.as_str())
            .collect();
        // A replacement goes to a live node holding none of the version
        // (a lost node whose manager came back counts: it holds nothing of
        // it any more, but a node that did not just fail goes first), the
        // emptiest first; only without one does it share a node.
        let mut candidates: Vec<_> = state.nodes.snapshot(now).into_iter().filter(|n| n.alive && !n.draining).collect();
        candidates
            .sort_by_key(|n| (survivors.contains(n.node.as_str()), dead.contains(&n.node), n.agents, n.node.clone()));
        if candidates.is_empty() {
            return Err(format!("no live checkpoint node is left to rebuild on after losing {dead:?}"));
        }
        let mut places: Vec<String> =
            (0..lost_slots.len()).map(|i| candidates[i % candidates.len()].node.clone()).collect();
        places.extend(stale.iter().map(|slot| protected.agents[*slot].node.clone()));
        let config = shared.dynamic();
        let spec = nodes::StartSpec {
            app: name,
            mem_budget: config.max_mem_node_bytes(),
            owner,
            complete: latest.filter(|_| !falls_back).or(Some(protected.version())),
            encrypted,
            protected: Some(protected.version()),
        };
        let waiters = send_starts(state, &spec, places);
        break (protected, dead, owner, waiters, lost_slots, stale, reused, falls_back);
    };
    tracing::warn!(
        app = name,
        version = protected.version(),
        lost = ?dead,
        slots = ?lost_slots,
        fresh_in_place = ?stale,
        "rebuilding on other nodes"
    );
    let _claim = Placing::of(shared, &waiters);
    let places: Vec<String> = waiters.iter().map(|(_, node, _)| node.clone()).collect();
    let started = match await_starts(shared, name, waiters).await {
        Ok(started) => started,
        Err(reason) => {
            look_again_if_lost(shared, name, &places);
            return Err(reason);
        }
    };
    let mut agents: Vec<AgentInfo> = protected.agents.clone();
    for (slot, agent) in lost_slots.iter().chain(&stale).zip(&started).chain(reused.iter()) {
        agents[*slot] = agent.clone();
    }
    let mut sources = protection::rebuild_sources(&protected, &dead)?;
    sources.retain(|(_, slot, _)| !reused.contains_key(slot));
    let rebuilt = sources.len();
    let mut pending = sources;
    let mut failed = Vec::new();
    for attempt in 1..=REBUILD_TRIES {
        let waiters: Vec<RankWaiter> = {
            let mut state = shared.state();
            pending
                .iter()
                .map(|(rank, slot, source)| {
                    let to = &agents[*slot];
                    let message = |request| ControllerToManager::Rebuild {
                        agent: to.id,
                        rank: *rank,
                        version: protected.version(),
                        source: source.clone(),
                        request,
                    };
                    ask_rank(&mut state, to, *rank, message)
                })
                .collect()
        };
        let awaited = await_ranks(shared, waiters).await;
        failed = awaited.failures;
        // A replacement's node lost meanwhile: asking its agent again is
        // no use. The application's rebuild looks again once this pass
        // ends, and places the lost node's slots elsewhere.
        let replacement_lost = !failed.is_empty() && {
            let targets: Vec<String> = pending.iter().map(|(_, slot, _)| agents[*slot].node.clone()).collect();
            look_again_if_lost(shared, name, &targets)
        };
        // An agent that never answered may still be writing its rank: a
        // second job beside it would write the same file.
        if failed.is_empty() || awaited.unanswered || replacement_lost || attempt == REBUILD_TRIES {
            break;
        }
        let why = describe_failures(&failed);
        tracing::warn!(app = name, attempt, failed = %why, "a rebuild's ranks failed; trying them again");
        pending.retain(|(rank, _, _)| failed.iter().any(|(failed, _)| failed == rank));
        tokio::time::sleep(REBUILD_RETRY_PAUSE).await;
    }
    let failed_ranks: Vec<u32> = failed.iter().map(|(rank, _)| *rank).collect();
    let mut state = shared.state();
    let state = &mut *state;
    if !failed.is_empty() {
        // Their node may hold other slots' files: nothing is discarded.
        tell_agents(&state.nodes, &started, |id| ControllerToManager::StopAgent { id, discard: false });
        return Err(format!(
            "version {} could not be rebuilt after losing nodes {dead:?}: ranks {failed_ranks:?} failed ({})",
            protected.version(),
            describe_failures(&failed)
        ));
    }
    let app = state.apps.get(name).ok_or("the application went away")?;
    let (registration, newest) = (app.registration.clone(), app.latest.clone());
    journal(state, &Event::Placed { registration: registration.clone(), agents: agents.clone(), owner: Some(owner) })?;
    if fell_back {
        // Journaled again, it is the newest the journal knows (the newer
        // ones leave it).
        let writers = decide::mapping_units(&registration);
        journal(state, &Event::VersionComplete { app: name.to_string(), record: protected.record.clone(), writers })?;
    }
    // The survivors delete the lost versions' files, which the application
    // writes again (after a controller restart, reconciliation did).
    let through = newest.as_ref().map(|n| n.version).filter(|_| fell_back);
    if let Some(through) = through {
        let above = protected.version();
        let nodes: BTreeSet<&str> = agents.iter().map(|a| a.node.as_str()).collect();
        for node in nodes {
            state.nodes.send(node, ControllerToManager::DropNewer { app: name.to_string(), above, through });
        }
    }
    let app = state.apps.get_mut(name).ok_or("the application went away")?;
    if fell_back {
        let lost = newest.map_or(0, |n| n.version);
        tracing::warn!(
            app = name,
            lost,
            newest = protected.version(),
            "fell back to the protected version: the newer one was lost with its node"
        );
        app.dropped.push(format!(
            "version {lost}: lost with nodes {dead:?} before it was protected; the newest complete version is \
             version {} again",
            protected.version()
        ));
        app.latest = Some(protected.record.clone());
    }
    // The old agents on the lost nodes are gone; the survivors stay.
    app.agents = agents.clone();
    app.protection.wiped.retain(|n| !dead.contains(n));
    app.protection.lost_since.retain(|n, _| !dead.contains(n));
    app.protection.rebuilt.extend(dead.iter().cloned());
    app.homes = agents.iter().map(|a| a.node.clone()).collect();
    start_protection(shared, state, name);
    Ok(Some(rebuilt))
}

#[cfg(test)]
mod tests {
    use super::super::apps::tests::agent;
    use super::*;

    #[test]
    fn each_slot_finds_its_agent_by_home_once_agents_before_it_are_gone() {
        let homes: Vec<String> = ["a", "b", "c", "d", "e"].map(String::from).to_vec();
        let all: Vec<AgentInfo> = homes.iter().enumerate().map(|(i, home)| agent(i as u64 + 1, home)).collect();
        assert_eq!(agents_by_slot(&homes, &all), all.iter().cloned().map(Some).collect::<Vec<_>>());
        // Slot 2's agent went (its node was noticed lost): the list is one
        // shorter, and index 4 no longer exists, nor names slot 4's agent.
        let without: Vec<AgentInfo> = [0, 1, 3, 4].map(|i| all[i].clone()).to_vec();
        let by_slot = agents_by_slot(&homes, &without);
        assert_eq!(by_slot[2], None);
        assert_eq!((by_slot[3].as_ref(), by_slot[4].as_ref()), (Some(&all[3]), Some(&all[4])));
        assert_eq!(without.get(3), Some(&all[4]), "by index, slot 3 would be slot 4's agent");
    }
}
