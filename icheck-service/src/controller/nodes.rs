//! The controller's book of checkpoint nodes, as a state machine that does
//! no I/O: managers register, report and beat; agent starts are counted
//! from the moment they are sent until the manager reports them; liveness
//! is judged against the time the caller passes in.
//!
//! Architecture invariant: nothing here reads a clock, sleeps or touches a
//! socket. Time comes in as arguments (`now`, and `clock`, the seconds the
//! derived metrics are sampled at), and messages go out through
//! [`ManagerLink`], which the controller implements with its per-connection
//! channel and the tests with a recorder. That is what lets the tests below
//! replay races (a status report overtaking an agent start, a silent
//! manager) deterministically on simulated time.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use icheck_core::decide::{self, NodeSnapshot};
use icheck_core::monitor::NodeTrend;
#[cfg(test)]
use icheck_core::monitor::TrendReport;
use icheck_core::protocol::{ControllerToManager, NodeReport, NodeStatus};

/// What an agent is started for: its application, the node's memory
/// budget, the application's owner (whose capability its sessions must
/// present) and its newest complete version.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StartSpec<'a> {
    pub(crate) app: &'a str,
    pub(crate) mem_budget: u64,
    pub(crate) owner: icheck_core::credentials::Owner,
    pub(crate) complete: Option<u64>,
    pub(crate) encrypted: bool,
    /// The newest protected version (see `ControllerToManager::StartAgent`).
    pub(crate) protected: Option<u64>,
}

/// Where the controller's messages to one manager go.
pub(crate) trait ManagerLink {
    /// Queues `message` for the manager; false when the connection is gone.
    fn send(&self, message: ControllerToManager) -> bool;
    /// Whether the connection can still carry messages.
    fn is_open(&self) -> bool;
}

impl ManagerLink for tokio::sync::mpsc::UnboundedSender<ControllerToManager> {
    fn send(&self, message: ControllerToManager) -> bool {
        tokio::sync::mpsc::UnboundedSender::send(self, message).is_ok()
    }

    fn is_open(&self) -> bool {
        !self.is_closed()
    }
}

/// One checkpoint node as the controller knows it.
pub(crate) struct NodeEntry<L> {
    /// The manager's process id (reported at registration).
    pub(crate) pid: u32,
    /// False once the manager's connection closed (it may come back).
    connected: bool,
    last_heartbeat: Instant,
    reported_down: bool,
    /// The manager's last report. Its agent count lags behind starts the
    /// controller has asked for; placement adds [`NodeEntry::starting`].
    pub(crate) status: NodeStatus,
    /// Agent starts sent to this manager and not yet answered. Kept apart
    /// from `status.agents`, which each status report replaces.
    starting: u32,
    /// Memory and agent-count history for the derived metrics.
    trend: NodeTrend,
    /// An operator is draining it: no new agents; its agents move away on
    /// their applications' probes.
    pub(crate) draining: bool,
    /// Which registration of the node this entry is: messages from an older
    /// connection of the same node are ignored.
    connection: u64,
    /// When the controller started its manager again (the last ten minutes' worth).
    relaunched: Vec<Instant>,
    /// Relaunched too often: the controller no longer starts it.
    given_up: bool,
    /// Its manager died and the controller is starting it again: the
    /// node's store (and the versions in it) is expected back.
    relaunching: bool,
    /// The controller asked the launcher to kill this manager, silent too
    /// long while its connection stayed open (once per silence).
    kill_asked: bool,
    /// Stale agents the controller asked this manager to stop (each once).
    stopping: std::collections::BTreeSet<u64>,
    /// Agents the manager reports running that no application claimed at
    /// the last report, and since when ([`NodeBook::stale_agents`]).
    unclaimed_since: BTreeMap<u64, Instant>,
    /// Its manager failed to start an agent: why, and until when no
    /// agents are placed there.
    start_failure: Option<(String, Instant)>,
    link: L,
}

/// How long a node whose manager failed to start an agent takes no new
/// agents (a registration that waited for it failed after the start
/// timeout; the next ones go elsewhere).
pub(crate) const START_QUARANTINE: Duration = Duration::from_secs(60);

/// The nodes, by name.
pub(crate) struct NodeBook<L> {
    nodes: BTreeMap<String, NodeEntry<L>>,
    next_connection: u64,
    /// Expected heartbeat period.
    heartbeat: Duration,
    /// Heartbeats a node may miss before it counts as down.
    missed: u32,
}

impl<L: ManagerLink> NodeBook<L> {
    /// An empty book judging liveness by `heartbeat` and `missed`.
    pub(crate) fn new(heartbeat: Duration, missed: u32) -> NodeBook<L> {
        NodeBook { nodes: BTreeMap::new(), next_connection: 0, heartbeat, missed }
    }

    /// A manager registers `node`. Refused while a live manager with an open
    /// connection holds the name; otherwise the node (new, or back after an
    /// outage, keeping its drain) gets a fresh connection number, returned.
    pub(crate) fn register(
        &mut self,
        node: &str,
        pid: u32,
        status: NodeStatus,
        link: L,
        now: Instant,
        clock: f64,
    ) -> Result<u64, String> {
        if let Some(existing) = self.nodes.get(node) {
            if self.entry_alive(existing, now) && existing.link.is_open() {
                return Err(format!(
                    "node name {node:?} is already registered by a live manager (pid {})",
                    existing.pid
                ));
            }
        }
        self.next_connection += 1;
        let connection = self.next_connection;
        let mut trend = NodeTrend::default();
        trend.sample_with_total(clock, status.mem_available, Some(status.mem_total), status.agents);
        let draining = self.nodes.get(node).is_some_and(|n| n.draining);
        let relaunched = self.nodes.get(node).map(|n| n.relaunched.clone()).unwrap_or_default();
        let entry = NodeEntry {
            relaunched,
            given_up: false,
            relaunching: false,
            kill_asked: false,
            stopping: Default::default(),
            unclaimed_since: BTreeMap::new(),
            start_failure: None,
            pid,
            connected: true,
            last_heartbeat: now,
            reported_down: false,
            status,
            starting: 0,
            trend,
            draining,
            connection,
            link,
        };
        self.nodes.insert(node.to_string(), entry);
        Ok(connection)
    }

    /// The entry of `node` while `connection` is its current registration.
    fn current(&mut self, node: &str, connection: u64) -> Option<&mut NodeEntry<L>> {
        self.nodes.get_mut(node).filter(|entry| entry.connection == connection)
    }

    /// A heartbeat of `node` on `connection`. True when the node had been
    /// reported down and is back.
    pub(crate) fn heartbeat(&mut self, node: &str, connection: u64, now: Instant) -> bool {
        let Some(entry) = self.current(node, connection) else { return false };
        entry.last_heartbeat = now;
        // Answering again ends the silence: a later one may be killed again.
        entry.kill_asked = false;
        std::mem::take(&mut entry.reported_down)
    }

    /// A status report of `node` on `connection`: it replaces the last one
    /// (agent starts still unanswered keep counting apart) and is a
    /// heartbeat too.
    pub(crate) fn status(&mut self, node: &str, connection: u64, status: NodeStatus, now: Instant, clock: f64) {
        if let Some(entry) = self.current(node, connection) {
            entry.trend.sample_with_total(clock, status.mem_available, Some(status.mem_total), status.agents);
            entry.status = status;
            entry.last_heartbeat = now;
        }
    }

    /// The connection of `node` closed. True when it was the current one
    /// (the node is down, its agents gone); false for a stale connection of
    /// a node that has registered again since.
    pub(crate) fn disconnected(&mut self, node: &str, connection: u64) -> bool {
        let Some(entry) = self.current(node, connection) else { return false };
        entry.connected = false;
        // The liveness check need not report this outage a second time.
        entry.reported_down = true;
        true
    }

    /// Nodes that stopped being alive since the last call (each reported
    /// once per outage).
    pub(crate) fn newly_down(&mut self, now: Instant) -> Vec<String> {
        let (heartbeat, missed) = (self.heartbeat, self.missed);
        let mut down = Vec::new();
        for (name, entry) in &mut self.nodes {
            if !entry.reported_down && !alive(entry, now, heartbeat, missed) {
                entry.reported_down = true;
                down.push(name.clone());
            }
        }
        down
    }

    /// Managers silent for `after` or more while their connection stays
    /// open (stopped, hung in a way their own watchdog does not catch, or
    /// cut off), each returned once per silence with the pid it registered
    /// with: the controller has them killed, so that they are started
    /// again like dead ones. A node given up is left alone.
    pub(crate) fn silent_for_too_long(&mut self, now: Instant, after: Duration) -> Vec<(String, u32)> {
        let mut silent = Vec::new();
        for (name, entry) in &mut self.nodes {
            let quiet = now.saturating_duration_since(entry.last_heartbeat);
            if entry.connected && !entry.given_up && !entry.kill_asked && quiet >= after {
                entry.kill_asked = true;
                silent.push((name.clone(), entry.pid));
            }
        }
        silent
    }

    /// The controller itself did not run for a while (stopped, starved):
    /// the heartbeats it missed say nothing about the managers, so every
    /// connected node gets a fresh window from `now` to show it is alive.
    pub(crate) fn pardon(&mut self, now: Instant) {
        for entry in self.nodes.values_mut().filter(|entry| entry.connected) {
            entry.last_heartbeat = entry.last_heartbeat.max(now);
        }
    }

    fn entry_alive(&self, entry: &NodeEntry<L>, now: Instant) -> bool {
        alive(entry, now, self.heartbeat, self.missed)
    }

    /// Whether `node` missed a heartbeat (silent for over 1.25 intervals)
    /// but is not reported down yet: it may answer again, or be marked
    /// down within [`NodeBook::down_after`].
    pub(crate) fn in_doubt(&self, node: &str, now: Instant) -> bool {
        self.nodes.get(node).is_some_and(|entry| {
            entry.connected
                && !entry.reported_down
                && now.saturating_duration_since(entry.last_heartbeat) > self.heartbeat * 5 / 4
        })
    }

    /// How long a silent node is still counted alive.
    pub(crate) fn down_after(&self) -> Duration {
        self.heartbeat * self.missed
    }

    /// How long `node`'s manager has been silent at `now` (since its last
    /// heartbeat); `None` for an unknown node.
    pub(crate) fn silent_for(&self, node: &str, now: Instant) -> Option<Duration> {
        self.nodes.get(node).map(|entry| now.saturating_duration_since(entry.last_heartbeat))
    }

    /// Whether `node` is known and alive at `now`.
    pub(crate) fn is_alive(&self, node: &str, now: Instant) -> bool {
        self.nodes.get(node).is_some_and(|entry| self.entry_alive(entry, now))
    }

    /// The agents `node`'s manager runs, by its last status report.
    pub(crate) fn running_agents(&self, node: &str) -> Vec<u64> {
        self.nodes.get(node).map(|n| n.status.agent_bandwidth.iter().map(|(id, _)| *id).collect()).unwrap_or_default()
    }

    /// The manager of `node` is dead and may be started again at `now`
    /// unless it was already started `limit` times within `window`; then
    /// the node is given up (until a manager registers it again). True
    /// (and the attempt counted) when a relaunch may go ahead.
    pub(crate) fn relaunch_allowed(&mut self, node: &str, now: Instant, limit: u32, window: Duration) -> bool {
        let possible = self.relaunch_possible(node, now, limit, window);
        let Some(entry) = self.nodes.get_mut(node) else { return false };
        entry.relaunched.retain(|at| now.saturating_duration_since(*at) < window);
        if !possible {
            entry.given_up = true;
            return false;
        }
        entry.relaunched.push(now);
        true
    }

    /// Whether [`relaunch_allowed`](Self::relaunch_allowed) could let
    /// `node`'s manager start again at `now`, without counting an attempt:
    /// a rebuild waits for a node coming back only when one can.
    pub(crate) fn relaunch_possible(&self, node: &str, now: Instant, limit: u32, window: Duration) -> bool {
        self.nodes.get(node).is_some_and(|entry| {
            let recent = entry.relaunched.iter().filter(|at| now.saturating_duration_since(**at) < window).count();
            !entry.given_up && recent < limit as usize
        })
    }

    /// Gives `node` up now (a resource manager's node replaces it): its
    /// manager is not started again until one registers it.
    pub(crate) fn give_up(&mut self, node: &str) {
        if let Some(entry) = self.nodes.get_mut(node) {
            entry.given_up = true;
        }
    }

    /// Whether `node` was given up.
    pub(crate) fn is_given_up(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|entry| entry.given_up)
    }

    /// The agents `node`'s last report lists that `claimed` has not
    /// accounted for (no application lists them, no placement is starting
    /// them) in any report for at least `grace`: each is returned once, for
    /// the caller to stop. The grace keeps a report measured just before a
    /// stop the controller sent from asking for a second one; `ZERO` stops
    /// at once what is unclaimed now. Forgets the agents the report no
    /// longer lists (agent ids are never reused).
    pub(crate) fn stale_agents(
        &mut self,
        node: &str,
        now: Instant,
        grace: Duration,
        claimed: impl Fn(u64) -> bool,
    ) -> Vec<u64> {
        let Some(entry) = self.nodes.get_mut(node) else { return Vec::new() };
        let running: Vec<u64> = entry.status.agent_bandwidth.iter().map(|(id, _)| *id).collect();
        entry.unclaimed_since.retain(|id, _| running.contains(id));
        entry.stopping.retain(|id| running.contains(id));
        let mut stale = Vec::new();
        for id in running {
            if claimed(id) {
                entry.unclaimed_since.remove(&id);
                continue;
            }
            let since = *entry.unclaimed_since.entry(id).or_insert(now);
            if now.saturating_duration_since(since) >= grace && entry.stopping.insert(id) {
                stale.push(id);
            }
        }
        stale
    }

    /// Records that agent `id` on `node` is being stopped, so that
    /// [`stale_agents`](Self::stale_agents) does not ask again.
    pub(crate) fn note_stopping(&mut self, node: &str, id: u64) {
        if let Some(entry) = self.nodes.get_mut(node) {
            entry.stopping.insert(id);
        }
    }

    /// Marks `node`'s manager as being started again (or no longer).
    pub(crate) fn set_relaunching(&mut self, node: &str, relaunching: bool) {
        if let Some(entry) = self.nodes.get_mut(node) {
            entry.relaunching = relaunching;
        }
    }

    /// Whether `node`'s manager is being started again.
    pub(crate) fn is_relaunching(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|entry| entry.relaunching)
    }

    /// `node`'s manager connection (each registration opens a new one),
    /// while it is open: the same value later means the same manager
    /// process all along (silent for a while, perhaps, never restarted).
    pub(crate) fn open_connection(&self, node: &str) -> Option<u64> {
        self.nodes.get(node).filter(|entry| entry.connected).map(|entry| entry.connection)
    }

    /// Whether a manager of `node` registered since the controller started.
    pub(crate) fn is_known(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    /// Whether `node` is known and draining.
    pub(crate) fn is_draining(&self, node: &str) -> bool {
        self.nodes.get(node).is_some_and(|entry| entry.draining)
    }

    /// `node`'s manager failed to start an agent at `now` (it answered with
    /// a failure, or not within the start timeout): it takes no agents for
    /// [`START_QUARANTINE`], and the status says why.
    pub(crate) fn start_failed(&mut self, node: &str, reason: &str, now: Instant) {
        if let Some(entry) = self.nodes.get_mut(node) {
            entry.start_failure = Some((reason.to_string(), now + START_QUARANTINE));
        }
    }

    /// Why `node` takes no agents now after a failed start, if it does not.
    fn quarantined(entry: &NodeEntry<L>, now: Instant) -> Option<&str> {
        entry.start_failure.as_ref().filter(|(_, until)| now < *until).map(|(reason, _)| reason.as_str())
    }

    /// The nodes as placement sees them at `now`: an agent start counts from
    /// the moment it is sent, whatever reports arrive meanwhile. A node
    /// quarantined after a failed start counts as draining (no new agents;
    /// its running agents stay, since only operators' drains move them).
    pub(crate) fn snapshot(&self, now: Instant) -> Vec<NodeSnapshot> {
        self.nodes
            .iter()
            .map(|(name, n)| NodeSnapshot {
                node: name.clone(),
                alive: self.entry_alive(n, now),
                agents: n.status.agents + n.starting,
                mem_available: n.status.mem_available,
                bandwidth: n.status.bandwidth,
                cops_per_min: n.status.cops_per_min,
                power_watts: n.status.power_watts,
                bytes_held: n.status.bytes_held,
                draining: n.draining || Self::quarantined(n, now).is_some(),
            })
            .collect()
    }

    /// The nodes for the status API at `now`, with trends forecast
    /// `horizon_secs` ahead.
    pub(crate) fn report(&self, now: Instant, horizon_secs: f64) -> Vec<NodeReport> {
        self.nodes
            .iter()
            .map(|(name, n)| NodeReport {
                node: name.clone(),
                pid: n.pid,
                alive: self.entry_alive(n, now),
                last_heartbeat_secs: (now - n.last_heartbeat).as_secs_f64(),
                status: n.status.clone(),
                trend: n.trend.report(horizon_secs),
                draining: n.draining,
                relaunches: u32::try_from(n.relaunched.len()).unwrap_or(u32::MAX),
                given_up: n.given_up,
                start_failure: Self::quarantined(n, now).map(str::to_string),
            })
            .collect()
    }

    /// The node's trend report (for tests and the status API).
    #[cfg(test)]
    fn trend(&self, node: &str, horizon_secs: f64) -> Option<TrendReport> {
        self.nodes.get(node).map(|n| n.trend.report(horizon_secs))
    }

    /// Asks `node`'s manager to start agent `id` of `app`, and counts the
    /// start against the node until it is answered. False when the node is
    /// unknown or its connection is gone (nothing is counted then).
    pub(crate) fn start_agent(&mut self, node: &str, id: u64, spec: &StartSpec<'_>) -> bool {
        let Some(entry) = self.nodes.get_mut(node) else { return false };
        let sent = entry.link.send(ControllerToManager::StartAgent {
            id,
            app: spec.app.to_string(),
            mem_budget: spec.mem_budget,
            owner: spec.owner,
            complete: spec.complete,
            encrypted: spec.encrypted,
            protected: spec.protected,
        });
        // Counted even if the connection just closed: the answer (a failure,
        // or the controller's timeout) uncounts it, like any other start.
        entry.starting += 1;
        sent
    }

    /// One agent start on `node` got its answer (or the controller gave up
    /// waiting for it): it no longer counts as starting. An agent that
    /// `started` counts as running until the manager's next report, which
    /// is sent after its AgentReady and includes it.
    pub(crate) fn start_answered(&mut self, node: &str, started: bool) {
        if let Some(entry) = self.nodes.get_mut(node) {
            entry.starting = entry.starting.saturating_sub(1);
            entry.status.agents += u32::from(started);
        }
    }

    /// Sends `message` to `node`'s manager; false when the node is unknown
    /// or its connection is gone.
    pub(crate) fn send(&self, node: &str, message: ControllerToManager) -> bool {
        self.nodes.get(node).is_some_and(|entry| entry.link.send(message))
    }

    /// An operator drains `node` (or opens it again). Returns its agents,
    /// or names the known nodes when there is no such node.
    pub(crate) fn set_draining(&mut self, node: &str, drain: bool) -> Result<u32, String> {
        let Some(entry) = self.nodes.get_mut(node) else {
            let known: Vec<&String> = self.nodes.keys().collect();
            return Err(format!("no checkpoint node named {node:?} (known: {known:?})"));
        };
        entry.draining = drain;
        Ok(entry.status.agents)
    }
}

/// A node is alive while its manager's connection is open and its
/// heartbeats arrive.
fn alive<L>(entry: &NodeEntry<L>, now: Instant, heartbeat: Duration, missed: u32) -> bool {
    entry.connected && decide::is_alive(now.saturating_duration_since(entry.last_heartbeat), heartbeat, missed)
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    use icheck_core::config::DynamicConfig;

    use super::*;

    fn spec(app: &str) -> StartSpec<'_> {
        let owner = icheck_core::credentials::Capability::generate().unwrap();
        StartSpec {
            app,
            mem_budget: 0,
            owner: icheck_core::credentials::Owner { verifier: owner.verifier(), uid: 0 },
            complete: None,
            encrypted: false,
            protected: None,
        }
    }

    /// A manager connection that records what the controller sends.
    #[derive(Clone, Default)]
    struct Recorder {
        sent: Rc<RefCell<Vec<ControllerToManager>>>,
        closed: Rc<Cell<bool>>,
    }

    impl ManagerLink for Recorder {
        fn send(&self, message: ControllerToManager) -> bool {
            self.sent.borrow_mut().push(message);
            !self.closed.get()
        }

        fn is_open(&self) -> bool {
            !self.closed.get()
        }
    }

    const BEAT: Duration = Duration::from_secs(1);

    fn status(agents: u32) -> NodeStatus {
        NodeStatus { mem_available: 8 << 30, mem_total: 16 << 30, agents, ..NodeStatus::default() }
    }

    /// A book with `nodes` registered at `t0`, and their recorders.
    fn book(t0: Instant, nodes: &[&str]) -> (NodeBook<Recorder>, Vec<Recorder>) {
        let mut book = NodeBook::new(BEAT, 3);
        let links: Vec<Recorder> = nodes.iter().map(|_| Recorder::default()).collect();
        for (node, link) in nodes.iter().zip(&links) {
            book.register(node, 1, status(0), link.clone(), t0, 0.0).unwrap();
        }
        (book, links)
    }

    fn one_agent_per_node() -> DynamicConfig {
        DynamicConfig { max_agents_node: 1, ..DynamicConfig::default() }
    }

    #[test]
    fn a_starting_agent_counts_against_the_node_limit_whatever_reports_arrive() {
        let t0 = Instant::now();
        let (mut book, links) = book(t0, &["a", "b"]);
        let config = one_agent_per_node();
        // First placement takes one node and sends the start.
        let first = decide::choose_nodes(&book.snapshot(t0), 1, &config).unwrap();
        assert!(book.start_agent(&first[0], 1, &spec("app")));
        // The manager's periodic report, sent before it saw the start,
        // overtakes the answer: it still says 0 agents.
        let conn = 1 + u64::from(first[0] == "b");
        book.status(&first[0], conn, status(0), t0 + BEAT, 1.0);
        // A racing placement must not put a second agent there.
        let second = decide::choose_nodes(&book.snapshot(t0 + BEAT), 1, &config).unwrap();
        assert_ne!(second, first, "the starting agent was forgotten by the report");
        assert!(book.start_agent(&second[0], 2, &spec("other")));
        // Both nodes are now full: a third agent has no room.
        assert!(decide::choose_nodes(&book.snapshot(t0 + BEAT), 1, &config).is_err());
        // The start is answered; until the next report the agent counts as running.
        book.start_answered(&first[0], true);
        assert!(decide::choose_nodes(&book.snapshot(t0 + BEAT), 1, &config).is_err());
        // The next report includes it.
        book.status(&first[0], conn, status(1), t0 + 2 * BEAT, 2.0);
        assert!(decide::choose_nodes(&book.snapshot(t0 + 2 * BEAT), 1, &config).is_err());
        let starts = links.iter().map(|l| l.sent.borrow().len()).sum::<usize>();
        assert_eq!(starts, 2, "one StartAgent per placed agent");
    }

    /// A report listing `agents` (by id).
    fn running(agents: &[u64]) -> NodeStatus {
        let count = u32::try_from(agents.len()).expect("a handful of agents");
        NodeStatus { agent_bandwidth: agents.iter().map(|id| (*id, 0.0)).collect(), ..status(count) }
    }

    #[test]
    fn an_unclaimed_agent_is_stale_once_its_grace_ran_out_and_named_once() {
        let t0 = Instant::now();
        let (mut book, _) = book(t0, &["a"]);
        let grace = 2 * BEAT;
        let claimed = |id| id == 1;
        // Agent 2 is claimed by no one: first seen now, not stale yet.
        book.status("a", 1, running(&[1, 2]), t0, 0.0);
        assert!(book.stale_agents("a", t0, grace, claimed).is_empty());
        book.status("a", 1, running(&[1, 2]), t0 + BEAT, 1.0);
        assert!(book.stale_agents("a", t0 + BEAT, grace, claimed).is_empty());
        // Unclaimed through the whole grace: stale, and named once only.
        book.status("a", 1, running(&[1, 2]), t0 + grace, 2.0);
        assert_eq!(book.stale_agents("a", t0 + grace, grace, claimed), vec![2]);
        assert!(book.stale_agents("a", t0 + 3 * BEAT, grace, claimed).is_empty());
        // An agent claimed again in between starts its grace afresh: a
        // placement that listed it is not undone by an earlier report.
        book.status("a", 1, running(&[1, 3]), t0 + 3 * BEAT, 3.0);
        assert!(book.stale_agents("a", t0 + 3 * BEAT, grace, |_| false).is_empty());
        assert!(book.stale_agents("a", t0 + 4 * BEAT, grace, |_| true).is_empty());
        assert!(book.stale_agents("a", t0 + 5 * BEAT, grace, |_| false).is_empty());
        assert_eq!(book.stale_agents("a", t0 + 7 * BEAT, grace, |_| false), vec![1, 3]);
        // A zero grace stops at once what is unclaimed now; one already
        // asked to stop is not asked again.
        book.status("a", 1, running(&[3, 4]), t0 + 8 * BEAT, 8.0);
        book.note_stopping("a", 4);
        assert!(book.stale_agents("a", t0 + 8 * BEAT, Duration::ZERO, |_| false).is_empty());
        book.status("a", 1, running(&[5]), t0 + 9 * BEAT, 9.0);
        assert_eq!(book.stale_agents("a", t0 + 9 * BEAT, Duration::ZERO, |_| false), vec![5]);
        // An unknown node has none.
        assert!(book.stale_agents("b", t0, Duration::ZERO, |_| false).is_empty());
    }

    #[test]
    fn a_failed_start_frees_its_place() {
        let t0 = Instant::now();
        let (mut book, _) = book(t0, &["a"]);
        let config = one_agent_per_node();
        assert!(book.start_agent("a", 1, &spec("app")));
        assert!(decide::choose_nodes(&book.snapshot(t0), 1, &config).is_err());
        book.start_answered("a", false);
        assert_eq!(decide::choose_nodes(&book.snapshot(t0), 1, &config).unwrap(), vec!["a".to_string()]);
    }

    #[test]
    fn a_node_that_fails_to_start_agents_takes_none_for_a_while_and_says_why() {
        let t0 = Instant::now();
        let (mut book, links) = book(t0, &["a", "b"]);
        let config = DynamicConfig::default();
        book.start_failed("a", "manager on a did not start agent 1 within 15s", t0);
        // Placement goes to b only; the status names the failure.
        assert_eq!(decide::choose_nodes(&book.snapshot(t0), 1, &config).unwrap(), vec!["b".to_string()]);
        let report = book.report(t0, 60.0);
        assert!(report[0].start_failure.as_deref().is_some_and(|r| r.contains("did not start")), "{report:?}");
        assert_eq!(report[1].start_failure, None);
        // Its running agents are not moved: it is not draining.
        assert!(!book.is_draining("a"));
        // After the quarantine, or once its manager registers again, it takes agents.
        let later = t0 + START_QUARANTINE + Duration::from_secs(1);
        assert!(book.snapshot(later).iter().all(|n| !n.draining));
        book.start_failed("a", "again", t0);
        book.disconnected("a", 1);
        book.register("a", 2, status(0), links[0].clone(), t0, 0.0).unwrap();
        assert!(book.snapshot(t0).iter().all(|n| !n.draining));
    }

    #[test]
    fn a_silent_manager_is_down_after_its_missed_heartbeats_and_back_with_the_next() {
        let t0 = Instant::now();
        let (mut book, _) = book(t0, &["a", "b"]);
        // b keeps beating; a falls silent.
        for second in 1..=3 {
            assert!(!book.heartbeat("b", 2, t0 + BEAT * second));
        }
        assert!(book.newly_down(t0 + BEAT * 3).is_empty(), "3 missed beats are allowed");
        assert_eq!(book.newly_down(t0 + BEAT * 3 + Duration::from_millis(1)), vec!["a".to_string()]);
        assert!(book.newly_down(t0 + BEAT * 10).contains(&"b".to_string()), "b fell silent later");
        assert!(book.newly_down(t0 + BEAT * 11).is_empty(), "each outage is reported once");
        assert!(!book.is_alive("a", t0 + BEAT * 4));
        let placed = decide::choose_nodes(&book.snapshot(t0 + BEAT * 4), 1, &DynamicConfig::default()).unwrap();
        assert_eq!(placed, vec!["b".to_string()], "placement skips the silent node");
        // A heartbeat brings it back, and says so once.
        assert!(book.heartbeat("a", 1, t0 + BEAT * 12));
        assert!(!book.heartbeat("a", 1, t0 + BEAT * 12));
        assert!(book.is_alive("a", t0 + BEAT * 12));
    }

    /// A controller that was itself stopped sees every manager silent when
    /// it wakes; pardoned, no connected node is given up for it, and one
    /// that stays silent is down a full window later. A node whose
    /// connection closed is not pardoned.
    #[test]
    fn a_controller_pause_is_not_taken_for_silent_managers() {
        let t0 = Instant::now();
        let (mut book, _) = book(t0, &["a", "b"]);
        assert!(book.disconnected("b", 2));
        let woke = t0 + BEAT * 10;
        book.pardon(woke);
        assert!(book.newly_down(woke).is_empty());
        assert!(book.is_alive("a", woke) && !book.is_alive("b", woke));
        assert_eq!(book.newly_down(woke + BEAT * 3 + Duration::from_millis(1)), vec!["a".to_string()]);
    }

    /// A manager silent past the kill bound is named once, with its pid;
    /// one whose connection closed (dead: the relaunch takes it) or that
    /// is given up is not; one that answers again may be named again after
    /// a later silence.
    #[test]
    fn a_manager_silent_too_long_is_named_once_per_silence() {
        let t0 = Instant::now();
        let after = BEAT * 20;
        let (mut book, _) = book(t0, &["a", "b", "c"]);
        assert!(book.disconnected("b", 2));
        book.give_up("c");
        assert!(book.silent_for_too_long(t0 + after - Duration::from_millis(1), after).is_empty());
        assert_eq!(book.silent_for_too_long(t0 + after, after), vec![("a".to_string(), 1)]);
        assert!(book.silent_for_too_long(t0 + after * 2, after).is_empty(), "named once");
        assert!(!book.heartbeat("a", 1, t0 + after * 2), "not reported down: newly_down was not asked");
        assert!(book.silent_for_too_long(t0 + after * 3 - Duration::from_millis(1), after).is_empty());
        assert_eq!(book.silent_for_too_long(t0 + after * 3, after), vec![("a".to_string(), 1)], "a new silence");
    }

    #[test]
    fn a_node_name_is_held_by_its_live_manager_and_free_once_it_is_gone() {
        let t0 = Instant::now();
        let (mut book, links) = book(t0, &["a"]);
        let err = book.register("a", 2, status(0), Recorder::default(), t0, 0.0).unwrap_err();
        assert!(err.contains("already registered") && err.contains("pid 1"), "{err}");
        book.set_draining("a", true).unwrap();
        // The connection closes: the node is down, and the name is free.
        links[0].closed.set(true);
        assert!(book.disconnected("a", 1));
        assert!(!book.is_alive("a", t0));
        assert!(book.newly_down(t0 + BEAT * 10).is_empty(), "the closed connection was the report");
        let again = book.register("a", 3, status(0), Recorder::default(), t0 + BEAT, 1.0).unwrap();
        assert_eq!(again, 2);
        assert!(book.is_draining("a"), "a manager that comes back keeps its node's drain");
        // Messages of the old connection no longer count.
        assert!(!book.disconnected("a", 1));
        book.status("a", 1, status(7), t0 + BEAT, 1.0);
        assert_eq!(book.snapshot(t0 + BEAT)[0].agents, 0);
        assert!(book.trend("a", 60.0).is_some());
        let err = book.set_draining("x", true).unwrap_err();
        assert!(err.contains("\"x\"") && err.contains("\"a\""), "{err}");
    }

    #[test]
    fn a_relaunch_is_possible_only_while_the_limit_allows_and_looking_counts_nothing() {
        let t0 = Instant::now();
        let window = Duration::from_secs(600);
        let (mut book, _links) = book(t0, &["a"]);
        assert!(!book.relaunch_possible("a", t0, 0, window), "no relaunches allowed: nothing to wait for");
        assert!(!book.relaunch_possible("x", t0, 3, window), "an unknown node is never started");
        assert!(book.relaunch_possible("a", t0, 1, window));
        assert!(book.relaunch_possible("a", t0, 1, window), "asking twice counts no attempt");
        assert!(book.relaunch_allowed("a", t0, 1, window));
        assert!(!book.relaunch_possible("a", t0, 1, window), "the one relaunch is used");
        assert!(book.relaunch_possible("a", t0 + window, 1, window), "outside the window it may be started again");
        book.give_up("a");
        assert!(!book.relaunch_possible("a", t0 + window, 1, window), "a node given up is not started again");
    }
}
