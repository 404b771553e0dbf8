//! The controller: registry of checkpoint nodes, agents and applications;
//! answers registrations with agent lists; tracks heartbeats; serves status.
//!
//! Owned state (all behind one mutex, never held across an await):
//! nodes (manager connection, last heartbeat, measurements), applications
//! (registration, agents), and pending agent starts.

#![forbid(unsafe_code)]

mod agent_change;
mod apps;
mod awaiting;
mod copies;
pub mod journal;
mod managers;
mod node_events;
mod nodes;
mod protection;
mod rebuild;
mod reconcile;
mod registration;
mod replica;
mod replication;
mod scaler;
mod status;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::Instrument;

use icheck_core::config::{DaemonTokens, DynamicConfig, StaticConfig};
use icheck_core::credentials::Capability;
use icheck_core::decide;
use icheck_core::protocol::{
    self, AgentChange, AgentInfo, AppReport, ClientReply, ClientRequest, CommitSample, ControllerToManager, Hello,
    HelloReply, ManagerToController, PfsCopyStats, Privilege, ProtocolError, Role, StatusReport, StoredPiece,
    TransferMode, VersionRecord,
};

use crate::framing;
use crate::launcher::Launcher;
use crate::store::FileIdentity;
use crate::ServiceError;
use agent_change::{ask_rank, await_ranks, change_agents, probe, ProbeAsked, RankWaiter};
use apps::{AppEntry, ProbePlan, Recorded};
use awaiting::{Answer, Awaiting, RankRequest, RankRequests};
use copies::{Answered, CopyBook, OnRecorded};
use journal::{Event, Journal, JournaledApp};
use managers::{serve_manager, watch_liveness};
use node_events::{
    adopt_agents, check_returning_node, drop_obsolete_files, drop_pieces_on_returned_nodes, drop_stale_pieces_on,
    node_back, node_lost, ranks_lost_with_given_up_nodes, ranks_on_silent_nodes, recheck_homed_on, reconcile_pending,
    stop_stale_agents, STALE_AGENT_GRACE,
};
use nodes::NodeBook;
use protection::ProtectionBook;
use reconcile::Holdings;
use registration::{
    await_reconciled, await_starts, manager_answer, register_app, send_starts, wait_out_doubt, Placement, Placing,
    Refused,
};
use replica::{Lease, ToPrimary, ToStandby};
use replication::{follow, replica_stream, watch_partners};
use status::{app_report, status_report};

/// How far ahead the memory forecast looks, in seconds.
const FORECAST_HORIZON_SECS: f64 = 60.0;
/// Time a peer has to send its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections that have not authenticated yet, at most (see `run`'s accept loop).
const MAX_UNAUTHENTICATED: usize = 128;
/// Time managers have to start the agents of one registration.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(15);
/// Time new agents have to take over the ranks that move to them.
const TAKE_OVER_TIMEOUT: Duration = Duration::from_secs(300);
/// Window over which `ManagerRelaunches` counts a node's relaunches.
const RELAUNCH_WINDOW: Duration = Duration::from_secs(600);
/// Time a registration waits for a home node whose manager is being started
/// again (within the library's 30 s for a controller request).
const RELAUNCH_WAIT: Duration = Duration::from_secs(10);
/// Longest an init's probe waits for a node in doubt to be marked down or
/// heard again ([`wait_out_doubt`]): below the library's 30 s bound on an
/// answer from the controller.
const AT_INIT_DOUBT_WAIT: Duration = Duration::from_secs(20);
/// Time a relaunched manager has to register before it counts as dead again.
const RELAUNCH_REGISTER_TIMEOUT: Duration = Duration::from_secs(15);

/// The node book over the managers' connections.
type ManagerBook = NodeBook<mpsc::UnboundedSender<ControllerToManager>>;

struct State {
    /// The checkpoint nodes, and the channel to each manager.
    nodes: ManagerBook,
    apps: BTreeMap<String, AppEntry>,
    /// Agent starts under way, by agent id: the agent or why not.
    pending: Awaiting<u64, AgentInfo>,
    /// Agents started for an application that does not list them yet: its
    /// registration, agent change or rebuild is still under way (waiting
    /// for the other starts, moving or rebuilding ranks). Nothing stops
    /// them as stale meanwhile ([`Placing`] ends the claim).
    placing: BTreeSet<u64>,
    /// Take-overs and rebuilds under way: bytes moved or why not.
    takeovers: RankRequests,
    next_agent: u64,
    /// The durable state, when the controller has a state directory.
    journal: Option<Journal>,
    /// What each node's store held when its manager last registered.
    holdings: Holdings,
    /// The pieces of redundancy each node's store held then.
    piece_holdings: BTreeMap<String, Vec<StoredPiece>>,
    /// Until when journaled applications wait for the managers of their
    /// nodes to register before they are reconciled with what did.
    reconcile_by: Instant,
    /// Journaled agents on nodes that never registered were dropped.
    startup_settled: bool,
    /// The fencing epoch of this primary.
    epoch: u64,
    /// This primary's lease and its standby's progress.
    lease: Lease,
    /// The attached standby's stream: every journaled event goes there.
    standby: Option<mpsc::UnboundedSender<ToStandby>>,
}

/// Ids of agents of controller incarnation `n` start here, so an agent
/// started by an earlier controller process never shares an id with one
/// started by this one.
const AGENT_IDS_PER_INCARNATION: u64 = 1_000_000;

/// Writes `event` to the journal (when the controller keeps one) before
/// the caller acknowledges what it records; the error is the reply.
/// The event also goes to the standby, and the reply that acknowledges it
/// waits for the standby's acknowledgement ([`replicated`]).
///
/// The lease is checked again right before the write: a request that was
/// admitted just before this process was paused must not be recorded
/// after it wakes, when another controller may have taken over.
fn journal(state: &mut State, event: &Event) -> Result<(), String> {
    if let Err(why) = state.lease.may_act(Instant::now()) {
        return Err(format!(
            "this controller (epoch {}) may no longer be the primary, so it is not recorded: {why}",
            state.epoch
        ));
    }
    let Some(journal) = state.journal.as_mut() else { return Ok(()) };
    journal.append(event).map_err(|err| {
        tracing::error!(%err, "cannot write the controller journal");
        format!("the controller cannot journal it, so it is not recorded: {err}")
    })?;
    let seq = state.lease.appended();
    if let Some(standby) = &state.standby {
        let _ = standby.send(ToStandby::Append { seq, event: event.clone() });
    }
    Ok(())
}

struct Shared {
    /// When the controller started: the clock of the derived metrics.
    started: Instant,
    /// The secrets peers present: which one decides what a peer may ask.
    tokens: DaemonTokens,
    pfs: Option<icheck_core::pfs::PfsStore>,
    heartbeat: Duration,
    missed: u32,
    /// `ClientIdleTimeout`: a client connection silent this long is closed.
    client_idle: Duration,
    /// `NodeGroup`: each node's failure domain, for redundancy placement.
    node_groups: BTreeMap<String, String>,
    /// How dead managers are started again, if at all.
    launcher: Option<Arc<dyn Launcher>>,
    /// Nodes being released to the resource manager (Algorithm 9), so that
    /// a request and the reactive scaler never empty one node twice.
    releasing: Mutex<BTreeSet<String>>,
    /// `ManagerRelaunches`.
    relaunch_limit: u32,
    /// `KillSilentManagerAfter` (`None`: never).
    kill_silent_after: Option<Duration>,
    state: Mutex<State>,
    dynamic: RwLock<DynamicConfig>,
    /// This controller's address, and every configured controller's.
    me: String,
    controllers: Vec<String>,
    /// `TakeoverAfter`.
    window: Duration,
    /// Set when a higher epoch was seen: the primary phase ends.
    step_down: tokio::sync::Notify,
    /// Woken when the standby acknowledges events or goes away.
    acked: tokio::sync::Notify,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seconds since the controller started.
    fn clock(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn dynamic(&self) -> DynamicConfig {
        self.dynamic.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether this primary may act now (its lease), or why not, in words
    /// a client or manager is told.
    fn may_act(&self) -> Result<(), String> {
        let state = self.state();
        state.lease.may_act(Instant::now()).map_err(|why| {
            format!("controller {} (epoch {}) is not acting as the primary: {why}", self.me, state.epoch)
        })
    }

    /// Ends the primary phase: a controller with a higher epoch exists.
    fn step_down(&self, why: &str) {
        tracing::warn!(%why, "stepping down to standby");
        self.step_down.notify_one();
    }
}

/// Waits until the standby acknowledged every event journaled so far (at
/// most the lease): what a reply acknowledges is on both controllers.
/// Without a standby nothing is waited for, but the lease must hold.
async fn replicated(shared: &Shared) -> Result<(), String> {
    let seq = shared.state().lease.seq();
    loop {
        let notified = shared.acked.notified();
        {
            let state = shared.state();
            if state.lease.replicated(seq) {
                drop(state);
                return shared.may_act();
            }
        }
        shared.may_act()?;
        let _ = tokio::time::timeout(shared.window / 8, notified).await;
    }
}

/// Writes `address` to `dir/name` atomically (what `icheck up` and tests read).
fn write_address(dir: &std::path::Path, name: &str, address: &str) -> Result<(), ServiceError> {
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, address)
        .and_then(|_| std::fs::rename(&tmp, dir.join(name)))
        .map_err(|error| ServiceError::Io { what: format!("cannot write {}/{name}", dir.display()), error })
}

/// How a controller process runs (`icheck controller`).
pub struct ControllerOptions {
    /// Where `controller.addr` and `metrics.addr` are written (by whichever
    /// controller is primary) and, unless `journal_dir` says otherwise,
    /// the journal is kept.
    pub state_dir: Option<PathBuf>,
    /// Where the journal is kept (overrides `state_dir` and
    /// `ControllerStateDir`); two controllers on one host need two.
    pub journal_dir: Option<PathBuf>,
    /// How dead managers are started again, if at all.
    pub launcher: Option<Arc<dyn Launcher>>,
    /// Start as the standby: follow the primary's journal and take over
    /// when it falls silent.
    pub standby: bool,
    /// This controller's entry of `ControllerAddress` (default: the first,
    /// or the second with `standby`).
    pub listen: Option<String>,
    /// The secrets it admits peers with (checked: `StaticConfig::daemon_tokens`).
    pub tokens: DaemonTokens,
}

/// Runs a controller until the process ends: as the primary, or as the
/// standby until it takes over, and as the standby again after it steps
/// down. Each phase runs on a runtime of its own, so a phase that ends
/// leaves no task, connection or listener behind.
///
/// With a `launcher`, a manager whose connection closed and whose process
/// is dead is started again through it (§6.5.2), at most
/// `ManagerRelaunches` times in ten minutes before the node is given up.
pub fn serve(config: StaticConfig, options: ControllerOptions) -> Result<(), ServiceError> {
    let controllers = config.controller_endpoints();
    let me = match (&options.listen, options.standby) {
        (Some(address), _) => address.clone(),
        (None, false) => controllers[0].clone(),
        (None, true) => controllers.get(1).cloned().ok_or_else(|| {
            ServiceError::Remote(
                "--standby needs a second controller in ControllerAddress, e.g. \
                 ControllerAddress = [\"host1:7777\", \"host2:7777\"]"
                    .into(),
            )
        })?,
    };
    if controllers.len() > 1 && !controllers.contains(&me) {
        return Err(ServiceError::Remote(format!(
            "--listen {me} is not one of the controllers in ControllerAddress ({})",
            controllers.join(", ")
        )));
    }
    let journal_dir = options
        .journal_dir
        .clone()
        .or_else(|| options.state_dir.clone())
        .or_else(|| config.controller_state_dir.clone());
    let _lock = match &journal_dir {
        Some(dir) => Some(lock_journal_dir(dir)?),
        None if controllers.len() > 1 => {
            return Err(ServiceError::Remote(
                "a controller with a standby keeps a journal: give it --state-dir or ControllerStateDir".into(),
            ))
        }
        None => None,
    };
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|error| ServiceError::Io { what: "cannot start the async runtime".into(), error })
    };
    let mut standby = options.standby;
    loop {
        if standby {
            let dir = journal_dir.as_deref().expect("checked: a controller with partners keeps a journal");
            let phase = runtime()?;
            phase.block_on(follow(&config, &options.tokens, &me, &controllers, dir))?;
            phase.shutdown_timeout(Duration::from_millis(200));
        }
        let phase = runtime()?;
        phase.block_on(run(&config, &options, &me, journal_dir.clone(), standby))?;
        phase.shutdown_timeout(Duration::from_millis(200));
        standby = true;
    }
}

/// Holds an exclusive lock on the journal directory for the process's
/// life (the returned guard): two controllers writing one journal would
/// corrupt it.
fn lock_journal_dir(dir: &std::path::Path) -> Result<nix::fcntl::Flock<std::fs::File>, ServiceError> {
    let io = |what: String| move |error| ServiceError::Io { what, error };
    std::fs::create_dir_all(dir).map_err(io(format!("cannot create the journal directory {}", dir.display())))?;
    let path = dir.join("controller.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(format!("cannot open {}", path.display())))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        ServiceError::Remote(format!(
            "the journal directory {} is in use by another controller ({errno}); give each controller its own \
             (--journal-dir)",
            dir.display()
        ))
    })
}

/// The primary phase: runs until a controller with a higher epoch is
/// seen. With a state directory, the listening addresses are written to
/// `controller.addr` (and `metrics.addr` when `MetricsPort` is set).
async fn run(
    config: &StaticConfig,
    options: &ControllerOptions,
    me: &str,
    journal_dir: Option<PathBuf>,
    took_over: bool,
) -> Result<(), ServiceError> {
    let (config, state_dir, launcher) = (config.clone(), options.state_dir.clone(), options.launcher.clone());
    let tokens = &options.tokens;
    let can_scale = launcher.as_ref().is_some_and(|l| l.can_scale());
    let dynamic = match &config.dynamic_config {
        Some(path) => {
            let dynamic = DynamicConfig::load(path)?;
            dynamic.supported(path, can_scale)?;
            dynamic
        }
        None => DynamicConfig::default(),
    };
    let listener = TcpListener::bind(me)
        .await
        .map_err(|error| ServiceError::Io { what: format!("cannot listen on {me}"), error })?;
    let local = listener.local_addr().map_err(|error| ServiceError::Io { what: "local_addr".into(), error })?;
    tracing::info!(address = %local, "controller listening");
    for ignored in config.ignored_keys() {
        tracing::warn!("{ignored}");
    }
    let mut journal = match &journal_dir {
        Some(dir) => Some(Journal::open(dir).map_err(|err| ServiceError::Remote(err.to_string()))?),
        None => {
            tracing::warn!(
                "no ControllerStateDir and no --state-dir: a restarted controller will forget every version in agent memory"
            );
            None
        }
    };
    if let Some(journal) = journal.as_mut().filter(|j| j.state().epoch == 0) {
        let first = Event::Epoch { epoch: 1, took_over_unix_ms: None, takeovers: 0 };
        journal.append(&first).map_err(|err| ServiceError::Remote(err.to_string()))?;
    }
    let epoch = journal.as_ref().map_or(1, |j| j.state().epoch);
    let pfs = config.pfs_dir.clone().map(icheck_core::pfs::PfsStore::new);
    let (apps, incarnation) = match &journal {
        Some(journal) => {
            let report = journal.report();
            if let Some(damage) = &report.damage {
                tracing::error!("{damage}");
            }
            let replayed = journal.state();
            tracing::info!(
                journal = %report.path,
                incarnation = replayed.incarnation,
                epoch,
                apps = replayed.apps.len(),
                "replayed the controller journal; versions count once the managers confirm them"
            );
            (journaled_apps(&replayed.apps, pfs.as_ref()), replayed.incarnation)
        }
        None => (BTreeMap::new(), 0),
    };
    // After a takeover, managers first wait out the old primary's silence
    // (up to twice the takeover window) before they look for this one.
    let reconcile_window = config.heartbeat() * config.missed_heartbeats.max(1)
        + Duration::from_secs(5)
        + if took_over { config.takeover_after() * 2 } else { Duration::ZERO };
    let controllers = config.controller_endpoints();
    let shared = Arc::new(Shared {
        started: Instant::now(),
        tokens: tokens.clone(),
        pfs,
        heartbeat: config.heartbeat(),
        missed: config.missed_heartbeats,
        client_idle: config.client_idle_timeout(),
        node_groups: config.node_groups.clone(),
        launcher,
        releasing: Mutex::new(BTreeSet::new()),
        relaunch_limit: config.manager_relaunches,
        kill_silent_after: config.kill_silent_manager_after(),
        state: Mutex::new(State {
            nodes: NodeBook::new(config.heartbeat(), config.missed_heartbeats),
            startup_settled: apps.is_empty(),
            apps,
            pending: Awaiting::default(),
            placing: BTreeSet::new(),
            takeovers: RankRequests::default(),
            next_agent: u64::from(incarnation) * AGENT_IDS_PER_INCARNATION + 1,
            journal,
            holdings: Holdings::new(),
            piece_holdings: BTreeMap::new(),
            reconcile_by: Instant::now() + reconcile_window,
            epoch,
            lease: {
                let mut lease = Lease::new(config.takeover_after(), controllers.len() > 1);
                if took_over {
                    lease.took_over();
                }
                lease
            },
            standby: None,
        }),
        dynamic: RwLock::new(dynamic),
        me: me.to_string(),
        controllers,
        window: config.takeover_after(),
        step_down: tokio::sync::Notify::new(),
        acked: tokio::sync::Notify::new(),
    });
    if let Some(dir) = &state_dir {
        write_address(dir, "controller.addr", &local.to_string())?;
    }
    if let Some(path) = config.dynamic_config.clone() {
        tokio::spawn(reload_dynamic(shared.clone(), path));
    }
    if let Some(port) = config.metrics_port {
        let host = icheck_core::config::split_port(me).map_or(me, |(host, _)| host);
        let address = format!("{host}:{port}");
        let metrics = TcpListener::bind(&address)
            .await
            .map_err(|error| ServiceError::Io { what: format!("cannot listen for /metrics on {address}"), error })?;
        let local = metrics.local_addr().map_err(|error| ServiceError::Io { what: "local_addr".into(), error })?;
        tracing::info!(address = %local, "metrics at http://{local}/metrics");
        if let Some(dir) = &state_dir {
            write_address(dir, "metrics.addr", &local.to_string())?;
        }
        let shared = shared.clone();
        let readers = std::iter::once(tokens.admin.clone()).chain(tokens.metrics.clone()).collect();
        tokio::spawn(super::metrics::serve(metrics, readers, move || status_report(&shared, Privilege::Admin)));
    }
    tokio::spawn(watch_liveness(shared.clone()));
    if can_scale {
        tokio::spawn(scaler::run(shared.clone()));
        tokio::spawn(scaler::run_reactive(shared.clone()));
    }
    if shared.controllers.len() > 1 {
        tokio::spawn(watch_partners(shared.clone()));
    }
    // A flood of connections that never authenticate holds at most
    // MAX_UNAUTHENTICATED descriptors, each for HELLO_TIMEOUT at most;
    // beyond that, new ones are closed at once.
    let mut listener = crate::accept::BoundedListener::new(listener, MAX_UNAUTHENTICATED, "controller", "a Hello");
    loop {
        let (stream, peer, permit) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shared.step_down.notified() => return Ok(()),
        };
        stream.set_nodelay(true).ok();
        let shared = shared.clone();
        tokio::spawn(async move {
            if let Err(err) = serve_connection(shared, stream, peer, permit).await {
                match err {
                    ProtocolError::Closed => tracing::debug!(%peer, "connection closed"),
                    err => tracing::warn!(%peer, %err, "connection dropped"),
                }
            }
        });
    }
}

/// The applications a journal remembers, as entries waiting for
/// reconciliation: their journaled agents count as theirs until the
/// managers say otherwise, and no version counts until the stores confirm
/// it ([`reconcile_pending`]).
fn journaled_apps(
    journaled: &BTreeMap<String, JournaledApp>,
    pfs: Option<&icheck_core::pfs::PfsStore>,
) -> BTreeMap<String, AppEntry> {
    journaled
        .iter()
        .filter_map(|(name, app)| {
            let registration = app.registration.clone()?;
            let on_pfs = pfs.and_then(|pfs| pfs.latest_record(name).ok().flatten()).map(|r| r.version);
            let adaptation = apps::Adaptation { sized_for: decide::mapping_units(&registration), ..Default::default() };
            let entry = AppEntry {
                homes: app.agents.iter().map(|a| a.node.clone()).collect(),
                agents: app.agents.clone(),
                owner: app.owner,
                registration,
                latest: None,
                persisted: app.persisted,
                copies: CopyBook::new(on_pfs),
                finishing: false,
                adaptation,
                unconfirmed: Some(app.versions.clone()),
                dropped: Vec::new(),
                abandoned: Vec::new(),
                protection: app.protected.as_ref().map(ProtectionBook::from_journal).unwrap_or_default(),
                transfer: None,
                unreached: BTreeMap::new(),
            };
            Some((name.clone(), entry))
        })
        .collect()
}

/// Re-reads the dynamic configuration every `readInterval` if the file
/// changed since the last read (its `FileIdentity`: inode, size, change
/// times); a broken file is rejected with a logged reason and the previous
/// settings stay.
async fn reload_dynamic(shared: Arc<Shared>, path: PathBuf) {
    let mut last_error = String::new();
    let mut last_read = FileIdentity::of_path(&path);
    loop {
        let every = shared.dynamic().read_every();
        tokio::time::sleep(every).await;
        // An unchanged file is not parsed again: `icheck up` re-reads every
        // 2 s, and parsing is most of what an idle controller does.
        // A file that cannot be read is read (and its error reported) anyway.
        let identity = FileIdentity::of_path(&path);
        if identity.is_some() && identity == last_read {
            continue;
        }
        last_read = identity;
        let can_scale = shared.launcher.as_ref().is_some_and(|l| l.can_scale());
        match DynamicConfig::load(&path).and_then(|new| new.supported(&path, can_scale).map(|()| new)) {
            Ok(new) => {
                last_error.clear();
                let mut current = shared.dynamic.write().unwrap_or_else(|p| p.into_inner());
                if *current != new {
                    tracing::info!(file = %path.display(), "dynamic configuration changed; applying it");
                    *current = new;
                }
            }
            Err(err) => {
                let text = err.to_string();
                if text != last_error {
                    tracing::error!("rejected dynamic configuration, keeping the previous settings: {text}");
                    last_error = text;
                }
            }
        }
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
    unauthenticated: tokio::sync::OwnedSemaphorePermit,
) -> Result<(), ProtocolError> {
    let hello = framing::recv_hello(&mut stream, HELLO_TIMEOUT).await?;
    let privilege = match protocol::admit_hello(&hello, &accepted_tokens(&shared.tokens)) {
        Ok(privilege) => privilege,
        Err(reason) => {
            tracing::warn!(%peer, role = ?hello.role, %reason, "refused a peer");
            framing::send(&mut stream, &HelloReply::Refused(reason)).await?;
            return Ok(());
        }
    };
    // Authenticated: it no longer counts against the waiting connections.
    drop(unauthenticated);
    // The fencing rule: a peer that has seen a higher epoch knows of a
    // newer primary; this one must not act, and becomes a standby.
    let epoch = shared.state().epoch;
    if hello.epoch > epoch {
        let reason = format!(
            "controller {} has epoch {epoch}, but {peer} has seen epoch {}: it was replaced",
            shared.me, hello.epoch
        );
        framing::send(&mut stream, &not_primary(&shared, reason.clone())).await?;
        shared.step_down(&reason);
        return Ok(());
    }
    if hello.role == Role::Standby {
        return replica_stream(shared, stream, peer).await;
    }
    if let Err(reason) = shared.may_act() {
        framing::send(&mut stream, &not_primary(&shared, reason)).await?;
        return Ok(());
    }
    framing::send(&mut stream, &HelloReply::Primary { epoch }).await?;
    match hello.role {
        Role::Manager => serve_manager(shared, stream).await,
        Role::Client | Role::Standby => serve_client(shared, stream, privilege, peer).await,
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The tokens a controller admits, with what each allows.
fn accepted_tokens(tokens: &DaemonTokens) -> [(Privilege, &str); 3] {
    [(Privilege::Client, &tokens.client), (Privilege::Admin, &tokens.admin), (Privilege::Node, &tokens.node)]
}

/// Events this controller's journal recorded (0 without one).
fn sequence(shared: &Shared) -> u64 {
    shared.state().journal.as_ref().map_or(0, |j| j.state().sequence)
}

/// The answer of a controller that is not acting as the primary: why, and
/// its epoch and journal length (what a partner compares with its own).
fn not_primary(shared: &Shared, reason: String) -> HelloReply {
    let epoch = shared.state().epoch;
    HelloReply::NotPrimary { reason, epoch, sequence: sequence(shared) }
}

async fn serve_client(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    privilege: Privilege,
    peer: std::net::SocketAddr,
) -> Result<(), ProtocolError> {
    // The Unix user behind a local client's socket (None: another host).
    let seen_uid = stream.local_addr().ok().and_then(|local| crate::peercred::socket_owner(local, peer));
    loop {
        // An idle client holds a descriptor and a task: after
        // `ClientIdleTimeout` it is closed (the library opens a new
        // connection when it next needs one). A frame read cut short leaves
        // the stream mid-frame, which is why the connection ends here.
        let next = framing::recv_limited(&mut stream, protocol::MAX_CLIENT_REQUEST);
        let Ok(request) = tokio::time::timeout(shared.client_idle, next).await else {
            tracing::debug!(%peer, idle = ?shared.client_idle, "closed an idle client connection");
            return Ok(());
        };
        let request: ClientRequest = request?;
        // Checked before anything is done: a primary paused past its lease
        // finds requests queued meanwhile, and must not act on them. A
        // status report acts on nothing: it is always answered.
        let acts = !matches!(request, ClientRequest::Status | ClientRequest::AppStatus { .. });
        if acts {
            if let Err(reason) = shared.may_act() {
                framing::send(&mut stream, &ClientReply::NotPrimary(reason)).await?;
                continue;
            }
        }
        if let Err(reason) = authorize(&shared, &request, privilege, seen_uid) {
            tracing::warn!(%peer, ?privilege, %reason, "refused a request");
            framing::send(&mut stream, &ClientReply::Error(reason)).await?;
            continue;
        }
        let reply = match request {
            ClientRequest::Status => ClientReply::Status(status_report(&shared, privilege)),
            ClientRequest::AppStatus { name, .. } => {
                let node_failure = shared.dynamic().node_failure_probability;
                let state = shared.state();
                ClientReply::AppStatus(
                    state
                        .apps
                        .get(&name)
                        .map(|a| Box::new(app_report(&name, a, &state.nodes, node_failure, Instant::now()))),
                )
            }
            ClientRequest::RegisterApp { registration, capability, uid } => {
                let span = tracing::info_span!("register", app = %registration.name);
                let claim = apps::Claim { presented: capability.as_deref(), reported: uid, seen: seen_uid };
                match register_app(&shared, registration, &claim, Placement::Start).instrument(span).await {
                    Ok((agents, latest, capability)) => {
                        ClientReply::Registered { agents, latest, capability: capability.expose().to_string() }
                    }
                    Err(reason) => {
                        tracing::warn!(%peer, %reason, "registration refused");
                        ClientReply::Error(reason.to_string())
                    }
                }
            }
            ClientRequest::VersionComplete {
                name,
                version,
                bytes,
                commit_secs,
                spilled,
                epoch,
                agents,
                transfer,
                ..
            } => {
                let sample = CommitSample { version, bytes, commit_secs, agents: 0 };
                await_reconciled(&shared, &name).await;
                let reply = record_version(&shared, &name, sample, spilled, epoch, &agents);
                if reply == ClientReply::Ok && transfer.is_some() {
                    if let Some(app) = shared.state().apps.get_mut(&name) {
                        app.transfer = transfer;
                    }
                }
                reply
            }
            ClientRequest::Probe { name, agents, remaining_commits, capability, at_init, unreachable } => {
                let span = tracing::info_span!("probe", app = %name);
                await_reconciled(&shared, &name).await;
                let asked =
                    ProbeAsked { known: &agents, remaining: remaining_commits, at_init, unreachable: &unreachable };
                probe(&shared, &name, &capability, asked).instrument(span).await
            }
            ClientRequest::FinishApp { name, persist, .. } => finish_app(&shared, &name, persist),
            ClientRequest::DeleteApp { name } => delete_app(&shared, &name).await,
            ClientRequest::DrainNode { node, drain } => drain_node(&shared, &node, drain),
            ClientRequest::ReleaseNodes { nodes, count } => scaler::release_nodes(&shared, nodes, count),
            ClientRequest::FlushApp { name, .. } => flush_app(&shared, &name),
        };
        // What the reply acknowledges is on the standby too, or the client
        // hears that this controller could not make sure it was.
        let reply = if acts {
            match replicated(&shared).await {
                Err(reason) => ClientReply::NotPrimary(format!(
                    "{reason}; what was asked may not be recorded, so ask the primary again"
                )),
                Ok(()) => reply,
            }
        } else {
            reply
        };
        framing::send(&mut stream, &reply).await?;
    }
}

/// Whether a peer admitted with `privilege` may make `request`: operators'
/// commands need the admin token; requests about an application need its
/// capability, from its owner's Unix user where the socket shows it
/// (`seen_uid`) (checked here for applications the controller knows; for
/// others the request fails on its own).
fn authorize(
    shared: &Shared,
    request: &ClientRequest,
    privilege: Privilege,
    seen_uid: Option<u32>,
) -> Result<(), String> {
    let (name, capability) = match request {
        ClientRequest::Status | ClientRequest::RegisterApp { .. } => return Ok(()),
        ClientRequest::DeleteApp { .. } | ClientRequest::DrainNode { .. } | ClientRequest::ReleaseNodes { .. } => {
            return match privilege {
                Privilege::Admin => Ok(()),
                _ => Err("this command needs the admin token (AdminToken, or ICHECK_ADMIN_TOKEN)".into()),
            }
        }
        ClientRequest::AppStatus { .. } | ClientRequest::FlushApp { .. } if privilege == Privilege::Admin => {
            return Ok(())
        }
        ClientRequest::AppStatus { name, capability }
        | ClientRequest::FlushApp { name, capability }
        | ClientRequest::VersionComplete { name, capability, .. }
        | ClientRequest::Probe { name, capability, .. }
        | ClientRequest::FinishApp { name, capability, .. } => (name, capability),
    };
    let state = shared.state();
    match state.apps.get(name) {
        Some(app) => apps::check_capability(name, app.owner.as_ref(), capability, seen_uid),
        None => Ok(()),
    }
}

/// `name`'s protection just completed (its book's `protected` is the
/// version): recorded in its history, journaled, and the older versions'
/// pieces dropped.
fn version_protected(state: &mut State, name: &str) {
    let Some(app) = state.apps.get_mut(name) else { return };
    let book = &mut app.protection;
    let Some(protected) = &book.protected else { return };
    let done = protected.version();
    let secs = book.began.take().filter(|(v, _)| *v == done).map(|(_, at)| at.elapsed().as_secs_f64());
    if let Some(secs) = secs {
        book.history.push_back((done, secs));
        if book.history.len() > protection::PROTECTION_HISTORY {
            book.history.pop_front();
        }
    }
    tracing::info!(app = %name, version = done, policy = %book.policy, ?secs, "version protected");
    let drops: Vec<String> = book.nodes().into_iter().collect();
    // A re-planned version: what each node keeps of it under the new plan
    // (every node is told, since the old plan's holders may be others).
    let replanned = (book.replanned.take() == Some(done)).then(|| {
        let nodes = state.nodes.snapshot(Instant::now());
        nodes.into_iter().filter(|n| n.alive).map(|n| (protected.pieces_on(&n.node), n.node)).collect::<Vec<_>>()
    });
    // Journaled, so that a restarted controller (or the standby) can still
    // rebuild it after a lost node.
    let event = Event::Protected { app: name.to_string(), protection: protected.journaled() };
    match journal(state, &event) {
        // Only once the journal names the new version (or plan) do the
        // older pieces go: a controller restarted in between finds those
        // its journal names.
        Ok(()) => {
            for holder in drops {
                state.nodes.send(&holder, ControllerToManager::DropPieces { app: name.to_string(), below: done });
            }
            for (keep, node) in replanned.into_iter().flatten() {
                let drop = ControllerToManager::DropStalePieces { app: name.to_string(), version: done, keep };
                state.nodes.send(&node, drop);
            }
            drop_pieces_on_returned_nodes(state, name);
        }
        Err(reason) => tracing::error!(
            %reason,
            "cannot journal a protected version: a restarted controller would not know it (the older version's \
             pieces are kept)"
        ),
    }
}

/// Starts protecting `name`'s newest version on its agents (its policy's
/// pieces requested from them), replacing any protection under way.
fn start_protection(shared: &Shared, state: &mut State, name: &str) {
    let policy = {
        let Some(app) = state.apps.get(name) else { return };
        shared.dynamic().redundancy_for(&app.registration)
    };
    let Some(app) = state.apps.get_mut(name) else { return };
    app.protection.policy = policy;
    let Some(record) = app.latest.clone() else { return };
    let version = record.version;
    if !policy.is_none() && app.agents.len() != app.homes.len() {
        app.protection.problem = Some(format!("version {version} is not protected: some of its agents are lost"));
        return;
    }
    let units = decide::mapping_units(&app.registration);
    let holders = |book: &protection::ProtectionBook| book.protected.as_ref().map(|p| (p.version(), p.agents.clone()));
    let before = holders(&app.protection);
    let requests = app.protection.begin(&record, units, &app.agents, &|node| shared.node_groups.get(node).cloned());
    let after = holders(&app.protection);
    if after != before && after.as_ref().is_some_and(|(v, _)| *v == version) {
        // Repaired with no piece to build: protected on its new agents.
        version_protected(state, name);
        return;
    }
    app.protection.began = (!requests.is_empty()).then(|| (version, Instant::now()));
    if let Some(problem) = &app.protection.problem {
        tracing::warn!(app = name, %policy, %problem, "redundancy cannot be placed");
    }
    // Before any piece is asked for (and before the application hears the
    // version is complete): its primaries keep it while it is protected.
    if !requests.is_empty() {
        let nodes: BTreeSet<&String> = app.agents.iter().map(|a| &a.node).collect();
        for node in nodes {
            state.nodes.send(node, ControllerToManager::Protecting { app: name.to_string(), version });
        }
    }
    for (agent, node, task) in requests {
        state.nodes.send(&node, ControllerToManager::Protect { agent, task });
    }
}

/// Records a complete version (all-or-nothing is the library's job: it
/// reports only after every rank stored its data).
fn record_version(
    shared: &Shared,
    name: &str,
    sample: CommitSample,
    spilled: bool,
    epoch: u32,
    stored_on: &[u64],
) -> ClientReply {
    let CommitSample { version, bytes, commit_secs, .. } = sample;
    let mut state = shared.state();
    let state = &mut *state;
    let Some(app) = state.apps.get_mut(name) else {
        return ClientReply::Error(format!("no application named {name:?} is registered"));
    };
    // Only a version stored on the application's agents counts: one stored
    // on agents given up meanwhile (a silent node) may live only where it
    // is about to be dropped. (An empty list: a library that does not say.)
    let agents: Vec<u64> = app.agents.iter().map(|a| a.id).collect();
    if !stored_on.is_empty() && stored_on != agents.as_slice() {
        tracing::warn!(app = name, version, ?stored_on, ?agents, "version stored on agents given up; not recorded");
        // Its new agents, so that the library moves there; none while some
        // are still to be placed (a Probe places them).
        let complete = !app.agents.is_empty() && app.agents.len() == app.homes.len();
        return ClientReply::Agents(if complete { app.agents.clone() } else { Vec::new() });
    }
    // The library sends a request again when its controller went away
    // before answering: a version already recorded (by this controller, or
    // by the primary it took over from) is simply confirmed.
    if app.latest.as_ref().is_some_and(|l| l.version == version && l.bytes == bytes && l.epoch == epoch) {
        tracing::info!(app = name, version, "version already recorded; confirmed again");
        return ClientReply::Ok;
    }
    let completed_unix_ms = unix_ms();
    let before = (app.latest.clone(), app.adaptation.commits.clone());
    let Recorded { resized, due } = match app.record(name, sample, epoch, completed_unix_ms) {
        Ok(recorded) => recorded,
        Err(message) => return ClientReply::Error(message),
    };
    // `enable_multi_level = false` turns the PFS level's copies off (a
    // spilled version is still completed there: its ranks are there already).
    let due = due && shared.dynamic().enable_multi_level;
    // Durable before the application hears the version is complete.
    let record = app.latest.clone().expect("just recorded");
    let event =
        Event::VersionComplete { app: name.to_string(), record, writers: decide::mapping_units(&app.registration) };
    if let Err(reason) = journal(state, &event) {
        if let Some(app) = state.apps.get_mut(name) {
            (app.latest, app.adaptation.commits) = before;
        }
        return ClientReply::Error(reason);
    }
    drop_obsolete_files(state);
    let app = state.apps.get_mut(name).expect("recorded above, under the same lock");
    tracing::info!(app = name, version, bytes, commit_secs, "version complete");
    if let Some((before, stale)) = resized {
        drop_moved_ranks(&state.nodes, name, stale.iter().map(|(rank, node)| (*rank, node.as_str())));
        tracing::info!(app = name, from = before, to = app.registration.ranks, epoch, "first version after a resize");
    }
    // Commits may come faster than copies. Queueing a copy per version would
    // make the agents keep every one of them in memory; instead the newest
    // due version waits (it is the newest, so no agent prunes it) and an
    // older waiting one is skipped, counted where operators look (CopyBook).
    // §6.2.3.2: the copy of v starts once every agent holds v, which the
    // library's VersionComplete says; each agent copies its ranks. A spilled
    // version is copied whatever the interval: the spilled ranks are on the
    // PFS only, and the copy completes the version there.
    let can_copy = shared.pfs.is_some() && !app.agents.is_empty();
    match app.copies.on_recorded(version, due, spilled, can_copy) {
        OnRecorded::CopyNow => request_pfs_copy(&state.nodes, app, version, shared.dynamic().max_cp_size.0),
        OnRecorded::Deferred => {
            tracing::debug!(app = name, version, "PFS copy deferred: the previous copy is still running");
        }
        OnRecorded::Nothing => {}
    }
    // For the tests: a version left unprotected, as when a node is lost
    // before its pieces are built.
    if icheck_core::failpoint::fails("controller.protect_recorded") {
        tracing::warn!(app = name, version, "failpoint: the version is not protected");
    } else if app.protection.defer(version, Instant::now()) {
        tracing::debug!(
            app = name,
            version,
            under_way = app.protection.protecting(),
            "protection waits for the one under way"
        );
    } else {
        start_protection(shared, state, name);
    }
    // A crash here: the version is recorded, but neither the application
    // nor its agents hear so (no Complete, so the agents keep the older one).
    icheck_core::failpoint::hit("controller.after_record_version");
    ClientReply::Ok
}

/// The newest version of `name` on the PFS, as a record (a fresh controller
/// knows nothing else about an application whose agents are all gone), with
/// the mode its files were written in where the PFS recorded it.
/// An error names the damaged file: no PFS version was readable although
/// some exist, which must not pass for a fresh start.
fn pfs_latest(shared: &Shared, name: &str) -> Result<Option<(VersionRecord, Option<TransferMode>)>, String> {
    let Some(pfs) = shared.pfs.as_ref() else { return Ok(None) };
    let manifest = pfs.latest_manifest(name).map_err(|err| err.to_string())?;
    Ok(manifest.map(|manifest| {
        tracing::info!(app = name, version = manifest.version, mode = ?manifest.mode, "complete version on the PFS");
        (icheck_core::pfs::PfsStore::record(&manifest), manifest.mode)
    }))
}

/// Collects the agents' parts of a PFS copy; the last one completes it.
fn pfs_copied(
    shared: &Arc<Shared>,
    agent: u64,
    version: u64,
    result: Result<(Vec<icheck_core::pfs::RankEntry>, PfsCopyStats), String>,
    superseded: bool,
) {
    let mut state = shared.state();
    let Some((name, app)) = state.apps.iter_mut().find(|(_, a)| a.agents.iter().any(|x| x.id == agent)) else {
        return;
    };
    let name = name.clone();
    if superseded {
        if app.copies.superseded(version) {
            let reason = result.err().unwrap_or_default();
            tracing::info!(app = %name, version, agent, %reason, "PFS copy overtaken by a newer version; copying that one");
        }
        start_deferred_copy(shared, &mut state, &name);
        return;
    }
    if let Err(reason) = &result {
        tracing::warn!(app = %name, version, agent, %reason, "PFS copy failed; the previous PFS version stays");
    }
    let (entries, stats) = match app.copies.answered(version, result) {
        Answered::Whole(entries, stats) => (entries, stats),
        Answered::Waiting | Answered::Unknown => return,
        Answered::Failed => {
            if app.finishing && app.copies.idle() {
                stop_and_forget(&mut state, &name);
            }
            start_deferred_copy(shared, &mut state, &name);
            return;
        }
    };
    let (ranks, mode) = (app.registration.ranks, app.registration.mode);
    let (shared, pfs) = (shared.clone(), shared.pfs.clone());
    tokio::task::spawn_blocking(move || {
        let Some(pfs) = pfs else { return };
        let completed = pfs.complete(&name, version, ranks, "agents", mode, entries);
        match &completed {
            Ok(()) => tracing::info!(
                app = %name,
                version,
                ratio = stats.ratio(),
                compress_secs = stats.compress_secs,
                write_secs = stats.write_secs,
                "version copied to the PFS"
            ),
            Err(err) => tracing::warn!(app = %name, version, %err, "cannot complete the PFS copy"),
        }
        if completed.is_ok() {
            // What failed copies of older versions left can go now (file I/O:
            // outside the state lock; copies under way keep their partials).
            let in_flight: BTreeSet<u64> =
                shared.state().apps.get(&name).map(|a| a.copies.in_flight()).unwrap_or_default();
            match pfs.remove_stale_partials(&name, version, &in_flight) {
                Ok(0) => {}
                Ok(removed) => tracing::info!(app = %name, removed, "removed abandoned partial PFS versions"),
                Err(err) => tracing::warn!(app = %name, %err, "cannot remove abandoned partial PFS versions"),
            }
        }
        let mut state = shared.state();
        if let Some(app) = state.apps.get_mut(&name) {
            app.copies.completed(version, completed.map_err(|e| e.to_string()), stats);
            // Stop only when no copy is still under way (an earlier
            // interval copy may finish before the final flush).
            if app.finishing && app.copies.idle() {
                tracing::info!(app = %name, "flushed; stopping its agents");
                stop_and_forget(&mut state, &name);
            }
        }
        start_deferred_copy(&shared, &mut state, &name);
    });
}

/// Starts the copy that waited for the previous one (see `pfs_deferred`),
/// once no copy of the application runs: of its newest complete version,
/// which its agents still hold, and which may be newer than the one that
/// waited (that one then counts as skipped).
fn start_deferred_copy(shared: &Shared, state: &mut State, name: &str) {
    let state = &mut *state;
    let Some(app) = state.apps.get_mut(name) else { return };
    let newest = app.latest.as_ref().map(|l| l.version);
    let Some(newest) = app.copies.next_deferred(newest, app.finishing, !app.agents.is_empty()) else { return };
    tracing::info!(
        app = name,
        version = newest,
        "copying the newest version to the PFS (it waited for the previous copy)"
    );
    request_pfs_copy(&state.nodes, app, newest, shared.dynamic().max_cp_size.0);
}

/// Operators: drain a node (no new agents; its agents move away on their
/// applications' next probes) or open it again.
fn drain_node(shared: &Shared, node: &str, drain: bool) -> ClientReply {
    let mut state = shared.state();
    if !state.nodes.is_known(node) {
        // set_draining names the known nodes.
        if let Err(message) = state.nodes.set_draining(node, drain) {
            return ClientReply::Error(message);
        }
    }
    if let Err(reason) = journal(&mut state, &Event::Drained { node: node.to_string(), drain }) {
        return ClientReply::Error(reason);
    }
    let agents = match state.nodes.set_draining(node, drain) {
        Ok(agents) => agents,
        Err(message) => return ClientReply::Error(message),
    };
    if drain {
        tracing::info!(node, agents, "node draining: its agents move away on their applications' next probes");
    } else {
        tracing::info!(node, "node open for agents again");
    }
    ClientReply::Ok
}

/// Tells each node to delete the given ranks of `app` from its store.
fn drop_moved_ranks<'a>(nodes: &ManagerBook, app: &str, ranks: impl Iterator<Item = (u32, &'a str)>) {
    let mut by_node: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (rank, node) in ranks {
        by_node.entry(node).or_default().push(rank);
    }
    for (node, ranks) in by_node {
        nodes.send(node, ControllerToManager::DropRanks { app: app.to_string(), ranks });
    }
}

/// Operators: stop the application's agents, delete its files from agent
/// memory and the PFS, and forget it.
async fn delete_app(shared: &Arc<Shared>, name: &str) -> ClientReply {
    if let Err(err) = icheck_core::format::check_app_name(name) {
        return ClientReply::Error(err.to_string());
    }
    let known = stop_and_forget(&mut shared.state(), name);
    let on_pfs = match &shared.pfs {
        Some(pfs) => {
            let (pfs, app) = (pfs.clone(), name.to_string());
            let removed = tokio::task::spawn_blocking(move || {
                let had = pfs.latest(&app).ok().flatten().is_some();
                pfs.remove_app(&app).map(|_| had)
            })
            .await;
            match removed {
                Ok(Ok(had)) => had,
                Ok(Err(err)) => return ClientReply::Error(err.to_string()),
                Err(err) => return ClientReply::Error(format!("PFS removal failed: {err}")),
            }
        }
        None => false,
    };
    if !known && !on_pfs {
        return ClientReply::Error(format!("no checkpoints of {name:?} are known (in agent memory or on the PFS)"));
    }
    tracing::info!(app = name, "application deleted by an operator");
    ClientReply::Ok
}

/// Starts a PFS copy of the application's newest complete version unless
/// one exists or runs (a job's time-limit warning: `icheck run` asks).
fn flush_app(shared: &Shared, name: &str) -> ClientReply {
    if shared.pfs.is_none() || !shared.dynamic().enable_multi_level {
        return ClientReply::Error(
            "no PFS level to flush to (PfsDir is not set, or enable_multi_level = false)".to_string(),
        );
    }
    let mut state = shared.state();
    let state = &mut *state;
    let Some(app) = state.apps.get_mut(name) else {
        return ClientReply::Error(format!("no application named {name:?} is registered"));
    };
    let Some(version) = app.latest.as_ref().map(|l| l.version) else {
        return ClientReply::Error(format!("{name} has no complete version yet"));
    };
    if app.copies.copied >= Some(version) || app.copies.is_pending(version) {
        return ClientReply::Ok;
    }
    if app.agents.is_empty() {
        return ClientReply::Error(format!("{name}'s agents are gone; version {version} cannot be copied"));
    }
    tracing::info!(app = name, version, "flushing the newest version to the PFS on request");
    request_pfs_copy(&state.nodes, app, version, shared.dynamic().max_cp_size.0);
    ClientReply::Ok
}

fn finish_app(shared: &Shared, name: &str, persist: bool) -> ClientReply {
    let mut state = shared.state();
    if persist {
        if !state.apps.contains_key(name) {
            return ClientReply::Error(format!("no application named {name:?} is registered"));
        }
        if let Err(reason) = journal(&mut state, &Event::Persisted { app: name.to_string(), persisted: true }) {
            return ClientReply::Error(reason);
        }
        tracing::info!(app = name, "application finished; checkpoints persist in agent memory");
        if let Some(app) = state.apps.get_mut(name) {
            app.persisted = true;
        }
        return ClientReply::Ok;
    }
    let state = &mut *state;
    let Some(app) = state.apps.get_mut(name) else {
        return ClientReply::Error(format!("no application named {name:?} is registered"));
    };
    // An application using the PFS level keeps its newest version there.
    let unflushed = app.latest.as_ref().map(|l| l.version).filter(|v| Some(*v) > app.copies.copied);
    let pfs_level = shared.pfs.is_some() && app.registration.pfs_interval > 0 && shared.dynamic().enable_multi_level;
    if let (Some(version), true) = (unflushed, pfs_level) {
        if !app.agents.is_empty() {
            tracing::info!(app = name, version, "application finished; flushing its newest version to the PFS");
            app.finishing = true;
            if !app.copies.is_pending(version) {
                request_pfs_copy(&state.nodes, app, version, shared.dynamic().max_cp_size.0);
            }
            return ClientReply::Ok;
        }
    }
    tracing::info!(app = name, "application finished; stopping its agents and deleting its checkpoints");
    stop_and_forget(state, name);
    // Nothing of it is left anywhere: the name is free for anyone again.
    if let Some(pfs) = &shared.pfs {
        if pfs.versions(name).is_ok_and(|v| v.is_empty()) {
            if let Err(err) = pfs.release_owner(name) {
                tracing::warn!(app = name, %err, "cannot remove the application's owner record from the PFS");
            }
        }
    }
    ClientReply::Ok
}

/// Stops an application's agents (deleting their memory) and forgets it;
/// false if it was not registered.
fn stop_and_forget(state: &mut State, name: &str) -> bool {
    // Deleting memory is an act of the primary: a controller that lost its
    // lease (a PFS flush finishing late) leaves it to whoever is primary.
    if let Err(why) = state.lease.may_act(Instant::now()) {
        tracing::warn!(app = name, %why, "not stopping the application's agents: this controller may not be the primary");
        return false;
    }
    let Some(app) = state.apps.remove(name) else { return false };
    // Best effort: a forgotten application the journal still lists comes
    // back after a restart without versions (its files are gone) and is
    // placed afresh when it registers.
    let _ = journal(state, &Event::Forgotten { app: name.to_string() });
    tell_agents(&state.nodes, &app.agents, |id| ControllerToManager::StopAgent { id, discard: true });
    true
}

/// Sends each agent's manager the message `message(agent id)`; agents whose
/// manager is gone get nothing (they went with it).
fn tell_agents(nodes: &ManagerBook, agents: &[AgentInfo], message: impl Fn(u64) -> ControllerToManager) {
    for agent in agents {
        nodes.send(&agent.node, message(agent.id));
    }
}

/// Starts the PFS copy of `version`: each of the application's agents
/// copies its ranks, and `pfs_copied` collects their answers.
fn request_pfs_copy(nodes: &ManagerBook, app: &mut AppEntry, version: u64, max_cp_size: u64) {
    let bytes = app.latest.as_ref().filter(|l| l.version == version).map_or(0, |l| l.bytes);
    let compression = app.registration.compression.for_version(bytes, max_cp_size);
    app.copies.started(version, app.agents.len());
    let (units, count) = (decide::mapping_units(&app.registration), app.agents.len() as u32);
    for (index, agent) in app.agents.iter().enumerate() {
        let ranks = (0..units).filter(|r| decide::agent_for_rank(*r, units, count) == index as u32).collect();
        nodes.send(&agent.node, ControllerToManager::CopyToPfs { agent: agent.id, version, compression, ranks });
    }
}
