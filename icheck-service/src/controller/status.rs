//! What `icheck status` and the status API report: the nodes, the
//! applications and the controller itself.
//!
//! Architecture invariant: a client (not an operator) sees only the
//! controller's own part, never other applications or the nodes.

use super::*;

/// The status; a client (not an operator) sees only the controller's own
/// part, never other applications or the nodes.
pub(super) fn status_report(shared: &Shared, privilege: Privilege) -> StatusReport {
    let state = shared.state();
    let now = Instant::now();
    if privilege == Privilege::Client {
        return StatusReport {
            nodes: Vec::new(),
            apps: Vec::new(),
            init_agent_count: String::new(),
            journal: None,
            controller: Some(Box::new(controller_report(shared, &state, now))),
        };
    }
    StatusReport {
        nodes: state.nodes.report(now, FORECAST_HORIZON_SECS),
        apps: {
            let node_failure = shared.dynamic().node_failure_probability;
            state.apps.iter().map(|(name, a)| app_report(name, a, &state.nodes, node_failure, now)).collect()
        },
        init_agent_count: format!("{:?}", shared.dynamic().init_agent_count),
        journal: state.journal.as_ref().map(|j| Box::new(j.report())),
        controller: Some(Box::new(controller_report(shared, &state, now))),
    }
}

/// One application, as the status shows it: a newest version lost with a
/// given-up node is listed with the dropped ones, since its restart will
/// not find it.
pub(super) fn app_report(name: &str, a: &AppEntry, nodes: &ManagerBook, node_failure: f64, now: Instant) -> AppReport {
    let units = decide::mapping_units(&a.registration);
    let latest = a.latest.as_ref().map(|l| l.version);
    let mut dropped = a.dropped.clone();
    dropped.extend(ranks_lost_with_given_up_nodes(name, a, nodes).map(|(_, why)| why));
    AppReport {
        redundancy: a.protection.policy,
        protected: a.protection.protected.as_ref().map(|p| p.version()),
        protecting: a.protection.protecting(),
        protection_waiting: a.protection.waiting(),
        rebuilding: a.protection.rebuilding || a.protection.rebuild_due,
        protection_problem: a.protection.problem.clone(),
        protection_secs: a.protection.history.iter().copied().collect(),
        exposure: a.protection.exposure(latest, units, &a.agents, node_failure),
        registration: a.registration.clone(),
        agents: a.agents.clone(),
        latest: a.latest.clone(),
        persisted: a.persisted,
        pfs_version: a.copies.copied,
        pfs_copy: a.copies.last,
        commits: a.adaptation.commits.iter().copied().collect(),
        agent_changes: a.adaptation.changes.clone(),
        scaling_settled: a.adaptation.scaling.settled,
        pfs_health: a.copies.health.clone(),
        dropped,
        transfer: a.transfer,
        unreached_nodes: a.avoided_since(now).into_iter().map(|(node, since)| (node, since.as_secs_f64())).collect(),
    }
}

/// This controller, its epoch, lease and standby, for the status.
pub(super) fn controller_report(shared: &Shared, state: &State, now: Instant) -> protocol::ControllerReport {
    let replayed = state.journal.as_ref().map(|j| j.state());
    let lease = state.lease.may_act(now);
    protocol::ControllerReport {
        address: shared.me.clone(),
        epoch: state.epoch,
        controllers: shared.controllers.clone(),
        lease: lease.is_ok(),
        lease_reason: match (lease, shared.controllers.len()) {
            (Ok(()), 1) => "no standby configured".into(),
            (Ok(()), _) if state.lease.attached().is_some() => "the standby acknowledges its heartbeats".into(),
            (Ok(()), _) => "the other controllers cannot take over (not running, or without the journal)".into(),
            (Err(why), _) => why,
        },
        standby: state.lease.attached().map(|peer| protocol::StandbyReport {
            peer: peer.to_string(),
            lag_events: state.lease.lag(),
            last_ack_secs: state.lease.last_ack_secs(now),
        }),
        took_over_unix_ms: replayed.and_then(|r| r.took_over_unix_ms),
        takeovers: replayed.map_or(0, |r| r.takeovers),
    }
}
