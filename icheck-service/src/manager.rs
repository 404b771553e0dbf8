//! The manager daemon of a checkpoint node: registers with the controller,
//! sends heartbeats and status, and starts and stops agent threads.
//!
//! Owned state: its agents (id → thread). The controller connection is
//! re-established if it drops; agents keep running meanwhile.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::mpsc;

use icheck_core::config::StaticConfig;
use icheck_core::monitor::{read_rapl_energy, AgentCounts, NodeActivity, PowerMeter};
use icheck_core::protocol::{
    self, AgentInfo, ControllerToManager, Hello, ManagerToController, NodeStatus, ProtocolError, Role,
};

use crate::agent::{Agent, AgentSettings, PieceOutcome};
use crate::framing;
use crate::store::{InventoryCache, Store};
use crate::{read_meminfo, ServiceError};

/// Background work (PFS copies, redundancy, the progress that serves other
/// agents) runs at nice 19: it must not slow the commits and restarts the
/// node's agents serve meanwhile.
pub(crate) use icheck_core::fabric::lower_thread_priority;

type Agents = Arc<Mutex<BTreeMap<u64, Agent>>>;

/// Gives the heap memory that is free back to the system (glibc's
/// `malloc_trim`). A stopped agent's fabric endpoints free their tcp
/// bounce buffers (libfabric's rxm: 78–95 MB per endpoint), but malloc
/// keeps freed memory in the arena of the thread that freed it: a manager
/// whose jobs had all ended held 234–270 MB of anonymous memory, and 35–39
/// MB after a `malloc_trim(0)`. Agents stop rarely; the trim takes
/// milliseconds.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer; it only releases free pages of
    // the allocator's own arenas, under the allocator's locks.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Agents being stopped (id → application), until their threads have
/// ended. `StopAgent` runs off the message loop, so a `DropRanks` that
/// follows it could otherwise delete a rank's directory while a session of
/// the stopping agent still writes there (a node back from a silence
/// resumes its sessions mid-commit), leaving files no version owns.
#[derive(Default)]
struct StoppingAgents {
    apps: Mutex<BTreeMap<u64, String>>,
    ended: std::sync::Condvar,
}

impl StoppingAgents {
    fn begin(&self, id: u64, app: &str) {
        self.apps.lock().unwrap_or_else(|p| p.into_inner()).insert(id, app.to_string());
    }

    fn end(&self, id: u64) {
        self.apps.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        self.ended.notify_all();
    }

    /// Waits until no agent of `app` is stopping, at most `bound`; false if
    /// one still was then.
    fn wait_for(&self, app: &str, bound: Duration) -> bool {
        let apps = self.apps.lock().unwrap_or_else(|p| p.into_inner());
        let (apps, _) = self
            .ended
            .wait_timeout_while(apps, bound, |apps| apps.values().any(|a| a == app))
            .unwrap_or_else(|p| p.into_inner());
        !apps.values().any(|a| a == app)
    }
}

/// How long deleting a rank's versions waits for a stopping agent of its
/// application: longer than a transfer's timeout (10 s), after which the
/// agent's sessions have given up.
const STOP_BEFORE_DROP: Duration = Duration::from_secs(30);

/// The node's measurements between status reports (thesis §6.3).
struct Monitor {
    started: std::time::Instant,
    activity: NodeActivity,
    power: PowerMeter,
}

impl Monitor {
    fn new() -> Monitor {
        Monitor { started: std::time::Instant::now(), activity: NodeActivity::default(), power: PowerMeter::default() }
    }

    /// The node's status now. It reads /proc and walks the store, which
    /// took up to 3 s on a busy node: call it on a blocking thread, never
    /// on the task that sends heartbeats. The agents' lock is held only
    /// while their counters are read.
    fn measure(&mut self, agents: &Agents, settings: &AgentSettings) -> NodeStatus {
        // For the tests: a measurement as slow as a busy node's.
        icheck_core::failpoint::hit("manager.measure");
        let store = &settings.store;
        use std::sync::atomic::Ordering::Relaxed;
        let now = self.started.elapsed().as_secs_f64();
        let (mem_available, mem_total) = read_meminfo();
        let (counts, agent_bandwidth) = {
            let agents = agents.lock().unwrap_or_else(|p| p.into_inner());
            let counts: Vec<AgentCounts> = agents
                .iter()
                .map(|(id, a)| AgentCounts {
                    agent: *id,
                    operations: a.counters().versions_sealed.load(Relaxed),
                    bytes: a.counters().bytes_moved.load(Relaxed),
                })
                .collect();
            let bandwidth: Vec<(u64, f64)> =
                agents.iter().map(|(id, a)| (*id, a.counters().last_bandwidth())).collect();
            (counts, bandwidth)
        };
        self.activity.sample_agents(now, &counts);
        // A counter for Prometheus: it counts agents that have ended too.
        let checkpoint_ops = self.activity.total_operations();
        self.power.sample(now, read_rapl_energy(Path::new("/sys/class/powercap")));
        NodeStatus {
            mem_available,
            mem_total,
            agents: counts.len() as u32,
            bytes_held: store.bytes_held(),
            checkpoint_ops,
            checkpoint_bytes: self.activity.total_bytes(),
            bandwidth: self.activity.bandwidth(),
            cops_per_min: self.activity.cops_per_min(),
            last_cop_interval: self.activity.cop_interval(),
            agent_bandwidth,
            power_watts: self.power.watts(),
            warm_bytes: store.warm_bytes(),
            files_handed_over: settings.handoff.as_ref().map_or(0, |h| h.files_taken()),
            provider: settings.provider.clone(),
            store_pages: settings.store_pages.clone(),
            manager_anonymous_bytes: crate::read_own_anonymous_memory(),
        }
    }
}

/// Size of a warm file before the node has made any version's file (at
/// most a quarter of the pool).
const FIRST_WARM_FILE: u64 = 256 << 20;
/// How long no version's file must have been made or reused before the
/// warm pool fills: its page zeroing would compete with a commit for
/// memory bandwidth and cores.
const WARM_WHEN_QUIET_FOR: Duration = Duration::from_secs(2);
/// How long the warm pool waits after a file could not be made.
const WARM_RETRY: Duration = Duration::from_secs(30);

/// Keeps `target` bytes of backed files in the store's warm pool
/// (`WarmPool`), on a thread of the lowest priority, one file at a time and
/// only while the node is quiet; each file has the size of the largest
/// version file made here (a new version's file takes the best fit), and is
/// made only while its file system keeps twice its size free beside it. A
/// file that cannot be made is tried again after [`WARM_RETRY`].
fn spawn_warm_pool(store: Store, target: u64) {
    let fill = move || {
        lower_thread_priority();
        let mut ready = false;
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let warm = store.warm_bytes();
            if warm >= target {
                if !ready {
                    tracing::info!(bytes = warm, "warm pool ready");
                }
                ready = true;
                continue;
            }
            let last = crate::store::version_file_activity();
            if last.is_some_and(|(since, _)| since < WARM_WHEN_QUIET_FOR) {
                continue;
            }
            let unknown = FIRST_WARM_FILE.min(target / 4);
            let len = last.map_or(unknown, |(_, len)| len).max(1 << 20).min(target - warm);
            let free = store.capacity().map_or(0, |c| c.available);
            if free < len.saturating_mul(3) {
                continue;
            }
            let started = std::time::Instant::now();
            match store.fill_warm(len) {
                Ok(()) => {
                    ready = false;
                    tracing::debug!(bytes = len, ms = started.elapsed().as_secs_f64() * 1e3, "warm file made");
                }
                Err(err) => {
                    tracing::warn!(%err, retry_secs = WARM_RETRY.as_secs(), "cannot fill the warm pool");
                    std::thread::sleep(WARM_RETRY);
                }
            }
        }
    };
    if let Err(err) = std::thread::Builder::new().name("icheck-warm".into()).spawn(fill) {
        tracing::warn!(%err, "cannot start filling the warm pool");
    }
}

/// The host agents bind and advertise for `wanted`: the first IPv4
/// address of the local network interface of that name, or `wanted`
/// itself (a host name or an IP address).
pub fn resolve_agent_address(wanted: &str) -> String {
    let interface = nix::ifaddrs::getifaddrs().ok().and_then(|mut addresses| {
        addresses.find_map(|ifaddr| {
            let ip = ifaddr.address.as_ref()?.as_sockaddr_in()?.ip();
            (ifaddr.interface_name == wanted).then(|| ip.to_string())
        })
    });
    interface.unwrap_or_else(|| wanted.to_string())
}

/// The settings this node's agents run with.
pub fn agent_settings(config: &StaticConfig, node: &str) -> AgentSettings {
    let store_root = config.agent_store_dir.join(node);
    AgentSettings {
        store_pages: icheck_core::pages::huge_pages_under(&store_root).to_string(),
        fabric: config.fabric.clone(),
        client_token: config.effective_token(),
        node_token: config.node_token().unwrap_or_default(),
        host: config.agent_address.clone(),
        store: Store::new(store_root),
        pfs: config.pfs_dir.clone().map(icheck_core::pfs::PfsStore::new),
        idle_timeout: config.client_idle_timeout(),
        handoff: None,
        // Checked again by every agent that opens it; `FI_PROVIDER` counts.
        provider: icheck_core::fabric::check_provider(&config.fabric)
            .map(|offered| offered.provider)
            .unwrap_or_else(|err| format!("(none: {err})")),
    }
}

/// Runs the manager for `node` until SIGTERM or SIGINT (then its agents
/// close their endpoints and stop; checkpoint files stay in the store) or
/// until the controller rejects it.
pub async fn run(config: StaticConfig, node: String) -> Result<(), ServiceError> {
    let agents: Agents = Arc::default();
    let result = tokio::select! {
        result = serve(config, node, agents.clone()) => result,
        _ = shutdown_signal() => {
            tracing::info!("stopping: closing the agents' endpoints");
            Ok(())
        }
    };
    let stopping: Vec<Agent> =
        std::mem::take(&mut *agents.lock().unwrap_or_else(|p| p.into_inner())).into_values().collect();
    // Joining agent threads blocks; do it off the async threads.
    let _ = tokio::task::spawn_blocking(move || stopping.into_iter().for_each(|agent| agent.stop(false))).await;
    result
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

async fn serve(config: StaticConfig, node: String, agents: Agents) -> Result<(), ServiceError> {
    let mut settings = agent_settings(&config, &node);
    tracing::info!(store = %settings.store.root().display(), pages = %settings.store_pages, "checkpoint store");
    // Restarting ranks on this host take their version's file here.
    settings.handoff = match icheck_core::handoff::HandoffServer::bind() {
        Ok(server) => Some(Arc::new(server)),
        Err(err) => {
            tracing::warn!(%err, "no same-host handoff socket: restarts on this host read over the fabric");
            None
        }
    };
    // No agent runs yet: whatever is unsealed was left by a manager that died
    // mid-commit, and would only take the room later versions need.
    let (files, bytes) = settings.store.sweep_unsealed();
    if files > 0 {
        tracing::warn!(files, bytes, "removed unsealed version files a previous manager left in the store");
    }
    if config.warm_pool.0 > 0 {
        spawn_warm_pool(settings.store.clone(), config.warm_pool.0);
    }
    // On a wedge the manager ends: the controller starts a new one, which
    // finds the store this one leaves (its agents start again where their
    // files are).
    crate::wedge::exit_when_wedged("this manager exits so that a new one serves its store");
    let inventory = Arc::new(Mutex::new(InventoryCache::default()));
    let stopping = Arc::new(StoppingAgents::default());
    let controllers = config.controller_endpoints();
    // With a standby, a takeover must not wait for a long back-off.
    let longest = if controllers.len() > 1 { Duration::from_millis(500) } else { Duration::from_secs(2) };
    let mut delay = Duration::from_millis(100);
    // The fencing epoch: the highest any controller answered with.
    let mut epoch = 0;
    loop {
        for peer in &controllers {
            let mut link = ControllerSession { peer, epoch, registered: false };
            let result = session(&config, &settings, &node, &agents, &inventory, &stopping, &mut link).await;
            epoch = link.epoch;
            if link.registered {
                delay = Duration::from_millis(100);
            }
            match result {
                Err(ServiceError::Protocol(ProtocolError::Refused { peer, reason })) => {
                    return Err(ProtocolError::Refused { peer, reason }.into());
                }
                Err(ServiceError::Protocol(err @ ProtocolError::NotPrimary { .. }))
                | Err(ServiceError::Protocol(err @ ProtocolError::StaleEpoch { .. })) => {
                    tracing::debug!(%err, "not the primary controller; trying the next");
                }
                Err(err) => tracing::warn!(%peer, %err, "controller connection lost; reconnecting"),
                Ok(()) => tracing::warn!(%peer, "controller closed the connection; reconnecting"),
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(longest);
    }
}

/// One connection to a controller, and what it taught.
struct ControllerSession<'a> {
    peer: &'a str,
    /// The highest controller epoch seen (raised by this controller's answer).
    epoch: u64,
    /// The controller accepted the registration.
    registered: bool,
}

async fn session(
    config: &StaticConfig,
    settings: &AgentSettings,
    node: &str,
    agents: &Agents,
    inventory: &Arc<Mutex<InventoryCache>>,
    stopping: &Arc<StoppingAgents>,
    link: &mut ControllerSession<'_>,
) -> Result<(), ServiceError> {
    let peer = link.peer.to_string();
    // With a standby, a stopped or cut-off controller must not hold the
    // manager for the whole request timeout (or a SYN's retries).
    let several = config.controller_endpoints().len() > 1;
    let answer_within = if several { config.takeover_after() } else { protocol::REQUEST_TIMEOUT };
    let cannot = |error| ServiceError::Io { what: format!("cannot connect to the controller at {peer}"), error };
    // Tests hold a manager back here (it runs, but has not registered).
    let _ = tokio::task::spawn_blocking(|| icheck_core::failpoint::hit("manager.before_connect")).await;
    let mut stream = match tokio::time::timeout(answer_within, TcpStream::connect(&peer)).await {
        Ok(connected) => connected.map_err(cannot)?,
        Err(_) => return Err(cannot(std::io::ErrorKind::TimedOut.into())),
    };
    stream.set_nodelay(true).ok();
    let token = config.node_token().unwrap_or_default();
    framing::send(&mut stream, &Hello::with_epoch(&token, Role::Manager, link.epoch)).await?;
    let reply = framing::recv_timeout(&mut stream, answer_within).await?;
    link.epoch = protocol::accept_controller(&peer, reply, link.epoch)?;
    // What the store holds, verified (reading only versions sealed since the
    // last registration): the controller reconciles its journal with it.
    let stored = {
        let (store, inventory) = (settings.store.clone(), inventory.clone());
        tokio::task::spawn_blocking(move || store.inventory(&mut inventory.lock().unwrap_or_else(|p| p.into_inner())))
            .await
            .unwrap_or_default()
    };
    let pieces = {
        let store = settings.store.clone();
        tokio::task::spawn_blocking(move || store.piece_inventory()).await.unwrap_or_default()
    };
    let damaged = stored.iter().filter(|s| s.damage.is_some()).count();
    if damaged > 0 {
        tracing::warn!(damaged, "stored versions do not verify against their manifests; announcing them as damaged");
    }
    let running: Vec<AgentInfo> =
        agents.lock().unwrap_or_else(|p| p.into_inner()).values().map(|a| a.info().clone()).collect();
    let status = {
        let (agents, settings) = (agents.clone(), settings.clone());
        tokio::task::spawn_blocking(move || Monitor::new().measure(&agents, &settings))
            .await
            .map_err(|err| ServiceError::Io { what: "measuring the node".into(), error: std::io::Error::other(err) })?
    };
    let register = ManagerToController::Register {
        node: node.to_string(),
        pid: std::process::id(),
        status,
        agents: running,
        stored,
        pieces,
    };
    framing::send(&mut stream, &register).await?;
    match framing::recv_timeout(&mut stream, protocol::REQUEST_TIMEOUT).await? {
        ControllerToManager::Registered => {
            link.registered = true;
            tracing::info!(%peer, epoch = link.epoch, "registered with the controller");
        }
        ControllerToManager::Rejected(reason) => return Err(ProtocolError::Refused { peer, reason }.into()),
        other => return Err(ProtocolError::Unexpected { peer, what: format!("{other:?}") }.into()),
    }
    let (mut reader, mut writer) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<ManagerToController>();
    let writer_task = tokio::spawn(async move {
        while let Some(message) = rx.recv().await {
            if framing::send(&mut writer, &message).await.is_err() {
                break;
            }
        }
    });
    // Heartbeats, status and the agent watchdog. The heartbeat never waits
    // for a measurement: one that walked a busy store held the heartbeats
    // back for 3 s, and the controller, hearing nothing for 1.5 s, gave
    // the node's agents up (a commit of a restarted job then failed for it).
    let timers = {
        let (tx, agents, settings) = (tx.clone(), agents.clone(), settings.clone());
        let (heartbeat, status_every) = (config.heartbeat(), config.status());
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(heartbeat);
            let mut status = tokio::time::interval(status_every);
            let monitor = Arc::new(Mutex::new(Monitor::new()));
            let mut last_beat = tokio::time::Instant::now();
            loop {
                tokio::select! {
                    _ = beat.tick() => {
                        let gap = last_beat.elapsed();
                        last_beat = tokio::time::Instant::now();
                        if gap > heartbeat * 2 {
                            // This task did not run for that long: the runtime's threads were busy or the process starved.
                            tracing::warn!(?gap, ?heartbeat, "heartbeat sent late: this manager did not run (stopped, or starved of CPU); the controller may have taken the node for silent");
                        }
                        let dead = take_dead_agents(&agents);
                        for id in dead.keys() {
                            let _ = tx.send(ManagerToController::AgentLost { id: *id });
                        }
                        if !dead.is_empty() {
                            // Closing their endpoints happens off the async threads.
                            tokio::task::spawn_blocking(move || drop(dead));
                        }
                        if tx.send(ManagerToController::Heartbeat).is_err() { break; }
                    }
                    _ = status.tick() => {
                        let (tx, agents, settings, monitor) = (tx.clone(), agents.clone(), settings.clone(), monitor.clone());
                        // On a blocking thread; skipped while the last one still runs.
                        tokio::task::spawn_blocking(move || {
                            let Some(mut monitor) = lock_if_free(&monitor) else { return };
                            let _ = tx.send(ManagerToController::Status(monitor.measure(&agents, &settings)));
                        });
                    }
                }
            }
        })
    };
    let mut timers = timers;
    // A controller that answers no heartbeat for the takeover window (and
    // one more heartbeat) may have been replaced: look for the primary.
    let silence = config.takeover_after() + config.heartbeat();
    let result = loop {
        let received = tokio::select! {
            received = framing::recv(&mut reader) => received,
            _ = tokio::time::sleep(silence), if several => {
                tracing::warn!(%peer, ?silence, "the controller is silent; looking for the primary");
                break Ok(());
            }
            // Heartbeats must never stop while the connection stays open:
            // the controller would take the node for silent. If their task
            // ends (a panic), the session ends, and a new one restarts it.
            ended = &mut timers => {
                let why = match ended {
                    Err(err) if err.is_panic() => "panicked",
                    _ => "ended",
                };
                tracing::error!("the heartbeat and status task {why}; reconnecting to restart it");
                let error = std::io::Error::other(format!("it {why}"));
                break Err(ServiceError::Io { what: "the manager's heartbeat task".into(), error });
            }
        };
        let message: ControllerToManager = match received {
            Ok(message) => message,
            Err(ProtocolError::Closed) => break Ok(()),
            Err(err) => break Err(err.into()),
        };
        match message {
            ControllerToManager::StartAgent { id, app, mem_budget, owner, complete, encrypted, protected } => {
                let (tx, agents, settings, node) = (tx.clone(), agents.clone(), settings.clone(), node.to_string());
                tokio::task::spawn_blocking(move || {
                    icheck_core::failpoint::hit("manager.before_agent_start");
                    let task =
                        crate::agent::AgentTask { app: app.clone(), mem_budget, owner, complete, encrypted, protected };
                    let started = match icheck_core::failpoint::fails("manager.agent_start") {
                        true => Err(icheck_core::fabric::FabricError::Config("failpoint manager.agent_start".into())),
                        false => Agent::start(&settings, &node, id, &task),
                    };
                    let reply = match started {
                        Ok(agent) => {
                            let info = agent.info().clone();
                            agents.lock().unwrap_or_else(|p| p.into_inner()).insert(id, agent);
                            tracing::info!(agent = id, %app, "agent started");
                            ManagerToController::AgentReady(info)
                        }
                        Err(err) => {
                            tracing::error!(agent = id, %app, %err, "agent failed to start");
                            ManagerToController::AgentFailed { id, reason: err.to_string() }
                        }
                    };
                    let _ = tx.send(reply);
                });
            }
            ControllerToManager::CopyToPfs { agent, version, compression, ranks } => {
                let job = agent_job(agents, agent, |a| a.pfs_copy_job(version, compression, ranks));
                let tx = tx.clone();
                let copy = move || {
                    lower_thread_priority();
                    // A loaded node runs nice-19 copies late (the copy-versus-prune test).
                    icheck_core::failpoint::hit("manager.before_pfs_copy");
                    let result = job.map_err(crate::agent::PfsCopyError::Failed).and_then(|job| job());
                    let superseded = matches!(result, Err(crate::agent::PfsCopyError::Superseded { .. }));
                    let result = result.map_err(|e| e.to_string());
                    let _ = tx.send(ManagerToController::PfsCopied { agent, version, result, superseded });
                };
                if let Err(err) = std::thread::Builder::new().name("icheck-pfs-copy".into()).spawn(copy) {
                    tracing::error!(agent, version, %err, "cannot start a PFS copy thread");
                }
            }
            ControllerToManager::StopAgent { id, discard } => {
                let agent = agents.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                if let Some(agent) = agent {
                    tracing::info!(agent = id, discard, "stopping agent");
                    // Noted here, in message order, so that a DropRanks
                    // after it waits for it.
                    stopping.begin(id, agent.app());
                    let stopping = stopping.clone();
                    // Joining the threads happens off the async threads.
                    tokio::task::spawn_blocking(move || {
                        agent.stop(discard);
                        stopping.end(id);
                        return_freed_memory();
                    });
                }
            }
            ControllerToManager::TakeOver { agent, rank, version, from, request } => {
                let job = agent_job(agents, agent, |a| a.take_over_job(rank, version, from));
                fill_rank(tx.clone(), (agent, rank, request), version, job, "take-over failed");
            }
            ControllerToManager::DropRanks { app, ranks } => {
                let (store, stopping) = (settings.store.clone(), stopping.clone());
                for agent in agents.lock().unwrap_or_else(|p| p.into_inner()).values() {
                    for &rank in &ranks {
                        agent.forget_rank(&app, rank);
                    }
                }
                tokio::task::spawn_blocking(move || {
                    if !stopping.wait_for(&app, STOP_BEFORE_DROP) {
                        tracing::warn!(%app, "an agent of this application is still stopping; deleting its ranks' versions anyway");
                    }
                    for rank in ranks {
                        match store.remove_rank(&app, rank) {
                            Ok(()) => {
                                tracing::info!(%app, rank, "rank moved to another node; its versions here are deleted")
                            }
                            Err(err) => tracing::warn!(%app, rank, %err, "cannot delete a moved rank's versions"),
                        }
                    }
                });
            }
            ControllerToManager::Protect { agent, task } => {
                let (version, attempt) = (task.version, task.attempt);
                let failed = |why: String| PieceOutcome::all_failed(agent, &task, &why);
                let job = agent_job(agents, agent, |a| a.protect_job(task.clone())).map_err(failed);
                let tx = tx.clone();
                // Background work, like a PFS copy: at nice 19 on a thread of
                // its own, so that encoding never starves the node's commits
                // or this manager's heartbeats.
                let build = move || {
                    lower_thread_priority();
                    // For the tests: a protection that takes a while.
                    icheck_core::failpoint::hit("manager.before_protect");
                    // An encoder answers for the shards it wrote elsewhere too.
                    for PieceOutcome { agent, piece, result } in job.map_or_else(|failed| failed, |job| job()) {
                        if let Err(reason) = &result {
                            tracing::warn!(agent, version, %piece, %reason, "building a piece of redundancy failed");
                        }
                        let _ = tx.send(ManagerToController::Protected { agent, version, attempt, piece, result });
                    }
                };
                if let Err(err) = std::thread::Builder::new().name("icheck-protect".into()).spawn(build) {
                    tracing::error!(agent, version, %err, "cannot start a thread to build a piece of redundancy");
                }
            }
            ControllerToManager::Rebuild { agent, rank, version, source, request } => {
                let job = agent_job(agents, agent, |a| a.rebuild_job(rank, version, source));
                fill_rank(tx.clone(), (agent, rank, request), version, job, "rebuilding a lost rank failed");
            }
            ControllerToManager::Protecting { app, version } => {
                for_app_agents(agents, &app, |agent| agent.protecting(version));
            }
            ControllerToManager::DropStalePieces { app, version, keep } => {
                let store = settings.store.clone();
                tokio::task::spawn_blocking(move || match store.drop_stale_pieces(&app, version, &keep) {
                    Ok(0) => {}
                    Ok(removed) => tracing::info!(%app, version, removed, "pieces no record places here deleted"),
                    Err(err) => tracing::warn!(%app, version, %err, "cannot delete pieces no record places here"),
                });
            }
            ControllerToManager::DropPieces { app, below } => {
                // `below` is protected: its agents here may let older versions go.
                for_app_agents(agents, &app, |agent| agent.protected(below));
                let store = settings.store.clone();
                tokio::task::spawn_blocking(move || match store.drop_pieces_below(&app, below) {
                    Ok(0) => {}
                    Ok(removed) => tracing::debug!(%app, below, removed, "older pieces of redundancy deleted"),
                    Err(err) => tracing::warn!(%app, below, %err, "cannot delete older pieces of redundancy"),
                });
            }
            ControllerToManager::DropNewer { app, above, through } => {
                for_app_agents(agents, &app, |agent| agent.fell_back(above, through));
                let store = settings.store.clone();
                tokio::task::spawn_blocking(move || match store.drop_newer(&app, above, through) {
                    Ok(removed) => tracing::warn!(%app, above, through, removed, "versions lost with a node deleted"),
                    Err(err) => {
                        tracing::error!(%app, above, through, %err, "cannot delete the versions lost with a node")
                    }
                });
            }
            ControllerToManager::Beat => {}
            other => tracing::warn!(?other, "unexpected message from the controller; ignored"),
        }
    };
    timers.abort();
    writer_task.abort();
    result
}

/// Runs `job`, which gives `agent` the rank's version (a take-over or a
/// rebuild, the controller's `request`), on a blocking thread and reports
/// it as `TookOver`; a failure is logged as `failed`.
fn fill_rank(
    tx: mpsc::UnboundedSender<ManagerToController>,
    (agent, rank, request): (u64, u32, u64),
    version: u64,
    job: Result<impl FnOnce() -> Result<u64, String> + Send + 'static, String>,
    failed: &'static str,
) {
    tokio::task::spawn_blocking(move || {
        let result = job.and_then(|job| job());
        if let Err(reason) = &result {
            tracing::warn!(agent, rank, version, request, %reason, "{failed}");
        }
        let _ = tx.send(ManagerToController::TookOver { agent, rank, request, result });
    });
}

/// The agents whose threads have ended, taken out of `agents`; none while
/// another thread holds the map (they are looked for again at the next
/// heartbeat, which must not wait for that thread).
fn take_dead_agents(agents: &Agents) -> BTreeMap<u64, Agent> {
    let Some(mut map) = lock_if_free(agents) else { return BTreeMap::new() };
    let dead: Vec<u64> = map.iter().filter(|(_, a)| !a.is_alive()).map(|(id, _)| *id).collect();
    dead.into_iter().filter_map(|id| map.remove(&id).map(|agent| (id, agent))).collect()
}

/// `mutex` locked if no other thread holds it (a poisoned one too, as the
/// manager's other locks are taken), `None` if one does.
fn lock_if_free<T>(mutex: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    match mutex.try_lock() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Runs `each` on every agent here that serves application `app`.
fn for_app_agents(agents: &Agents, app: &str, each: impl FnMut(&Agent)) {
    agents.lock().unwrap_or_else(|p| p.into_inner()).values().filter(|a| a.app() == app).for_each(each);
}

/// A job built from agent `id` (taken under the agents' lock, run after
/// it), or why there is none.
fn agent_job<J>(agents: &Agents, id: u64, build: impl FnOnce(&Agent) -> J) -> Result<J, String> {
    let agents = agents.lock().unwrap_or_else(|p| p.into_inner());
    agents.get(&id).map(build).ok_or_else(|| format!("agent {id} is not running here"))
}

#[cfg(test)]
mod tests {
    use super::{resolve_agent_address, StoppingAgents};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn dropping_a_ranks_versions_waits_for_its_applications_stopping_agents_only() {
        let stopping = Arc::new(StoppingAgents::default());
        stopping.begin(1, "app");
        stopping.begin(2, "other");
        assert!(!stopping.wait_for("app", Duration::from_millis(20)), "agent 1 is still stopping");
        let ender = {
            let stopping = stopping.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                stopping.end(1);
            })
        };
        assert!(stopping.wait_for("app", Duration::from_secs(10)), "agent 1 ended");
        ender.join().unwrap();
        assert!(!stopping.wait_for("other", Duration::ZERO), "another application's agent is still stopping");
        assert!(stopping.wait_for("third", Duration::ZERO));
    }

    #[test]
    fn an_agent_address_may_name_an_interface() {
        assert_eq!(resolve_agent_address("lo"), "127.0.0.1");
        assert_eq!(resolve_agent_address("10.1.2.3"), "10.1.2.3");
        assert_eq!(resolve_agent_address("cpnode7"), "cpnode7", "not an interface: a host name");
    }
}
