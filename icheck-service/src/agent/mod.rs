//! Agent threads: each serves one application. An agent owns a fabric
//! endpoint, a TCP command channel where the application's ranks open
//! sessions, and the rank files of its [`Store`].
//!
//! Threads per agent: one accept/idle-progress loop, which also collects
//! the Hello of new connections without blocking, plus one thread per
//! authenticated rank session. A session moves the rank's bytes itself (pull: the
//! session's `fi_read`s; push: a spinning progress thread while the rank
//! writes), so the control plane (manager tasks, controller) never sits on
//! the data path.
//!
//! Architecture invariant: a session acknowledges `Seal` only after the
//! manifest (with the rank's own checksums of its data) is on the store; a session that ends
//! before sealing leaves no manifest, so its partial version is never served.

#![forbid(unsafe_code)]

mod files;
mod fills;
mod kept;
mod redundancy;
pub use redundancy::PieceOutcome;
mod session;

use std::io::{ErrorKind, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use icheck_core::credentials::Owner;
use icheck_core::fabric::{
    Access, AlignedBuffer, Domain, Endpoint, FabricConfig, FabricError, Peer, ProgressThread, RegisteredBuffer, RmaOp,
    TransferOptions,
};
use icheck_core::pattern::fill_pattern;
use icheck_core::protocol::{
    self, AgentInfo, AgentReply, AgentRequest, Hello, HelloReply, Manifest, PfsCopyStats, PieceMeta, Privilege,
    ProtocolError,
};
use icheck_core::redundancy::PieceId;

use crate::store::{MappedFile, SharedMapping, Store, StoreError, VersionKey};
use files::{begin_version, held_back, piece_sealed, prepare_next_file, prune_older, Held};
use icheck_core::format::first_bad_chunk;
use kept::KeptVersions;
use session::{Abandoned, BeginChecked, Found, Sealed, Serve, SessionCore};

/// Bytes of the probe region every agent exposes for reachability checks.
pub const PROBE_LEN: usize = 4096;
/// Time to reach the agent a rank is taken over from.
const TAKE_OVER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time the agent a rank is taken over from has for each answer.
const TAKE_OVER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a take-over or rebuild waits for another job filling the same
/// version here ([`fills`]): as long as the controller waits for its answer.
const FILL_PATIENCE: Duration = Duration::from_secs(300);

/// The pattern seed of an agent's probe region: its id.
pub fn probe_seed(agent_id: u64) -> u64 {
    agent_id
}

/// What an agent needs from its manager.
#[derive(Clone, Debug)]
pub struct AgentSettings {
    /// Fabric provider and domain.
    pub fabric: FabricConfig,
    /// Token ranks present on the command channel (each session then
    /// presents its application's capability).
    pub client_token: String,
    /// Token agents present to each other (a take-over's session).
    pub node_token: String,
    /// Host the command channel binds and advertises.
    pub host: String,
    /// The node's checkpoint store.
    pub store: Store,
    /// The PFS level, if configured: copies go there, and versions missing
    /// from the store are loaded from there.
    pub pfs: Option<icheck_core::pfs::PfsStore>,
    /// How long a session waits for its rank's next request before it is
    /// closed (`ClientIdleTimeout`; the library then opens a new one).
    pub idle_timeout: Duration,
    /// The manager's socket that hands version files to restarting ranks on
    /// this host ([`icheck_core::handoff`]); `None`: every restart reads
    /// over the fabric.
    pub handoff: Option<Arc<icheck_core::handoff::HandoffServer>>,
    /// The provider this node's agents open, as libfabric names it
    /// (`shm`, `tcp;ofi_rxm`, ...): reported in the node's status.
    pub provider: String,
    /// How the store backs new version files (huge pages or 4 KiB ones,
    /// and why), as the node's status reports it.
    pub store_pages: String,
}

/// Counters an agent keeps for the manager's status reports.
#[derive(Debug, Default)]
pub struct AgentCounters {
    /// Versions sealed (checkpoint operations).
    pub versions_sealed: AtomicU64,
    /// Bytes that arrived for sealed versions (an incremental version's
    /// changed blocks only).
    pub bytes_moved: AtomicU64,
    /// Bytes per second of the last sealed version's transfer (bw_agent,
    /// eq. 6.8), as f64 bits.
    pub last_bandwidth: AtomicU64,
}

impl AgentCounters {
    /// Counts a sealed version of `bytes` that took `secs` to arrive.
    fn sealed(&self, bytes: u64, secs: f64) {
        self.versions_sealed.fetch_add(1, Ordering::Relaxed);
        self.bytes_moved.fetch_add(bytes, Ordering::Relaxed);
        if secs > 0.0 {
            self.last_bandwidth.store((bytes as f64 / secs).to_bits(), Ordering::Relaxed);
        }
    }

    /// bw_agent of the last sealed version, bytes/s (0 before the first).
    pub fn last_bandwidth(&self) -> f64 {
        f64::from_bits(self.last_bandwidth.load(Ordering::Relaxed))
    }
}

struct Shared {
    id: u64,
    app: String,
    /// The application's owner: sessions present its capability.
    owner: Owner,
    /// The controller's newest complete version at the start, and since
    /// then each rank's newest version its Complete (or a take-over)
    /// confirmed: Begin never overwrites one, Complete never goes back.
    recorded: Option<u64>,
    completed: Mutex<std::collections::HashMap<u32, u64>>,
    /// The application's PFS copies are encrypted, with the key its ranks
    /// gave at `Open` (kept in memory only; `None` until one did).
    encrypted: bool,
    pfs_key: Mutex<Option<icheck_core::cipher::PfsKey>>,
    endpoint: Endpoint,
    settings: AgentSettings,
    /// Bytes of checkpoint memory this node may hold (0 = no limit).
    mem_budget: u64,
    stop: AtomicBool,
    /// Versions a PFS copy is reading, with how many copies read each:
    /// `Complete` does not prune them.
    pinned: Mutex<std::collections::BTreeMap<u64, usize>>,
    /// A second handle on each open session's socket, by session id; see
    /// [`SessionRegistration`].
    sessions: Mutex<std::collections::HashMap<u64, TcpStream>>,
    next_session: AtomicU64,
    counters: AgentCounters,
    /// Each rank's newest sealed version, kept mapped (and checked) for
    /// its next restart after its session ends; see [`kept`].
    kept: Arc<KeptVersions>,
    /// The application's newest version protected by redundancy (0: none
    /// known). Each rank holds it back from pruning until a newer one is
    /// protected: if a node is lost before then, the controller rebuilds
    /// this one from its pieces and these primaries ([`Shared::held_back`]).
    protected: AtomicU64,
    /// The version whose redundancy is being built (0: none known): held
    /// back too, so that the encoders still find it when newer versions
    /// complete meanwhile (the controller protects one version at a time).
    protecting: AtomicU64,
    /// Endpoints besides `endpoint` that serve sessions' concurrent reads
    /// of this agent (see [`Shared::lease_lane`]); made on demand.
    lanes: Mutex<Vec<Lane>>,
    /// A thread is opening lanes ahead of restarts
    /// ([`Shared::open_lanes_ahead`]).
    opening_lanes: AtomicBool,
    /// The take-overs and rebuilds running here, one per rank's version.
    fills: fills::Fills,
    /// The newest `PutPiece` of each piece being received here.
    piece_owners: Arc<crate::owners::Owners<(u64, PieceId)>>,
    /// Endpoints this agent's jobs reach other agents through, idle
    /// between jobs (see [`Shared::outgoing_endpoint`]).
    outgoing: Mutex<Vec<Endpoint>>,
}

/// One job of an agent (a take-over, a piece of redundancy, a rebuild):
/// the agent's state, with the endpoint the job reads from and writes to
/// other agents through. `job.endpoint` is that endpoint, not the agent's
/// own; everything else derefs to [`Shared`].
///
/// Architecture invariant: every peer a job inserts and every transfer it
/// makes go through this one endpoint (a peer's address handle is only
/// valid on the endpoint that inserted it).
struct Job<'a> {
    shared: &'a Shared,
    endpoint: Endpoint,
}

impl<'a> Job<'a> {
    fn new(shared: &'a Shared) -> Job<'a> {
        Job { shared, endpoint: shared.outgoing_endpoint() }
    }
}

impl Drop for Job<'_> {
    /// Gives the job's endpoint back for the next job, unless a transfer
    /// closed it (or it is the agent's own).
    fn drop(&mut self) {
        if !self.endpoint.is_closed() && !self.endpoint.same_as(&self.shared.endpoint) {
            self.shared.outgoing.lock().unwrap_or_else(|p| p.into_inner()).push(self.endpoint.clone());
        }
    }
}

impl std::ops::Deref for Job<'_> {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        self.shared
    }
}

/// Most endpoints an agent opens besides its own to serve concurrent
/// readers (a lone rank's parity holders, rebuilds, ranks restoring at
/// once): beyond this many, readers share the least used.
const MAX_LANES: usize = 3;

/// An endpoint serving sessions' reads apart from the agent's own.
struct Lane {
    endpoint: Endpoint,
    /// One clone per session using the lane.
    users: Arc<()>,
}

impl Lane {
    fn new(endpoint: Endpoint) -> Lane {
        Lane { endpoint, users: Arc::new(()) }
    }

    /// How many sessions read through each of `lanes`.
    fn readers_of(lanes: &[Lane]) -> Vec<usize> {
        lanes.iter().map(|lane| Arc::strong_count(&lane.users) - 1).collect()
    }

    /// The lane for one more session.
    fn lease(&self) -> LaneLease {
        LaneLease { endpoint: self.endpoint.clone(), _user: self.users.clone() }
    }
}

/// Which lane a new reader gets.
#[derive(Debug, PartialEq, Eq)]
enum LaneChoice {
    /// The lane at this index.
    Reuse(usize),
    /// A new lane.
    Open,
}

/// The lane for a new reader, given how many readers each open lane
/// serves: an idle one, else a new one while fewer than `max` are open,
/// else the least used (the first of equals).
fn choose_lane(readers: &[usize], max: usize) -> LaneChoice {
    if let Some(idle) = readers.iter().position(|n| *n == 0) {
        return LaneChoice::Reuse(idle);
    }
    if readers.len() < max {
        return LaneChoice::Open;
    }
    readers.iter().enumerate().min_by_key(|(_, n)| **n).map_or(LaneChoice::Open, |(i, _)| LaneChoice::Reuse(i))
}

/// How many lanes to open ahead of the restarts of an agent's `ranks`
/// when `open` are open: one per rank, at most [`MAX_LANES`] in all.
fn lanes_to_open_ahead(ranks: usize, open: usize) -> usize {
    ranks.min(MAX_LANES).saturating_sub(open)
}

/// A session's use of a [`Lane`], released when dropped.
struct LaneLease {
    endpoint: Endpoint,
    _user: Arc<()>,
}

impl Shared {
    /// An endpoint for one job's transfers to other agents, apart from the
    /// one that serves this agent's memory and from other jobs' (an idle
    /// one, else a new one).
    ///
    /// A transfer to a peer that stops answering (its node lost during a
    /// protection or a take-over) fails, and the fabric layer gives up the
    /// endpoint it ran on. On the agent's own endpoint that ended the
    /// agent, and with it every read of the pieces and primaries it holds:
    /// a rebuild after that loss found its parity shard's holder gone and
    /// lost the version (the `rs:2+1` fault campaign, once in several CI
    /// runs). On an endpoint of its own only that job fails. Jobs do not
    /// share one at the same time, because the loss would fail the others
    /// too (a re-protection running beside the encoding whose member was
    /// lost did). Idle endpoints are kept for later jobs rather than opened
    /// anew for each: every endpoint a reader opens stays known to the
    /// agents it reads from (shm maps each in a table of 256 peers).
    ///
    /// Where keys are bound to an endpoint (`FI_MR_ENDPOINT`) a job's
    /// memory could not be registered on another one, so jobs use the
    /// agent's own, as they do if no other can be opened.
    fn outgoing_endpoint(&self) -> Endpoint {
        if !self.endpoint.registrations_are_domain_wide() {
            return self.endpoint.clone();
        }
        let mut idle = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        idle.retain(|endpoint| !endpoint.is_closed());
        if let Some(endpoint) = idle.pop() {
            return endpoint;
        }
        drop(idle);
        match self.endpoint.sibling() {
            Ok(endpoint) => endpoint,
            Err(err) => {
                tracing::warn!(%err, "cannot open an endpoint for transfers to other agents; using the agent's own");
                self.endpoint.clone()
            }
        }
    }

    /// An endpoint of its own for a session whose reads run beside other
    /// sessions' reads of this agent (another agent's, or a restarting
    /// rank's: four ranks pulling from two agents restored at 2.94-2.96
    /// GB/s against 2.16-2.53), where the provider serialises them
    /// otherwise: `shm` copies each read while holding a lock in the target
    /// endpoint's region, so two holders reading one primary at once took
    /// turns, the waiting one spinning (a lone 1 GiB rank's two `rs:4+2`
    /// shards: 830-930 ms each, against 310-350 ms for one reader; with a
    /// lane each, 370-505 ms). Over tcp each lane is a connection with a
    /// progress thread of its own (the two shards over tcp: 912 and
    /// 1129 ms without, 837 and 891 ms with, in interleaved runs). `None`
    /// where keys are bound to an endpoint, or when no endpoint can be
    /// opened (the reader then reads through the agent's own, as before).
    ///
    /// The new endpoint is opened without the lanes' lock held: opening one
    /// took 36-890 ms here (the slowest on a node busy with the end of a
    /// job), and every other reader asking for a lane meanwhile waited.
    fn lease_lane(&self) -> Option<LaneLease> {
        {
            let lanes = self.live_lanes()?;
            if let LaneChoice::Reuse(index) = choose_lane(&Lane::readers_of(&lanes), MAX_LANES) {
                return Some(lanes[index].lease());
            }
        }
        let endpoint = match self.endpoint.sibling() {
            Ok(endpoint) => endpoint,
            Err(err) => {
                tracing::warn!(%err, "cannot open an endpoint for a reader; it shares the agent's own");
                return None;
            }
        };
        let mut lanes = self.live_lanes()?;
        // Others may have opened lanes meanwhile: this one stays if there
        // is room, and the reader gets an idle lane, else the least used.
        let surplus = if lanes.len() < MAX_LANES {
            lanes.push(Lane::new(endpoint));
            None
        } else {
            Some(endpoint)
        };
        let lease = match choose_lane(&Lane::readers_of(&lanes), lanes.len()) {
            LaneChoice::Reuse(index) => Some(lanes[index].lease()),
            LaneChoice::Open => None,
        };
        // Closed outside the lock.
        drop(lanes);
        drop(surplus);
        lease
    }

    /// Opens lanes before anyone asks for them, up to one per rank this
    /// agent holds (at most [`MAX_LANES`]), on a thread of its own (one at
    /// a time per agent): the restart that usually follows a rank's session
    /// would otherwise open its lane inside `restart()`. Called when a rank
    /// first completes a version here, long before any restart, and again
    /// when a rank's own session ends. (Opened only when that session
    /// ended, and on its thread, the lanes of four ranks restarting at once
    /// right after their job took 0.4-0.5 s of their first `restart()`:
    /// opening an endpoint on a node busy with the end of a job took up to
    /// 0.9 s, and the ranks' requests for a lane waited for the lock it was
    /// opened under.) Idle lanes cost no thread; they stay, as lanes opened
    /// on demand do.
    fn open_lanes_ahead(self: &Arc<Self>) {
        // Most calls (every session's end) find nothing to open: no thread.
        if self.lanes_wanted_ahead() == 0 || self.opening_lanes.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = self.clone();
        let spawned = std::thread::Builder::new().name("icheck-lanes".into()).spawn(move || {
            // Opening an endpoint costs tens of milliseconds of CPU, taken
            // from idle time rather than from the job's next commit.
            crate::manager::lower_thread_priority();
            let _agent = tracing::info_span!("agent", id = shared.id, app = %shared.app).entered();
            let wanted = || if shared.stop.load(Ordering::Acquire) { 0 } else { shared.lanes_wanted_ahead() };
            loop {
                while wanted() > 0 {
                    // For the tests: an endpoint that takes long to open.
                    icheck_core::failpoint::hit("agent.before_lane_ahead");
                    let started = Instant::now();
                    let endpoint = match shared.endpoint.sibling() {
                        Ok(endpoint) => endpoint,
                        Err(err) => {
                            tracing::debug!(%err, "cannot open a lane ahead of a restart; its reader opens one");
                            shared.opening_lanes.store(false, Ordering::Release);
                            return;
                        }
                    };
                    let ranks = shared.ranks_completed();
                    let Some(mut lanes) = shared.live_lanes() else { break };
                    // A reader may have opened one meanwhile.
                    if lanes_to_open_ahead(ranks, lanes.len()) == 0 {
                        break;
                    }
                    lanes.push(Lane::new(endpoint));
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::debug!(lanes = lanes.len(), ms, "lane opened ahead of a restart");
                }
                shared.opening_lanes.store(false, Ordering::Release);
                // A rank that completed while this thread was finishing
                // found it busy: its lane is opened now, unless another
                // thread took over.
                if wanted() == 0 || shared.opening_lanes.swap(true, Ordering::AcqRel) {
                    break;
                }
            }
        });
        if let Err(err) = spawned {
            self.opening_lanes.store(false, Ordering::Release);
            tracing::debug!(%err, "cannot start a thread to open lanes ahead of a restart");
        }
    }

    /// How many more lanes [`open_lanes_ahead`](Self::open_lanes_ahead) opens.
    fn lanes_wanted_ahead(&self) -> usize {
        let ranks = self.ranks_completed();
        self.live_lanes().map_or(0, |lanes| lanes_to_open_ahead(ranks, lanes.len()))
    }

    /// How many ranks have completed a version here since the agent started.
    fn ranks_completed(&self) -> usize {
        self.completed.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The agent's lanes still open, locked; `None` where the agent has no
    /// lanes: its provider binds keys to an endpoint, so a lane could not
    /// serve the agent's registrations.
    fn live_lanes(&self) -> Option<std::sync::MutexGuard<'_, Vec<Lane>>> {
        if !self.endpoint.registrations_are_domain_wide() {
            return None;
        }
        let mut lanes = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        lanes.retain(|lane| !lane.endpoint.is_closed());
        Some(lanes)
    }

    /// The PFS level as this application's copies use it: with its key
    /// when they are encrypted (and an error while no rank gave it).
    fn pfs(&self) -> Result<icheck_core::pfs::PfsStore, String> {
        let pfs = self.settings.pfs.clone().ok_or("no PfsDir is configured")?;
        if !self.encrypted {
            return Ok(pfs);
        }
        match self.pfs_key.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(key) => Ok(pfs.with_key(Some(key))),
            None => Err(format!(
                "{:?}'s PFS copies are encrypted and none of its ranks has given this agent the key since it \
                 started (they do at their next session)",
                self.app
            )),
        }
    }

    /// The versions of a rank kept besides its newest complete one
    /// `newest`: the newest protected version while it is older (what a
    /// rebuild falls back to until `newest` is protected), and the one
    /// being protected. Only those: the versions between them were never
    /// protected, and a protection that stalls (a failing piece, a policy
    /// set to `none`) holds at most two versions, not every later one.
    fn held_back(&self, newest: u64) -> Held {
        held_back(self.protected.load(Ordering::Acquire), self.protecting.load(Ordering::Acquire), newest)
    }

    /// The newest complete version of `rank` this agent knows of.
    fn complete(&self, rank: u32) -> Option<u64> {
        let completed = self.completed.lock().unwrap_or_else(|p| p.into_inner()).get(&rank).copied();
        completed.max(self.recorded)
    }

    /// `version` of `rank` is complete. Returns whether it is the first
    /// version of `rank` completed here since the agent started.
    fn completed(&self, rank: u32, version: u64) -> bool {
        let mut completed = self.completed.lock().unwrap_or_else(|p| p.into_inner());
        let first = !completed.contains_key(&rank);
        let entry = completed.entry(rank).or_insert(version);
        *entry = (*entry).max(version);
        first
    }

    /// Runs `fill` (a take-over or a rebuild of `rank`'s `version`) as a
    /// job, one at a time per version ([`fills`]): a job already filling
    /// it is waited for, and a version it sealed is the answer.
    fn fill_once(
        &self,
        rank: u32,
        version: u64,
        fill: impl FnOnce(&Job<'_>) -> Result<u64, String>,
    ) -> Result<u64, String> {
        let sealed = || self.settings.store.manifest(&self.app, rank, version).ok().map(|m| m.total_len);
        self.fills.one_at_a_time((rank, version), FILL_PATIENCE, sealed, || fill(&Job::new(self)))
    }

    /// Shuts every open session's socket down, so session threads waiting
    /// for their rank (up to `ClientIdleTimeout`) end now.
    fn end_sessions(&self) {
        for (_, session) in self.sessions.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = session.shutdown(Shutdown::Both);
        }
    }

    /// The versions PFS copies are reading now.
    fn pinned_versions(&self) -> std::collections::BTreeSet<u64> {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).keys().copied().collect()
    }
}

/// Why an agent's part of a PFS copy did not happen.
#[derive(Debug, thiserror::Error)]
pub enum PfsCopyError {
    /// Retention dropped the version before the copy could pin it: a newer
    /// version of `rank` completed in between (a commit overtook the copy
    /// request). Not a failure: the newer version is the one to copy.
    #[error("rank {rank}'s version {newer} completed before the copy could start")]
    Superseded {
        /// The rank.
        rank: u32,
        /// Its newest complete version here.
        newer: u64,
    },
    /// The copy failed.
    #[error("{0}")]
    Failed(String),
}

impl From<String> for PfsCopyError {
    fn from(reason: String) -> Self {
        PfsCopyError::Failed(reason)
    }
}

/// Keeps a version out of pruning while a PFS copy reads it (from the
/// moment the manager receives the copy request until the copy ends).
struct PinnedVersion {
    shared: Arc<Shared>,
    version: u64,
}

impl PinnedVersion {
    fn new(shared: &Arc<Shared>, version: u64) -> PinnedVersion {
        *shared.pinned.lock().unwrap_or_else(|p| p.into_inner()).entry(version).or_default() += 1;
        PinnedVersion { shared: shared.clone(), version }
    }
}

impl Drop for PinnedVersion {
    fn drop(&mut self) {
        let mut pinned = self.shared.pinned.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = pinned.get_mut(&self.version) {
            *count -= 1;
            if *count == 0 {
                pinned.remove(&self.version);
            }
        }
    }
}

/// What an agent serves: the controller's `StartAgent`.
#[derive(Clone, Debug)]
pub struct AgentTask {
    /// The application.
    pub app: String,
    /// Bytes of checkpoint memory the node may hold (0: no limit); versions
    /// beyond it are spilled to the PFS.
    pub mem_budget: u64,
    /// Its owner: sessions must present the capability this checks.
    pub owner: Owner,
    /// Its newest complete version the controller recorded.
    pub complete: Option<u64>,
    /// Its PFS copies are encrypted: none is written without the key.
    pub encrypted: bool,
    /// Its newest version protected by redundancy, if any: each rank holds
    /// it back from pruning until a newer one is protected.
    pub protected: Option<u64>,
}

/// A running agent.
pub struct Agent {
    info: AgentInfo,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// One byte written here wakes the accept loop from its idle sleep, so
    /// that stopping an agent does not wait for the loop's tick.
    waker: Option<UnixStream>,
}

impl Agent {
    /// Opens an endpoint, registers the probe region, binds the command
    /// channel and starts the agent's threads. Versions that would take the
    /// node's store beyond `mem_budget` bytes are spilled to the PFS.
    pub fn start(settings: &AgentSettings, node: &str, id: u64, task: &AgentTask) -> Result<Agent, FabricError> {
        let AgentTask { app, mem_budget, owner, complete, encrypted, protected } = task;
        let mem_budget = store_budget(*mem_budget, &settings.store);
        let domain = Domain::open(&settings.fabric)?;
        let endpoint = Endpoint::new(&domain)?;
        let mut probe = AlignedBuffer::zeroed(PROBE_LEN);
        fill_pattern(probe.as_mut_slice(), probe_seed(id));
        let probe = endpoint.register(probe, Access::REMOTE_READ)?;
        let listener = TcpListener::bind((settings.host.as_str(), 0))
            .and_then(|l| l.set_nonblocking(true).map(|_| l))
            .map_err(|err| FabricError::Config(format!("agent {id}: cannot listen on {}: {err}", settings.host)))?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        // Nothing reads `woken`: once written, it stays readable, and the
        // loop ends at its next turn.
        let (waker, woken) = UnixStream::pair()
            .map_err(|err| FabricError::Config(format!("agent {id}: cannot make its wake-up socket pair: {err}")))?;
        let info = AgentInfo {
            id,
            node: node.to_string(),
            address: endpoint.address().clone(),
            provider: endpoint.provider().to_string(),
            probe: probe.remote(),
            control: format!("{}:{port}", settings.host),
        };
        let shared = Arc::new(Shared {
            id,
            app: app.to_string(),
            owner: *owner,
            recorded: *complete,
            completed: Mutex::default(),
            encrypted: *encrypted,
            pfs_key: Mutex::default(),
            endpoint,
            settings: settings.clone(),
            mem_budget,
            stop: AtomicBool::new(false),
            pinned: Mutex::default(),
            sessions: Mutex::default(),
            next_session: AtomicU64::new(0),
            counters: AgentCounters::default(),
            kept: Arc::default(),
            protected: AtomicU64::new(protected.unwrap_or(0)),
            protecting: AtomicU64::new(0),
            lanes: Mutex::default(),
            opening_lanes: AtomicBool::new(false),
            fills: fills::Fills::default(),
            piece_owners: Arc::default(),
            outgoing: Mutex::default(),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("icheck-agent-{id}"))
            .spawn(move || {
                let _span = tracing::info_span!("agent", id, app = %thread_shared.app).entered();
                tracing::info!(control = port, "agent running");
                accept_loop(&thread_shared, &listener, &woken, probe);
                tracing::info!("agent stopped");
            })
            .map_err(|err| FabricError::Config(format!("cannot start agent thread: {err}")))?;
        Ok(Agent { info, shared, thread: Some(thread), waker: Some(waker) })
    }

    /// What the application needs to reach this agent.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// The agent's counters.
    pub fn counters(&self) -> &AgentCounters {
        &self.shared.counters
    }

    /// A job that copies `ranks` (the ones this agent serves) of `version`
    /// from the store to the PFS, for a blocking thread (it reads whole
    /// versions).
    pub fn pfs_copy_job(
        &self,
        version: u64,
        compression: icheck_core::pfs::Compression,
        ranks: Vec<u32>,
    ) -> impl FnOnce() -> Result<(Vec<icheck_core::pfs::RankEntry>, PfsCopyStats), PfsCopyError> + Send + 'static {
        let shared = self.shared.clone();
        // Pinned now, while the manager handles the request, not when the
        // (low-priority) copy thread gets to run: a commit completing
        // meanwhile must not prune the version away.
        let pin = PinnedVersion::new(&shared, version);
        move || {
            let _pin = pin;
            let pfs = &shared.pfs()?;
            let mut entries = Vec::new();
            let mut total = PfsCopyStats { version, ..PfsCopyStats::default() };
            for rank in ranks {
                let (manifest, file) = match shared.settings.store.open(&shared.app, rank, version) {
                    Ok(stored) => stored,
                    Err(err @ StoreError::Missing { .. }) => {
                        // Spilled: the rank's file is on the PFS already.
                        let entry = pfs.take_partial_entry(&shared.app, version, rank).map_err(|e| e.to_string())?;
                        // Dropped by retention before the pin: a newer
                        // version of the rank completed first.
                        if let Some(newer) = shared.complete(rank).filter(|c| *c > version && entry.is_none()) {
                            return Err(PfsCopyError::Superseded { rank, newer });
                        }
                        let entry = entry.ok_or_else(|| err.to_string())?;
                        total.raw += entry.stored_len;
                        total.stored += entry.stored_len;
                        entries.push(entry);
                        continue;
                    }
                    Err(err) => return Err(err.to_string().into()),
                };
                let (entry, stats) =
                    pfs.write_rank(&manifest, file.as_slice(), compression).map_err(|e| e.to_string())?;
                tracing::info!(
                    agent = shared.id,
                    version,
                    rank,
                    bytes = stats.raw,
                    ratio = stats.ratio(),
                    compress_ms = stats.compress.as_secs_f64() * 1e3,
                    write_ms = stats.write.as_secs_f64() * 1e3,
                    "copied to the PFS"
                );
                entries.push(entry);
                total.add(&PfsCopyStats {
                    version,
                    raw: stats.raw,
                    stored: stats.stored,
                    compress_secs: stats.compress.as_secs_f64(),
                    write_secs: stats.write.as_secs_f64(),
                });
            }
            Ok((entries, total))
        }
    }

    /// A job that takes over `rank`'s `version` from agent `from` on another
    /// node, for a blocking thread: the application's agents changed and
    /// this agent serves the rank now. Returns the bytes moved.
    pub fn take_over_job(
        &self,
        rank: u32,
        version: u64,
        from: AgentInfo,
    ) -> impl FnOnce() -> Result<u64, String> + Send + 'static {
        let shared = self.shared.clone();
        move || shared.fill_once(rank, version, |job| take_over(job, rank, version, &from))
    }

    /// A job that builds a piece of redundancy for a complete version
    /// (a copy of another node's rank, or a parity shard), for a blocking
    /// thread. Returns the bytes the piece holds.
    pub fn protect_job(&self, task: protocol::PieceTask) -> impl FnOnce() -> Vec<PieceOutcome> + Send + 'static {
        let shared = self.shared.clone();
        move || redundancy::protect(&Job::new(&shared), &task)
    }

    /// A job that rebuilds `rank`'s `version`, lost with its node, from
    /// `source` into this agent's store, for a blocking thread.
    pub fn rebuild_job(
        &self,
        rank: u32,
        version: u64,
        source: protocol::RebuildSource,
    ) -> impl FnOnce() -> Result<u64, String> + Send + 'static {
        let shared = self.shared.clone();
        move || shared.fill_once(rank, version, |job| redundancy::rebuild(job, rank, version, &source))
    }

    /// Lets go of `rank`'s kept version of application `app` (if this agent
    /// serves it): the manager is about to delete the rank's versions here,
    /// and a kept mapping would hold their memory unseen by the budget.
    pub fn forget_rank(&self, app: &str, rank: u32) {
        if self.shared.app == app {
            self.shared.kept.forget_if(rank, |_| true);
        }
    }

    /// The controller says `version` of the application is protected: older
    /// versions may go at each rank's next Begin or Complete.
    pub fn protected(&self, version: u64) {
        self.shared.protected.fetch_max(version, Ordering::AcqRel);
    }

    /// The controller started protecting `version` of the application:
    /// each rank holds it back until a newer one is protected or being
    /// protected, so that newer versions completing meanwhile do not prune
    /// it under the encoders.
    pub fn protecting(&self, version: u64) {
        self.shared.protecting.fetch_max(version, Ordering::AcqRel);
    }

    /// The controller fell back to an older version (see
    /// `ControllerToManager::DropNewer`): kept versions `above < v <=
    /// through` are forgotten before their files go. (Begin writes their
    /// numbers again once the files are gone: it refuses only stored ones.)
    pub fn fell_back(&self, above: u64, through: u64) {
        self.shared.kept.forget_all_if(|kept| kept > above && kept <= through);
    }

    /// The application this agent serves.
    pub fn app(&self) -> &str {
        &self.shared.app
    }

    /// Whether the thread is still running.
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the agent; with `discard`, deletes the application's checkpoints
    /// from the store too.
    pub fn stop(mut self, discard: bool) {
        self.shutdown();
        if discard {
            if let Err(err) = self.shared.settings.store.remove_app(&self.shared.app) {
                tracing::warn!(agent = self.shared.id, %err, "cannot delete checkpoints");
            }
        }
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(mut waker) = self.waker.take() {
            // A failed write only leaves the loop to notice at its next tick.
            let _ = waker.write_all(&[1]);
        }
        self.shared.end_sessions();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Unmapped now, not when the last session thread lets go of `shared`.
        self.shared.kept.clear();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Time a connecting peer has to send its Hello before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most connections waiting for their Hello at once. Beyond it the oldest
/// is dropped: a rank sends its Hello right after connecting, so only
/// idle (or hostile) sockets ever get old.
const MAX_HANDSHAKES: usize = 64;
/// Most sessions an agent serves at once (a thread each); more are refused.
/// Ranks open one each: this is far above any job an agent serves.
const MAX_SESSIONS: usize = 1024;

/// A connection that has not sent its Hello yet. It holds no thread: the
/// accept loop polls every waiting connection without blocking.
struct Handshake {
    stream: TcpStream,
    peer: std::net::SocketAddr,
    since: Instant,
    frame: protocol::FrameAssembler,
}

/// What became of a [`Handshake`] this round.
enum HandshakeStep {
    /// Still waiting for bytes, within its deadline.
    Waiting(Handshake),
    /// The Hello was accepted: the connection is a session now.
    Admitted,
    /// Refused, timed out, closed or malformed: the socket is closed.
    Dropped,
}

/// The node's checkpoint-memory budget: `configured` bytes (`max_mem_node`;
/// 0 = no limit), but never more than the store's file system holds, so that
/// versions that cannot fit spill instead of failing half-written (the
/// default of 90 GiB exceeds many nodes' /dev/shm).
fn store_budget(configured: u64, store: &Store) -> u64 {
    let Ok(capacity) = store.capacity() else { return configured };
    let budget = pick_budget(configured, capacity.total);
    if budget != configured {
        tracing::warn!(
            configured,
            store = %store.root().display(),
            store_size = capacity.total,
            "max_mem_node exceeds the checkpoint store's file system; the store's size is the budget"
        );
    }
    budget
}

/// [`store_budget`]'s rule: the smaller of the two, where 0 means "no limit".
fn pick_budget(configured: u64, store_size: u64) -> u64 {
    match (configured, store_size) {
        (_, 0) => configured,
        (0, size) => size,
        (configured, size) => configured.min(size),
    }
}

/// Accepts rank sessions and, while idle, polls the endpoint so peers' RMA
/// against the probe region progresses.
///
/// Connections are admitted in two stages so that sockets cost nothing
/// before they authenticate: the loop itself collects each connection's
/// Hello without blocking (at most [`MAX_HANDSHAKES`] at once, each within
/// [`HANDSHAKE_TIMEOUT`]); only an accepted Hello gets a session thread.
fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener, woken: &UnixStream, _probe: RegisteredBuffer) {
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut handshakes: std::collections::VecDeque<Handshake> = std::collections::VecDeque::new();
    let mut evicted = 0u64;
    let mut last_busy = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        if shared.endpoint.is_closed() {
            // A transfer to an unresponsive peer timed out and the fabric
            // layer closed the endpoint (nothing may write into our memory
            // late). This agent can serve nobody any more: it ends, its
            // manager reports it lost, and the controller places a new agent
            // on this node for the application's next registration. The
            // store's sealed versions stay for that agent.
            tracing::error!(
                "the fabric endpoint was closed after a transfer timed out; \
                 stopping this agent so that the controller replaces it"
            );
            break;
        }
        let mut busy = false;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    busy = true;
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if handshakes.len() >= MAX_HANDSHAKES {
                        handshakes.pop_front();
                        evicted += 1;
                        if evicted.is_power_of_two() {
                            tracing::warn!(evicted, "too many connections without a Hello; dropping the oldest");
                        }
                    }
                    let frame = protocol::FrameAssembler::new(protocol::MAX_HELLO);
                    handshakes.push_back(Handshake { stream, peer, since: Instant::now(), frame });
                }
                Err(err) if err.kind() == ErrorKind::WouldBlock => break,
                Err(err) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%err, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                    break;
                }
            }
        }
        let mut waiting = std::collections::VecDeque::with_capacity(handshakes.len());
        for handshake in handshakes.drain(..) {
            match advance_handshake(shared, handshake, &mut threads) {
                HandshakeStep::Waiting(handshake) => waiting.push_back(handshake),
                HandshakeStep::Admitted => busy = true,
                HandshakeStep::Dropped => {}
            }
        }
        handshakes = waiting;
        threads.retain(|h| !h.is_finished());
        if busy || !handshakes.is_empty() {
            last_busy = Instant::now();
        }
        if !busy {
            shared.endpoint.progress();
            let tick = if last_busy.elapsed() < IDLE_AFTER { BUSY_TICK_MS } else { IDLE_TICK_MS };
            wait_for_connections(listener, woken, &handshakes, tick);
        }
    }
    drop(handshakes);
    shared.end_sessions();
    for handle in threads {
        let _ = handle.join();
    }
}

/// How long an agent sleeps between turns of its accept loop when no
/// connection stirs, for [`IDLE_AFTER`] after the last one did. New
/// connections, Hellos and [`Agent::stop`] wake it at once (they are
/// polled); what waits for the tick is RMA against the probe region, which
/// needs the agent's progress under manual progress and is read by
/// diagnostics alone (every transfer of data has a session thread driving
/// the endpoint), and noticing an endpoint closed by a timed-out transfer.
/// At 2000 turns a second (a 500 µs sleep) an idle agent cost 5% of a core.
const BUSY_TICK_MS: u16 = 100;

/// The accept loop's tick once nothing has stirred for [`IDLE_AFTER`]: an
/// agent whose application computes between commits wakes once a second,
/// a tenth of the wake-ups of [`BUSY_TICK_MS`] (each costs a poll of the
/// listener, an `accept` and a progress of the endpoint, which on a
/// virtual machine's two cores add up to about a quarter of a percent of a
/// core per agent at ten a second: `commit-bench --idle-seconds`).
const IDLE_TICK_MS: u16 = 1000;

/// How long after the last connection or Hello the accept loop keeps its
/// short tick.
const IDLE_AFTER: Duration = Duration::from_secs(2);

/// Sleeps until the listener has a connection to accept, a waiting
/// connection sent more of its Hello, the agent is stopped, or `tick_ms`
/// pass.
fn wait_for_connections(
    listener: &TcpListener,
    woken: &UnixStream,
    handshakes: &std::collections::VecDeque<Handshake>,
    tick_ms: u16,
) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds: Vec<PollFd> = [listener.as_fd(), woken.as_fd()]
        .into_iter()
        .chain(handshakes.iter().map(|h| h.stream.as_fd()))
        .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
        .collect();
    // EINTR or any other failure only ends the wait early.
    let _ = poll(&mut fds, PollTimeout::from(tick_ms));
}

/// Reads what a waiting connection sent; admits it once its Hello is whole
/// and valid.
fn advance_handshake(
    shared: &Arc<Shared>,
    mut handshake: Handshake,
    threads: &mut Vec<JoinHandle<()>>,
) -> HandshakeStep {
    let peer = handshake.peer;
    let payload = match handshake.frame.poll(&mut handshake.stream) {
        Ok(Some(payload)) => payload,
        Ok(None) if handshake.since.elapsed() < HANDSHAKE_TIMEOUT => return HandshakeStep::Waiting(handshake),
        Ok(None) => {
            tracing::debug!(%peer, "no Hello within {HANDSHAKE_TIMEOUT:?}; connection closed");
            return HandshakeStep::Dropped;
        }
        Err(err) => {
            tracing::debug!(%peer, %err, "connection closed before its Hello");
            return HandshakeStep::Dropped;
        }
    };
    let mut stream = handshake.stream;
    // The replies below are a few bytes on a fresh socket: they fit its
    // send buffer, so a blocking write with a short bound cannot stall the loop.
    if stream.set_nonblocking(false).is_err() || stream.set_write_timeout(Some(Duration::from_secs(1))).is_err() {
        return HandshakeStep::Dropped;
    }
    let accepted = [
        (Privilege::Client, shared.settings.client_token.as_str()),
        (Privilege::Node, shared.settings.node_token.as_str()),
    ];
    let checked = protocol::decode::<Hello>(&payload)
        .map_err(|err| err.to_string())
        .and_then(|hello| protocol::admit_hello(&hello, &accepted));
    let privilege = match checked {
        Ok(privilege) => privilege,
        Err(reason) => {
            tracing::warn!(%peer, %reason, "refused a connection");
            let _ = protocol::send_blocking(&mut stream, &HelloReply::Refused(reason));
            return HandshakeStep::Dropped;
        }
    };
    let open_sessions = shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).len();
    if open_sessions >= MAX_SESSIONS {
        tracing::warn!(%peer, open_sessions, "too many sessions; refusing a new one");
        let _ =
            protocol::send_blocking(&mut stream, &HelloReply::Refused("this agent serves too many sessions".into()));
        return HandshakeStep::Dropped;
    }
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(None);
    let Some(registration) = SessionRegistration::new(shared, &stream) else {
        return HandshakeStep::Dropped;
    };
    let session_shared = shared.clone();
    // (Not `icheck-agent-{id}-session`: Linux keeps 15 bytes of a thread's
    // name, which made sessions and the accept loop look alike in `top`.)
    let spawned = std::thread::Builder::new().name("icheck-session".into()).spawn(move || {
        let _registration = registration;
        let _span = tracing::info_span!("session", agent = session_shared.id, %peer).entered();
        match serve_session(&session_shared, stream, privilege) {
            Ok(()) | Err(SessionEnd::Closed) => tracing::debug!("session ended"),
            Err(SessionEnd::Idle(waited)) => tracing::info!(?waited, "closed an idle session"),
            Err(SessionEnd::Failed(err)) => tracing::warn!(%err, "session dropped"),
        }
    });
    match spawned {
        Ok(handle) => {
            threads.push(handle);
            HandshakeStep::Admitted
        }
        Err(err) => {
            tracing::error!(%err, "cannot start a session thread");
            HandshakeStep::Dropped
        }
    }
}

/// A session's entry in [`Shared::sessions`] (a second handle on its
/// socket, so stopping the agent can shut every session down). Dropping it,
/// when the session ends however it ends, removes the entry and closes that
/// handle: a finished session keeps no descriptor.
struct SessionRegistration {
    shared: Arc<Shared>,
    id: u64,
}

impl SessionRegistration {
    fn new(shared: &Arc<Shared>, stream: &TcpStream) -> Option<SessionRegistration> {
        let handle = stream.try_clone().ok()?;
        let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
        shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).insert(id, handle);
        Some(SessionRegistration { shared: shared.clone(), id })
    }
}

impl Drop for SessionRegistration {
    fn drop(&mut self) {
        self.shared.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

enum SessionEnd {
    /// The rank closed it.
    Closed,
    /// The rank sent nothing for `ClientIdleTimeout`; it opens a new
    /// session when it needs one.
    Idle(Duration),
    Failed(String),
}

impl From<ProtocolError> for SessionEnd {
    fn from(err: ProtocolError) -> Self {
        match err {
            ProtocolError::Closed => SessionEnd::Closed,
            err => SessionEnd::Failed(err.to_string()),
        }
    }
}

/// Where the version a rank is writing goes.
enum Destination {
    /// The store's mapped, registered file: the usual case.
    Memory(RegisteredBuffer<MappedFile>),
    /// The node's memory budget is used up: pulled pieces pass through a
    /// registered staging buffer into the rank's file on the PFS.
    Spill {
        /// Registered bounce buffer.
        staging: RegisteredBuffer,
        /// The rank's file in the PFS partial version.
        file: icheck_core::pfs::SpillFile,
    },
}

/// What a version being written holds: the session core knows the
/// version, this is where its bytes go.
struct Writing {
    destination: Destination,
    /// Spins while the rank pushes into `file`.
    _progress: Option<ProgressThread>,
}

/// A version exposed for the rank to read back, or to have delivered.
struct Fetching {
    exposed: Exposed,
    /// Bytes of the rank's version a `Deliver` may write from (`None`: a
    /// piece of redundancy, which only another agent reads).
    deliverable: Option<u64>,
    /// Drives reads of `exposed`; stopped while the agent itself writes,
    /// and not started while a same-host reader may take the file instead.
    progress: Option<ProgressThread>,
    /// The version's file offered to a reader on this host: held only to
    /// revoke the offer when the fetch ends.
    _offered: Option<icheck_core::handoff::Offered>,
}

/// The memory a fetched version is read from.
enum Exposed {
    /// The version's file in the store (shared with the kept versions and
    /// the session that sealed it): the usual case.
    Stored(RegisteredBuffer<SharedMapping>),
    /// A version loaded from the PFS that the store had no room for, held in
    /// the manager's memory only while the rank reads it.
    Loaded(RegisteredBuffer),
}

impl Exposed {
    /// The exposed bytes as the source of the agent's own writes.
    fn source(&self) -> icheck_core::fabric::LocalSource<'_> {
        match self {
            Exposed::Stored(file) => file.source(),
            Exposed::Loaded(buffer) => buffer.source(),
        }
    }
}

struct Session {
    /// The node's store, to discard what an abandoned version left there.
    store: Store,
    /// Where the newest sealed version's mapping goes when the session ends.
    kept: Arc<KeptVersions>,
    /// The protocol state (which version is being written, and its layout).
    core: SessionCore,
    peer: Peer,
    /// The resources of the version `core` is writing.
    writing: Option<Writing>,
    /// This session's ticket in the store's writers, with the version it
    /// claimed (at `Begin`, before its file is made): a newer session of
    /// the same rank and version on this node supersedes it, and then this
    /// one neither seals nor discards the file.
    writer: Option<(u64, VersionKey)>,
    fetching: Option<Fetching>,
    /// Mappings of versions this session sealed, oldest first; kept so a
    /// pruned version's memory can take the next version without being
    /// mapped and registered again.
    /// They are not registered: a version's memory is exposed to the
    /// fabric only while it is written (Begin to Seal) or read (Fetch to
    /// FetchDone).
    sealed: Vec<(u64, SharedMapping)>,
    /// The mapping of the rank's spare file, ready for the next version.
    spare: Option<MappedFile>,
    /// The rank's next file, being backed and mapped in the background
    /// when no spare will exist for the next version (after the first
    /// version, whose predecessor left none): see [`prepare_next_file`].
    prepared: Option<JoinHandle<Option<MappedFile>>>,
    /// Bytes of the file a `Prepare` hint asked for (0: none).
    prepared_len: u64,
    /// Fetches the rank is done with, released after the reply is sent
    /// (unmapping takes time the rank need not wait for).
    retired: Vec<Fetching>,
    /// A parity shard another agent is writing here (PutPiece to SealPiece).
    receiving: Option<Receiving>,
    /// The rank's own session (its application's), rather than another
    /// agent's reading the rank to copy, encode or take it over.
    the_ranks_own: bool,
    /// The endpoint serving this session's reads, when not the agent's
    /// own (`ServeApart`).
    lane: Option<LaneLease>,
}

impl Session {
    /// The endpoint that serves this session's reads.
    fn serving_endpoint<'a>(&'a self, shared: &'a Shared) -> &'a Endpoint {
        self.lane.as_ref().map_or(&shared.endpoint, |lane| &lane.endpoint)
    }
}

/// A piece being written by the agent that encodes its group. Its file is
/// discarded unless it is sealed.
struct Receiving {
    version: u64,
    piece: PieceId,
    file: Option<RegisteredBuffer<MappedFile>>,
    store: Store,
    app: String,
    /// This receiver's ticket in `owners`: a newer `PutPiece` of the same
    /// piece supersedes it, and then it leaves the file alone.
    ticket: u64,
    owners: Arc<crate::owners::Owners<(u64, PieceId)>>,
    _progress: ProgressThread,
}

impl Receiving {
    /// Deletes the unsealed piece's file, unless a newer receiver owns it.
    fn discard(&self) {
        let (version, piece) = (self.version, self.piece);
        let discarded =
            self.owners.finish(&(version, piece), self.ticket, || self.store.discard_piece(&self.app, version, piece));
        match discarded {
            Some(Err(err)) => tracing::warn!(version, %piece, %err, "cannot discard an unsealed piece"),
            None => tracing::info!(version, %piece, "an unsealed piece was left to the newer PutPiece of it"),
            Some(Ok(())) => {}
        }
    }
}

impl Drop for Receiving {
    fn drop(&mut self) {
        // Unmapped (and deregistered) before the file goes.
        if self.file.take().is_some() {
            self.discard();
        }
    }
}

impl Session {
    /// Drops the version being written, if any, and deletes its unsealed
    /// data file: a version whose rank went away before `Seal` can never be
    /// served, so its memory goes back to the node at once.
    fn abandon_writing(&mut self) {
        // Unmaps (and deregisters) before the file goes.
        drop(self.writing.take());
        let abandoned = self.core.abandon();
        // A claim ends here whether or not a version was under way (a
        // `Begin` that failed after claiming leaves one).
        let Some((ticket, key)) = self.writer.take() else { return };
        let (app, rank, version) = (&key.0, key.1, key.2);
        let discard = || match abandoned {
            Some(Abandoned { version: begun, in_memory: true }) if begun == version => {
                self.store.discard_unsealed(app, rank, version)
            }
            _ => Ok(false),
        };
        match self.store.writers().finish(&key, ticket, discard) {
            Some(Ok(true)) => tracing::info!(version, rank, "abandoned version discarded"),
            Some(Ok(false)) => {}
            Some(Err(err)) => tracing::warn!(version, rank, %err, "cannot discard an abandoned version"),
            None => {
                tracing::info!(version, rank, "an abandoned version's file was left to the newer session writing it")
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.abandon_writing();
        // A file still being prepared is waited for: the session's thread
        // ends only once nothing it started writes the store any more, so
        // that an agent's stop (which joins its session threads) leaves the
        // manager free to delete the rank's directory. A prepare thread left
        // running could make the directory again after that delete.
        if let Some(thread) = self.prepared.take() {
            let _ = thread.join();
        }
        // The rank's next session is likely a restart: its newest version
        // (kept mapped since its Seal) is checked before it is asked for;
        // an incremental one, which nothing keeps yet, is composed, then
        // checked. Not when another agent's session ends: an encoder or a
        // copier reads every version while the rank's own session goes on,
        // and a check after each would read every version once more for
        // nothing.
        let (app, rank) = (self.core.app(), self.core.rank());
        if self.the_ranks_own {
            self.kept.check_later(&self.store, app, rank);
        }
        match self.sealed.last() {
            Some((newest, _)) if self.the_ranks_own => {
                self.kept.compose_and_check_later(&self.store, app, rank, *newest)
            }
            Some((newest, _)) => self.kept.compose_later(&self.store, app, rank, *newest),
            None => {}
        }
    }
}

/// Serves one authenticated rank (its Hello was accepted by the accept
/// loop with `privilege`).
fn serve_session(shared: &Arc<Shared>, mut stream: TcpStream, privilege: Privilege) -> Result<(), SessionEnd> {
    // The first request (Open) comes right after the Hello: a session that
    // does not open within the handshake bound holds its thread no longer.
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    protocol::send_blocking(&mut stream, &HelloReply::Welcome)?;
    // The Unix user behind a local rank's socket (None: another host).
    let seen_uid = match (stream.local_addr(), stream.peer_addr()) {
        (Ok(local), Ok(peer)) => crate::peercred::socket_owner(local, peer),
        _ => None,
    };
    let caller = Caller { privilege, seen_uid };
    let mut session: Option<Session> = None;
    let ended = serve_requests(shared, &mut stream, caller, &mut session);
    let (peer, the_ranks_own) =
        session.take().map_or((None, false), |s| (Some(s.peer.name().to_string()), s.the_ranks_own));
    drop(stream);
    if the_ranks_own {
        shared.open_lanes_ahead();
    }
    if let (Some(owner), Some(peer)) = (seen_uid, peer) {
        // A rank killed on this host leaves its shm region behind, and
        // nobody else frees it; this agent talked to it over shm here, so
        // its process id is this host's (see `remove_dead_peer_region`,
        // which leaves another provider's peer alone at once).
        if icheck_core::fabric::remove_dead_peer_region(&peer, owner, DEAD_PEER_PATIENCE) {
            tracing::info!(%peer, "removed the shm region a dead rank left");
        }
    }
    ended
}

/// How long a session's thread waits, after the session ended, for its
/// rank's process to be gone before it leaves the rank's shm region alone
/// (a killed rank is a zombie until its parent reaps it; a live one keeps
/// its region).
const DEAD_PEER_PATIENCE: Duration = Duration::from_secs(5);

/// Answers a session's requests until it ends.
fn serve_requests(
    shared: &Arc<Shared>,
    stream: &mut TcpStream,
    caller: Caller,
    session: &mut Option<Session>,
) -> Result<(), SessionEnd> {
    let mut wait = HANDSHAKE_TIMEOUT;
    loop {
        let request: AgentRequest = match protocol::recv_blocking(stream, wait) {
            Err(ProtocolError::Timeout(_)) if session.is_some() => return Err(SessionEnd::Idle(wait)),
            request => request?,
        };
        let reply = match handle(shared, session, request, caller) {
            Ok(reply) => reply,
            Err(message) => {
                tracing::warn!(%message, "request failed");
                AgentReply::Error(message)
            }
        };
        protocol::send_blocking(stream, &reply)?;
        let Some(session) = session.as_mut() else {
            // A session that is not open (a refused or missing Open) serves nothing.
            return Err(SessionEnd::Failed("closed: the session was not opened".into()));
        };
        session.retired.clear();
        wait = shared.settings.idle_timeout;
        let _ = stream.set_read_timeout(Some(wait));
    }
}

/// Who is on the other end of a session: what its token admitted it to,
/// and its Unix user where the socket shows it.
#[derive(Clone, Copy, Debug)]
struct Caller {
    privilege: Privilege,
    seen_uid: Option<u32>,
}

fn handle(
    shared: &Arc<Shared>,
    session: &mut Option<Session>,
    request: AgentRequest,
    caller: Caller,
) -> Result<AgentReply, String> {
    if let AgentRequest::Open { app, rank, address, capability, pfs_key } = request {
        let core = SessionCore::open(&shared.app, shared.id, app, rank)?;
        if let Err(reason) =
            session::admit_session(&shared.app, &shared.owner, caller.privilege, &capability, caller.seen_uid)
        {
            tracing::warn!(rank, %reason, "refused a session");
            *session = None;
            return Err(reason);
        }
        if let Some(key) = pfs_key.filter(|_| shared.encrypted) {
            *shared.pfs_key.lock().unwrap_or_else(|p| p.into_inner()) = Some(icheck_core::cipher::PfsKey::new(key));
        }
        let peer = shared.endpoint.insert_peer(&address).map_err(|e| e.to_string())?;
        *session = Some(Session {
            store: shared.settings.store.clone(),
            kept: shared.kept.clone(),
            core,
            peer,
            writing: None,
            writer: None,
            fetching: None,
            sealed: Vec::new(),
            spare: None,
            prepared: None,
            prepared_len: 0,
            retired: Vec::new(),
            receiving: None,
            the_ranks_own: caller.privilege == Privilege::Client,
            lane: None,
        });
        return Ok(AgentReply::Ok);
    }
    let Some(session) = session.as_mut() else {
        return Err("open a session (Open) first".into());
    };
    let store = &shared.settings.store;
    match request {
        AgentRequest::Open { .. } => unreachable!("handled above"),
        AgentRequest::Begin { version, ranks, epoch, labels, push } => {
            let begun = Instant::now();
            let checked = check_begin(shared, session, version, ranks, epoch, labels)?;
            begin_version(shared, session, checked, push, begun)
        }
        AgentRequest::BeginDelta { version, ranks, epoch, labels, push, parent, changed } => {
            let begun = Instant::now();
            let mut checked = check_begin(shared, session, version, ranks, epoch, labels)?;
            let rank = session.core.rank();
            // Without the parent here (another agent wrote it, it was
            // dropped or lost), the version is taken whole.
            match store.block_map(&shared.app, rank, parent) {
                Ok(Some(map)) => {
                    if let Err(reason) = checked.make_incremental(&map, &changed) {
                        tracing::info!(version, rank, parent, %reason, "taking the version whole");
                    }
                }
                Ok(None) => tracing::debug!(version, rank, parent, "parent not stored here: taking the version whole"),
                Err(err) => tracing::warn!(version, rank, parent, %err, "parent unreadable: taking the version whole"),
            }
            begin_version(shared, session, checked, push, begun)
        }
        AgentRequest::Pull(segments) => {
            let ops = session.core.pull_ops(&segments)?;
            let writing = session.writing.as_mut().ok_or("Pull without Begin")?;
            let bytes = pull(&shared.endpoint, &session.peer, writing, &ops)?;
            Ok(AgentReply::Pulled { bytes })
        }
        AgentRequest::Prepare { len } => {
            // Only before the rank's first version here, only for a larger
            // size than prepared so far, and never over a file still being
            // prepared (Begin takes whichever fits, or reuses its pages).
            let rank = session.core.rank();
            let first = session.sealed.is_empty()
                && session.spare.is_none()
                && store.sealed_versions(&shared.app, rank).is_ok_and(|v| v.is_empty());
            let busy = session.prepared.as_ref().is_some_and(|thread| !thread.is_finished());
            if first && !busy && session.writing.is_none() && len > session.prepared_len {
                // A smaller file prepared earlier grows in place: its pages stay.
                drop(session.prepared.take().map(JoinHandle::join));
                session.prepared = prepare_next_file(shared, rank, len);
                session.prepared_len = len;
            }
            Ok(AgentReply::Ok)
        }
        other => handle_rest(shared, session, other, caller),
    }
}

/// A Begin (whole or incremental) of `version`: the version being written
/// is abandoned, and the session core checks the new one against what the
/// rank has stored and completed here.
fn check_begin(
    shared: &Shared,
    session: &mut Session,
    version: u64,
    ranks: u32,
    epoch: u32,
    labels: Vec<icheck_core::protocol::LabelLayout>,
) -> Result<BeginChecked, String> {
    session.abandon_writing();
    let rank = session.core.rank();
    // Its file may be written again (see `kept`'s invariant).
    shared.kept.forget_if(rank, |kept| kept >= version);
    let stored = |v: u64| shared.settings.store.is_sealed(&shared.app, rank, v);
    session.core.begin(version, ranks, epoch, labels, shared.complete(rank), stored)
}

/// Runs `seal` (which publishes a version's manifest in the store) if the
/// session holding `writer` (its ticket and version) still owns the
/// version's file; refuses it if a newer session of the rank writes that
/// version on this node now (see [`crate::owners`]).
fn seal_if_owned(
    store: &Store,
    (ticket, key): &(u64, VersionKey),
    seal: impl FnOnce() -> Result<(), StoreError>,
) -> Result<(), String> {
    match store.writers().finish(key, *ticket, seal) {
        Some(sealed) => sealed.map_err(|e| e.to_string()),
        None => Err(format!(
            "version {} of rank {} is being written by a newer session on this node (this agent was replaced): \
             its Seal here is refused",
            key.2, key.1
        )),
    }
}

/// The requests that neither begin nor move a version's bytes.
fn handle_rest(
    shared: &Arc<Shared>,
    session: &mut Session,
    request: AgentRequest,
    caller: Caller,
) -> Result<AgentReply, String> {
    let store = &shared.settings.store;
    match request {
        AgentRequest::Open { .. }
        | AgentRequest::Begin { .. }
        | AgentRequest::BeginDelta { .. }
        | AgentRequest::Prepare { .. }
        | AgentRequest::Pull(_) => unreachable!("handled by the caller"),
        AgentRequest::Seal { crcs } => {
            // The rank has finished writing: stop spinning for it.
            let destination = session.writing.take().map(|writing| writing.destination);
            let Sealed { manifest, transfer_secs, delta } = session.core.seal(crcs, Instant::now(), unix_ms())?;
            let destination = destination.ok_or("Seal without Begin")?;
            let (version, total_len) = (manifest.version, manifest.total_len);
            let writer = session.writer.take().ok_or("Seal without Begin")?;
            let sealing = Instant::now();
            // What crossed the fabric: an incremental version's changed blocks.
            let written = delta.as_ref().map_or(total_len, |d| d.written_len);
            shared.counters.sealed(written, transfer_secs);
            let spilled = match (destination, delta) {
                (Destination::Memory(file), Some(delta)) => {
                    seal_if_owned(store, &writer, || store.seal_delta(&manifest, &delta.map))?;
                    // Kept mapped like a whole version's file: once dropped
                    // and unused by newer maps it is the spare, and a whole
                    // version of its length takes it without mapping again.
                    session.sealed.push((version, SharedMapping::new(file.into_inner())));
                    false
                }
                (Destination::Memory(file), None) => {
                    seal_if_owned(store, &writer, || store.seal(&manifest))?;
                    // Deregistered at once: sealed memory is no peer's to touch.
                    // Shared with the kept versions: the copies, parity
                    // shards and restarts that read it next map nothing.
                    let file = SharedMapping::new(file.into_inner());
                    shared.kept.keep_sealed(store, &manifest, file.clone());
                    session.sealed.push((version, file));
                    false
                }
                (Destination::Spill { file, .. }, _) => {
                    // Nothing of it is in the store; the claim ends here.
                    store.writers().finish(&writer.1, writer.0, || ());
                    // The store keeps nothing of it: a Fetch finds it missing and
                    // reads it from the PFS, where the controller's copy completes it.
                    file.finish(&manifest).map_err(|e| e.to_string())?;
                    true
                }
            };
            let seal_ms = sealing.elapsed().as_secs_f64() * 1e3;
            tracing::info!(
                version,
                rank = session.core.rank(),
                bytes = total_len,
                written,
                transfer_ms = transfer_secs * 1e3,
                seal_ms,
                spilled,
                "version sealed"
            );
            Ok(if spilled { AgentReply::Spilled(manifest) } else { AgentReply::Sealed(manifest) })
        }
        AgentRequest::Complete { version } => {
            let rank = session.core.rank();
            let sealed = || store.is_sealed(&shared.app, rank, version);
            session.core.complete(version, shared.complete(rank), sealed)?;
            if shared.completed(rank, version) {
                // One lane per rank, long before its restart needs it.
                shared.open_lanes_ahead();
            }
            // Tests lose the agent's endpoint here, as a transfer to an
            // unresponsive peer that timed out would: the agent ends.
            if icheck_core::failpoint::fails("agent.endpoint_lost_after_complete") {
                shared.endpoint.close();
            }
            // Tests wedge the next progress poll of this manager here, as a
            // dead process's shm lock would.
            if icheck_core::failpoint::fails("agent.fabric_wedged_after_complete") {
                icheck_core::fabric::wedge_next_call();
            }
            let pruning = Instant::now();
            let held = shared.held_back(version);
            let pruned = prune_older(shared, session, version, &held)?;
            // Nothing was pruned (the first version, or older ones still
            // pinned): the next version would map fresh memory inside its
            // commit; make its file now, while the application computes.
            // (Not while an older version waits for this one's protection:
            // it usually comes before the next Begin, which then reuses it.)
            let waiting = !held.is_empty();
            let len = session.sealed.iter().find(|(v, _)| *v == version).map(|(_, file)| file.data_len() as u64);
            if let (None, None, Some(len), false) = (&session.spare, &session.prepared, len, waiting) {
                session.prepared = prepare_next_file(shared, rank, len);
            }
            let prune_ms = pruning.elapsed().as_secs_f64() * 1e3;
            tracing::debug!(
                version,
                rank = session.core.rank(),
                removed = pruned.removed,
                kept_for_pfs_copy = ?pruned.pinned,
                kept_until_protected = waiting,
                prune_ms,
                "older versions pruned"
            );
            Ok(AgentReply::Ok)
        }
        AgentRequest::Fetch { version, reader, reader_checks } => {
            let fetch_started = Instant::now();
            session.fetching = None;
            let (app, rank) = (session.core.app().to_string(), session.core.rank());
            // Kept mapped since the rank's last session (and usually checked
            // since): no mapping and no second pass over the bytes.
            let (opened, identity, intact, kept) = match shared.kept.share(store, &app, (rank, version), !reader_checks)
            {
                Some(kept) => (Ok((kept.manifest, kept.file)), Some(kept.identity), kept.intact, true),
                // The identity before the check: a change after it shows.
                None => {
                    let identity = store.data_identity(&app, rank, version).ok();
                    let opened = store.open(&app, rank, version).map(|(m, file)| (m, SharedMapping::new(file)));
                    (opened, identity, false, false)
                }
            };
            let open_ms = fetch_started.elapsed().as_secs_f64() * 1e3;
            // Intact only by the reader's word: nothing is checked here, and
            // nothing is recorded as checked.
            let unchecked = reader_checks && !intact;
            let found = match &opened {
                Err(missing @ StoreError::Missing { .. }) => Found::Missing(missing.to_string()),
                Err(err) => Found::Unreadable(err.to_string()),
                Ok(_) if intact => Found::Intact,
                // Served as found: the reader checks every chunk itself.
                Ok(_) if unchecked => Found::Intact,
                Ok((manifest, file)) => match manifest.verify(file.as_slice()) {
                    Ok(()) => Found::Intact,
                    Err(damage) => Found::Damaged(damage.to_string()),
                },
            };
            match (&found, &opened, identity) {
                // Checked: the next reader need not (see `kept`).
                (Found::Intact, Ok((manifest, file)), Some(identity)) if !unchecked => {
                    shared.kept.keep_intact(manifest, identity, file)
                }
                // Not worth keeping mapped (and perhaps about to be removed).
                (Found::Damaged(_), _, _) => shared.kept.forget_if(rank, |kept| kept == version),
                _ => {}
            }
            let pfs = shared.settings.pfs.as_ref();
            let has_copy = || pfs.is_some_and(|pfs| pfs.manifest(&app, version).is_ok());
            // A reader on this host takes the very file the check above
            // vouched for, or reads over the fabric.
            let offer = |file: &SharedMapping| offer_file(shared, reader.as_ref(), rank, version, file, identity);
            let (manifest, exposed, damaged, offered) =
                match (session.core.serve_fetch(version, found, pfs.is_some(), has_copy)?, opened) {
                    (Serve::Stored, Ok((manifest, file))) => {
                        let offered = offer(&file);
                        (manifest, expose_file(shared, file)?, None, offered)
                    }
                    (Serve::Damaged(report), Ok((manifest, file))) => {
                        tracing::warn!(version, rank, %report, "stored version is damaged and has no PFS copy");
                        let offered = offer(&file);
                        (manifest, expose_file(shared, file)?, Some(report), offered)
                    }
                    (Serve::FromPfs { replacing }, opened) => {
                        // Unmapped before the damaged version's files go.
                        let missing = opened.err();
                        if let Some(damage) = &replacing {
                            tracing::warn!(version, rank, %damage, "stored version is damaged; using its PFS copy");
                            store.remove_version(&app, rank, version).map_err(|e| e.to_string())?;
                        }
                        // Not in memory either: the reader learns both
                        // places were tried, not only the PFS path.
                        let (manifest, exposed) =
                            expose_from_pfs(shared, &app, rank, version).map_err(|pfs| match missing {
                                Some(missing) if replacing.is_none() => {
                                    format!("{missing}; nor on the PFS: {pfs}")
                                }
                                _ => pfs,
                            })?;
                        (manifest, exposed, None, None)
                    }
                    (_, Err(err)) => return Err(err.to_string()),
                };
            let mut region = match &exposed {
                Exposed::Stored(file) => file.remote(),
                Exposed::Loaded(buffer) => buffer.remote(),
            };
            region.len = manifest.total_len.min(region.len);
            // A reader that takes the file reads nothing over the fabric: no
            // thread spins for it (one that cannot take it fetches again).
            let (handoff, offered) = offered.unzip();
            let progress =
                if offered.is_none() { Some(serve_reads(session.serving_endpoint(shared), caller)?) } else { None };
            session.fetching = Some(Fetching { exposed, deliverable: Some(region.len), progress, _offered: offered });
            let ms = fetch_started.elapsed().as_secs_f64() * 1e3;
            tracing::debug!(
                version,
                rank,
                bytes = region.len,
                kept,
                open_ms,
                ms,
                same_host = handoff.is_some(),
                "version checked and exposed for reading"
            );
            Ok(AgentReply::Fetch { manifest, region, damaged, handoff })
        }
        AgentRequest::Deliver(segments) => {
            let ops = session::deliver_ops(session.fetching.as_ref().and_then(|f| f.deliverable), &segments)?;
            let serving = session.serving_endpoint(shared).clone();
            let fetching = session.fetching.as_mut().ok_or("Deliver without a Fetch")?;
            // Nobody reads while the agent writes: a spinning reader-side
            // thread would only take a core from the copy.
            drop(fetching.progress.take());
            let written =
                shared.endpoint.write(&session.peer, fetching.exposed.source(), &ops, &TransferOptions::default());
            // Reads of the version may follow (a restore may mix both).
            fetching.progress = Some(serve_reads(&serving, caller)?);
            let stats = written.map_err(|e| format!("delivering to the rank: {e}"))?;
            Ok(AgentReply::Delivered { bytes: stats.bytes })
        }
        AgentRequest::FetchDone => {
            session.retired.extend(session.fetching.take());
            Ok(AgentReply::Ok)
        }
        AgentRequest::ServeApart => {
            if session.lane.is_none() {
                session.lane = shared.lease_lane();
            }
            Ok(session.lane.as_ref().map_or(AgentReply::Ok, |lane| AgentReply::Apart(lane.endpoint.address().clone())))
        }
        AgentRequest::FetchPiece { version, piece } => {
            // Pieces hold other nodes' ranks: only another agent reads them.
            if caller.privilege != Privilege::Node {
                return Err("pieces of redundancy are read by agents only (the node token)".into());
            }
            session.fetching = None;
            let (meta, file) = store.open_piece(&shared.app, version, piece).map_err(|e| e.to_string())?;
            // Checked before it is exposed: a damaged piece is refused, and
            // the rebuild goes on without it.
            verify_piece(&meta, file.as_slice(), version, piece)?;
            let exposed = expose_file(shared, SharedMapping::new(file))?;
            let Exposed::Stored(registered) = &exposed else { unreachable!("expose_file exposes the stored file") };
            let region = registered.remote();
            let progress = serve_reads(session.serving_endpoint(shared), caller)?;
            session.fetching = Some(Fetching { exposed, deliverable: None, progress: Some(progress), _offered: None });
            Ok(AgentReply::Piece { meta, region })
        }
        AgentRequest::PutPiece { version, piece, len } => {
            if caller.privilege != Privilege::Node {
                return Err("pieces of redundancy are written by agents only (the node token)".into());
            }
            if !matches!(piece, PieceId::Parity { .. }) {
                return Err(format!("only parity shards are written by another agent, not a {piece}"));
            }
            // A piece left unsealed by an earlier PutPiece goes first.
            session.receiving = None;
            let progress = ProgressThread::serving_background_writes(&shared.endpoint).map_err(|e| e.to_string())?;
            let owners = shared.piece_owners.clone();
            let (ticket, created) =
                owners.claim((version, piece), || store.create_piece(&shared.app, version, piece, len));
            let mut receiving = Receiving {
                version,
                piece,
                file: None,
                store: store.clone(),
                app: shared.app.clone(),
                ticket,
                owners,
                _progress: progress,
            };
            let file = created
                .map_err(|e| e.to_string())
                .and_then(|file| shared.endpoint.register(file, Access::REMOTE_WRITE).map_err(|e| e.to_string()))
                .inspect_err(|_| receiving.discard())?;
            let region = file.remote();
            receiving.file = Some(file);
            session.receiving = Some(receiving);
            Ok(AgentReply::Target(region))
        }
        AgentRequest::SealPiece { meta } => {
            let mut receiving = session.receiving.take().ok_or("SealPiece without PutPiece")?;
            let (version, piece) = (receiving.version, receiving.piece);
            let len = meta.check(&shared.app, version, piece).map_err(|e| format!("the {piece} described: {e}"))?;
            let file = receiving.file.take().expect("an unsealed piece has its file");
            let result = match usize::try_from(len).ok().filter(|len| *len <= file.len()) {
                None => Err(format!("the {piece} is described as {len} bytes, {} were written", file.len())),
                Some(len) => verify_piece(&meta, &file.as_slice()[..len], version, piece),
            };
            // Sealed only by the newest PutPiece of the piece (see `crate::owners`).
            let seal = || store.seal_piece(&shared.app, version, piece, &meta).map_err(|e| e.to_string());
            let result = result.and_then(|()| {
                let sealed = receiving.owners.finish(&(version, piece), receiving.ticket, seal);
                sealed.unwrap_or_else(|| {
                    Err(format!("the {piece} of version {version} is being written by a newer PutPiece here"))
                })
            });
            match &result {
                Ok(()) => piece_sealed(shared, version, piece, file.into_inner(), len),
                Err(_) => {
                    drop(file);
                    receiving.discard();
                }
            }
            result.map(|()| AgentReply::Ok)
        }
    }
}

/// Checks a piece's bytes against its description: a copy or a slice
/// against the rank's checksums, a parity shard against its stripe
/// checksums.
fn verify_piece(meta: &PieceMeta, bytes: &[u8], version: u64, piece: PieceId) -> Result<(), String> {
    match meta {
        PieceMeta::Copy(manifest) => {
            manifest.verify(bytes).map_err(|e| format!("the {piece} of version {version} is damaged: {e}"))
        }
        PieceMeta::Parity(parity) => {
            let stripes = bytes.chunks(protocol::STRIPE as usize);
            match stripes.zip(&parity.crcs).position(|(bytes, crc)| icheck_core::format::crc32c(bytes) != *crc) {
                Some(bad) => Err(format!(
                    "the {piece} of version {version} is damaged at bytes {}..",
                    bad as u64 * protocol::STRIPE
                )),
                None => Ok(()),
            }
        }
        PieceMeta::Slice(slice) => {
            let damaged = |e: String| format!("the {piece} of version {version} is damaged: {e}");
            let (start, end) = slice.bounds().map_err(damaged)?;
            let bytes = bytes.get(..(end - start) as usize).ok_or_else(|| damaged("it is short".into()))?;
            let mut check = icheck_core::format::InOrderCheck::over(&slice.manifest, (start, end))
                .map_err(|e| damaged(e.to_string()))?;
            check.feed(bytes).map(drop).map_err(|e| damaged(e.to_string()))
        }
    }
}

/// The version's files for a reader on this host (`reader`), when its own
/// data file is exactly the one the Fetch checked or kept (`identity`): the
/// file of a version stored whole, or every file holding the blocks of an
/// incremental one.
fn offer_file(
    shared: &Shared,
    reader: Option<&icheck_core::handoff::HostId>,
    rank: u32,
    version: u64,
    file: &SharedMapping,
    identity: Option<crate::store::FileIdentity>,
) -> Option<(icheck_core::handoff::Handoff, icheck_core::handoff::Offered)> {
    let server = shared.settings.handoff.as_ref()?;
    if reader.is_none() || reader != server.host() {
        return None;
    }
    let (files, extents, opened) = match shared.settings.store.open_read_only(&shared.app, rank, version) {
        Ok(found) => found,
        Err(err) => {
            tracing::debug!(%err, version, rank, "no file to hand over; the rank reads over the fabric");
            return None;
        }
    };
    let covered: u64 = extents.iter().map(|e| e.len).sum();
    if Some(opened) != identity || covered != file.data_len() as u64 {
        tracing::debug!(
            version,
            rank,
            "the version's file changed since it was checked; the rank reads over the fabric"
        );
        return None;
    }
    server
        .offer(files, extents)
        .map_err(|err| tracing::warn!(%err, version, rank, "cannot offer the version's files to a rank on this host"))
        .ok()
}

/// Drives this endpoint's progress while a caller reads what it exposed. A
/// rank restarting waits for it, so it spins where this side moves the
/// bytes ([`ProgressThread::serving_restart_reads`]; over shm, where the
/// reader copies, it polls under `SCHED_IDLE`);
/// another agent's read (a copy, a rebuild, a take-over) is background
/// work and polls at the lowest priority like the reader's side, or its
/// polling would starve that reader on a busy node
/// ([`ProgressThread::serving_background_reads`]).
fn serve_reads(endpoint: &Endpoint, caller: Caller) -> Result<ProgressThread, String> {
    let spawned = if caller.privilege == Privilege::Node {
        ProgressThread::serving_background_reads(endpoint)
    } else {
        ProgressThread::serving_restart_reads(endpoint)
    };
    spawned.map_err(|e| e.to_string())
}

/// Serialises loads of versions from the PFS into this node's store.
static NODE_PFS_LOADS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Registers a stored version's file for the rank to read.
fn expose_file(shared: &Shared, file: SharedMapping) -> Result<Exposed, String> {
    let file = shared.endpoint.register(file, Access::REMOTE_READ).map_err(|e| e.to_string())?;
    Ok(Exposed::Stored(file))
}

/// Brings a version back from the PFS ([`load_from_pfs`]) and exposes it:
/// from the store it was loaded into, or from memory when the store is full.
fn expose_from_pfs(shared: &Shared, app: &str, rank: u32, version: u64) -> Result<(Manifest, Exposed), String> {
    match load_from_pfs(shared, app, rank, version)? {
        Loaded::IntoStore => {
            let (manifest, file) = shared.settings.store.open(app, rank, version).map_err(|e| e.to_string())?;
            Ok((manifest, expose_file(shared, SharedMapping::new(file))?))
        }
        Loaded::NoRoom(manifest, data) => Ok((manifest, expose_loaded(shared, &data)?)),
    }
}

/// Registers bytes loaded from the PFS (outside the store) for the rank to read.
fn expose_loaded(shared: &Shared, data: &[u8]) -> Result<Exposed, String> {
    let mut buffer = AlignedBuffer::zeroed(data.len().max(1));
    buffer.as_mut_slice()[..data.len()].copy_from_slice(data);
    let buffer = shared.endpoint.register(buffer, Access::REMOTE_READ).map_err(|e| e.to_string())?;
    Ok(Exposed::Loaded(buffer))
}

/// Where [`load_from_pfs`] put a version.
enum Loaded {
    /// Into the store, sealed: open it there.
    IntoStore,
    /// The store's file system is full: here are its manifest and bytes.
    NoRoom(Manifest, Vec<u8>),
}

/// Brings a version this node's store lacks (its agents were lost, or the
/// store was wiped) back from the PFS copy, verified, into the store; or,
/// when the store has no room for it, hands the verified bytes back.
fn load_from_pfs(shared: &Shared, app: &str, rank: u32, version: u64) -> Result<Loaded, String> {
    let pfs = &shared.pfs()?;
    // Several sessions may want the same old rank at once (processes of a
    // resized run): one loads it, the others find it loaded. Loading
    // rewrites the version's files, so two loads must never overlap.
    let _one_load = NODE_PFS_LOADS.lock().unwrap_or_else(|p| p.into_inner());
    if shared.settings.store.open(app, rank, version).is_ok() {
        return Ok(Loaded::IntoStore);
    }
    let started = Instant::now();
    let (rank_manifest, data) = match pfs.manifest(app, version) {
        Ok(manifest) => pfs.read_rank(&manifest, rank),
        // Spilled, and the copy that completes it on the PFS is still under way.
        Err(incomplete) => pfs.read_partial_rank(app, version, rank).map_err(|_| incomplete),
    }
    .map_err(|e| e.to_string())?;
    let store = &shared.settings.store;
    let mut file = match store.create(app, rank, version, rank_manifest.total_len) {
        Ok(file) => file,
        Err(full @ StoreError::NoSpace { .. }) => {
            tracing::warn!(version, rank, %full, "serving a PFS version from memory outside the full store");
            return Ok(Loaded::NoRoom(rank_manifest, data));
        }
        Err(err) => return Err(err.to_string()),
    };
    file.as_mut_slice().copy_from_slice(&data);
    store.seal(&rank_manifest).map_err(|e| e.to_string())?;
    tracing::info!(
        version,
        rank,
        bytes = data.len(),
        ms = started.elapsed().as_secs_f64() * 1e3,
        "loaded from the PFS"
    );
    Ok(Loaded::IntoStore)
}

/// Fetches `rank`'s `version` from the agent `from` exactly as a restarting
/// rank would (Open, Fetch, RMA read, FetchDone), verifies every chunk
/// against the rank's own checksums, and seals it in this node's store.
fn take_over(job: &Job<'_>, rank: u32, version: u64, from: &AgentInfo) -> Result<u64, String> {
    let started = Instant::now();
    let fail = |what: String| format!("taking over rank {rank} version {version}: {what}");
    if icheck_core::failpoint::fails("agent.take_over_rank") {
        return Err(fail("the failpoint agent.take_over_rank refused it".into()));
    }
    let mut session = redundancy::PeerSession::open(job, from, rank).map_err(fail)?;
    // Checked by the peer first: a damaged version is served from its PFS copy.
    let (manifest, region) = session.fetch(job, (rank, version), false).map_err(fail)?;
    let total = manifest.total_len as usize;
    let from_node = format!("the primary on {}", from.node);
    redundancy::read_rank_into_primary(job, &mut session, &manifest, region, &from_node).map_err(fail)?;
    // The controller's newest complete version, now held here.
    job.completed(rank, version);
    tracing::info!(
        rank,
        version,
        from = from.id,
        from_node = %from.node,
        bytes = total,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "took over a rank"
    );
    Ok(total as u64)
}

/// Seals `manifest`'s version, written into `file` by this agent (a
/// take-over or a rebuild) and checked against every chunk's checksum on
/// the way, and keeps the mapping as the rank's checked version. The
/// restart or protection that reads it next then neither maps it again nor
/// checks it again: for one rank of 1 GiB after a lost node that was
/// 0.2 s of a 0.45 s restart.
fn seal_checked(shared: &Shared, manifest: &Manifest, file: MappedFile) -> Result<(), String> {
    let store = &shared.settings.store;
    store.seal(manifest).map_err(|e| e.to_string())?;
    // The identity after sealing: nothing writes the file from here on.
    if let Ok(identity) = store.data_identity(&manifest.app, manifest.rank, manifest.version) {
        shared.kept.keep_intact(manifest, identity, &SharedMapping::new(file));
    }
    Ok(())
}

/// Reads the rank's segments into the version file.
fn pull(endpoint: &Endpoint, peer: &Peer, writing: &mut Writing, ops: &[RmaOp]) -> Result<u64, String> {
    let options = TransferOptions::default();
    match &mut writing.destination {
        Destination::Memory(file) => {
            let stats =
                endpoint.read(peer, file.target(), ops, &options).map_err(|e| format!("pulling from rank: {e}"))?;
            Ok(stats.bytes)
        }
        Destination::Spill { staging, file } => {
            // Piece by piece through the staging buffer into the PFS file.
            let step = staging.len();
            let mut moved = 0u64;
            for op in ops {
                let mut done = 0;
                while done < op.len {
                    let len = step.min(op.len - done);
                    let piece = RmaOp {
                        local_offset: 0,
                        remote: op.remote,
                        remote_offset: op.remote_offset + done as u64,
                        len,
                    };
                    endpoint
                        .read(peer, staging.target(), &[piece], &options)
                        .map_err(|e| format!("pulling from rank: {e}"))?;
                    file.write_at((op.local_offset + done) as u64, &staging.as_slice()[..len])
                        .map_err(|e| e.to_string())?;
                    done += len;
                    moved += len as u64;
                }
            }
            Ok(moved)
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::format::check_layout;
    use icheck_core::protocol::{DataKind, LabelLayout};

    #[test]
    fn lanes_are_opened_ahead_one_per_rank_up_to_the_most_an_agent_opens() {
        assert_eq!(lanes_to_open_ahead(0, 0), 0, "no rank: nothing to restart");
        assert_eq!(lanes_to_open_ahead(2, 0), 2);
        assert_eq!(lanes_to_open_ahead(2, 1), 1);
        assert_eq!(lanes_to_open_ahead(2, 2), 0);
        assert_eq!(lanes_to_open_ahead(8, 0), MAX_LANES);
        assert_eq!(lanes_to_open_ahead(8, MAX_LANES), 0);
        assert_eq!(lanes_to_open_ahead(1, MAX_LANES), 0, "lanes are never closed here");
    }

    #[test]
    fn a_reader_gets_an_idle_lane_then_a_new_one_then_the_least_used() {
        assert_eq!(choose_lane(&[], 3), LaneChoice::Open, "no lane yet");
        assert_eq!(choose_lane(&[1, 0, 2], 3), LaneChoice::Reuse(1), "an idle lane before a new one");
        assert_eq!(choose_lane(&[1, 1], 3), LaneChoice::Open, "every lane busy, room for one more");
        assert_eq!(choose_lane(&[2, 1, 1], 3), LaneChoice::Reuse(1), "at the cap: the least used, first of equals");
        assert_eq!(choose_lane(&[1], 0), LaneChoice::Reuse(0), "over a cap of none: share");
    }

    #[test]
    fn only_the_newest_protected_version_is_held_back_and_only_while_older() {
        let held = |versions: &[u64]| versions.iter().copied().collect::<Held>();
        assert_eq!(held_back(0, 0, 5), held(&[]), "nothing protected yet: the usual pruning");
        assert_eq!(held_back(4, 0, 5), held(&[4]), "version 5 unprotected: 4 is what a rebuild falls back to");
        assert_eq!(held_back(2, 0, 5), held(&[2]), "a stalled protection holds one version, not 2 to 4");
        assert_eq!(held_back(5, 0, 5), held(&[]), "the newest is protected");
        assert_eq!(held_back(2, 3, 5), held(&[2, 3]), "3 is being protected: its encoders read it");
        assert_eq!(held_back(0, 3, 5), held(&[3]), "the first protection");
        assert_eq!(held_back(3, 3, 5), held(&[3]), "protected now: held once");
        assert_eq!(held_back(4, 3, 5), held(&[4]), "a newer one was protected: 3 goes");
        assert_eq!(held_back(2, 5, 5), held(&[2]), "the newest itself is being protected");
    }

    fn label(name: &str, offset: u64, len: u64) -> LabelLayout {
        LabelLayout { label: name.into(), kind: DataKind::Double, offset, len, adapt: None }
    }

    #[test]
    fn the_budget_never_exceeds_the_store() {
        assert_eq!(pick_budget(90 << 30, 100 << 20), 100 << 20);
        assert_eq!(pick_budget(0, 100 << 20), 100 << 20);
        assert_eq!(pick_budget(12 << 20, 100 << 20), 12 << 20);
        assert_eq!(pick_budget(12 << 20, 0), 12 << 20, "an unknown size changes nothing");
    }

    #[test]
    fn layouts_must_be_contiguous_and_unique() {
        assert_eq!(check_layout(&[label("a", 0, 8), label("b", 8, 16)]), Ok(24));
        assert_eq!(check_layout(&[]), Ok(0));
        assert!(check_layout(&[label("a", 0, 8), label("a", 8, 8)]).unwrap_err().contains("twice"));
        assert!(check_layout(&[label("a", 0, 8), label("b", 9, 8)]).unwrap_err().contains("instead of 8"));
        assert!(check_layout(&[label("a", 0, u64::MAX), label("b", u64::MAX, 8)]).is_err());
    }
}
