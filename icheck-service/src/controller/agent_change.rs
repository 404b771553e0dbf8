//! Probes (§6.4.2) and agent changes: whether an application's agents
//! change (replaced after a lost node, moved off a draining node, or a new
//! count by Algorithm 5 and eq. 6.11/6.12), and the change itself: new
//! agents started, each moved rank's newest version taken over by its new
//! agent over the fabric (ranks staying on their node share its store),
//! then the old ones stopped.
//!
//! Architecture invariant: a change is all or nothing. The application is
//! answered the new agents only once every rank's newest version is on
//! them; otherwise the started agents stop, the moved ranks' new files are
//! dropped, and the application keeps its old agents
//! (`undo_agent_change`).

use super::*;

/// What a probe asks (§6.4.2), as the job sent it.
pub(super) struct ProbeAsked<'a> {
    /// The agents the job uses now.
    pub(super) known: &'a [u64],
    /// Commits it still expects (0: unknown).
    pub(super) remaining: u32,
    /// Asked by a job's `init`, before it stored anything.
    pub(super) at_init: bool,
    /// Agents some rank could not reach, or that did not answer it in time.
    pub(super) unreachable: &'a [u64],
}

/// §6.4.2, a probe. Agents lost with their manager are replaced first (on
/// the nodes holding the application's files when those are alive, else
/// where the placement rules say); agents the job cannot reach on nodes
/// that still heartbeat (a partition only the job sees) and agents on
/// draining nodes move next (new locations, never a node the job reported
/// unreachable lately). Otherwise Algorithm 5 and eq. 6.11/6.12 decide
/// whether the agent count changes. The answer is `Unchanged` or the new
/// agents, which already hold every rank's newest complete version.
pub(super) async fn probe(shared: &Shared, name: &str, capability: &str, asked: ProbeAsked<'_>) -> ClientReply {
    let ProbeAsked { known, remaining, at_init, unreachable } = asked;
    if at_init {
        wait_out_doubt(shared, name).await;
    }
    let config = shared.dynamic();
    let plan = {
        let mut state = shared.state();
        let state = &mut *state;
        let now = Instant::now();
        let snapshot = state.nodes.snapshot(now);
        let Some(app) = state.apps.get_mut(name) else {
            return ClientReply::Error(format!("no application named {name:?} is registered"));
        };
        let heartbeating = |node: &str| snapshot.iter().any(|n| n.node == node && n.alive);
        let cut_off = app.cut_off_slots(unreachable, heartbeating, now);
        if !cut_off.is_empty() {
            let nodes: BTreeSet<&str> = cut_off.iter().map(|slot| app.agents[*slot].node.as_str()).collect();
            tracing::warn!(
                ?nodes,
                agents = ?cut_off.iter().map(|slot| app.agents[*slot].id).collect::<Vec<_>>(),
                "the job cannot reach these agents, whose nodes still heartbeat: moving them to other nodes"
            );
        }
        let draining: Vec<usize> =
            (app.agents.iter().enumerate()).filter(|(_, a)| state.nodes.is_draining(&a.node)).map(|(i, _)| i).collect();
        // Algorithm 5 does not shrink below the nodes redundancy spreads over.
        let live = snapshot.iter().filter(|n| n.alive && !n.draining).count();
        let wanted = config.redundancy_for(&app.registration).wanted_nodes().min(live);
        let floor = (wanted as u32).min(config.max_agents_app);
        let moving = apps::Moving { cut_off, draining };
        match app.probe_plan(known, moving, remaining, floor, &config, at_init) {
            Ok(plan) => plan,
            Err(answer) => return answer,
        }
    };
    match plan {
        ProbePlan::Replace(registration) => {
            // Authorized already (`authorize`): the owner asks, with its capability.
            let uid = shared.state().apps.get(name).and_then(|a| a.owner).map_or(0, |o| o.uid);
            let claim = apps::Claim { presented: Some(capability), reported: uid, seen: None };
            // At init the job has stored nothing: its new agents serve its
            // restart, as a registration's would, and the same refusals hold.
            let placement = if at_init { Placement::Start } else { Placement::Replace };
            match register_app(shared, registration, &claim, placement).await {
                // No node can take agents (the registration would send the
                // job to the PFS): a probe has none to offer yet; the job
                // may ask again while a silent node comes back.
                Ok((agents, ..)) if agents.is_empty() => {
                    ClientReply::NoRoom(decide::PlacementError::NoLiveNode.to_string())
                }
                Ok((agents, ..)) => ClientReply::Agents(agents),
                Err(Refused::NoRoom(reason)) => ClientReply::NoRoom(reason.to_string()),
                Err(reason) => ClientReply::Error(reason.to_string()),
            }
        }
        ProbePlan::Relocate { current, replace } => {
            tracing::info!(agents = replace.len(), "moving agents off draining nodes or nodes the job cannot reach");
            match change_agents(shared, name, current, &replace, &config).await {
                Ok(agents) => ClientReply::Agents(agents),
                Err(reason) => {
                    tracing::warn!(%reason, "cannot move agents off draining nodes or nodes the job cannot reach; the application keeps them");
                    ClientReply::Unchanged
                }
            }
        }
        ProbePlan::Resize { current, to, units } => {
            tracing::info!(from = current, to, units, strategy = ?config.agent_change_strategy, "agents follow the resize");
            match change_agents(shared, name, to, &[], &config).await {
                Ok(agents) => {
                    if let Some(app) = shared.state().apps.get_mut(name) {
                        app.adaptation.sized_for = units;
                        app.adaptation.scaling = decide::ScalingState::default();
                    }
                    ClientReply::Agents(agents)
                }
                Err(reason) => {
                    tracing::warn!(from = current, to, %reason, "agents cannot follow the resize; the application keeps its agents");
                    ClientReply::Unchanged
                }
            }
        }
        ProbePlan::Scale { current, to, scaling } => match change_agents(shared, name, to, &[], &config).await {
            Ok(agents) => {
                if let Some(app) = shared.state().apps.get_mut(name) {
                    app.adaptation.scaling = scaling;
                }
                ClientReply::Agents(agents)
            }
            Err(reason) => {
                tracing::warn!(from = current, to, %reason, "agent change failed; the application keeps its agents");
                if let Some(app) = shared.state().apps.get_mut(name) {
                    app.adaptation.scaling.settled = true;
                }
                ClientReply::Unchanged
            }
        },
    }
}

/// Moves an application to `to` agents (§6.4.2): the current agents stay
/// in their slots (the first `to` of them) except those at the indices in
/// `replace`; the missing slots get new agents placed by Algorithm 6.
/// Ranks map to agents in blocks ([`decide::agent_for_rank`]); every rank
/// whose new agent sits on another node than its old one is taken over by
/// the new agent over the fabric (ranks on the same node share its store).
/// Only when every take-over succeeded do the new agents replace the old,
/// the retired agents stop and the moved ranks leave their old nodes;
/// otherwise nothing changes.
pub(super) async fn change_agents(
    shared: &Shared,
    name: &str,
    to: u32,
    replace: &[usize],
    config: &DynamicConfig,
) -> Result<Vec<AgentInfo>, String> {
    let changing = Instant::now();
    let (old, units, latest, owner, waiters, lost_before) = {
        let mut state = shared.state();
        let now = Instant::now();
        let snapshot = state.nodes.snapshot(now);
        let app = state.apps.get_mut(name).ok_or("the application went away")?;
        let avoided = app.avoided_nodes(now);
        let (old, units, latest) =
            (app.agents.clone(), decide::mapping_units(&app.registration), app.latest.as_ref().map(|l| l.version));
        let owner = app.owner.ok_or("the application has no recorded owner")?;
        let encrypted = app.registration.encrypted;
        let protected = app.protection.protected.as_ref().map(|p| p.version());
        // Nodes of the protected version already lost when the change began.
        let lost_before: BTreeSet<String> = app.protection.lost_since.keys().cloned().collect();
        let kept = (0..old.len().min(to as usize)).filter(|i| !replace.contains(i)).count() as u32;
        let waiters = match to - kept {
            0 => Vec::new(),
            missing => {
                let leaving: BTreeSet<String> =
                    replace.iter().filter_map(|i| old.get(*i)).map(|a| a.node.clone()).collect();
                let nodes = nodes_for_new_agents(&snapshot, missing, config, &avoided, &leaving)?;
                let mem_budget = config.max_mem_node_bytes();
                let spec = nodes::StartSpec { app: name, mem_budget, owner, complete: latest, encrypted, protected };
                send_starts(&mut state, &spec, nodes)
            }
        };
        (old, units, latest, owner, waiters, lost_before)
    };
    let current = old.len() as u32;
    let _claim = Placing::of(shared, &waiters);
    let started = await_starts(shared, name, waiters).await?;
    let mut fresh = started.iter().cloned();
    let new: Vec<AgentInfo> = (0..to as usize)
        .map(|i| match old.get(i).filter(|_| !replace.contains(&i)) {
            Some(kept) => kept.clone(),
            None => fresh.next().expect("one started agent per missing slot"),
        })
        .collect();
    // (rank, from, to) for every rank that changes node.
    let moves: Vec<(u32, &AgentInfo, &AgentInfo)> = (0..units)
        .map(|r| {
            let from = &old[decide::agent_for_rank(r, units, current) as usize];
            (r, from, &new[decide::agent_for_rank(r, units, to) as usize])
        })
        .filter(|(_, from, to)| from.node != to.node)
        .collect();
    let mut moved_bytes = 0;
    if let Some(version) = latest {
        let waiters: Vec<_> = {
            let mut state = shared.state();
            moves
                .iter()
                .map(|(rank, from, to)| {
                    let from = (*from).clone();
                    let message =
                        |request| ControllerToManager::TakeOver { agent: to.id, rank: *rank, version, from, request };
                    ask_rank(&mut state, to, *rank, message)
                })
                .collect()
        };
        let RanksAwaited { moved: bytes, failures, .. } = await_ranks(shared, waiters).await;
        moved_bytes = bytes;
        if let Some((_, reason)) = failures.into_iter().last() {
            undo_agent_change(&shared.state().nodes, name, &started, &moves);
            return Err(reason);
        }
    }
    let secs = changing.elapsed().as_secs_f64();
    let mut state = shared.state();
    let state = &mut *state;
    let app = state.apps.get(name).ok_or("the application went away")?;
    // A node of the protected version lost meanwhile starts a rebuild that
    // places the version's agents from its record: moved ranks would leave
    // the nodes that record names. The change yields and is undone.
    let protection = &app.protection;
    if protection.rebuilding || protection.lost_since.keys().any(|node| !lost_before.contains(node)) {
        undo_agent_change(&state.nodes, name, &started, &moves);
        return Err("a node of the protected version was lost during the change; its rebuild places the agents".into());
    }
    let registration = app.registration.clone();
    journal(state, &Event::Placed { registration, agents: new.clone(), owner: Some(owner) })?;
    let app = state.apps.get_mut(name).ok_or("the application went away")?;
    app.agents = new.clone();
    app.homes = new.iter().map(|a| a.node.clone()).collect();
    let after_version = latest.unwrap_or(0);
    app.adaptation.changed_after = after_version;
    app.adaptation.reconfigure_secs = secs;
    app.adaptation.changes.push(AgentChange { after_version, from: current, to, secs, moved_bytes });
    let reprotect = app.protection.protected.is_some() && !moves.is_empty();
    let retired: Vec<AgentInfo> = old.iter().filter(|a| !new.iter().any(|n| n.id == a.id)).cloned().collect();
    tell_agents(&state.nodes, &retired, |id| ControllerToManager::StopAgent { id, discard: false });
    drop_moved_ranks(&state.nodes, name, moves.iter().map(|(rank, from, _)| (*rank, from.node.as_str())));
    tracing::info!(from = current, to, moved = moves.len(), moved_bytes, secs, "agents changed");
    if reprotect {
        // The protected version's record names the nodes the moved ranks
        // just left: a rebuild from it would read primaries that are gone.
        // Protected again on the new agents, the record is current, rather
        // than only once the application's next version is.
        start_protection(shared, state, name);
    }
    Ok(new)
}

/// Nodes for `missing` new agents of an application: none it reported
/// unreachable lately (`avoided`) while other nodes can take them. Agents
/// that leave nodes (`leaving`: a cut the job reported now, a draining
/// node) may fall back on a node reported earlier, whose path may have
/// come back, but never on one they leave; new agents of a bigger count
/// never go behind a reported cut.
fn nodes_for_new_agents(
    snapshot: &[decide::NodeSnapshot],
    missing: u32,
    config: &DynamicConfig,
    avoided: &BTreeSet<String>,
    leaving: &BTreeSet<String>,
) -> Result<Vec<String>, String> {
    let without = |excluded: &BTreeSet<String>| -> Vec<decide::NodeSnapshot> {
        snapshot.iter().filter(|n| !excluded.contains(&n.node)).cloned().collect()
    };
    let first = decide::choose_nodes(&without(avoided), missing, config);
    match first {
        Ok(nodes) => Ok(nodes),
        Err(_) if !leaving.is_empty() && avoided.iter().any(|n| !leaving.contains(n)) => {
            decide::choose_nodes(&without(leaving), missing, config)
                .map_err(|e| format!("{e} (other than {leaving:?}, which the agents leave)"))
        }
        Err(e) if avoided.is_empty() => Err(e.to_string()),
        Err(e) => Err(format!("{e} (other than {avoided:?}, which the job could not reach lately)")),
    }
}

/// Undoes an agent change that will not be carried out: its new agents
/// stop and the ranks moved to them leave their new nodes (the old agents
/// kept serving them all along).
pub(super) fn undo_agent_change(
    nodes: &ManagerBook,
    name: &str,
    started: &[AgentInfo],
    moves: &[(u32, &AgentInfo, &AgentInfo)],
) {
    tell_agents(nodes, started, |id| ControllerToManager::StopAgent { id, discard: false });
    drop_moved_ranks(nodes, name, moves.iter().map(|(rank, _, to)| (*rank, to.node.as_str())));
}

/// A rank an agent was asked to take over or rebuild: the request (agent,
/// rank, number) and where its answer arrives.
pub(super) type RankWaiter = (RankRequest, Answer<u64>);

/// Sends the message `message(request)` builds (a take-over or rebuild of
/// `rank`, carrying the new request number) to agent `to`'s manager and
/// returns where its answer arrives; a manager that cannot be reached
/// answers at once.
pub(super) fn ask_rank(
    state: &mut State,
    to: &AgentInfo,
    rank: u32,
    message: impl FnOnce(u64) -> ControllerToManager,
) -> RankWaiter {
    let (key, answer) = state.takeovers.ask(to.id, rank, &to.node);
    if !state.nodes.send(&to.node, message(key.request)) {
        state.takeovers.answer(&key, Err(format!("node {} is not connected (agent {}, rank {rank})", to.node, to.id)));
    }
    (key, answer)
}

/// What became of the ranks of one [`await_ranks`].
#[derive(Default)]
pub(super) struct RanksAwaited {
    /// Bytes moved by the ranks that succeeded.
    pub(super) moved: u64,
    /// Per rank that failed, why.
    pub(super) failures: Vec<(u32, String)>,
    /// Whether some agent never answered: its job may still be running.
    pub(super) unanswered: bool,
}

/// Waits for every rank of `waiters` (each at most `TAKE_OVER_TIMEOUT`).
pub(super) async fn await_ranks(shared: &Shared, waiters: Vec<RankWaiter>) -> RanksAwaited {
    let mut awaited = RanksAwaited::default();
    for (key, rx) in waiters {
        let RankRequest { agent, rank, .. } = key;
        match manager_answer(rx, TAKE_OVER_TIMEOUT).await {
            Some(Ok(bytes)) => awaited.moved += bytes,
            Some(Err(reason)) => awaited.failures.push((rank, reason)),
            None => {
                shared.state().takeovers.forget(&key);
                awaited.unanswered = true;
                let why = format!("agent {agent} did not answer for rank {rank} within {TAKE_OVER_TIMEOUT:?}");
                awaited.failures.push((rank, why));
            }
        }
    }
    awaited
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn new_agents_avoid_reported_nodes_and_never_return_to_the_one_they_leave() {
        let config = DynamicConfig::default();
        let snapshot: Vec<decide::NodeSnapshot> =
            ["n1", "n2", "n3"].iter().map(|n| decide::NodeSnapshot::idle(n, 1 << 34)).collect();
        // Nodes enough beside the reported ones: never a reported one.
        let placed = nodes_for_new_agents(&snapshot, 1, &config, &names(&["n1", "n2"]), &names(&["n2"])).unwrap();
        assert_eq!(placed, vec!["n3".to_string()]);
        // Only reported nodes: agents leaving n2 fall back on n1, reported
        // earlier, never on n2.
        let two = &snapshot[..2];
        let placed = nodes_for_new_agents(two, 1, &config, &names(&["n1", "n2"]), &names(&["n2"])).unwrap();
        assert_eq!(placed, vec!["n1".to_string()]);
        // New agents of a bigger count (leaving nothing) never go behind a
        // reported cut, and the error says why.
        let refused = nodes_for_new_agents(two, 1, &config, &names(&["n1", "n2"]), &names(&[])).unwrap_err();
        assert!(refused.contains("which the job could not reach lately"), "{refused}");
        // The only node is the one left: nowhere to go.
        let alone = &snapshot[1..2];
        let refused = nodes_for_new_agents(alone, 1, &config, &names(&["n2"]), &names(&["n2"])).unwrap_err();
        assert!(refused.contains("\"n2\""), "{refused}");
    }
}
