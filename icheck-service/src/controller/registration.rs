//! Registrations: an application's `init` (a first run or a restart) gets
//! its agents and its newest complete version here (`register_app`), and
//! agents are started on managers and awaited (`send_starts`,
//! `await_starts`, `Placing`).
//!
//! Architecture invariant: a registration never hands out a version it
//! cannot serve. It waits until the application's journaled versions are
//! reconciled with the managers' stores and any rebuild is done, refuses
//! a restart whose newest version only silent or lost nodes hold (naming
//! them), and refuses a restart in the other transfer mode before
//! anything is placed or journaled. When no node can take agents it
//! answers none (the job writes to the PFS itself) only to a restart
//! whose version is on the PFS.

use super::*;

/// Why a registration places agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Placement {
    /// A job starts (a first run or a restart; also its `init`'s probe
    /// when an agent it was given cannot be reached): it reads its newest
    /// version back from the agents.
    Start,
    /// A running job's agents are gone (its probe): it holds its data and
    /// stores its versions again on the new agents.
    Replace,
}

/// Why a run registering in `registration.mode` cannot restart from the
/// version agent memory holds, given as its number and the mode it was
/// written in (that of the registration in force when it was recorded;
/// `None` when there is none): MR keeps a file per rank and SHMR one per
/// node, and neither reads the other's.
pub(super) fn mode_mismatch(
    registration: &protocol::AppRegistration,
    held: Option<(u64, protocol::TransferMode)>,
) -> Option<String> {
    mode_mismatch_in(registration, held, "agent memory")
}

/// [`mode_mismatch`] for the version a restart reads from `place`.
pub(super) fn mode_mismatch_in(
    registration: &protocol::AppRegistration,
    held: Option<(u64, protocol::TransferMode)>,
    place: &str,
) -> Option<String> {
    let (version, written_in) = held?;
    (written_in != registration.mode)
        .then(|| written_in.cannot_restore_in(registration.mode, &registration.name, version, place))
}

/// Why a registration gave no agents.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    /// No node can take the agents now (none is live, or none has room):
    /// asking again later may succeed.
    #[error(transparent)]
    NoRoom(#[from] decide::PlacementError),
    /// Any other refusal, worded for the application.
    #[error("{0}")]
    Other(String),
}

impl From<String> for Refused {
    fn from(reason: String) -> Self {
        Refused::Other(reason)
    }
}

/// §6.1.2: pick the agent count and nodes, have managers start the agents,
/// and return them. A restarting application whose agents all live gets
/// them back.
pub(super) async fn register_app(
    shared: &Shared,
    registration: protocol::AppRegistration,
    claim: &apps::Claim<'_>,
    placement: Placement,
) -> Result<(Vec<AgentInfo>, Option<VersionRecord>, Capability), Refused> {
    icheck_core::format::check_app_name(&registration.name).map_err(|e| e.to_string())?;
    if registration.ranks == 0 || registration.nodes == 0 {
        return Err(format!("application {:?} registered with 0 ranks or 0 nodes", registration.name).into());
    }
    // Before anything else: only its owner may register a known application.
    let known_owner = shared.state().apps.get(&registration.name).and_then(|a| a.owner);
    let recorded = match known_owner {
        Some(owner) => Some(owner),
        // Not known here (a new journal, or an application that finished):
        // its copies on the PFS may name an owner.
        None => pfs_owner(shared, &registration.name)?,
    };
    let (capability, owner) = apps::admit_owner(&registration.name, recorded.as_ref(), claim)?;
    // A run that finished with IC_CLEANUP may still be flushing to the PFS:
    // let it finish, so the new run starts from the flushed version.
    let flushing_since = Instant::now();
    while shared.state().apps.get(&registration.name).is_some_and(|a| a.finishing) {
        if flushing_since.elapsed() > AGENT_START_TIMEOUT {
            return Err(
                format!("application {:?} is still being flushed to the PFS; try again", registration.name).into()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its files are on a node whose dead manager is being started again:
    // wait for it (bounded) rather than place the agents elsewhere, where
    // the newest version is not.
    let waiting = Instant::now();
    while waiting.elapsed() < RELAUNCH_WAIT && {
        let state = shared.state();
        let homes = state.apps.get(&registration.name).map(|a| a.homes.clone()).unwrap_or_default();
        homes.iter().any(|node| state.nodes.is_relaunching(node))
    } {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    await_reconciled(shared, &registration.name).await;
    let config = shared.dynamic();
    // The agent starts sent; `None`: no node can take agents, and the job
    // is sent to the PFS (below).
    let waiters;
    let latest;
    // The agents this placement replaces (told to stop below).
    let mut superseded: Vec<AgentInfo> = Vec::new();
    // Read before taking the state lock: it is file I/O.
    // The PFS's newest version, and the mode it was written in where recorded.
    let (pfs_mode, pfs_record) = match pfs_latest(shared, &registration.name) {
        Ok(Some((record, mode))) => (mode.map(|mode| (record.version, mode)), Ok(Some(record))),
        Ok(None) => (None, Ok(None)),
        Err(damage) => (None, Err(damage)),
    };
    let on_pfs = pfs_record.as_ref().ok().and_then(|r| r.as_ref().map(|r| r.version));
    'placing: {
        let mut state = shared.state();
        let now = Instant::now();
        // The newest complete version wherever it is: the library may have
        // written newer ones straight to the PFS while its agents were gone.
        let in_memory = state.apps.get(&registration.name).and_then(|a| a.latest.clone());
        let pfs_record = match pfs_record {
            Ok(record) => record,
            // Agent memory holds a newer version than anything on the PFS could.
            Err(damage) if in_memory.is_some() => {
                tracing::warn!(%damage, "no PFS version is readable; restarting from agent memory");
                None
            }
            Err(damage) => {
                return Err(format!(
                    "application {:?} has versions on the PFS but none is readable, so it cannot restart: {damage}",
                    registration.name
                )
                .into())
            }
        };
        let lost = state.apps.get(&registration.name).and_then(|app| {
            app.protection
                .lost
                .clone()
                .or_else(|| ranks_lost_with_given_up_nodes(&registration.name, app, &state.nodes))
        });
        latest = match (in_memory, pfs_record) {
            (Some(memory), Some(pfs)) if pfs.version > memory.version => Some(pfs),
            // A lost node took ranks of the newest version with it and the
            // redundancy could not rebuild them: the PFS copy, if any.
            (Some(memory), pfs) if lost.as_ref().is_some_and(|(v, _)| *v == memory.version) => {
                let (_, why) = lost.expect("matched above");
                match pfs {
                    Some(pfs) => {
                        tracing::warn!(%why, pfs = pfs.version, "restarting from the PFS copy");
                        Some(pfs)
                    }
                    None => return Err(format!("{why}; no PFS copy of {:?} exists", registration.name).into()),
                }
            }
            (memory, pfs) => memory.or(pfs),
        };
        if placement == Placement::Start {
            // The version the restart reads, when agent memory holds it.
            let held = state.apps.get(&registration.name).and_then(|app| {
                let memory = app.latest.as_ref()?;
                let read = latest.as_ref().filter(|l| l.version == memory.version)?;
                Some((read.version, app.registration.mode))
            });
            // Else the version the restart reads from the PFS.
            let why = match held {
                Some(_) => mode_mismatch(&registration, held),
                None => {
                    let read = pfs_mode.filter(|(version, _)| latest.as_ref().is_some_and(|l| l.version == *version));
                    mode_mismatch_in(&registration, read, "the PFS")
                }
            };
            if let Some(why) = why {
                tracing::warn!(app = %registration.name, %why, "refused a restart");
                return Err(why.into());
            }
        }
        // A restart of a version held only by a silent node, with no other
        // way to it: not placed elsewhere, where every rank would fail to
        // find it. (A running job asking for new agents stores its
        // versions again there.)
        let restart =
            latest.as_ref().filter(|l| placement == Placement::Start && on_pfs.is_none_or(|pfs| pfs < l.version));
        let silent = restart.and_then(|_| {
            let app = state.apps.get(&registration.name)?;
            ranks_on_silent_nodes(&registration.name, app, &state.nodes, shared.kill_silent_after, now)
        });
        if let Some(why) = silent {
            tracing::warn!(app = %registration.name, %why, "refused a restart");
            return Err(why.into());
        }
        let state = &mut *state;
        if let Some(app) = state.apps.get_mut(&registration.name) {
            let nodes = &state.nodes;
            let all_alive = !app.agents.is_empty()
                && app.agents.len() == app.homes.len()
                && app.agents.iter().all(|a| nodes.is_alive(&a.node, now));
            if all_alive {
                tracing::info!(agents = app.agents.len(), ?latest, "application re-registered; returning its agents");
                let agents = app.agents.clone();
                let placed =
                    Event::Placed { registration: registration.clone(), agents: agents.clone(), owner: Some(owner) };
                let was_persisted = app.persisted;
                journal(state, &placed)?;
                if was_persisted {
                    journal(state, &Event::Persisted { app: registration.name.clone(), persisted: false })?;
                }
                let app = state.apps.get_mut(&registration.name).expect("looked up above, under the same lock");
                app.persisted = false;
                app.registration = registration;
                app.owner = Some(owner);
                app.latest = latest.clone();
                return Ok((agents, latest, capability));
            }
        }
        // Agents of a returning application go back to the nodes that hold
        // its checkpoint files, where those are alive, and it gets its
        // previous agent count back (within its limit).
        let previous: Vec<String> = state.apps.get(&registration.name).map(|a| a.homes.clone()).unwrap_or_default();
        let count = match previous.len() as u32 {
            0 => decide::initial_agent_count(&registration, &config),
            n => n.min(decide::agent_limit(&registration, &config)),
        };
        let snapshot = state.nodes.snapshot(now);
        // Redundancy across nodes wants the agents on that many distinct
        // nodes, where they exist.
        let policy = config.redundancy_for(&registration);
        let live = snapshot.iter().filter(|n| n.alive && !n.draining).count();
        // §6.5.1, as when the controller cannot be reached: no node can take
        // agents (all silent, dead, draining or refusing agents), but the
        // version a restart reads is on the PFS. The job restarts from there
        // and writes its versions to the PFS itself, and its library asks
        // again every `t_wait` until nodes answer. Before, the registration
        // failed and the job could not even restart from the versions it had
        // written there. A newest version only agent memory holds is never
        // passed over: that case fails below, as before, or is refused
        // above. A first run (no version anywhere) still fails: it has
        // nothing to lose by waiting for the service.
        let restart_on_pfs = latest.as_ref().is_some_and(|l| on_pfs == Some(l.version));
        if live == 0 && placement == Placement::Start && shared.pfs.is_some() && restart_on_pfs {
            tracing::warn!(
                app = %registration.name,
                version = ?latest.as_ref().map(|l| l.version),
                "no checkpoint node can take agents: the application writes its versions to the PFS until one does"
            );
            waiters = None;
            break 'placing;
        }
        // (Beyond one agent per rank: the extra agents hold pieces only.)
        let count = count.max((policy.wanted_nodes().min(live) as u32).min(config.max_agents_app));
        let mut config = config;
        if !policy.is_none() {
            // Candidates enough for every agent to get a node of its own.
            config.candidate_count = config.candidate_count.max(count);
        }
        // Survivors of the old placement stop; their files stay for the new agents.
        if let Some(app) = state.apps.get(&registration.name) {
            tell_agents(&state.nodes, &app.agents, |id| ControllerToManager::StopAgent { id, discard: false });
            superseded = app.agents.clone();
        }
        let usable = |node: &String| snapshot.iter().any(|s| &s.node == node && s.alive && !s.draining);
        let lost_slots: Vec<usize> = (0..previous.len()).filter(|i| !usable(&previous[*i])).collect();
        let same_count = previous.len() == count as usize;
        // Slots whose node lives keep it (their ranks' files are there);
        // the others go to nodes the application does not use yet.
        let replacements = (same_count && !lost_slots.is_empty() && lost_slots.len() < previous.len())
            .then(|| {
                let others: Vec<_> = snapshot.iter().filter(|s| !previous.contains(&s.node)).cloned().collect();
                decide::choose_nodes(&others, lost_slots.len() as u32, &config).ok()
            })
            .flatten();
        let nodes = if same_count && lost_slots.is_empty() {
            previous
        } else if let Some(new) = replacements {
            let mut nodes = previous;
            for (slot, node) in lost_slots.into_iter().zip(new) {
                nodes[slot] = node;
            }
            nodes
        } else {
            decide::choose_nodes(&snapshot, count, &config)?
        };
        let complete = latest.as_ref().map(|l| l.version);
        let protected =
            state.apps.get(&registration.name).and_then(|a| a.protection.protected.as_ref()).map(|p| p.version());
        let spec = nodes::StartSpec {
            app: &registration.name,
            mem_budget: config.max_mem_node_bytes(),
            owner,
            complete,
            encrypted: registration.encrypted,
            protected,
        };
        waiters = Some(send_starts(state, &spec, nodes));
    }
    let Some(waiters) = waiters else {
        record_owner_on_pfs(shared, recorded.is_none(), &registration.name, &owner);
        return Ok((Vec::new(), latest, capability));
    };
    let placing = Instant::now();
    let _claim = Placing::of(shared, &waiters);
    let agents = await_starts(shared, &registration.name, waiters).await?;
    let mut state = shared.state();
    // Agents another task started for the application while these started
    // (a rebuild starting lost agents again where the files are) are
    // replaced too: left listed nowhere, they would run on unseen.
    if let Some(app) = state.apps.get(&registration.name) {
        let known = |a: &AgentInfo| superseded.iter().chain(&agents).any(|b| b.id == a.id);
        let meanwhile: Vec<AgentInfo> = app.agents.iter().filter(|a| !known(a)).cloned().collect();
        if !meanwhile.is_empty() {
            tracing::info!(agents = ?meanwhile.iter().map(|a| a.id).collect::<Vec<_>>(), "stopping agents started meanwhile by a rebuild");
            tell_agents(&state.nodes, &meanwhile, |id| ControllerToManager::StopAgent { id, discard: false });
        }
    }
    let placed = Event::Placed { registration: registration.clone(), agents: agents.clone(), owner: Some(owner) };
    if let Err(reason) = journal(&mut state, &placed) {
        tell_agents(&state.nodes, &agents, |id| ControllerToManager::StopAgent { id, discard: false });
        return Err(reason.into());
    }
    tracing::info!(agents = agents.len(), "application registered");
    let mut adaptation = state.apps.get(&registration.name).map(|a| a.adaptation.clone()).unwrap_or_default();
    adaptation.changed_after = latest.as_ref().map_or(0, |l| l.version);
    adaptation.reconfigure_secs = placing.elapsed().as_secs_f64();
    if adaptation.sized_for == 0 {
        adaptation.sized_for = decide::mapping_units(&registration);
    }
    let homes = agents.iter().map(|a| a.node.clone()).collect();
    let name = registration.name.clone();
    let registration_name = name.clone();
    let entry = AppEntry {
        registration,
        owner: Some(owner),
        agents: agents.clone(),
        homes,
        latest: latest.clone(),
        persisted: false,
        // What is on the PFS already needs no flush when this run ends.
        copies: CopyBook::new(on_pfs),
        finishing: false,
        adaptation,
        unconfirmed: None,
        dropped: state.apps.get(&name).map(|a| a.dropped.clone()).unwrap_or_default(),
        abandoned: state.apps.get(&name).map(|a| a.abandoned.clone()).unwrap_or_default(),
        protection: Default::default(),
        transfer: None,
        // Still cut off from this job's hosts, most likely: a new run of
        // the same job is placed by the same reports.
        unreached: state.apps.get(&name).map(|a| a.unreached.clone()).unwrap_or_default(),
    };
    state.apps.insert(name.clone(), entry);
    // New agents: the version they serve is protected again on them.
    start_protection(shared, &mut state, &name);
    drop(state);
    record_owner_on_pfs(shared, recorded.is_none(), &registration_name, &owner);
    Ok((agents, latest, capability))
}

/// A new owner (`new`: none was recorded) is recorded beside the copies
/// once its registration succeeded (a failed one hands out no capability
/// to match it).
fn record_owner_on_pfs(shared: &Shared, new: bool, name: &str, owner: &icheck_core::credentials::Owner) {
    if !new {
        return;
    }
    if let Some(pfs) = &shared.pfs {
        if let Err(err) = pfs.set_owner(name, owner) {
            tracing::warn!(%err, "cannot record the application's owner on the PFS");
        }
    }
}

/// The owner the PFS level recorded for `name`, if any. A damaged record
/// refuses the registration: it may be the only thing between the
/// application's copies and someone else.
pub(super) fn pfs_owner(shared: &Shared, name: &str) -> Result<Option<icheck_core::credentials::Owner>, String> {
    match &shared.pfs {
        None => Ok(None),
        Some(pfs) => pfs.owner(name).map_err(|err| {
            format!("cannot tell who owns {name:?}: {err}; an administrator can `icheck delete {name}`")
        }),
    }
}

/// A journaled application counts no version until the stores confirmed
/// it: waits for its nodes' managers (bounded by the reconcile window).
pub(super) async fn await_reconciled(shared: &Shared, name: &str) {
    let since = Instant::now();
    while {
        let mut state = shared.state();
        reconcile_pending(&mut state, Instant::now());
        // A rebuild after a lost node replaces agents: what the application
        // asks next is answered with the rebuilt ones (bounded: a rebuild
        // that hangs must not hold the application for ever).
        let rebuilding = since.elapsed() < rebuild::REBUILD_WAIT
            && state.apps.get(name).is_some_and(|a| a.protection.rebuilding || a.protection.rebuild_due);
        rebuilding || state.apps.get(name).is_some_and(|a| a.unconfirmed.is_some())
    } {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An agent start the controller waits for: id, node, and the manager's answer.
pub(super) type StartWaiter = (u64, String, Answer<AgentInfo>);

/// The claim of a placement on the agents it started ([`State::placing`]),
/// ended when this drops: by then the application lists them, or they
/// were stopped. Made right after [`send_starts`]; it locks the state when
/// it drops, so it must outlive every state guard of its scope (declared
/// before them).
pub(super) struct Placing<'s> {
    shared: &'s Shared,
    ids: Vec<u64>,
}

impl<'s> Placing<'s> {
    pub(super) fn of(shared: &'s Shared, waiters: &[StartWaiter]) -> Placing<'s> {
        Placing { shared, ids: waiters.iter().map(|(id, _, _)| *id).collect() }
    }
}

impl Drop for Placing<'_> {
    fn drop(&mut self) {
        let mut state = self.shared.state();
        for id in &self.ids {
            state.placing.remove(id);
        }
    }
}

/// Asks the managers of `nodes` to start one agent each for `app` (under
/// the state lock; [`await_starts`] collects the answers after it).
pub(super) fn send_starts(state: &mut State, spec: &nodes::StartSpec<'_>, nodes: Vec<String>) -> Vec<StartWaiter> {
    let mut waiters = Vec::with_capacity(nodes.len());
    for node in nodes {
        let id = state.next_agent;
        state.next_agent += 1;
        let rx = state.pending.ask(id, &node);
        state.placing.insert(id);
        // Counted from now on, so parallel placements spread out.
        state.nodes.start_agent(&node, id, spec);
        waiters.push((id, node, rx));
    }
    waiters
}

/// Waits for the agents [`send_starts`] asked for; if any fails, stops the
/// others and names the failure.
pub(super) async fn await_starts(
    shared: &Shared,
    app: &str,
    waiters: Vec<StartWaiter>,
) -> Result<Vec<AgentInfo>, String> {
    let mut agents = Vec::new();
    let mut failure = None;
    for (id, node, rx) in waiters {
        let failed = match manager_answer(rx, AGENT_START_TIMEOUT).await {
            Some(Ok(info)) => {
                agents.push(info);
                continue;
            }
            Some(Err(reason)) => format!("manager on {node} failed to start agent {id}: {reason}"),
            None => {
                let mut state = shared.state();
                if state.pending.forget(&id) {
                    state.nodes.start_answered(&node, false);
                }
                format!("manager on {node} did not start agent {id} within {AGENT_START_TIMEOUT:?}")
            }
        };
        // No more agents go there for a while: a broken (or hostile) node
        // must not take every new application down with it. A node that
        // was lost meanwhile is not quarantined: down, it takes no agents,
        // and once its manager is back it is as good as new.
        let mut state = shared.state();
        let now = Instant::now();
        if state.nodes.is_alive(&node, now) {
            tracing::warn!(%node, reason = %failed, "placing no agents on this node for {:?}", nodes::START_QUARANTINE);
            state.nodes.start_failed(&node, &failed, now);
        }
        failure = Some(failed);
    }
    match failure {
        None => Ok(agents),
        Some(reason) => {
            tell_agents(&shared.state().nodes, &agents, |id| ControllerToManager::StopAgent { id, discard: false });
            Err(format!("could not start the agents of {app}: {reason}"))
        }
    }
}

/// A manager's answer to a request, or `None` when none came within
/// `limit` (or its connection went away); the caller drops its waiter.
pub(super) async fn manager_answer<T>(rx: Answer<T>, limit: Duration) -> Option<Result<T, String>> {
    tokio::time::timeout(limit, rx).await.ok().and_then(Result::ok)
}

/// An init's probe says its job cannot reach an agent. If the agent's
/// node missed heartbeats but is not marked down yet, the answer waits
/// (bounded) until it is, or until the node is heard again: answered at
/// once, "unchanged" would end the job's init with nothing to restart
/// from, where a moment later the controller places new agents (or, for a
/// version only that node holds, refuses naming it).
pub(super) async fn wait_out_doubt(shared: &Shared, name: &str) {
    let started = Instant::now();
    let mut said = false;
    loop {
        let (in_doubt, limit) = {
            let state = shared.state();
            let now = Instant::now();
            let agents = state.apps.get(name).map(|app| app.agents.as_slice()).unwrap_or_default();
            let in_doubt: Vec<&str> =
                agents.iter().filter(|a| state.nodes.in_doubt(&a.node, now)).map(|a| a.node.as_str()).collect();
            if !in_doubt.is_empty() && !said {
                said = true;
                tracing::info!(nodes = ?in_doubt, "an init cannot reach its agents; waiting until the silent nodes are marked down or heard again");
            }
            (!in_doubt.is_empty(), (state.nodes.down_after() + Duration::from_secs(1)).min(AT_INIT_DOUBT_WAIT))
        };
        if !in_doubt || started.elapsed() > limit {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::{mode_mismatch, mode_mismatch_in};
    use icheck_core::protocol::{AppRegistration, TransferMode};

    fn registration(mode: TransferMode) -> AppRegistration {
        AppRegistration {
            name: "sim".into(),
            ranks: 4,
            nodes: 2,
            ranks_per_node: 2,
            mode,
            pfs_interval: 0,
            compression: icheck_core::pfs::CompressionPolicy::Never,
            encrypted: false,
            redundancy: None,
        }
    }

    #[test]
    fn a_restart_is_refused_only_in_the_other_mode_of_a_version_agent_memory_holds() {
        let (mr, shmr) = (TransferMode::Mr, TransferMode::Shmr);
        let why = mode_mismatch(&registration(mr), Some((7, shmr))).expect("SHMR version, MR run");
        assert!(why.starts_with("version 7 of \"sim\" was written in SHMR (N:M) mode"), "{why}");
        assert!(why.contains("ICHECK_MODE=shmr") && why.contains("icheck delete sim --yes"), "{why}");
        let why = mode_mismatch(&registration(shmr), Some((7, mr))).expect("MR version, SHMR run");
        assert!(why.contains("mode = \"mr\" (ICHECK_MODE=mr)"), "{why}");
        // The same mode, or no version in agent memory (none at all, or a
        // restart from the PFS, whose record does not say the mode):
        // registered as before, in either mode.
        assert_eq!(mode_mismatch(&registration(shmr), Some((7, shmr))), None);
        assert_eq!(mode_mismatch(&registration(mr), None), None);
        assert_eq!(mode_mismatch(&registration(shmr), None), None);
    }

    #[test]
    fn a_restart_from_the_pfs_is_refused_in_the_other_mode_its_manifest_records() {
        let (mr, shmr) = (TransferMode::Mr, TransferMode::Shmr);
        let why = mode_mismatch_in(&registration(mr), Some((4, shmr)), "the PFS").expect("SHMR copy, MR run");
        assert!(why.contains("cannot be restored in MR (P:M) mode (the PFS keeps it as one file per node)"), "{why}");
        let why = mode_mismatch_in(&registration(shmr), Some((4, mr)), "the PFS").expect("MR copy, SHMR run");
        assert!(why.contains("one file per process") && why.contains("ICHECK_MODE=mr"), "{why}");
        assert_eq!(mode_mismatch_in(&registration(mr), Some((4, mr)), "the PFS"), None);
    }
}
