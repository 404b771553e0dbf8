//! The proactive scaler (thesis Algorithm 8) driven by the controller:
//! every `scaler_interval` seconds, with `is_dynamic_hs = true` and a
//! launcher that can add nodes (Slurm), it turns the node reports into
//! [`NodeLoad`]s and carries out what [`scaling::proactive`] decides.
//!
//! A node's memory here is its checkpoint memory: `max_mem_node` (never
//! more than the node has), of which the versions it holds are used; the
//! depletion rate is how fast what it holds grew since the last pass.
//!
//! Architecture invariant: one request at a time. After asking for a node
//! the scaler asks for nothing more until a new manager has registered (or
//! five minutes have passed), so a slow resource manager is never flooded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use icheck_core::scaling::{self, NodeLoad, ProactiveAction, ScalerState};

use super::{Shared, FORECAST_HORIZON_SECS};

/// How long a request may stay unanswered before the scaler may ask again.
const REQUEST_PATIENCE: Duration = Duration::from_secs(300);

/// Bytes held by each node at the previous pass, and when.
type Previous = HashMap<String, (u64, Instant)>;

/// The loads of the live nodes at `now`, from their reports and the
/// previous pass (for the depletion rate).
fn loads(
    reports: &[icheck_core::protocol::NodeReport],
    budget: u64,
    previous: &Previous,
    now: Instant,
) -> Vec<NodeLoad> {
    reports
        .iter()
        .filter(|n| n.alive)
        .map(|n| {
            let total = match n.status.mem_total {
                0 => budget,
                node => budget.min(node),
            };
            let held = n.status.bytes_held;
            let depletion_rate = previous.get(&n.node).and_then(|(before, at)| {
                let secs = now.duration_since(*at).as_secs_f64();
                (secs > 0.0).then(|| ((held as f64 - *before as f64) / secs).max(0.0))
            });
            NodeLoad {
                node: n.node.clone(),
                mem_total: total,
                mem_available: total.saturating_sub(held),
                depletion_rate,
                bandwidth: n.status.bandwidth,
                cops_per_min: n.status.cops_per_min,
                agents: n.status.agents,
            }
        })
        .collect()
}

/// Runs the proactive scaler for as long as the controller is primary.
pub(super) async fn run(shared: Arc<Shared>) {
    let Some(launcher) = shared.launcher.clone().filter(|l| l.can_scale()) else { return };
    let mut scaler = ScalerState::default();
    let mut previous = Previous::new();
    let mut asked: Option<(Instant, usize)> = None;
    loop {
        let dynamic = shared.dynamic();
        tokio::time::sleep(Duration::from_secs_f64(dynamic.scaler_interval)).await;
        if !dynamic.is_dynamic_hs || shared.may_act().is_err() {
            continue;
        }
        let now = Instant::now();
        let reports = shared.state().nodes.report(now, FORECAST_HORIZON_SECS);
        let alive = reports.iter().filter(|n| n.alive).count();
        let loads = loads(&reports, dynamic.max_mem_node_bytes(), &previous, now);
        previous = reports.iter().map(|n| (n.node.clone(), (n.status.bytes_held, now))).collect();
        if let Some((at, count)) = asked {
            if alive <= count && now.duration_since(at) < REQUEST_PATIENCE {
                continue;
            }
            asked = None;
        }
        if scaler.pending_query {
            let ask = launcher.clone();
            if let Ok(Some(idle)) = tokio::task::spawn_blocking(move || ask.idle_nodes()).await {
                scaler.idle_nodes = idle;
            }
        }
        match scaling::proactive(&loads, &dynamic.scaling_thresholds(), &mut scaler) {
            ProactiveAction::Nothing => {}
            ProactiveAction::Query { because } => {
                tracing::info!(%because, "scaler: asking the resource manager for idle nodes");
            }
            ProactiveAction::Request { priority, because }
                if dynamic.manager_count.is_some_and(|most| alive >= most as usize) =>
            {
                tracing::debug!(?priority, %because, alive, "scaler: at manager_count nodes already; asking for none");
            }
            ProactiveAction::Request { priority, because } => {
                let add = launcher.clone();
                match tokio::task::spawn_blocking(move || add.add_node()).await {
                    Ok(Ok(what)) => {
                        tracing::info!(?priority, %because, %what, "scaler: asked for another checkpoint node");
                        asked = Some((now, alive));
                    }
                    Ok(Err(why)) => {
                        tracing::warn!(?priority, %because, %why, "scaler: could not get another checkpoint node")
                    }
                    Err(err) => tracing::error!(%err, "scaler: the request for a node failed"),
                }
            }
        }
    }
}

/// The reactive scaler (Algorithm 9): every `scaler_interval`, nodes the
/// resource manager asks back are emptied and released, one at a time.
pub(super) async fn run_reactive(shared: Arc<Shared>) {
    let Some(launcher) = shared.launcher.clone().filter(|l| l.can_scale()) else { return };
    loop {
        tokio::time::sleep(Duration::from_secs_f64(shared.dynamic().scaler_interval)).await;
        if shared.may_act().is_err() {
            continue;
        }
        let ask = launcher.clone();
        let reclaimed = tokio::task::spawn_blocking(move || ask.reclaimed()).await.unwrap_or_default();
        for node in reclaimed {
            release_one(&shared, &launcher, &node).await;
        }
    }
}

/// Releases `node` unless a release of it runs already; logs the outcome.
async fn release_one(shared: &Arc<Shared>, launcher: &Arc<dyn crate::launcher::Launcher>, node: &str) {
    if !shared.releasing.lock().unwrap_or_else(|p| p.into_inner()).insert(node.to_string()) {
        return;
    }
    let started = Instant::now();
    match remove_node(shared, launcher, node).await {
        Ok((apps, released)) => tracing::info!(
            %node,
            apps,
            %released,
            secs = started.elapsed().as_secs_f64(),
            "released checkpoint node: its agents' versions moved to other nodes first"
        ),
        Err(why) => tracing::error!(%node, %why, "cannot release the checkpoint node yet; it stays drained"),
    }
    shared.releasing.lock().unwrap_or_else(|p| p.into_inner()).remove(node);
}

/// An operator's (or the resource manager's) request to give nodes back:
/// the named ones, or `count` picked by Algorithm 9's order
/// ([`scaling::removal_candidates`]); at least one live node stays. The
/// releases run in the background, one node after the other.
pub(super) fn release_nodes(
    shared: &Arc<Shared>,
    nodes: Vec<String>,
    count: u32,
) -> icheck_core::protocol::ClientReply {
    use icheck_core::protocol::ClientReply;
    let Some(launcher) = shared.launcher.clone().filter(|l| l.can_scale()) else {
        return ClientReply::Error(
            "releasing checkpoint nodes needs a resource manager that takes them back (icheck up --slurm)".into(),
        );
    };
    let now = Instant::now();
    let reports = shared.state().nodes.report(now, FORECAST_HORIZON_SECS);
    let alive: Vec<&str> = reports.iter().filter(|n| n.alive).map(|n| n.node.as_str()).collect();
    let chosen = if nodes.is_empty() {
        let loads = loads(&reports, shared.dynamic().max_mem_node_bytes(), &Previous::new(), now);
        scaling::removal_candidates(&loads, count as usize)
    } else {
        if let Some(unknown) = nodes.iter().find(|n| !alive.contains(&n.as_str())) {
            return ClientReply::Error(format!("{unknown} is not a live checkpoint node (live: {alive:?})"));
        }
        nodes
    };
    if chosen.is_empty() {
        return ClientReply::Error("no node to release: give node names or --count 1 or more".into());
    }
    if chosen.len() >= alive.len() {
        return ClientReply::Error(format!(
            "releasing {chosen:?} would leave no checkpoint node for the versions to move to (live: {alive:?})"
        ));
    }
    tracing::info!(nodes = ?chosen, "releasing checkpoint nodes on request");
    let (shared, releasing) = (shared.clone(), chosen.clone());
    tokio::spawn(async move {
        for node in releasing {
            release_one(&shared, &launcher, &node).await;
        }
    });
    ClientReply::Releasing(chosen)
}

/// Longest a release waits for a committing application's next probe.
const PROBE_WAIT: Duration = Duration::from_secs(120);
/// An application that completed a version this recently is taken to be
/// running (committing), not finished or killed.
const RUNNING_WITHIN: Duration = Duration::from_secs(60);

/// Why the agents of an application on a released node may move now.
enum Moment {
    /// Its own probe moved them (the node is draining).
    Moved,
    /// It finished (persisted) or has been quiet: no commit races the move.
    Idle,
}

/// A committing application's agents move at its next probe (the node is
/// draining, so the probe's plan replaces them), while the application
/// waits in the probe and commits nothing. Moving them behind its back
/// would race its commits: a version it completes on the old agents during
/// the move would be lost with the node. An application that finished
/// (persisted) or completed no version for a minute is moved at once.
async fn wait_until_idle_or_moved(shared: &Arc<Shared>, name: &str, node: &str) -> Result<Moment, String> {
    let started = Instant::now();
    loop {
        {
            let state = shared.state();
            let Some(app) = state.apps.get(name) else { return Ok(Moment::Moved) };
            if !app.agents.iter().any(|a| a.node == node) {
                return Ok(Moment::Moved);
            }
            let quiet_ms =
                app.latest.as_ref().map_or(u64::MAX, |l| super::unix_ms().saturating_sub(l.completed_unix_ms));
            if app.persisted || quiet_ms > RUNNING_WITHIN.as_millis() as u64 {
                return Ok(Moment::Idle);
            }
        }
        if started.elapsed() > PROBE_WAIT {
            return Err(format!(
                "{name} is committing and did not probe within {PROBE_WAIT:?}; its agents leave {node} at its next \
                 probe (icheck_probe_agents) or once it ends"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Algorithm 9's `node_removal` for one node: no new agents there; every
/// application's agents on it are replaced by agents on other nodes, which
/// take their ranks' newest version over the fabric (the agent-change
/// path, verified against the ranks' checksums) — a committing
/// application's at its next probe ([`wait_until_idle_or_moved`]); only
/// then is the manager stopped and the node given back. Returns the applications moved and
/// what the launcher did.
async fn remove_node(
    shared: &Arc<Shared>,
    launcher: &Arc<dyn crate::launcher::Launcher>,
    node: &str,
) -> Result<(usize, String), String> {
    // Journaled, as an operator's drain is: a controller that restarts
    // mid-release still places nothing there.
    if let icheck_core::protocol::ClientReply::Error(why) = super::drain_node(shared, node, true) {
        return Err(why);
    }
    let apps: Vec<(String, u32, Vec<usize>)> = shared
        .state()
        .apps
        .iter()
        .filter_map(|(name, app)| {
            let slots: Vec<usize> =
                app.agents.iter().enumerate().filter(|(_, a)| a.node == node).map(|(i, _)| i).collect();
            (!slots.is_empty()).then(|| (name.clone(), app.agents.len() as u32, slots))
        })
        .collect();
    let config = shared.dynamic();
    for (name, agents, slots) in &apps {
        match wait_until_idle_or_moved(shared, name, node).await? {
            Moment::Moved => {}
            Moment::Idle => {
                super::change_agents(shared, name, *agents, slots, &config)
                    .await
                    .map_err(|why| format!("moving {name}'s agents off {node}: {why}"))?;
            }
        }
    }
    let (release, name) = (launcher.clone(), node.to_string());
    let released =
        tokio::task::spawn_blocking(move || release.release(&name)).await.map_err(|err| err.to_string())??;
    Ok((apps.len(), released))
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::protocol::{NodeReport, NodeStatus};

    fn report(node: &str, held: u64, alive: bool) -> NodeReport {
        NodeReport {
            node: node.into(),
            pid: 1,
            alive,
            last_heartbeat_secs: 0.0,
            status: NodeStatus { mem_total: 64 << 30, bytes_held: held, agents: 2, ..NodeStatus::default() },
            trend: Default::default(),
            draining: false,
            relaunches: 0,
            given_up: false,
            start_failure: None,
        }
    }

    #[test]
    fn checkpoint_memory_is_the_budget_and_depletion_the_growth_of_what_is_held() {
        let start = Instant::now();
        let later = start + Duration::from_secs(2);
        let budget = 100 << 20;
        let first = loads(&[report("a", 10 << 20, true), report("b", 0, false)], budget, &Previous::new(), start);
        assert_eq!(first.len(), 1, "only live nodes");
        assert_eq!((first[0].mem_total, first[0].mem_available), (budget, 90 << 20));
        assert_eq!(first[0].depletion_rate, None, "no rate from one sample");
        let previous: Previous = [("a".to_string(), (10 << 20, start))].into();
        let second = loads(&[report("a", 30 << 20, true)], budget, &previous, later);
        assert_eq!(second[0].depletion_rate, Some(10.0 * (1 << 20) as f64), "20 MiB in 2 s");
        let shrinking = loads(&[report("a", 0, true)], budget, &previous, later);
        assert_eq!(shrinking[0].depletion_rate, Some(0.0), "freed memory is no depletion");
        // A budget above the node's memory is cut to it.
        let huge = loads(&[report("a", 0, true)], u64::MAX, &Previous::new(), start);
        assert_eq!(huge[0].mem_total, 64 << 30);
    }
}
