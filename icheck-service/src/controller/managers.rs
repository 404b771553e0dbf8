//! The controller's side of its managers: a manager's connection
//! (`serve_manager`: registration with its store, heartbeats, status,
//! answers to agent starts and take-overs), liveness (`watch_liveness`:
//! silent managers are marked down, and killed through the launcher after
//! `KillSilentManagerAfter`), and relaunching managers that died.
//!
//! Architecture invariant: a manager is marked down only by missed
//! heartbeats or a closed connection, never because the controller itself
//! did not run (a controller woken late pardons every manager first).

use super::*;

/// Marks managers that stop sending heartbeats down (once per outage), and
/// has those silent past `KillSilentManagerAfter` killed to start again.
pub(super) async fn watch_liveness(shared: Arc<Shared>) {
    let mut last_tick = Instant::now();
    loop {
        tokio::time::sleep(shared.heartbeat).await;
        let now = Instant::now();
        let mut state = shared.state();
        reconcile_pending(&mut state, now);
        let due: Vec<String> = state
            .apps
            .iter_mut()
            .filter_map(|(name, app)| {
                let due = std::mem::take(&mut app.protection.rebuild_due);
                (std::mem::take(&mut app.protection.recheck_due) || due).then(|| name.clone())
            })
            .collect();
        rebuild::spawn(&shared, due);
        // Woken far too late: the controller was stopped or starved, and
        // the silence it saw is its own.
        if now - last_tick > shared.heartbeat * 2 {
            tracing::warn!(
                paused = ?(now - last_tick),
                "the controller did not run for a while; managers get a fresh heartbeat window"
            );
            state.nodes.pardon(now);
        }
        last_tick = now;
        for node in state.nodes.newly_down(now) {
            // §6.5.2: a silent manager (hung, stopped, cut off) may keep its
            // connection open; its agents are given up all the same.
            tracing::warn!(%node, "manager missed {} heartbeats; marked down", shared.missed);
            let rebuilds = node_lost(&mut state, &node, "its node went silent");
            rebuild::spawn(&shared, rebuilds);
        }
        if let (Some(after), Some(launcher)) = (shared.kill_silent_after, &shared.launcher) {
            for (node, pid) in state.nodes.silent_for_too_long(now, after) {
                tokio::spawn(kill_silent_manager(launcher.clone(), node, pid, after));
            }
        }
    }
}

/// A manager silent for `after` while its process lives (stopped, hung
/// outside the fabric calls its own watchdog covers) would stay down for
/// good, and the versions in its memory with it: it is killed through the
/// launcher. Its connection then closes, and the controller starts it
/// again like any dead manager; it comes back with its store.
pub(super) async fn kill_silent_manager(launcher: Arc<dyn Launcher>, node: String, pid: u32, after: Duration) {
    let name = node.clone();
    match tokio::task::spawn_blocking(move || launcher.kill_silent(&name, pid)).await {
        Ok(Ok(done)) => tracing::warn!(
            %node,
            pid,
            silent = ?after,
            %done,
            "the manager stayed silent while alive (KillSilentManagerAfter): killed, so that it is started again with its store"
        ),
        Ok(Err(reason)) => tracing::error!(%node, pid, %reason, "cannot kill the silent manager; its node stays down"),
        Err(err) => tracing::error!(%node, pid, %err, "cannot kill the silent manager; its node stays down"),
    }
}

pub(super) async fn serve_manager(shared: Arc<Shared>, stream: TcpStream) -> Result<(), ProtocolError> {
    let (mut reader, mut writer) = stream.into_split();
    let (node, pid, status, running, stored, pieces) = match framing::recv_timeout(&mut reader, HELLO_TIMEOUT).await? {
        ManagerToController::Register { node, pid, status, agents, stored, pieces } => {
            (node, pid, status, agents, stored, pieces)
        }
        other => {
            let reason = format!("expected Register, got {other:?}");
            framing::send(&mut writer, &ControllerToManager::Rejected(reason.clone())).await?;
            return Err(ProtocolError::Unexpected { peer: "manager".into(), what: reason });
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let admitted = {
        let mut state = shared.state();
        let admitted = state.nodes.register(&node, pid, status, tx, Instant::now(), shared.clock());
        if admitted.is_ok() {
            // Queued behind the Registered sent below: the writer task starts after it.
            adopt_agents(&mut state, &node, &running);
            let drained = state.journal.as_ref().is_some_and(|j| j.state().drained.contains(&node));
            if drained {
                let _ = state.nodes.set_draining(&node, true);
            }
            let versions = stored.len();
            if running.is_empty() {
                // A new manager process (restarted, relaunched): no agent of
                // it can be sealing a version while its store was listed.
                check_returning_node(&mut state, &node, &stored);
            }
            state.holdings.insert(node.clone(), stored);
            state.piece_holdings.insert(node.clone(), pieces);
            if running.is_empty() {
                drop_stale_pieces_on(&mut state, &node);
            }
            recheck_homed_on(&mut state, &node);
            tracing::info!(%node, pid, agents = running.len(), versions, "manager registered");
            reconcile_pending(&mut state, Instant::now());
            drop_obsolete_files(&mut state);
        }
        admitted
    };
    let connection = match admitted {
        Ok(connection) => connection,
        Err(reason) => {
            framing::send(&mut writer, &ControllerToManager::Rejected(reason.clone())).await?;
            return Err(ProtocolError::Refused { peer: node, reason });
        }
    };
    framing::send(&mut writer, &ControllerToManager::Registered).await?;
    let writer_task = tokio::spawn(async move {
        while let Some(message) = rx.recv().await {
            if framing::send(&mut writer, &message).await.is_err() {
                break;
            }
        }
    });
    let result = loop {
        let message: ManagerToController = match framing::recv(&mut reader).await {
            Ok(message) => message,
            Err(err) => break Err(err),
        };
        let mut state = shared.state();
        match message {
            ManagerToController::Heartbeat => {
                // Answered only while this primary may act: a manager that
                // hears nothing looks for the primary elsewhere.
                if state.lease.answers_managers(Instant::now()) {
                    state.nodes.send(&node, ControllerToManager::Beat);
                }
                if state.nodes.heartbeat(&node, connection, Instant::now()) {
                    tracing::info!(%node, "manager is back after missing its heartbeats");
                    node_back(&mut state, &node);
                }
            }
            ManagerToController::Status(status) => {
                state.nodes.status(&node, connection, status, Instant::now(), shared.clock());
                stop_stale_agents(
                    &mut state,
                    &node,
                    STALE_AGENT_GRACE,
                    "no application lists (left over by a placement or a replacement)",
                );
            }
            ManagerToController::AgentReady(info) => {
                let id = info.id;
                if state.pending.answer(&id, Ok(info)) {
                    state.nodes.start_answered(&node, true);
                } else {
                    // Its placement gave up on it (the start's bound ran
                    // out, or the node was taken for lost) and lists it
                    // nowhere: left running, it would hold its memory
                    // unseen.
                    tracing::info!(%node, agent = id, "stopping an agent that started after its placement gave up on it");
                    state.nodes.note_stopping(&node, id);
                    state.nodes.send(&node, ControllerToManager::StopAgent { id, discard: false });
                }
            }
            ManagerToController::AgentFailed { id, reason } => {
                if state.pending.answer(&id, Err(format!("node {node}: {reason}"))) {
                    state.nodes.start_answered(&node, false);
                }
            }
            ManagerToController::AgentLost { id } => {
                tracing::warn!(%node, agent = id, "agent thread died");
                let config = shared.dynamic();
                let mut protected_apps = Vec::new();
                for (name, app) in state.apps.iter_mut() {
                    let before = app.agents.len();
                    app.agents.retain(|a| a.id != id);
                    if app.agents.len() < before && !config.redundancy_for(&app.registration).is_none() {
                        protected_apps.push(name.clone());
                    }
                }
                // Their versions stay protected only with an agent where
                // the files are: one starts again there (`rebuild`).
                drop(state);
                rebuild::spawn(&shared, protected_apps);
            }
            ManagerToController::Register { .. } => {
                tracing::warn!(%node, "manager registered twice on one connection; ignored");
            }
            ManagerToController::TookOver { agent, rank, request, result } => {
                let key = RankRequest { agent, rank, request };
                if !state.takeovers.answer(&key, result.map_err(|reason| format!("node {node}: {reason}"))) {
                    // Asked again since, or given up on: its answer is not
                    // the newer request's.
                    tracing::debug!(%node, agent, rank, request, "an answer for a rank no request awaits; ignored");
                }
            }
            ManagerToController::PfsCopied { agent, version, result, superseded } => {
                drop(state);
                pfs_copied(&shared, agent, version, result, superseded);
            }
            ManagerToController::Protected { agent, version, attempt, piece, result } => {
                if let Err(reason) = &result {
                    // A protection no longer under way (a newer version or a
                    // new attempt at this one took its place, and its pieces
                    // were dropped under the builder) costs nothing: not
                    // worth a warning.
                    let wanted = state.apps.values().any(|a| a.protection.awaits(version, attempt));
                    if wanted {
                        tracing::warn!(%node, agent, version, %piece, %reason, "a piece of redundancy could not be built");
                    } else {
                        tracing::debug!(%node, agent, version, attempt, %piece, %reason, "a superseded protection's piece was not built");
                    }
                }
                let state = &mut *state;
                let mut protected = None;
                let mut due = Vec::new();
                for (name, app) in state.apps.iter_mut() {
                    let done = app.protection.piece_done(agent, version, attempt, piece, result.clone());
                    // The protection ended (built or failed): the newest
                    // version that waited for it is protected next.
                    if let Some(next) = app.protection.next_due() {
                        tracing::debug!(app = %name, ended = version, next, "protecting the version that waited");
                        due.push(name.clone());
                    }
                    if done.is_some() {
                        protected = Some(name.clone());
                        break;
                    }
                }
                if let Some(name) = protected {
                    version_protected(state, &name);
                }
                for name in due {
                    start_protection(&shared, state, &name);
                }
            }
        }
    };
    writer_task.abort();
    // Logged before the node's state changes, so whoever sees the node down
    // in the status also finds the reason in the log.
    tracing::warn!(%node, "manager connection closed; marked down, its agents are gone");
    let mut state = shared.state();
    if state.nodes.disconnected(&node, connection) {
        let rebuilds = node_lost(&mut state, &node, "its manager's connection closed");
        let may_return = state.nodes.relaunch_possible(&node, Instant::now(), shared.relaunch_limit, RELAUNCH_WINDOW);
        if shared.launcher.is_some() && may_return {
            // Marked before the rebuild looks: it waits for this node to
            // come back (`rebuild::await_free_nodes`) rather than double up
            // on a survivor. A node that will not be started again
            // (relaunches used up, or none allowed) is not waited for.
            state.nodes.set_relaunching(&node, true);
        }
        drop(state);
        tokio::spawn(relaunch_when_dead(shared.clone(), node, pid));
        rebuild::spawn(&shared, rebuilds);
    }
    result
}

/// §6.5.2: a manager whose connection closed is started again through the
/// launcher once its process is dead (a live one, even stopped or hung,
/// reconnects by itself or stays down; it is never started twice). Gives
/// the node up after `ManagerRelaunches` relaunches in ten minutes. The
/// caller marks the node relaunching (under the lock that marks it down);
/// this clears the mark when it is done.
pub(super) async fn relaunch_when_dead(shared: Arc<Shared>, node: String, pid: u32) {
    let Some(launcher) = shared.launcher.clone() else { return };
    relaunch_until_registered(&shared, launcher, &node, pid).await;
    shared.state().nodes.set_relaunching(&node, false);
}

/// Waits (at most `timeout`) until `node` is alive; whether it is.
pub(super) async fn registers_within(shared: &Shared, node: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if shared.state().nodes.is_alive(node, Instant::now()) {
            return true;
        }
    }
    false
}

/// [`relaunch_when_dead`]'s loop: returns once the node is back, its
/// process turns out alive (after waiting, bounded, for it to register:
/// it may be a manager started by someone else), or the node is given up.
pub(super) async fn relaunch_until_registered(shared: &Shared, launcher: Arc<dyn Launcher>, node: &str, mut pid: u32) {
    let node = node.to_string();
    loop {
        tokio::time::sleep(shared.heartbeat).await;
        if shared.state().nodes.is_alive(&node, Instant::now()) {
            return;
        }
        let (check, name) = (launcher.clone(), node.clone());
        let dead = tokio::task::spawn_blocking(move || {
            icheck_core::failpoint::hit("controller.before_relaunch_check");
            check.is_dead(&name, pid)
        })
        .await
        .unwrap_or(false);
        if !dead {
            // Alive: the same process (stopped or hung, never started
            // twice), or a manager someone else started meanwhile (an
            // operator's `icheck up`), which has yet to register. The node
            // stays "being started again" while that one may still
            // register: cleared at once, a rebuild waiting for the node
            // counted its memory lost and fell back a version that the
            // new manager then brought back (the fault campaign found it).
            registers_within(shared, &node, RELAUNCH_REGISTER_TIMEOUT).await;
            return;
        }
        let (ask, name) = (launcher.clone(), node.clone());
        if tokio::task::spawn_blocking(move || ask.released(&name)).await.unwrap_or(false) {
            tracing::info!(%node, "the node was given back to the resource manager; its manager stays down");
            return;
        }
        if shared.state().nodes.is_given_up(&node) {
            tracing::info!(%node, "the node was given up (replaced); its manager is not started again");
            return;
        }
        let allowed =
            shared.state().nodes.relaunch_allowed(&node, Instant::now(), shared.relaunch_limit, RELAUNCH_WINDOW);
        if !allowed {
            match shared.relaunch_limit {
                // Not a crash loop: the operator asked for no relaunches.
                0 => tracing::warn!(
                    %node,
                    "manager died; ManagerRelaunches is 0, so it stays down until an operator starts it"
                ),
                limit => tracing::error!(
                    %node,
                    "manager died {limit} times within {RELAUNCH_WINDOW:?}; the node is given up until an operator starts it"
                ),
            }
            return;
        }
        let (start, name) = (launcher.clone(), node.clone());
        match tokio::task::spawn_blocking(move || start.relaunch(&name)).await {
            Ok(Ok(started)) => {
                tracing::warn!(%node, dead = pid, pid = started, "manager was dead; started it again");
                pid = started;
                if registers_within(shared, &node, RELAUNCH_REGISTER_TIMEOUT).await {
                    return;
                }
            }
            Ok(Err(reason)) => tracing::error!(%node, %reason, "cannot start the manager again"),
            Err(err) => tracing::error!(%node, %err, "cannot start the manager again"),
        }
    }
}
