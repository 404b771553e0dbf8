//! The controller: registry of checkpoint nodes, agents and applications;
//! answers registrations with agent lists; tracks heartbeats; serves status.
//!
//! Owned state (all behind one mutex, never held across an await):
//! nodes (manager connection, last heartbeat, measurements), applications
//! (registration, agents), and pending agent starts.

#![forbid(unsafe_code)]

mod apps;
mod awaiting;
mod copies;
pub mod journal;
mod node_events;
mod nodes;
mod protection;
mod rebuild;
mod reconcile;
mod replica;
mod scaler;

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
use apps::{AppEntry, ProbePlan, Recorded};
use awaiting::{Answer, Awaiting, RankRequest, RankRequests};
use copies::{Answered, CopyBook, OnRecorded};
use journal::{Event, Journal, JournaledApp};
use node_events::{
    adopt_agents, check_returning_node, drop_obsolete_files, drop_pieces_on_returned_nodes, drop_stale_pieces_on,
    node_back, node_lost, ranks_lost_with_given_up_nodes, ranks_on_silent_nodes, recheck_homed_on, reconcile_pending,
    stop_stale_agents,
};
use nodes::NodeBook;
use protection::ProtectionBook;
use reconcile::Holdings;
use replica::{Lease, ToPrimary, ToStandby};

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
    /// Nodes that answered again after being given up, and until when
    /// their reports are searched for stale agents (the report stored when
    /// a node comes back may predate agents it started just before it fell
    /// silent).
    returning: HashMap<String, Instant>,
    /// The fencing epoch of this primary.
    epoch: u64,
    /// This primary's lease and its standby's progress.
    lease: Lease,
    /// The attached standby's stream: every journaled event goes there.
    standby: Option<mpsc::UnboundedSender<ToStandby>>,
}

/// How long a returned node's reports are searched for stale agents.
const RETURN_WINDOW: Duration = Duration::from_secs(10);

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
            returning: HashMap::new(),
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
    let waiting = Arc::new(tokio::sync::Semaphore::new(MAX_UNAUTHENTICATED));
    let mut turned_away = 0u64;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shared.step_down.notified() => return Ok(()),
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // A flood of connections that never authenticate holds at most
        // MAX_UNAUTHENTICATED descriptors, each for HELLO_TIMEOUT at most;
        // beyond that, new ones are closed at once.
        let Ok(permit) = waiting.clone().try_acquire_owned() else {
            turned_away += 1;
            if turned_away.is_power_of_two() {
                tracing::warn!(turned_away, %peer, "too many connections without a Hello; closing new ones at once");
            }
            continue;
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

/// The standby phase: follows the primary's journal (the first other
/// controller that answers as the primary at an epoch no older than the
/// one this journal has seen) and returns once it took over: the primary
/// was silent for the whole takeover window and could not be reached
/// again. Until it holds a copy of the journal, it never takes over.
async fn follow(
    config: &StaticConfig,
    tokens: &DaemonTokens,
    me: &str,
    controllers: &[String],
    dir: &std::path::Path,
) -> Result<(), ServiceError> {
    let window = config.takeover_after();
    let listener = TcpListener::bind(me)
        .await
        .map_err(|error| ServiceError::Io { what: format!("cannot listen on {me}"), error })?;
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(answer_as_standby(listener, tokens.clone(), synced.clone()));
    let mut epoch = Journal::peek(dir).epoch;
    tracing::info!(%me, epoch, ?window, "standby: following the primary");
    let mut mirror: Option<Journal> = None;
    let mut last_heard = Instant::now();
    loop {
        for peer in controllers.iter().filter(|c| c.as_str() != me) {
            let mut follower = Follower { dir, epoch, window, mirror: &mut mirror, last_heard: &mut last_heard };
            let result = follower.follow(peer, &tokens.node, &synced).await;
            epoch = follower.epoch;
            match result {
                Ok(()) => tracing::warn!(primary = %peer, "the primary ended the journal stream"),
                Err(reason) => tracing::debug!(primary = %peer, %reason, "not following"),
            }
        }
        let synced_now = synced.load(std::sync::atomic::Ordering::SeqCst);
        if replica::takeover_due(synced_now, last_heard, Instant::now(), window) {
            let journal = mirror.as_mut().expect("synced: the mirror exists");
            let state = journal.state();
            let took_over = Event::Epoch {
                epoch: state.epoch.max(epoch) + 1,
                took_over_unix_ms: Some(unix_ms()),
                takeovers: state.takeovers + 1,
            };
            journal.append(&took_over).map_err(|err| ServiceError::Remote(err.to_string()))?;
            tracing::warn!(
                silent = ?last_heard.elapsed(),
                ?took_over,
                "the primary is silent and unreachable: taking over"
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Answers every Hello while this controller is a standby: not the
/// primary, and whether it holds the journal.
async fn answer_as_standby(listener: TcpListener, tokens: DaemonTokens, synced: Arc<std::sync::atomic::AtomicBool>) {
    let waiting = Arc::new(tokio::sync::Semaphore::new(MAX_UNAUTHENTICATED));
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            // As the primary's accept loop: no spin on a lasting error.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        // As the primary's accept loop: a bounded number of waiting peers.
        let Ok(permit) = waiting.clone().try_acquire_owned() else { continue };
        let (tokens, synced) = (tokens.clone(), synced.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(hello) = framing::recv_hello(&mut stream, HELLO_TIMEOUT).await else { return };
            let reply = match protocol::admit_hello(&hello, &accepted_tokens(&tokens)) {
                Err(reason) => HelloReply::Refused(reason),
                Ok(_) => HelloReply::Standby { synced: synced.load(std::sync::atomic::Ordering::SeqCst) },
            };
            let _ = framing::send(&mut stream, &reply).await;
        });
    }
}

/// One attachment of a standby to a primary.
struct Follower<'a> {
    dir: &'a std::path::Path,
    /// The highest epoch seen.
    epoch: u64,
    window: Duration,
    mirror: &'a mut Option<Journal>,
    last_heard: &'a mut Instant,
}

impl Follower<'_> {
    /// Attaches to `peer` and follows its journal until the stream ends or
    /// is silent for the takeover window.
    async fn follow(&mut self, peer: &str, token: &str, synced: &std::sync::atomic::AtomicBool) -> Result<(), String> {
        let limit = self.window / 4;
        let attach = async {
            let mut stream = TcpStream::connect(peer).await.map_err(|e| e.to_string())?;
            stream.set_nodelay(true).ok();
            framing::send(&mut stream, &Hello::with_epoch(token, Role::Standby, self.epoch))
                .await
                .map_err(|e| e.to_string())?;
            let reply = framing::recv::<_, HelloReply>(&mut stream).await.map_err(|e| e.to_string())?;
            protocol::accept_controller(peer, reply, self.epoch).map_err(|e| e.to_string()).map(|e| (stream, e))
        };
        let (mut stream, epoch) = tokio::time::timeout(limit, attach).await.map_err(|_| "no answer".to_string())??;
        self.epoch = epoch;
        let silent = |what: &str| format!("{what} for {:?}", self.window);
        let mut events = Vec::new();
        let seq = loop {
            match tokio::time::timeout(self.window, framing::recv::<_, ToStandby>(&mut stream)).await {
                Err(_) => return Err(silent("no snapshot")),
                Ok(Err(err)) => return Err(err.to_string()),
                Ok(Ok(ToStandby::Snapshot { events: part, done, seq, .. })) => {
                    events.extend(part);
                    if done {
                        break seq;
                    }
                }
                Ok(Ok(other)) => return Err(format!("expected the journal snapshot, got {other:?}")),
            }
        };
        let journal = Journal::mirror(self.dir, &events).map_err(|e| e.to_string())?;
        *self.mirror = Some(journal);
        synced.store(true, std::sync::atomic::Ordering::SeqCst);
        *self.last_heard = Instant::now();
        tracing::info!(primary = %peer, epoch, events = events.len(), "standby synced with the primary's journal");
        let (mut synced_seq, mut beat) = (seq, 0);
        loop {
            let message = match tokio::time::timeout(self.window, framing::recv::<_, ToStandby>(&mut stream)).await {
                Err(_) => return Err(silent("the primary said nothing")),
                Ok(Err(ProtocolError::Closed)) => return Ok(()),
                Ok(Err(err)) => return Err(err.to_string()),
                Ok(Ok(message)) => message,
            };
            *self.last_heard = Instant::now();
            match message {
                ToStandby::Append { seq, event } => {
                    let journal = self.mirror.as_mut().expect("set above");
                    journal.append(&event).map_err(|e| format!("cannot keep the journal copy: {e}"))?;
                    self.epoch = self.epoch.max(journal.state().epoch);
                    synced_seq = seq;
                }
                ToStandby::Beat { id } => beat = id,
                ToStandby::Snapshot { .. } => return Err("a second snapshot on one stream".into()),
            }
            let ack = ToPrimary::Ack { seq: synced_seq, beat };
            framing::send(&mut stream, &ack).await.map_err(|e| e.to_string())?;
        }
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

/// Marks managers that stop sending heartbeats down (once per outage), and
/// has those silent past `KillSilentManagerAfter` killed to start again.
async fn watch_liveness(shared: Arc<Shared>) {
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
async fn kill_silent_manager(launcher: Arc<dyn Launcher>, node: String, pid: u32, after: Duration) {
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

/// The tokens a controller admits, with what each allows.
fn accepted_tokens(tokens: &DaemonTokens) -> [(Privilege, &str); 3] {
    [(Privilege::Client, &tokens.client), (Privilege::Admin, &tokens.admin), (Privilege::Node, &tokens.node)]
}

/// A standby attached (`Standby` Hello): it gets the journal's state, then
/// every appended event and a heartbeat every eighth of the takeover
/// window; its acknowledgements renew this primary's lease.
async fn replica_stream(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Result<(), ProtocolError> {
    let refused = {
        let state = shared.state();
        if state.journal.is_none() {
            Some("this controller keeps no journal (no --state-dir or ControllerStateDir) to follow".to_string())
        } else {
            state.lease.attached().map(|other| format!("standby {other} already follows this controller"))
        }
    };
    if let Some(reason) = refused {
        framing::send(&mut stream, &not_primary(&shared, reason)).await?;
        return Ok(());
    }
    let epoch = shared.state().epoch;
    framing::send(&mut stream, &HelloReply::Primary { epoch }).await?;
    // At most two controllers: the standby is the other one.
    let peer_name = match shared.controllers.iter().find(|c| **c != shared.me) {
        Some(standby) => format!("{standby} (from {peer})"),
        None => peer.to_string(),
    };
    // The snapshot and the channel are taken under one lock: every event
    // is in the snapshot or in the channel, never in both or neither.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (events, seq) = {
        let mut state = shared.state();
        let events = state.journal.as_ref().map(|j| j.state().snapshot()).unwrap_or_default();
        state.standby = Some(tx);
        state.lease.attach(&peer_name);
        (events, state.lease.seq())
    };
    tracing::info!(standby = %peer, events = events.len(), "standby attached; sending the journal");
    let (mut reader, mut writer) = stream.into_split();
    let result = async {
        let chunks: Vec<&[Event]> = events.chunks(replica::SNAPSHOT_CHUNK).collect();
        let last = chunks.len().saturating_sub(1);
        if chunks.is_empty() {
            framing::send(&mut writer, &ToStandby::Snapshot { epoch, events: Vec::new(), done: true, seq }).await?;
        }
        for (index, chunk) in chunks.into_iter().enumerate() {
            let part = ToStandby::Snapshot { epoch, events: chunk.to_vec(), done: index == last, seq };
            framing::send(&mut writer, &part).await?;
        }
        // Acknowledgements arrive on their own task: a frame read is not
        // cancel-safe, so it never races the sends below in a select.
        let (ack_tx, mut acks) = mpsc::unbounded_channel();
        let ack_reader = tokio::spawn(async move {
            loop {
                let ack: Result<ToPrimary, ProtocolError> = framing::recv(&mut reader).await;
                let failed = ack.is_err();
                if ack_tx.send(ack).is_err() || failed {
                    break;
                }
            }
        });
        let mut beat = tokio::time::interval(shared.window / 8);
        let outcome = loop {
            tokio::select! {
                event = rx.recv() => match event {
                    Some(event) => framing::send(&mut writer, &event).await?,
                    None => break Ok(()),
                },
                _ = beat.tick() => {
                    let id = shared.state().lease.beat_sent(Instant::now());
                    framing::send(&mut writer, &ToStandby::Beat { id }).await?;
                }
                ack = acks.recv() => match ack {
                    Some(Ok(ToPrimary::Ack { seq, beat })) => {
                        shared.state().lease.acked(seq, beat);
                        shared.acked.notify_waiters();
                    }
                    Some(Err(err)) => break Err(err),
                    None => break Err(ProtocolError::Closed),
                },
            }
        };
        ack_reader.abort();
        outcome
    }
    .await;
    {
        let mut state = shared.state();
        state.standby = None;
        state.lease.detach();
    }
    shared.acked.notify_waiters();
    tracing::warn!(standby = %peer, ?result, "standby detached");
    result
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

/// Answers a probe of a partner controller, and what this primary makes of it.
enum PartnerSays {
    /// Nothing listens there, or it holds no copy of the journal: it
    /// cannot take over.
    Inert,
    /// A standby with the journal: it will attach.
    Following,
    /// A primary at this epoch.
    Primary(u64),
    /// A primary not acting (it cannot confirm its lease), at this epoch
    /// and journal sequence: it cannot take over (only a synced standby can).
    NotActing(u64, u64),
    /// No answer in time (stopped, cut off): it may be taking over.
    Silent,
}

/// Asks the controller at `peer` what it is (a client Hello, then closed).
async fn probe_partner(peer: &str, token: &str, epoch: u64, limit: Duration) -> PartnerSays {
    let attempt = async {
        let mut stream = TcpStream::connect(peer).await?;
        framing::send(&mut stream, &Hello::with_epoch(token, Role::Client, epoch))
            .await
            .map_err(std::io::Error::other)?;
        framing::recv::<_, HelloReply>(&mut stream).await.map_err(std::io::Error::other)
    };
    match tokio::time::timeout(limit, attempt).await {
        Err(_) => PartnerSays::Silent,
        Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionRefused => PartnerSays::Inert,
        Ok(Err(_)) => PartnerSays::Silent,
        Ok(Ok(HelloReply::Standby { synced: false })) => PartnerSays::Inert,
        Ok(Ok(HelloReply::Standby { synced: true })) => PartnerSays::Following,
        Ok(Ok(HelloReply::Primary { epoch })) => PartnerSays::Primary(epoch),
        Ok(Ok(HelloReply::NotPrimary { epoch, sequence, .. })) => PartnerSays::NotActing(epoch, sequence),
        Ok(Ok(_)) => PartnerSays::Silent,
    }
}

/// While no standby is attached, asks the other controllers every quarter
/// of the takeover window what they are. One that cannot take over (not
/// running, without the journal, or a primary that cannot act either) lets
/// this primary act alone. This one steps down for a primary acting at
/// its epoch or a higher one, and for one that cannot act either but is
/// at a higher epoch, or at the same epoch with a longer journal (or as
/// long and listed first): of two controllers at one epoch, the one that
/// recorded more holds the newer state.
async fn watch_partners(shared: Arc<Shared>) {
    let index = |peer: &str| shared.controllers.iter().position(|c| c == peer).unwrap_or(usize::MAX);
    let mine = index(&shared.me);
    loop {
        if shared.state().lease.attached().is_none() {
            // Two statements: the state lock is not reentrant.
            let epoch = shared.state().epoch;
            let sequence = sequence(&shared);
            let mut inert = true;
            for peer in shared.controllers.iter().filter(|c| **c != shared.me) {
                match probe_partner(peer, &shared.tokens.node, epoch, shared.window / 4).await {
                    PartnerSays::Inert => {}
                    PartnerSays::Primary(theirs) if theirs >= epoch => {
                        shared.step_down(&format!("{peer} is the primary at epoch {theirs} (this one has {epoch})"));
                        return;
                    }
                    PartnerSays::NotActing(theirs, longer)
                        if (theirs, longer, std::cmp::Reverse(index(peer)))
                            > (epoch, sequence, std::cmp::Reverse(mine)) =>
                    {
                        shared.step_down(&format!(
                            "{peer} cannot act as the primary either, but it is at epoch {theirs} with {longer} \
                             journaled events (this one: epoch {epoch}, {sequence} events)"
                        ));
                        return;
                    }
                    PartnerSays::NotActing(..) => {}
                    _ => inert = false,
                }
            }
            if inert {
                shared.state().lease.partner_inert(Instant::now());
            }
        }
        tokio::time::sleep(shared.window / 4).await;
    }
}

async fn serve_manager(shared: Arc<Shared>, stream: TcpStream) -> Result<(), ProtocolError> {
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
                let returned = state.returning.get(&node).copied();
                match returned {
                    Some(until) if Instant::now() < until => stop_stale_agents(&mut state, &node),
                    Some(_) => {
                        state.returning.remove(&node);
                    }
                    None => {}
                }
            }
            ManagerToController::AgentReady(info) => {
                let id = info.id;
                if state.pending.answer(&id, Ok(info)) {
                    state.nodes.start_answered(&node, true);
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
async fn relaunch_when_dead(shared: Arc<Shared>, node: String, pid: u32) {
    let Some(launcher) = shared.launcher.clone() else { return };
    relaunch_until_registered(&shared, launcher, &node, pid).await;
    shared.state().nodes.set_relaunching(&node, false);
}

/// Waits (at most `timeout`) until `node` is alive; whether it is.
async fn registers_within(shared: &Shared, node: &str, timeout: Duration) -> bool {
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
async fn relaunch_until_registered(shared: &Shared, launcher: Arc<dyn Launcher>, node: &str, mut pid: u32) {
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
                    state.apps.get(&name).map(|a| Box::new(app_report(&name, a, &state.nodes, node_failure))),
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
                        ClientReply::Error(reason)
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
            ClientRequest::Probe { name, agents, remaining_commits, capability, at_init } => {
                let span = tracing::info_span!("probe", app = %name);
                await_reconciled(&shared, &name).await;
                probe(&shared, &name, &agents, remaining_commits, &capability, at_init).instrument(span).await
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

/// The status; a client (not an operator) sees only the controller's own
/// part, never other applications or the nodes.
fn status_report(shared: &Shared, privilege: Privilege) -> StatusReport {
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
            state.apps.iter().map(|(name, a)| app_report(name, a, &state.nodes, node_failure)).collect()
        },
        init_agent_count: format!("{:?}", shared.dynamic().init_agent_count),
        journal: state.journal.as_ref().map(|j| Box::new(j.report())),
        controller: Some(Box::new(controller_report(shared, &state, now))),
    }
}

/// One application, as the status shows it: a newest version lost with a
/// given-up node is listed with the dropped ones, since its restart will
/// not find it.
fn app_report(name: &str, a: &AppEntry, nodes: &ManagerBook, node_failure: f64) -> AppReport {
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
    }
}

/// This controller, its epoch, lease and standby, for the status.
fn controller_report(shared: &Shared, state: &State, now: Instant) -> protocol::ControllerReport {
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

/// Why a registration places agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
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
fn mode_mismatch(
    registration: &protocol::AppRegistration,
    held: Option<(u64, protocol::TransferMode)>,
) -> Option<String> {
    mode_mismatch_in(registration, held, "agent memory")
}

/// [`mode_mismatch`] for the version a restart reads from `place`.
fn mode_mismatch_in(
    registration: &protocol::AppRegistration,
    held: Option<(u64, protocol::TransferMode)>,
    place: &str,
) -> Option<String> {
    let (version, written_in) = held?;
    (written_in != registration.mode)
        .then(|| written_in.cannot_restore_in(registration.mode, &registration.name, version, place))
}

/// §6.1.2: pick the agent count and nodes, have managers start the agents,
/// and return them. A restarting application whose agents all live gets
/// them back.
async fn register_app(
    shared: &Shared,
    registration: protocol::AppRegistration,
    claim: &apps::Claim<'_>,
    placement: Placement,
) -> Result<(Vec<AgentInfo>, Option<VersionRecord>, Capability), String> {
    icheck_core::format::check_app_name(&registration.name).map_err(|e| e.to_string())?;
    if registration.ranks == 0 || registration.nodes == 0 {
        return Err(format!("application {:?} registered with 0 ranks or 0 nodes", registration.name));
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
            return Err(format!("application {:?} is still being flushed to the PFS; try again", registration.name));
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
    {
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
                ))
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
                    None => return Err(format!("{why}; no PFS copy of {:?} exists", registration.name)),
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
                return Err(why);
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
            return Err(why);
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
            decide::choose_nodes(&snapshot, count, &config).map_err(|e| e.to_string())?
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
        waiters = send_starts(state, &spec, nodes);
    }
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
        return Err(reason);
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
    };
    state.apps.insert(name.clone(), entry);
    // New agents: the version they serve is protected again on them.
    start_protection(shared, &mut state, &name);
    drop(state);
    // A new owner is recorded beside the copies once its registration
    // succeeded (a failed one hands out no capability to match it).
    if recorded.is_none() {
        if let Some(pfs) = &shared.pfs {
            if let Err(err) = pfs.set_owner(&registration_name, &owner) {
                tracing::warn!(%err, "cannot record the application's owner on the PFS");
            }
        }
    }
    Ok((agents, latest, capability))
}

/// The owner the PFS level recorded for `name`, if any. A damaged record
/// refuses the registration: it may be the only thing between the
/// application's copies and someone else.
fn pfs_owner(shared: &Shared, name: &str) -> Result<Option<icheck_core::credentials::Owner>, String> {
    match &shared.pfs {
        None => Ok(None),
        Some(pfs) => pfs.owner(name).map_err(|err| {
            format!("cannot tell who owns {name:?}: {err}; an administrator can `icheck delete {name}`")
        }),
    }
}

/// A journaled application counts no version until the stores confirmed
/// it: waits for its nodes' managers (bounded by the reconcile window).
async fn await_reconciled(shared: &Shared, name: &str) {
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

/// An agent start the controller waits for: id, node, and the manager's answer.
type StartWaiter = (u64, String, Answer<AgentInfo>);

/// The claim of a placement on the agents it started ([`State::placing`]),
/// ended when this drops: by then the application lists them, or they
/// were stopped. Made right after [`send_starts`]; it locks the state when
/// it drops, so it must outlive every state guard of its scope (declared
/// before them).
struct Placing<'s> {
    shared: &'s Shared,
    ids: Vec<u64>,
}

impl<'s> Placing<'s> {
    fn of(shared: &'s Shared, waiters: &[StartWaiter]) -> Placing<'s> {
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
fn send_starts(state: &mut State, spec: &nodes::StartSpec<'_>, nodes: Vec<String>) -> Vec<StartWaiter> {
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
async fn await_starts(shared: &Shared, app: &str, waiters: Vec<StartWaiter>) -> Result<Vec<AgentInfo>, String> {
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
async fn manager_answer<T>(rx: Answer<T>, limit: Duration) -> Option<Result<T, String>> {
    tokio::time::timeout(limit, rx).await.ok().and_then(Result::ok)
}

/// An init's probe says its job cannot reach an agent. If the agent's
/// node missed heartbeats but is not marked down yet, the answer waits
/// (bounded) until it is, or until the node is heard again: answered at
/// once, "unchanged" would end the job's init with nothing to restart
/// from, where a moment later the controller places new agents (or, for a
/// version only that node holds, refuses naming it).
async fn wait_out_doubt(shared: &Shared, name: &str) {
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

/// §6.4.2, a probe. Agents lost with their manager are replaced first (on
/// the nodes holding the application's files when those are alive, else
/// where the placement rules say); agents on draining nodes move next (new
/// locations). Otherwise Algorithm 5 and eq. 6.11/6.12 decide whether the
/// agent count changes. The answer is `Unchanged` or the new agents, which
/// already hold every rank's newest complete version.
/// `at_init`: asked by a job's `init`, before it stored anything.
async fn probe(
    shared: &Shared,
    name: &str,
    known: &[u64],
    remaining: u32,
    capability: &str,
    at_init: bool,
) -> ClientReply {
    if at_init {
        wait_out_doubt(shared, name).await;
    }
    let config = shared.dynamic();
    let plan = {
        let mut state = shared.state();
        let state = &mut *state;
        let Some(app) = state.apps.get_mut(name) else {
            return ClientReply::Error(format!("no application named {name:?} is registered"));
        };
        let draining: Vec<usize> =
            (app.agents.iter().enumerate()).filter(|(_, a)| state.nodes.is_draining(&a.node)).map(|(i, _)| i).collect();
        // Algorithm 5 does not shrink below the nodes redundancy spreads over.
        let live = state.nodes.snapshot(Instant::now()).iter().filter(|n| n.alive && !n.draining).count();
        let wanted = config.redundancy_for(&app.registration).wanted_nodes().min(live);
        let floor = (wanted as u32).min(config.max_agents_app);
        match app.probe_plan(known, draining, remaining, floor, &config, at_init) {
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
                Ok((agents, ..)) => ClientReply::Agents(agents),
                Err(reason) => ClientReply::Error(reason),
            }
        }
        ProbePlan::Relocate { current, replace } => {
            tracing::info!(agents = replace.len(), "moving agents off draining nodes");
            match change_agents(shared, name, current, &replace, &config).await {
                Ok(agents) => ClientReply::Agents(agents),
                Err(reason) => {
                    tracing::warn!(%reason, "cannot move agents off draining nodes; the application keeps them");
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
async fn change_agents(
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
        let app = state.apps.get(name).ok_or("the application went away")?;
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
                let nodes = decide::choose_nodes(&snapshot, missing, config).map_err(|e| e.to_string())?;
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

/// Undoes an agent change that will not be carried out: its new agents
/// stop and the ranks moved to them leave their new nodes (the old agents
/// kept serving them all along).
fn undo_agent_change(nodes: &ManagerBook, name: &str, started: &[AgentInfo], moves: &[(u32, &AgentInfo, &AgentInfo)]) {
    tell_agents(nodes, started, |id| ControllerToManager::StopAgent { id, discard: false });
    drop_moved_ranks(nodes, name, moves.iter().map(|(rank, _, to)| (*rank, to.node.as_str())));
}

/// A rank an agent was asked to take over or rebuild: the request (agent,
/// rank, number) and where its answer arrives.
type RankWaiter = (RankRequest, Answer<u64>);

/// Sends the message `message(request)` builds (a take-over or rebuild of
/// `rank`, carrying the new request number) to agent `to`'s manager and
/// returns where its answer arrives; a manager that cannot be reached
/// answers at once.
fn ask_rank(
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
struct RanksAwaited {
    /// Bytes moved by the ranks that succeeded.
    moved: u64,
    /// Per rank that failed, why.
    failures: Vec<(u32, String)>,
    /// Whether some agent never answered: its job may still be running.
    unanswered: bool,
}

/// Waits for every rank of `waiters` (each at most `TAKE_OVER_TIMEOUT`).
async fn await_ranks(shared: &Shared, waiters: Vec<RankWaiter>) -> RanksAwaited {
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
