//! The client: registration with the controller, sessions with agents, and
//! the commit and restart data paths.
//!
//! Data paths of one rank (its agent is `decide::agent_for_rank`):
//! * zero-copy (blocking, `zero_copy = true`): each label's memory is
//!   registered for the duration of the commit; the agent `fi_read`s it
//!   (pull) or the library `fi_write`s it into the agent's file (push);
//! * pipelined (blocking, `zero_copy = false`): labels stream through a
//!   bounded staging buffer used as two halves, copying into one half while
//!   the other is transferred;
//! * asynchronous: labels are copied into a full-size staging buffer, the
//!   commit returns, and a background thread transfers and seals; `wait()`
//!   completes the version.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use icheck_core::config::{ConfigError, StaticConfig, TransferDirection};
use icheck_core::control::BlockingConnection;
use icheck_core::control::ServiceError;
use icheck_core::decide::agent_for_rank;
use icheck_core::distribution::{Adapt, Attribute, GlobalLayout};
use icheck_core::fabric::{
    Access, AlignedBuffer, Domain, Endpoint, FabricError, LocalSource, MemoryRegion, Peer, ProgressMode,
    ProgressThread, RegisteredBuffer, RemoteRegion, RmaOp, TransferOptions,
};
use icheck_core::format::{first_bad_chunk, label_crcs, CHUNK_BYTES, CHUNK_SIZE};
use icheck_core::protocol::ProtocolError;
use icheck_core::protocol::{
    self, AgentInfo, AgentReply, AgentRequest, AppRegistration, ClientReply, ClientRequest, DataKind, LabelLayout,
    Manifest, PullSegment, TransferMode, VersionRecord,
};

use crate::comm::Communicator;
use crate::region::{as_bytes_mut, Element, RawSource, Region, Source};
use crate::segment::NodeSegment;

mod resize;
pub use resize::Recalc;
use resize::Resized;
pub use resize::{Global, Recalculate, Replicated, Resize};

/// Environment variable naming the configuration file when `init` gets none.
pub const CONFIG_ENV: &str = "ICHECK_CONFIG";
/// Configuration file used when neither `init` nor the environment names one.
pub const DEFAULT_CONFIG: &str = "/etc/icheck/icheck.toml";
/// How long a controller request may take (it may start agents: 15 s each
/// at most on the controller's side).
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a data-path request may take (large transfers on slow fabrics).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(3600);

/// Everything a library call can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file is missing or wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The controller could not be reached or refused.
    #[error("controller at {peer}: {error}")]
    Controller {
        /// Its address.
        peer: String,
        /// What happened.
        error: ServiceError,
    },
    /// An agent could not be reached or failed a request.
    #[error("agent {agent} on node {node} ({peer}): {message}")]
    Agent {
        /// Agent id.
        agent: u64,
        /// Its node.
        node: String,
        /// Its command channel.
        peer: String,
        /// What happened.
        message: String,
    },
    /// Fabric failure on this process's side.
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// The label was never added (or is not in the checkpoint).
    #[error("unknown label {label:?}: {detail}")]
    UnknownLabel {
        /// The label.
        label: String,
        /// Where it is missing.
        detail: &'static str,
    },
    /// A label name is unusable.
    #[error("invalid label {0:?}: labels are 1 to 255 bytes")]
    BadLabel(String),
    /// The checkpointed data and the caller's memory differ in size.
    #[error("label {label:?}: the checkpoint holds {stored} bytes, the region given has {given} bytes")]
    SizeMismatch {
        /// The label.
        label: String,
        /// Bytes in the checkpoint.
        stored: u64,
        /// Bytes in the caller's region.
        given: u64,
    },
    /// The checkpointed data has another element type.
    #[error("label {label:?}: the checkpoint holds {stored:?} elements, the region holds {given:?}")]
    KindMismatch {
        /// The label.
        label: String,
        /// Kind in the checkpoint.
        stored: DataKind,
        /// Kind of the caller's region.
        given: DataKind,
    },
    /// A call came in the wrong order.
    #[error("{0}")]
    Order(&'static str),
    /// No complete checkpoint exists.
    #[error("no complete checkpoint of {0:?} exists")]
    NoCheckpoint(String),
    /// Restored bytes fail their checksum.
    #[error("version {version} of rank {rank}: bytes {start}..{end} (labels {labels}) fail their crc32c checksum")]
    Corrupt {
        /// Version.
        version: u64,
        /// Rank.
        rank: u32,
        /// First byte of the bad chunk.
        start: u64,
        /// End of the bad chunk.
        end: u64,
        /// Labels overlapping the damaged chunk.
        labels: String,
    },
    /// Another rank failed its part; the version was not recorded.
    #[error("version {version} is incomplete: {detail}; {previous} stays the newest complete version")]
    Incomplete {
        /// The version.
        version: u64,
        /// What failed where.
        detail: String,
        /// What a restart would get.
        previous: String,
    },
    /// The checkpoint was written with another process count, and this
    /// mode cannot restore it (SHMR keeps one file per node).
    #[error("version {version} was written by {written} processes, this run has {now}: a restart with another process count needs MR mode (mode = \"mr\")")]
    RankCount {
        /// Version.
        version: u64,
        /// Processes when written.
        written: u32,
        /// Processes now.
        now: u32,
    },
    /// A configuration value is not supported (yet).
    #[error("{0}")]
    Unsupported(String),
    /// A label added for malleability (`add_adapt`, `add_adapt_global`)
    /// cannot be stored or restored as asked.
    #[error("label {label:?}: {detail}")]
    Adapt {
        /// The label.
        label: String,
        /// What is wrong.
        detail: String,
    },
    /// A distributed array has no layout for the process count.
    #[error("label {label:?}: {error}")]
    Distribution {
        /// The label.
        label: String,
        /// Why.
        error: icheck_core::distribution::DistributionError,
    },
}

type Result<T> = std::result::Result<T, Error>;

/// What `init` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitStatus {
    /// No complete checkpoint exists: start from the beginning.
    Fresh,
    /// A complete checkpoint exists; `restart()` fetches it.
    Restart {
        /// Its version.
        version: u64,
    },
}

/// Hints for `probe_agents` (thesis §6.4.1).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProbeHints {
    /// Commits the application still expects to make (0 = unknown).
    pub remaining_commits: u32,
}

/// What a probe changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Same agents.
    Unchanged,
    /// The application now uses other agents; the next commit goes there.
    Reconnected {
        /// The new agent count.
        agents: usize,
    },
}

struct Label {
    name: String,
    source: Box<dyn Source>,
    /// How a run with another process count restores it (adapt labels).
    adapt: Option<icheck_core::distribution::Adapt>,
    /// A VOLATILE label's recalculation.
    recalc: Option<Recalc>,
}

/// This rank's session with its agent.
struct AgentLink {
    info: AgentInfo,
    peer: Peer,
    conn: BlockingConnection,
    /// The agent spilled the last sealed version to the PFS (its memory
    /// budget was used up); the controller must have it copied.
    spilled: bool,
}

impl AgentLink {
    fn open(
        endpoint: &Endpoint,
        info: &AgentInfo,
        token: &str,
        app: &str,
        rank: u32,
        timeout: Duration,
    ) -> Result<Self> {
        let fail = |message: String| Error::Agent {
            agent: info.id,
            node: info.node.clone(),
            peer: info.control.clone(),
            message,
        };
        let mut conn = BlockingConnection::connect(&info.control, token, timeout).map_err(|e| fail(e.to_string()))?;
        conn.set_timeout(TRANSFER_TIMEOUT);
        let peer = endpoint.insert_peer(&info.address)?;
        let mut link = AgentLink { info: info.clone(), peer, conn, spilled: false };
        link.call(&AgentRequest::Open { app: app.to_string(), rank, address: endpoint.address().clone() })?;
        Ok(link)
    }

    fn error(&self, message: String) -> Error {
        Error::Agent { agent: self.info.id, node: self.info.node.clone(), peer: self.info.control.clone(), message }
    }

    fn call(&mut self, request: &AgentRequest) -> Result<AgentReply> {
        match self.conn.call::<_, AgentReply>(request) {
            Ok(AgentReply::Error(message)) => Err(self.error(message)),
            Ok(reply) => Ok(reply),
            Err(err) => Err(self.error(err.to_string())),
        }
    }

    fn begin(&mut self, version: u64, shape: Shape, labels: Vec<LabelLayout>, push: bool) -> Result<RemoteRegion> {
        let Shape { ranks, epoch } = shape;
        match self.call(&AgentRequest::Begin { version, ranks, epoch, labels, push })? {
            AgentReply::Target(region) => Ok(region),
            other => Err(self.error(format!("unexpected answer to Begin: {other:?}"))),
        }
    }

    /// Pull mode: the agent reads `segments` while this process drives its
    /// endpoint's progress.
    fn pull(&mut self, endpoint: &Endpoint, segments: Vec<PullSegment>) -> Result<u64> {
        let progress = ProgressThread::spawn(endpoint, ProgressMode::Spin)
            .map_err(|e| self.error(format!("cannot start a progress thread: {e}")))?;
        let reply = self.call(&AgentRequest::Pull(segments));
        progress.stop();
        match reply? {
            AgentReply::Pulled { bytes } => Ok(bytes),
            other => Err(self.error(format!("unexpected answer to Pull: {other:?}"))),
        }
    }

    fn seal(&mut self, crcs: Vec<Vec<u32>>) -> Result<Manifest> {
        icheck_core::failpoint::hit("client.before_seal");
        self.spilled = false;
        match self.call(&AgentRequest::Seal { crcs })? {
            AgentReply::Sealed(manifest) => Ok(manifest),
            AgentReply::Spilled(manifest) => {
                self.spilled = true;
                Ok(manifest)
            }
            other => Err(self.error(format!("unexpected answer to Seal: {other:?}"))),
        }
    }
}

/// What a version is written by: the process count (node count in SHMR
/// mode, where a node is one writer) and the resize epoch.
#[derive(Clone, Copy, Debug)]
struct Shape {
    ranks: u32,
    epoch: u32,
}

/// What a background commit thread hands back.
struct Background {
    link: AgentLink,
    staging: Option<RegisteredBuffer>,
    segment_region: Option<MemoryRegion>,
    result: Result<()>,
}

/// A background commit. Processes without a transfer of their own (SHMR
/// non-leaders) have no thread but still complete the version in `wait`.
struct InFlight {
    version: u64,
    started: Instant,
    bytes: u64,
    handle: Option<JoinHandle<Background>>,
}

/// Begins `version` at the agent, moves `bytes` (registered as `registered`:
/// local source and remote view; `None` only when there are no bytes) to it,
/// checksums each label of `layout` meanwhile on another thread, and seals.
#[allow(clippy::too_many_arguments)]
fn send_version(
    link: &mut AgentLink,
    endpoint: &Endpoint,
    version: u64,
    shape: Shape,
    layout: Vec<LabelLayout>,
    push: bool,
    registered: Option<(LocalSource<'_>, RemoteRegion)>,
    bytes: &[u8],
) -> Result<()> {
    let total = bytes.len();
    let target = link.begin(version, shape, layout.clone(), push)?;
    let slices: Vec<&[u8]> = layout.iter().map(|l| &bytes[l.offset as usize..(l.offset + l.len) as usize]).collect();
    let crcs = std::thread::scope(|scope| -> Result<Vec<Vec<u32>>> {
        let checksums = scope.spawn(|| label_crcs(&slices));
        if total > 0 {
            let (source, remote) = registered.ok_or(Error::Order("the bytes to send are not registered"))?;
            if push {
                let op = RmaOp { local_offset: 0, remote: target, remote_offset: 0, len: total };
                endpoint.write(&link.peer, source, &[op], &TransferOptions::default())?;
            } else {
                let segment = PullSegment { source: remote, source_offset: 0, file_offset: 0, len: total as u64 };
                link.pull(endpoint, vec![segment])?;
            }
        }
        checksums.join().map_err(|_| Error::Order("the checksum thread panicked"))
    })?;
    link.seal(crcs).map(|_| ())
}

/// A version `restart` exposed at the agent; `restore` reads labels from it
/// straight into the caller's memory.
struct Restored {
    manifest: Manifest,
    data: RestoredData,
}

/// One process of a node and its labels' places in the node segment.
type NodeProcessLabels = (u32, Vec<LabelLayout>);

/// Where the bytes of a restarted version are.
enum RestoredData {
    /// At this rank's agent, exposed for reading until `FetchDone`.
    Agent(RemoteRegion),
    /// SHMR: in the node segment, read and verified by the node leader;
    /// labels are named `<rank>/<label>` there.
    Segment,
    /// Fallback: this rank's data, read and verified from the PFS.
    Local(Vec<u8>),
    /// Written by another process count: `restore` reads each label's
    /// pieces from the old ranks (`resize.rs`).
    Resized(Resized),
}

/// Bytes read per step of a restore; each step's checksums are verified on
/// another thread while the next step is read.
const RESTORE_STEP: usize = 16 * CHUNK_BYTES;

/// Reads `out.len()` bytes at `remote_offset` of `region` into `out` in
/// steps, verifying each step against `crcs` (one per `chunk` bytes of
/// `out`) while the next step is in flight. Returns the first bad chunk.
fn read_and_verify(
    endpoint: &Endpoint,
    peer: &Peer,
    region: RemoteRegion,
    remote_offset: u64,
    out: &mut [u8],
    chunk: usize,
    crcs: &[u32],
) -> Result<Option<usize>> {
    let total = out.len();
    if chunk == 0 || !RESTORE_STEP.is_multiple_of(chunk) || crcs.len() != total.div_ceil(chunk) {
        return Ok(Some(0));
    }
    if total == 0 {
        return Ok(None);
    }
    // SAFETY: `out` stays borrowed, alive and unmoved until the registration
    // is dropped at the end of this function.
    let local = unsafe { endpoint.register_raw(out.as_mut_ptr(), total, Access::LOCAL)? };
    let base = out.as_mut_ptr() as usize;
    let (to_verify, steps) = mpsc::channel::<usize>();
    std::thread::scope(|scope| {
        let verifier = scope.spawn(move || {
            for start in steps {
                let end = (start + RESTORE_STEP).min(total);
                // SAFETY: bytes start..end were completely read before this
                // step was sent, and no later read touches them.
                let bytes = unsafe { std::slice::from_raw_parts((base + start) as *const u8, end - start) };
                let first = start / chunk;
                if let Some(bad) = first_bad_chunk(bytes, &crcs[first..first + bytes.len().div_ceil(chunk)]) {
                    return Some(first + bad);
                }
            }
            None
        });
        let mut read = Ok(());
        let options = TransferOptions::default();
        for start in (0..total).step_by(RESTORE_STEP) {
            let len = RESTORE_STEP.min(total - start);
            let op = RmaOp { local_offset: start, remote: region, remote_offset: remote_offset + start as u64, len };
            // SAFETY: the verifier only reads steps already sent, which lie
            // before `start`; this read writes start..start+len only.
            let target = unsafe { local.target_unchecked() };
            if let Err(err) = endpoint.read(peer, target, &[op], &options) {
                read = Err(err.into());
                break;
            }
            if to_verify.send(start).is_err() {
                break;
            }
        }
        drop(to_verify);
        let bad = verifier.join().unwrap_or(Some(0));
        read.map(|_| bad)
    })
}

/// A checkpointing application process.
pub struct Icheck {
    app: String,
    token: String,
    comm: Box<dyn Communicator>,
    endpoint: Endpoint,
    controller: Option<BlockingConnection>,
    controller_peer: String,
    agents: Vec<AgentInfo>,
    /// This process's agent session: every rank in MR mode, node leaders
    /// only in SHMR mode.
    link: Option<AgentLink>,
    mode: TransferMode,
    /// Set while the service is unreachable: versions go straight to the
    /// PFS in the same format the agents write.
    fallback: Option<icheck_core::pfs::PfsStore>,
    /// The PFS level (`PfsDir`), if configured: where fallback writes go and
    /// where older versions are looked up when the newest cannot be read.
    pfs: Option<icheck_core::pfs::PfsStore>,
    /// Fallback: when the service was last tried, and how often to try.
    fallback_tried: Instant,
    t_wait: Duration,
    /// What registration needs, to try the service again.
    registration: AppRegistration,
    /// SHMR, node leader: the segment's registration (renewed when it
    /// grows). Declared before `segment` so it is dropped first.
    segment_region: Option<MemoryRegion>,
    /// SHMR: this node's shared segment (mapped by every node process).
    segment: Option<NodeSegment>,
    labels: Vec<Label>,
    latest: Option<VersionRecord>,
    /// Resize epoch of the versions this run writes: the newest version's,
    /// plus one when this run's process count differs from its.
    epoch: u32,
    next_version: u64,
    direction: TransferDirection,
    zero_copy: bool,
    staging_size: usize,
    staging: Option<RegisteredBuffer>,
    asynchronous: bool,
    in_flight: Option<InFlight>,
    restored: Option<Restored>,
    /// What the agent said is damaged in the version `restart` fetched (MR).
    restart_damage: Option<String>,
    finalized: bool,
    connect_timeout: Duration,
}

/// Opens this process's session with its agent: in MR mode every rank's
/// (agent by rank), in SHMR mode only the node leader's (agent by node, and
/// the node index stands in for the rank).
fn open_link(
    comm: &dyn Communicator,
    mode: TransferMode,
    endpoint: &Endpoint,
    agents: &[AgentInfo],
    token: &str,
    app: &str,
    timeout: Duration,
) -> Result<Option<AgentLink>> {
    let count = agents.len() as u32;
    let (who, of) = match mode {
        TransferMode::Mr => (comm.rank(), comm.size()),
        TransferMode::Shmr if comm.node_rank() == 0 => (comm.node_index(), comm.node_counts().0),
        TransferMode::Shmr => return Ok(None),
    };
    let mine = &agents[agent_for_rank(who, of, count) as usize];
    AgentLink::open(endpoint, mine, token, app, who, timeout).map(Some)
}

fn config_path(config: Option<&Path>) -> PathBuf {
    match config {
        Some(path) => path.to_path_buf(),
        None => std::env::var_os(CONFIG_ENV).map_or_else(|| PathBuf::from(DEFAULT_CONFIG), PathBuf::from),
    }
}

fn layouts(labels: &[Label], lens: &[usize]) -> Vec<LabelLayout> {
    let mut offset = 0u64;
    labels
        .iter()
        .zip(lens)
        .map(|(label, len)| {
            let layout = LabelLayout {
                label: label.name.clone(),
                kind: label.source.kind(),
                offset,
                len: *len as u64,
                adapt: label.adapt.clone(),
            };
            offset += *len as u64;
            layout
        })
        .collect()
}

impl Icheck {
    /// Registers the application with the service and opens this rank's
    /// session with its agent (*collective*). `config` defaults to
    /// `$ICHECK_CONFIG`, then `/etc/icheck/icheck.toml`.
    pub fn init<C: Communicator + 'static>(
        config: Option<&Path>,
        app_name: &str,
        comm: C,
    ) -> Result<(Icheck, InitStatus)> {
        let comm: Box<dyn Communicator> = Box::new(comm);
        let path = config_path(config);
        let config = StaticConfig::load(&path)?;
        let client = config.client.clone();
        let direction = match std::env::var("ICHECK_TRANSFER").ok().as_deref() {
            Some("push") => TransferDirection::Push,
            Some("pull") => TransferDirection::Pull,
            _ => client.transfer,
        };
        let mode = match std::env::var("ICHECK_MODE").ok().as_deref() {
            Some("shmr") => TransferMode::Shmr,
            Some("mr") => TransferMode::Mr,
            _ => client.mode,
        };
        let zero_copy = match std::env::var("ICHECK_ZERO_COPY").ok().as_deref() {
            Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            _ => client.zero_copy,
        };
        let staging_size = match std::env::var("ICHECK_STAGING_BUFFER") {
            Ok(text) => text
                .parse::<icheck_core::units::ByteSize>()
                .map_err(|e| Error::Unsupported(format!("environment variable ICHECK_STAGING_BUFFER: {e}")))?,
            Err(_) => client.staging_buffer,
        };
        let pfs_interval = match std::env::var("ICHECK_PFS_INTERVAL") {
            Ok(text) => text.parse::<u32>().map_err(|_| {
                Error::Unsupported(format!("environment variable ICHECK_PFS_INTERVAL: {text:?} is not a number"))
            })?,
            Err(_) => client.pfs_interval,
        };
        let mut client = client;
        if let Ok(text) = std::env::var("ICHECK_COMPRESSION") {
            client.compression = text;
        }
        let compression = client.compression().map_err(|expected| ConfigError::Invalid {
            file: path.clone(),
            key: "client.compression (or ICHECK_COMPRESSION)",
            expected,
        })?;
        let t_wait = match std::env::var("ICHECK_T_WAIT") {
            Ok(text) => text.parse::<f64>().ok().filter(|t| *t >= 0.0).ok_or_else(|| {
                Error::Unsupported(format!("environment variable ICHECK_T_WAIT: {text:?} is not a number of seconds"))
            })?,
            Err(_) => client.t_wait.max(0.0),
        };
        let t_wait = Duration::from_secs_f64(t_wait);
        let token = config.effective_token();
        let connect_timeout = Duration::from_secs_f64(client.connect_timeout.max(0.1));
        let (rank, size) = (comm.rank(), comm.size());
        let span = tracing::info_span!("icheck", app = app_name, rank);
        let _entered = span.enter();
        let domain = Domain::open(&config.fabric)?;
        let endpoint = Endpoint::new(&domain)?;

        // Rank 0 registers; everyone learns the outcome (or the error).
        let controller_peer = config.controller_endpoint();
        let mut controller = None;
        let mut answer = Vec::new();
        let (nodes, per_node) = comm.node_counts();
        let registration = AppRegistration {
            name: app_name.to_string(),
            ranks: size,
            nodes,
            ranks_per_node: per_node,
            mode,
            pfs_interval,
            compression,
        };
        if rank == 0 {
            let outcome = BlockingConnection::connect(&controller_peer, &token, connect_timeout).and_then(|mut c| {
                // Registrations and probes may wait for managers to start agents.
                c.set_timeout(CONTROLLER_TIMEOUT);
                let reply = c.request(&ClientRequest::RegisterApp(registration.clone()))?;
                Ok((c, reply))
            });
            let result: std::result::Result<ClientReply, String> = match outcome {
                Ok((connection, reply)) => {
                    controller = Some(connection);
                    Ok(reply)
                }
                // §6.5.1: no service, but a PFS: keep the application running
                // by writing versions there directly (an empty agent list).
                Err(err @ ServiceError::Io { .. }) | Err(err @ ServiceError::Protocol(ProtocolError::Timeout(_)))
                    if config.pfs_dir.is_some() =>
                {
                    let pfs = icheck_core::pfs::PfsStore::new(config.pfs_dir.clone().expect("checked"));
                    tracing::warn!(
                        controller = %controller_peer,
                        %err,
                        pfs = %config.pfs_dir.as_ref().expect("checked").display(),
                        "controller unreachable: checkpoints go directly to the PFS"
                    );
                    pfs.latest_record(app_name)
                        .map(|latest| ClientReply::Registered { agents: Vec::new(), latest })
                        .map_err(|e| e.to_string())
                }
                Err(err) => Err(err.to_string()),
            };
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = comm.broadcast_from_root(answer);
        let result: std::result::Result<ClientReply, String> =
            protocol::decode(&answer).unwrap_or_else(|e| Err(format!("undecodable registration answer: {e}")));
        let (agents, latest) = match result {
            Ok(ClientReply::Registered { agents, latest }) if !agents.is_empty() || config.pfs_dir.is_some() => {
                (agents, latest)
            }
            Ok(other) => {
                return Err(Error::Controller {
                    peer: controller_peer,
                    error: ServiceError::Remote(format!("unexpected answer to RegisterApp: {other:?}")),
                })
            }
            Err(message) => {
                return Err(Error::Controller { peer: controller_peer, error: ServiceError::Remote(message) })
            }
        };
        let fallback =
            agents.is_empty().then(|| icheck_core::pfs::PfsStore::new(config.pfs_dir.clone().expect("checked")));
        let link = if fallback.is_some() {
            Ok(None)
        } else {
            open_link(comm.as_ref(), mode, &endpoint, &agents, &token, app_name, connect_timeout)
        };
        let all_ok = comm.all_true(link.is_ok());
        let link = link?;
        if !all_ok {
            return Err(Error::Incomplete {
                version: 0,
                detail: "another rank could not reach its agent during init".into(),
                previous: "nothing".into(),
            });
        }
        let status = match &latest {
            Some(record) => InitStatus::Restart { version: record.version },
            None => InitStatus::Fresh,
        };
        let agent = link.as_ref().map(|l| l.info.id);
        tracing::info!(?status, ?agent, ?direction, ?mode, zero_copy, "initialised");
        drop(_entered);
        let next_version = latest.as_ref().map_or(1, |l| l.version + 1);
        let epoch = latest.as_ref().map_or(0, |l| l.epoch + u32::from(l.ranks != size));
        let icheck = Icheck {
            app: app_name.to_string(),
            token,
            comm,
            endpoint,
            controller,
            controller_peer,
            agents,
            link,
            mode,
            fallback,
            fallback_tried: Instant::now(),
            pfs: config.pfs_dir.clone().map(icheck_core::pfs::PfsStore::new),
            t_wait,
            registration,
            segment: None,
            segment_region: None,
            labels: Vec::new(),
            latest,
            epoch,
            next_version,
            direction,
            zero_copy,
            staging_size: (staging_size.0 as usize).max(8192),
            staging: None,
            asynchronous: false,
            in_flight: None,
            restored: None,
            restart_damage: None,
            finalized: false,
            connect_timeout,
        };
        Ok((icheck, status))
    }

    fn check_open(&self) -> Result<()> {
        if self.finalized {
            return Err(Error::Order("the library was finalized; call init again"));
        }
        Ok(())
    }

    fn add_source(&mut self, label: &str, source: Box<dyn Source>) -> Result<()> {
        self.check_open()?;
        if label.is_empty() || label.len() > 255 {
            return Err(Error::BadLabel(label.to_string()));
        }
        match self.labels.iter_mut().find(|l| l.name == label) {
            Some(existing) => {
                existing.source = source;
                existing.adapt = None;
                existing.recalc = None;
            }
            None => self.labels.push(Label { name: label.to_string(), source, adapt: None, recalc: None }),
        }
        Ok(())
    }

    /// Adds (or replaces) a labelled region. Labels are unique per rank;
    /// adding a label again replaces its region, and the next commit uses it.
    pub fn add<T: Element>(&mut self, label: &str, region: &Region<T>) -> Result<()> {
        self.add_source(label, Box::new(region.clone()))
    }

    /// Adds raw memory under `label`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until the
    /// label is replaced or the library finalized, and the memory must not be
    /// written by anyone else while a library call runs.
    pub unsafe fn add_raw(&mut self, label: &str, ptr: *mut u8, len: usize, kind: DataKind) -> Result<()> {
        self.add_source(label, Box::new(RawSource { ptr, len, kind }))
    }

    /// Chooses asynchronous commits: `commit` returns once the data is
    /// staged, and `wait` completes the version.
    pub fn set_async(&mut self, asynchronous: bool) {
        self.asynchronous = asynchronous;
    }

    /// Newest complete version known to this process.
    pub fn latest_version(&self) -> Option<u64> {
        self.latest.as_ref().map(|l| l.version)
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> u32 {
        self.comm.rank()
    }

    /// What this run's versions are written by (`ranks` writers).
    fn shape(&self, ranks: u32) -> Shape {
        Shape { ranks, epoch: self.epoch }
    }

    /// Resize epoch of the versions this run writes (see
    /// `VersionRecord::epoch`).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    fn link(&mut self) -> Result<&mut AgentLink> {
        self.link.as_mut().ok_or(Error::Order("no agent session (an earlier failure closed it)"))
    }

    /// Checkpoints every added label as the next version (*collective*).
    /// Blocking mode returns when the version is complete; asynchronous mode
    /// returns once the data is staged. A commit while another is in flight
    /// waits for it first. Returns the version number.
    pub fn commit(&mut self) -> Result<u64> {
        self.check_open()?;
        self.wait()?;
        self.release_restart();
        self.check_global_labels()?;
        let version = self.next_version;
        self.next_version += 1;
        let span = tracing::info_span!("commit", app = %self.app, rank = self.comm.rank(), version);
        let _entered = span.enter();
        let started = Instant::now();
        // Every rank must take the same branch (both are collective): the
        // ranks' clocks differ, so they agree on whether t_wait has passed.
        if self.fallback.is_some() && self.comm.all_true(self.fallback_tried.elapsed() >= self.t_wait) {
            self.try_service_again();
        }
        if self.fallback.is_some() {
            self.commit_fallback(version)?;
            return Ok(version);
        }
        if self.mode == TransferMode::Shmr {
            let stored = self.store_shmr(version, started);
            if self.asynchronous {
                let ok = self.comm.all_true(stored.is_ok());
                return match (stored, ok) {
                    (Ok(_), true) => Ok(version),
                    (Err(err), _) => Err(err),
                    (Ok(_), false) => {
                        let _ = self.finish_in_flight();
                        Err(self.incomplete(version, "another rank failed to stage its data".into()))
                    }
                };
            }
            self.complete_or_fall_back(version, stored, started)?;
            return Ok(version);
        }
        if self.asynchronous {
            let staged = self.stage_async(version, started);
            let ok = self.comm.all_true(staged.is_ok());
            return match (staged, ok) {
                (Ok(()), true) => Ok(version),
                (Err(err), _) => Err(err),
                (Ok(()), false) => {
                    // Others failed: finish ours, then report.
                    let _ = self.finish_in_flight();
                    Err(self.incomplete(version, "another rank failed to stage its data".into()))
                }
            };
        }
        let stored = if self.zero_copy { self.store_zero_copy(version) } else { self.store_pipelined(version) };
        self.complete_or_fall_back(version, stored, started)?;
        Ok(version)
    }

    /// Completes a blocking commit; when some rank's agent failed it and a
    /// PFS is configured, every rank writes the version directly to the PFS
    /// instead (§6.5.1) and keeps doing so until the service answers again
    /// (tried every `t_wait`).
    fn complete_or_fall_back(&mut self, version: u64, stored: Result<u64>, started: Instant) -> Result<()> {
        let all_stored = self.comm.all_true(stored.is_ok());
        if !all_stored {
            if let Some(pfs) = self.pfs.clone() {
                // Rank 0 announces the switch (once, not per commit); other
                // ranks only say what failed on their side.
                let cause = stored.as_ref().err().map(|e| e.to_string());
                if self.comm.rank() == 0 {
                    tracing::warn!(
                        err = cause.as_deref().unwrap_or("another rank's agent failed"),
                        pfs = %pfs.root().display(),
                        "an agent failed during a commit: checkpoints go directly to the PFS until the service answers again"
                    );
                } else if let Some(err) = cause {
                    tracing::warn!(%err, "this rank's agent failed during a commit");
                }
                self.link = None;
                self.fallback = Some(pfs);
                self.fallback_tried = Instant::now();
                return self.commit_fallback(version);
            }
        }
        let bytes = *stored.as_ref().unwrap_or(&0);
        self.complete_agreed(version, stored.map(|_| ()), all_stored, bytes, started)
    }

    fn controller_error(&self, message: String) -> Error {
        Error::Controller { peer: self.controller_peer.clone(), error: ServiceError::Remote(message) }
    }

    fn incomplete(&self, version: u64, detail: String) -> Error {
        let previous = self.latest.as_ref().map_or("no version".to_string(), |l| format!("version {}", l.version));
        Error::Incomplete { version, detail, previous }
    }

    /// Agrees with all ranks, records the version at the controller and
    /// lets agents drop older versions.
    fn complete(&mut self, version: u64, local: Result<()>, bytes: u64, started: Instant) -> Result<()> {
        let all_ok = self.comm.all_true(local.is_ok());
        self.complete_agreed(version, local, all_ok, bytes, started)
    }

    /// [`Self::complete`] once the ranks agreed whether all stored their data.
    fn complete_agreed(
        &mut self,
        version: u64,
        local: Result<()>,
        all_ok: bool,
        bytes: u64,
        started: Instant,
    ) -> Result<()> {
        local?;
        if !all_ok {
            return Err(self.incomplete(version, "another rank failed to store its data".into()));
        }
        let total = self.comm.sum(bytes);
        let spilled = self.comm.sum(u64::from(self.link.as_ref().is_some_and(|l| l.spilled))) > 0;
        let secs = started.elapsed().as_secs_f64();
        let mut recorded = Ok(());
        if let Some(controller) = self.controller.as_mut() {
            let request = ClientRequest::VersionComplete {
                name: self.app.clone(),
                version,
                bytes: total,
                commit_secs: secs,
                spilled,
                epoch: self.epoch,
            };
            recorded = controller
                .request(&request)
                .map(|_| ())
                .map_err(|error| Error::Controller { peer: self.controller_peer.clone(), error });
        }
        let all_recorded = self.comm.all_true(recorded.is_ok());
        recorded?;
        if !all_recorded {
            return Err(self.incomplete(version, "rank 0 could not record it at the controller".into()));
        }
        let ranks = self.comm.size();
        let epoch = self.epoch;
        self.latest =
            Some(VersionRecord { version, ranks, epoch, bytes: total, commit_secs: secs, completed_unix_ms: 0 });
        if let Some(link) = self.link.as_mut() {
            if let Err(err) = link.call(&AgentRequest::Complete { version }) {
                tracing::warn!(%err, "agent could not drop older versions");
            }
        }
        tracing::info!(bytes, total, secs, "version complete");
        Ok(())
    }

    /// Registers each label's own memory and moves it without copies.
    fn store_zero_copy(&mut self, version: u64) -> Result<u64> {
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        let lens: Vec<usize> = guards.iter().map(|g| g.len()).collect();
        let layout = layouts(&self.labels, &lens);
        let push = self.direction == TransferDirection::Push;
        let access = if push { Access::LOCAL } else { Access::REMOTE_READ };
        let mut regions: Vec<(usize, MemoryRegion)> = Vec::new();
        for (index, guard) in guards.iter().enumerate().filter(|(_, g)| !g.is_empty()) {
            // SAFETY: the read guard keeps the memory alive and unmodified
            // until after `regions` (declared later, dropped first) is gone.
            // The provider only reads it: pull registers it for remote reads,
            // push uses it as the source of writes.
            let region = unsafe { self.endpoint.register_raw(guard.as_ptr().cast_mut(), guard.len(), access)? };
            regions.push((index, region));
        }
        let endpoint = self.endpoint.clone();
        let shape = self.shape(self.comm.size());
        let link = self.link.as_mut().ok_or(Error::Order("no agent session"))?;
        let target = link.begin(version, shape, layout.clone(), push)?;
        let slices: Vec<&[u8]> = guards.iter().map(|g| &***g).collect();
        // Checksums are computed from this process's memory while the bytes
        // move, on another core: end to end, and off the transfer's path.
        let (moved, crcs) = std::thread::scope(|scope| -> Result<(u64, Vec<Vec<u32>>)> {
            let checksums = scope.spawn(|| label_crcs(&slices));
            let mut moved = 0u64;
            if push {
                let options = TransferOptions::default();
                for (index, region) in &regions {
                    let op = RmaOp {
                        local_offset: 0,
                        remote: target,
                        remote_offset: layout[*index].offset,
                        len: region.len(),
                    };
                    moved += endpoint.write(&link.peer, region.source(), &[op], &options)?.bytes;
                }
            } else {
                let segments = regions
                    .iter()
                    .map(|(index, region)| PullSegment {
                        source: region.remote(),
                        source_offset: 0,
                        file_offset: layout[*index].offset,
                        len: region.len() as u64,
                    })
                    .collect();
                moved = link.pull(&endpoint, segments)?;
            }
            Ok((moved, checksums.join().map_err(|_| Error::Order("the checksum thread panicked"))?))
        })?;
        link.seal(crcs)?;
        drop(regions);
        drop(guards);
        Ok(moved)
    }

    /// Fallback commit (*collective*): one writer per node (thesis §9.4.1.4)
    /// writes every process's file of that node to the PFS partial version,
    /// then rank 0 completes it from the entries.
    fn commit_fallback(&mut self, version: u64) -> Result<()> {
        let pfs = self.fallback.clone().expect("fallback mode");
        let (rank, ranks) = (self.comm.rank(), self.comm.size());
        let fail = |e: icheck_core::pfs::PfsError| Error::Unsupported(format!("fallback write to the PFS: {e}"));
        let started = Instant::now();
        let written = self.write_node_to_pfs(&pfs, version);
        let write_ms = started.elapsed().as_secs_f64() * 1e3;
        if !self.comm.all_true(written.is_ok()) {
            written?;
            return Err(self.incomplete(version, "another rank could not write its data to the PFS".into()));
        }
        let completed = if rank == 0 {
            let completed = pfs
                .partial_entries(&self.app, version, ranks)
                .and_then(|entries| pfs.complete(&self.app, version, ranks, "library", entries))
                .map_err(fail);
            if completed.is_ok() {
                // This job is the only writer now: older partial versions
                // (a killed run's, a failed copy's) can never complete.
                if let Err(err) = pfs.remove_stale_partials(&self.app, version, &Default::default()) {
                    tracing::warn!(%err, "cannot remove abandoned partial PFS versions");
                }
            }
            completed
        } else {
            Ok(())
        };
        if !self.comm.all_true(completed.is_ok()) {
            completed?;
            return Err(self.incomplete(version, "rank 0 could not complete the version on the PFS".into()));
        }
        let epoch = self.epoch;
        self.latest = Some(VersionRecord { version, ranks, epoch, bytes: 0, commit_secs: 0.0, completed_unix_ms: 0 });
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(version, write_ms, total_ms, "version written directly to the PFS");
        Ok(())
    }

    /// The node's processes stage their labels in the node segment, and the
    /// node leader writes one file per process from there: fewer writers
    /// contend for the PFS, and the on-disk format stays per rank.
    fn write_node_to_pfs(&mut self, pfs: &icheck_core::pfs::PfsStore, version: u64) -> Result<()> {
        let staging = Instant::now();
        let (staged, _) = self.stage_in_segment()?;
        tracing::debug!(stage_ms = staging.elapsed().as_secs_f64() * 1e3, "staged in the node segment");
        if self.comm.node_rank() != 0 {
            return Ok(());
        }
        let segment = self.segment.as_ref().expect("staged");
        let bytes = segment.as_slice();
        for (who, labels) in staged {
            let parts: Vec<&[u8]> =
                labels.iter().map(|l| &bytes[l.offset as usize..(l.offset + l.len) as usize]).collect();
            let base = labels.first().map_or(0, |l| l.offset);
            let manifest = Manifest {
                app: self.app.clone(),
                rank: who,
                ranks: self.comm.size(),
                epoch: self.epoch,
                version,
                total_len: parts.iter().map(|p| p.len() as u64).sum(),
                chunk_size: CHUNK_SIZE,
                crcs: label_crcs(&parts),
                labels: labels.into_iter().map(|l| LabelLayout { offset: l.offset - base, ..l }).collect(),
                sealed_unix_ms: 0,
            };
            pfs.write_rank_parts(&manifest, &parts)
                .map_err(|e| Error::Unsupported(format!("fallback write to the PFS: {e}")))?;
        }
        Ok(())
    }

    /// Opens this process's session with its agent among `agents`.
    fn open_own_link(&self, agents: &[AgentInfo]) -> Result<Option<AgentLink>> {
        open_link(self.comm.as_ref(), self.mode, &self.endpoint, agents, &self.token, &self.app, self.connect_timeout)
    }

    /// Fallback (*collective*): tries to register with the service again;
    /// when it answers with agents, every rank opens its session and the
    /// library is back on RDMA (the service restarts from the PFS versions
    /// written meanwhile, which use the agents' format).
    fn try_service_again(&mut self) {
        self.fallback_tried = Instant::now();
        let mut answer = Vec::new();
        let mut connection = None;
        if self.comm.rank() == 0 {
            let result: std::result::Result<ClientReply, String> =
                BlockingConnection::connect(&self.controller_peer, &self.token, self.connect_timeout)
                    .and_then(|mut c| {
                        c.set_timeout(CONTROLLER_TIMEOUT);
                        let reply = c.request(&ClientRequest::RegisterApp(self.registration.clone()))?;
                        connection = Some(c);
                        Ok(reply)
                    })
                    .map_err(|e| e.to_string());
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = self.comm.broadcast_from_root(answer);
        let agents = match protocol::decode::<std::result::Result<ClientReply, String>>(&answer) {
            Ok(Ok(ClientReply::Registered { agents, .. })) if !agents.is_empty() => agents,
            _ => return, // still unreachable: keep writing to the PFS
        };
        let link = self.open_own_link(&agents);
        if !self.comm.all_true(link.is_ok()) {
            tracing::warn!("the service answered but not every rank reached its agent; staying on the PFS");
            return;
        }
        tracing::warn!("the service is reachable again: checkpoints go to its agents");
        self.link = link.ok().flatten();
        self.agents = agents;
        self.controller = connection;
        self.fallback = None;
    }

    /// Fallback restart: this rank's data, verified, from the PFS.
    fn fetch_fallback(&mut self, version: u64) -> Result<u64> {
        let pfs = self.fallback.clone().expect("fallback mode");
        let fail = |e: icheck_core::pfs::PfsError| Error::Unsupported(format!("restart from the PFS: {e}"));
        let manifest = pfs.manifest(&self.app, version).map_err(fail)?;
        let (rank_manifest, data) = pfs.read_rank(&manifest, self.comm.rank()).map_err(fail)?;
        self.restored = Some(Restored { manifest: rank_manifest, data: RestoredData::Local(data) });
        Ok(version)
    }

    /// SHMR: makes every process of this node map a segment of at least
    /// `len` bytes (collective on the node; `len` is the same on all).
    fn ensure_segment(&mut self, len: usize) -> Result<()> {
        let leader = self.comm.node_rank() == 0;
        let shmr_error = |what: &str, err: std::io::Error| Error::Unsupported(format!("SHMR segment: {what}: {err}"));
        if self.segment.is_none() {
            let path = NodeSegment::path_for(&self.app, self.comm.node_index());
            let created = if leader { Some(NodeSegment::create(&path)) } else { None };
            let name = match &created {
                Some(Ok(_)) => path.to_string_lossy().into_owned().into_bytes(),
                _ => Vec::new(),
            };
            let name = self.comm.node_broadcast(name);
            let opened = match created {
                Some(result) => result.map_err(|e| shmr_error(&format!("cannot create {}", path.display()), e)),
                None if name.is_empty() => {
                    Err(Error::Unsupported("SHMR segment: the node leader could not create it".into()))
                }
                None => {
                    let name = String::from_utf8_lossy(&name).into_owned();
                    NodeSegment::open(Path::new(&name)).map_err(|e| shmr_error(&format!("cannot open {name}"), e))
                }
            };
            let statuses = self.comm.node_all_gather(vec![u8::from(opened.is_ok())]);
            if leader && !name.is_empty() {
                // Everyone has it open: drop the name so nothing outlives the job.
                let _ = std::fs::remove_file(&path);
            }
            let segment = opened?;
            if statuses.iter().any(|s| s.as_slice() != [1]) {
                return Err(Error::Unsupported("SHMR segment: a process of this node could not open it".into()));
            }
            self.segment = Some(segment);
        }
        let segment = self.segment.as_mut().expect("set above");
        if segment.len() >= len {
            return Ok(());
        }
        self.segment_region = None;
        let grown = if leader { segment.grow_file(len) } else { Ok(()) };
        let all_grown = self.comm.node_broadcast(vec![u8::from(grown.is_ok())]) == [1];
        grown.map_err(|e| shmr_error("cannot grow", e))?;
        if !all_grown {
            return Err(Error::Unsupported("SHMR segment: the node leader could not grow it".into()));
        }
        segment.remap().map_err(|e| shmr_error("cannot map", e))?;
        if leader && segment.len() > 0 {
            // SAFETY: the mapping stays in place until `segment_region`
            // is dropped (before any remap, and before `segment` itself).
            let region =
                unsafe { self.endpoint.register_raw(segment.as_mut_ptr(), segment.len(), Access::REMOTE_READ_WRITE)? };
            self.segment_region = Some(region);
        }
        Ok(())
    }

    /// SHMR commit: every node process copies its labels into the node
    /// segment; the node leader moves the segment to the node's agent.
    fn store_shmr(&mut self, version: u64, started: Instant) -> Result<u64> {
        let (staged, total) = self.stage_in_segment()?;
        // The agent holds one "rank" per node: labels are named <rank>/<label>.
        let layout: Vec<LabelLayout> = staged
            .into_iter()
            .flat_map(|(who, labels)| {
                labels.into_iter().map(move |l| LabelLayout { label: format!("{who}/{}", l.label), ..l })
            })
            .collect();
        let push = self.direction == TransferDirection::Push;
        let shape = self.shape(self.comm.node_counts().0);
        let Some(mut link) = self.link.take() else {
            // Not the node leader: nothing to move; async still completes in wait().
            if self.asynchronous {
                self.in_flight = Some(InFlight { version, started, bytes: 0, handle: None });
            }
            return Ok(0);
        };
        let region = self.segment_region.take();
        let segment = self.segment.as_ref().expect("ensured");
        // The segment is neither remapped nor written until this version
        // completes: every later call that could do so waits first.
        let (base, len) = (segment.as_slice().as_ptr() as usize, total as usize);
        let endpoint = self.endpoint.clone();
        let send = move |link: &mut AgentLink, region: Option<&MemoryRegion>| -> Result<()> {
            // SAFETY: see above; `len` <= the mapped length (ensure_segment).
            let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
            if region.is_none() && len > 0 {
                return Err(Error::Order("the SHMR segment is not registered"));
            }
            let registered = region.map(|r| (r.source(), r.remote()));
            send_version(link, &endpoint, version, shape, layout, push, registered, bytes)
        };
        if !self.asynchronous {
            let result = send(&mut link, region.as_ref());
            self.link = Some(link);
            self.segment_region = region;
            return result.map(|_| total);
        }
        let span = tracing::Span::current();
        let handle = std::thread::Builder::new()
            .name("icheck-async-commit".into())
            .spawn(move || {
                let _entered = span.enter();
                let result = send(&mut link, region.as_ref());
                Background { link, staging: None, segment_region: region, result }
            })
            .map_err(|e| Error::Unsupported(format!("cannot start the async commit thread: {e}")))?;
        self.in_flight = Some(InFlight { version, started, bytes: total, handle: Some(handle) });
        Ok(total)
    }

    /// Copies every label of every process of this node into the node
    /// segment (*collective on the node*). Returns, per node process in rank
    /// order, its rank and its labels at their places in the segment, and
    /// the bytes staged in all.
    fn stage_in_segment(&mut self) -> Result<(Vec<NodeProcessLabels>, u64)> {
        let rank = self.comm.rank();
        let mine: Vec<(String, DataKind, u64)> =
            self.labels.iter().map(|l| (l.name.clone(), l.source.kind(), l.source.bytes().len() as u64)).collect();
        let encoded = protocol::encode(&(rank, &mine)).map_err(|e| Error::Unsupported(e.to_string()))?;
        let mut staged = Vec::new();
        let mut my_offsets = Vec::new();
        let mut total = 0u64;
        for bytes in self.comm.node_all_gather(encoded) {
            let (who, labels): (u32, Vec<(String, DataKind, u64)>) =
                protocol::decode(&bytes).map_err(|e| Error::Unsupported(format!("node segment layout: {e}")))?;
            let mut placed = Vec::with_capacity(labels.len());
            for (name, kind, len) in labels {
                if who == rank {
                    my_offsets.push(total as usize);
                }
                placed.push(LabelLayout { label: name, kind, offset: total, len, adapt: None });
                total += len;
            }
            staged.push((who, placed));
        }
        self.ensure_segment(total as usize)?;
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        // Another thread of the application may have resized a region since
        // the layout was agreed; its range in the segment is fixed now.
        if let Some(((name, _, len), guard)) = mine.iter().zip(&guards).find(|((_, _, len), g)| g.len() as u64 != *len)
        {
            return Err(Error::SizeMismatch { label: name.clone(), stored: *len, given: guard.len() as u64 });
        }
        {
            let segment = self.segment.as_mut().expect("ensured");
            let base = segment.as_mut_ptr();
            for (guard, offset) in guards.iter().zip(&my_offsets) {
                // SAFETY: offset..offset+len is this rank's own part of the
                // segment (offsets come from the node-wide layout, which
                // gives every label of every rank a disjoint range inside
                // `total` <= the mapped length); no other process writes it.
                unsafe { std::ptr::copy_nonoverlapping(guard.as_ptr(), base.add(*offset), guard.len()) };
            }
        }
        drop(guards);
        self.comm.node_barrier();
        Ok((staged, total))
    }

    /// SHMR restart: the node leader reads and verifies the node's data into
    /// the segment; every node process then restores from there.
    fn fetch_shmr(&mut self, version: u64) -> Result<u64> {
        let fetched: std::result::Result<(Manifest, RemoteRegion), String> = match self.link.as_mut() {
            Some(link) => match link.call(&AgentRequest::Fetch { version }) {
                Ok(AgentReply::Fetch { damaged: Some(damage), .. }) => Err(damage),
                Ok(AgentReply::Fetch { manifest, region, damaged: None }) => {
                    manifest.validate().map(|()| (manifest, region)).map_err(|e| e.to_string())
                }
                Ok(other) => Err(format!("unexpected answer to Fetch: {other:?}")),
                Err(err) => Err(err.to_string()),
            },
            None => Err(String::new()),
        };
        let shared = self.comm.node_broadcast(protocol::encode(&fetched).unwrap_or_default());
        let (manifest, region) = protocol::decode::<std::result::Result<(Manifest, RemoteRegion), String>>(&shared)
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|message| Error::Unsupported(format!("SHMR restart, node leader: {message}")))?;
        self.ensure_segment(manifest.total_len as usize)?;
        let mut verified: std::result::Result<(), String> = Ok(());
        if let Some(link) = self.link.as_mut() {
            let segment = self.segment.as_mut().expect("ensured");
            let base = segment.as_mut_ptr();
            for (index, label) in manifest.labels.iter().enumerate() {
                // SAFETY: the label's range lies inside the segment, sized
                // to the manifest's total; only the leader writes it now.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(base.add(label.offset as usize), label.len as usize) };
                let chunk = manifest.chunk_size as usize;
                match read_and_verify(
                    &self.endpoint,
                    &link.peer,
                    region,
                    label.offset,
                    out,
                    chunk,
                    &manifest.crcs[index],
                ) {
                    Ok(None) => {}
                    Ok(Some(bad)) => {
                        verified =
                            Err(format!("label {:?} fails its checksum at bytes {}..", label.label, bad * chunk));
                        break;
                    }
                    Err(err) => {
                        verified = Err(err.to_string());
                        break;
                    }
                }
            }
            if let Err(err) = link.call(&AgentRequest::FetchDone) {
                tracing::warn!(%err, "agent did not acknowledge the end of a restart");
            }
        }
        let shared = self.comm.node_broadcast(protocol::encode(&verified).unwrap_or_default());
        protocol::decode::<std::result::Result<(), String>>(&shared)
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|message| Error::Unsupported(format!("SHMR restart, node leader: {message}")))?;
        let version = manifest.version;
        self.restored = Some(Restored { manifest, data: RestoredData::Segment });
        Ok(version)
    }

    /// A registered staging buffer of at least `len` bytes.
    fn staging(&mut self, len: usize) -> Result<RegisteredBuffer> {
        match self.staging.take() {
            Some(buffer) if buffer.len() >= len => Ok(buffer),
            _ => Ok(self.endpoint.register(AlignedBuffer::zeroed(len.max(4096)), Access::REMOTE_READ)?),
        }
    }

    /// Streams the labels through the two halves of the bounded staging
    /// buffer: one half is filled while the other is transferred.
    fn store_pipelined(&mut self, version: u64) -> Result<u64> {
        let mut staging = self.staging(self.staging_size)?;
        let result = self.pipeline(version, &mut staging);
        self.staging = Some(staging);
        result
    }

    fn pipeline(&mut self, version: u64, staging: &mut RegisteredBuffer) -> Result<u64> {
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        let lens: Vec<usize> = guards.iter().map(|g| g.len()).collect();
        let layout = layouts(&self.labels, &lens);
        let total: usize = lens.iter().sum();
        let push = self.direction == TransferDirection::Push;
        let endpoint = self.endpoint.clone();
        let shape = self.shape(self.comm.size());
        let link = self.link.as_mut().ok_or(Error::Order("no agent session"))?;
        let target = link.begin(version, shape, layout, push)?;
        let half = staging.len() / 2;
        let base = staging.as_mut_slice().as_mut_ptr() as usize;
        let (remote, source) = (staging.remote(), staging.source());
        // Halves go to the transfer thread as (half, file offset, len) and
        // come back free.
        let (to_transfer, transfers) = mpsc::sync_channel::<(usize, u64, usize)>(2);
        let (to_fill, free_halves) = mpsc::sync_channel::<usize>(2);
        to_fill.send(0).and_then(|_| to_fill.send(1)).expect("channel has room for both halves");
        let slices: Vec<&[u8]> = guards.iter().map(|g| &***g).collect();
        let transfer_link = &mut *link;
        let (moved, crcs) = std::thread::scope(|scope| -> Result<(u64, Vec<Vec<u32>>)> {
            let checksums = scope.spawn(|| label_crcs(&slices));
            let link = transfer_link;
            let transfer = scope.spawn(move || -> Result<u64> {
                let mut moved = 0;
                for (which, file_offset, len) in transfers {
                    let local_offset = which * half;
                    moved += if push {
                        let op = RmaOp { local_offset, remote: target, remote_offset: file_offset, len };
                        endpoint.write(&link.peer, source, &[op], &TransferOptions::default())?.bytes
                    } else {
                        let segment = PullSegment {
                            source: remote,
                            source_offset: local_offset as u64,
                            file_offset,
                            len: len as u64,
                        };
                        link.pull(&endpoint, vec![segment])?
                    };
                    if to_fill.send(which).is_err() {
                        break;
                    }
                }
                Ok(moved)
            });
            // Fill halves in order from the labels' bytes.
            let mut file_offset = 0usize;
            let mut pieces = guards.iter().flat_map(|g| g.chunks(half.max(1))).peekable();
            let mut pending: Option<&[u8]> = None;
            'fill: while file_offset < total {
                let Ok(which) = free_halves.recv() else { break };
                let mut filled = 0usize;
                while filled < half {
                    let piece = match pending.take().or_else(|| pieces.next()) {
                        Some(piece) => piece,
                        None => break,
                    };
                    let take = piece.len().min(half - filled);
                    // SAFETY: the destination lies inside half `which` of the
                    // staging buffer (filled + take <= half), which the
                    // transfer thread does not touch until it receives it below.
                    unsafe {
                        std::ptr::copy_nonoverlapping(piece.as_ptr(), (base + which * half + filled) as *mut u8, take);
                    }
                    filled += take;
                    if take < piece.len() {
                        pending = Some(&piece[take..]);
                    }
                }
                if filled == 0 || to_transfer.send((which, file_offset as u64, filled)).is_err() {
                    break 'fill;
                }
                file_offset += filled;
            }
            drop(to_transfer);
            let moved = transfer.join().unwrap_or(Err(Error::Order("the transfer thread panicked")))?;
            Ok((moved, checksums.join().map_err(|_| Error::Order("the checksum thread panicked"))?))
        })?;
        link.seal(crcs)?;
        Ok(moved)
    }

    /// Async mode: copy everything into the staging buffer and let a thread
    /// transfer and seal it.
    fn stage_async(&mut self, version: u64, started: Instant) -> Result<()> {
        let lens: Vec<usize> = self.labels.iter().map(|l| l.source.bytes().len()).collect();
        let total: usize = lens.iter().sum();
        let mut staging = self.staging(total)?;
        {
            let out = staging.as_mut_slice();
            let mut offset = 0;
            for label in &self.labels {
                let bytes = label.source.bytes();
                out[offset..offset + bytes.len()].copy_from_slice(&bytes);
                offset += bytes.len();
            }
        }
        let layout = layouts(&self.labels, &lens);
        let mut link = self.link.take().ok_or(Error::Order("no agent session"))?;
        let push = self.direction == TransferDirection::Push;
        let (endpoint, shape) = (self.endpoint.clone(), self.shape(self.comm.size()));
        let span = tracing::Span::current();
        let handle = std::thread::Builder::new()
            .name("icheck-async-commit".into())
            .spawn(move || {
                let _entered = span.enter();
                let bytes = &staging.as_slice()[..total];
                let result = send_version(
                    &mut link,
                    &endpoint,
                    version,
                    shape,
                    layout,
                    push,
                    Some((staging.source(), staging.remote())),
                    bytes,
                );
                Background { link, staging: Some(staging), segment_region: None, result }
            })
            .map_err(|e| Error::Unsupported(format!("cannot start the async commit thread: {e}")))?;
        self.in_flight = Some(InFlight { version, started, bytes: total as u64, handle: Some(handle) });
        Ok(())
    }

    /// Joins the background commit: (version, start, bytes, its result).
    fn finish_in_flight(&mut self) -> Option<(u64, Instant, u64, Result<()>)> {
        let InFlight { version, started, bytes, handle } = self.in_flight.take()?;
        let result = match handle.map(JoinHandle::join) {
            None => Ok(()),
            Some(Ok(background)) => {
                self.link = Some(background.link);
                if background.staging.is_some() {
                    self.staging = background.staging;
                }
                if background.segment_region.is_some() {
                    self.segment_region = background.segment_region;
                }
                background.result
            }
            Some(Err(_)) => Err(Error::Order("the async commit thread panicked")),
        };
        Some((version, started, bytes, result))
    }

    /// Whether the background commit has finished its transfer (this rank
    /// only; `wait` completes the version for all ranks).
    pub fn test(&self) -> bool {
        self.in_flight.as_ref().and_then(|f| f.handle.as_ref()).is_none_or(|h| h.is_finished())
    }

    /// Waits for a background commit and completes its version (*collective*).
    pub fn wait(&mut self) -> Result<()> {
        let Some((version, started, bytes, result)) = self.finish_in_flight() else { return Ok(()) };
        self.complete(version, result, bytes, started)
    }

    /// Prepares a restart from the newest complete version (*collective*):
    /// this rank's agent exposes its data, and `restore` / `restore_all`
    /// then read each label straight into the caller's memory, verifying its
    /// checksums. Returns the version.
    ///
    /// When the newest version cannot be read (a PFS file damaged or
    /// missing), the restart logs why, naming the file, and falls back to
    /// the previous complete version on the PFS.
    pub fn restart(&mut self) -> Result<u64> {
        self.check_open()?;
        self.wait()?;
        self.release_restart();
        let newest = self.restart_record()?;
        let size = self.comm.size();
        let mut candidates = vec![newest.version];
        if let Some(pfs) = &self.pfs {
            let older = pfs.versions(&self.app).unwrap_or_default();
            candidates.extend(older.into_iter().rev().filter(|v| *v < newest.version));
        }
        let last = candidates.len() - 1;
        for (tried, version) in candidates.into_iter().enumerate() {
            // The process count that wrote it: recorded for the newest; an
            // older PFS version's manifest is read only if it comes to that.
            let written = match (&self.pfs, version == newest.version) {
                (Some(pfs), false) => pfs.manifest(&self.app, version).map_or(newest.ranks, |m| m.ranks),
                _ => newest.ranks,
            };
            let result = match (&self.fallback, self.mode) {
                _ if written != size => self.fetch_resized(version, written),
                (Some(_), _) => self.fetch_fallback(version),
                (None, TransferMode::Mr) => self.fetch(version),
                (None, TransferMode::Shmr) => self.fetch_shmr(version),
            };
            // Every rank learns whether all could fetch intact data: one
            // damaged or missing rank moves the whole job to the next
            // candidate together, instead of leaving the others in their
            // next collective.
            let damaged = self.restart_damage.take();
            let all_ok = self.comm.all_true(result.is_ok() && damaged.is_none());
            if all_ok {
                if tried > 0 && self.comm.rank() == 0 {
                    tracing::warn!(
                        version,
                        newest = newest.version,
                        "restarted from an older complete version: the newer ones could not be read on every rank"
                    );
                }
                return result;
            }
            if tried == last {
                if let (Some(damage), Ok(_), 1) = (&damaged, &result, size) {
                    // A job of one process has nobody to wait for it: it
                    // restarts from the damaged version, whose damaged labels
                    // `restore` refuses while the intact ones restore.
                    tracing::error!(version, %damage, "no older version to fall back to");
                    return result;
                }
                result?;
                let detail = damaged.unwrap_or_else(|| "another rank could not fetch intact data".into());
                return Err(self.incomplete(version, detail));
            }
            if let Err(err) = &result {
                tracing::error!(version, %err, "cannot restart from this version; trying the previous complete one");
            } else if self.comm.rank() == 0 {
                tracing::error!(
                    version,
                    "another rank cannot restart from this version; trying the previous complete one"
                );
            }
            self.release_restart();
        }
        unreachable!("the last candidate returns")
    }

    /// The version a restart fetches, if this run can restore it.
    fn restart_record(&self) -> Result<VersionRecord> {
        self.latest.clone().ok_or_else(|| Error::NoCheckpoint(self.app.clone()))
    }

    fn fetch(&mut self, version: u64) -> Result<u64> {
        let link = self.link()?;
        let (manifest, region, damaged) = match link.call(&AgentRequest::Fetch { version })? {
            AgentReply::Fetch { manifest, region, damaged } => (manifest, region, damaged),
            other => return Err(link.error(format!("unexpected answer to Fetch: {other:?}"))),
        };
        // From the agent: checked before any offset in it is used.
        if let Err(err) = manifest.validate() {
            return Err(link.error(format!("the manifest of version {version} is unusable: {err}")));
        }
        let version = manifest.version;
        self.restart_damage = damaged;
        self.restored = Some(Restored { manifest, data: RestoredData::Agent(region) });
        Ok(version)
    }

    /// Tells the agent the restart data is no longer needed.
    fn release_restart(&mut self) {
        if self.restored.take().is_some_and(|r| matches!(r.data, RestoredData::Agent(_))) {
            if let Some(link) = self.link.as_mut() {
                if let Err(err) = link.call(&AgentRequest::FetchDone) {
                    tracing::warn!(%err, "agent did not acknowledge the end of a restart");
                }
            }
        }
    }

    fn restored_label(&self, label: &str) -> Result<(&Restored, usize)> {
        let restored = self.restored.as_ref().ok_or(Error::Order("restore needs a successful restart() first"))?;
        let key = match restored.data {
            RestoredData::Segment => format!("{}/{label}", self.comm.rank()),
            _ => label.to_string(),
        };
        let index = restored.manifest.labels.iter().position(|l| l.label == key).ok_or_else(|| {
            Error::UnknownLabel { label: label.to_string(), detail: "not in the restarted checkpoint" }
        })?;
        Ok((restored, index))
    }

    fn restore_bytes(&self, label: &str, kind: DataKind, out: &mut [u8]) -> Result<()> {
        let (restored, index) = self.restored_label(label)?;
        let layout = &restored.manifest.labels[index];
        if let RestoredData::Resized(resized) = &restored.data {
            return self.restore_resized(restored.manifest.version, resized.written, layout, kind, out);
        }
        // Replicated attributes that are not "read my own value back", and
        // MANUAL arrays, which go whole to their root whatever the count.
        match &layout.adapt {
            Some(Adapt::Global { layout: GlobalLayout::Manual { .. }, .. }) => {
                if self.mode == TransferMode::Shmr {
                    return Err(Error::Adapt {
                        label: label.into(),
                        detail: "MANUAL arrays need MR mode (SHMR keeps one file per node)".into(),
                    });
                }
                return self.restore_resized(restored.manifest.version, self.comm.size(), layout, kind, out);
            }
            Some(Adapt::Replicated(Attribute::Default { value, joining_only: false })) if layout.kind == kind => {
                resize::fill(out, value);
                return Ok(());
            }
            Some(Adapt::Replicated(Attribute::Volatile)) => return self.recalculate(label, self.comm.size(), out),
            _ => {}
        }
        if layout.len != out.len() as u64 {
            return Err(Error::SizeMismatch { label: label.to_string(), stored: layout.len, given: out.len() as u64 });
        }
        if layout.kind != kind {
            return Err(Error::KindMismatch { label: label.to_string(), stored: layout.kind, given: kind });
        }
        let start = layout.offset as usize;
        let region = match &restored.data {
            RestoredData::Agent(region) => *region,
            // Verified when read from the PFS.
            RestoredData::Local(bytes) => {
                out.copy_from_slice(&bytes[start..start + out.len()]);
                return Ok(());
            }
            // Verified by the node leader when it filled the segment.
            RestoredData::Segment => {
                let segment = self.segment.as_ref().ok_or(Error::Order("the SHMR segment is gone"))?;
                out.copy_from_slice(&segment.as_slice()[start..start + out.len()]);
                return Ok(());
            }
            RestoredData::Resized(_) => unreachable!("handled above"),
        };
        let link = self.link.as_ref().ok_or(Error::Order("no agent session"))?;
        let manifest = &restored.manifest;
        let span =
            tracing::debug_span!("restore", app = %self.app, rank = manifest.rank, version = manifest.version, label);
        let _entered = span.enter();
        let started = Instant::now();
        let chunk = manifest.chunk_size as usize;
        let bad = read_and_verify(&self.endpoint, &link.peer, region, layout.offset, out, chunk, &manifest.crcs[index])
            .map_err(|err| match err {
                Error::Fabric(err) => link.error(format!("reading label {label:?}: {err}")),
                other => other,
            })?;
        if let Some(bad) = bad {
            let start = (bad * chunk) as u64;
            return Err(Error::Corrupt {
                version: manifest.version,
                rank: manifest.rank,
                start,
                end: (start + chunk as u64).min(layout.len),
                labels: format!("{label:?}"),
            });
        }
        tracing::debug!(bytes = out.len(), ms = started.elapsed().as_secs_f64() * 1e3, "restored");
        Ok(())
    }

    /// Bytes label `label` holds in the restarted checkpoint, so callers can
    /// size their memory before `restore`.
    pub fn restored_len(&self, label: &str) -> Result<u64> {
        let (restored, index) = self.restored_label(label)?;
        let layout = &restored.manifest.labels[index];
        match restored.data {
            RestoredData::Resized(_) => Ok(self.local_count(label)? * layout.kind.size() as u64),
            _ => Ok(layout.len),
        }
    }

    /// Element type of label `label` in the restarted checkpoint.
    pub fn restored_kind(&self, label: &str) -> Result<DataKind> {
        let (restored, index) = self.restored_label(label)?;
        Ok(restored.manifest.labels[index].kind)
    }

    /// The process count that wrote the version `restart` fetched (which
    /// may differ from this run's), or `None` before a restart.
    pub fn restarted_from(&self) -> Option<u32> {
        let restored = self.restored.as_ref()?;
        Some(match &restored.data {
            RestoredData::Resized(resized) => resized.written,
            // Anything else was written by this run's count.
            _ => self.comm.size(),
        })
    }

    /// Whether `restart` has fetched a version that `restore` can read.
    pub fn has_restarted(&self) -> bool {
        self.restored.is_some()
    }

    /// Reads label `label` of the restarted version into `region`, whose
    /// length and element type must match the checkpoint's. The bytes are
    /// checked against the checksums the committing rank computed; on a
    /// mismatch the error names the label and byte range.
    pub fn restore<T: Element>(&self, label: &str, region: &Region<T>) -> Result<()> {
        self.restore_bytes(label, T::KIND, as_bytes_mut(&mut region.write()))
    }

    /// Reads label `label` into a plain slice.
    pub fn restore_into<T: Element>(&self, label: &str, out: &mut [T]) -> Result<()> {
        self.restore_bytes(label, T::KIND, as_bytes_mut(out))
    }

    /// Reads label `label` into raw memory of `len` bytes.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes.
    pub unsafe fn restore_raw(&self, label: &str, ptr: *mut u8, len: usize, kind: DataKind) -> Result<()> {
        // SAFETY: the caller guarantees ptr/len.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        self.restore_bytes(label, kind, out)
    }

    /// Restores every added label into its region.
    pub fn restore_all(&self) -> Result<()> {
        for label in &self.labels {
            let mut bytes = label.source.bytes_mut();
            self.restore_bytes(&label.name, label.source.kind(), &mut bytes)?;
        }
        Ok(())
    }

    /// Asks the controller whether this application's agents changed, and
    /// moves to the new ones if so (*collective*); the next commit goes there.
    pub fn probe_agents(&mut self, hints: ProbeHints) -> Result<ProbeOutcome> {
        self.check_open()?;
        self.wait()?;
        self.release_restart();
        let mut answer = Vec::new();
        if let Some(controller) = self.controller.as_mut() {
            let request = ClientRequest::Probe {
                name: self.app.clone(),
                agents: self.agents.iter().map(|a| a.id).collect(),
                remaining_commits: hints.remaining_commits,
            };
            let result = controller.request(&request).map_err(|e| e.to_string());
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = self.comm.broadcast_from_root(answer);
        let result: std::result::Result<ClientReply, String> =
            protocol::decode(&answer).unwrap_or_else(|e| Err(format!("undecodable probe answer: {e}")));
        let agents = match result {
            Ok(ClientReply::Unchanged) => return Ok(ProbeOutcome::Unchanged),
            Ok(ClientReply::Agents(agents)) if !agents.is_empty() => agents,
            Ok(other) => return Err(self.controller_error(format!("unexpected answer to Probe: {other:?}"))),
            Err(message) => return Err(self.controller_error(message)),
        };
        let link = self.open_own_link(&agents);
        let all_ok = self.comm.all_true(link.is_ok());
        let link = link?;
        if !all_ok {
            return Err(Error::Order("another rank could not reach its new agent"));
        }
        tracing::info!(agent = ?link.as_ref().map(|l| l.info.id), "moved to new agents");
        self.link = link;
        self.agents = agents;
        Ok(ProbeOutcome::Reconnected { agents: self.agents.len() })
    }

    /// Ends the application's use of the service (*collective*). With
    /// `persist` (IC_PERSIST) the checkpoints stay in agent memory for the
    /// next run; otherwise the agents stop and delete them.
    pub fn finalize(&mut self, persist: bool) -> Result<()> {
        if self.finalized {
            return Err(Error::Order("finalize was already called"));
        }
        let waited = self.wait();
        self.release_restart();
        self.comm.barrier();
        self.finalized = true;
        self.link = None;
        let mut result = Ok(());
        if let Some(mut controller) = self.controller.take() {
            result = controller
                .request(&ClientRequest::FinishApp { name: self.app.clone(), persist })
                .map(|_| ())
                .map_err(|error| Error::Controller { peer: self.controller_peer.clone(), error });
        }
        waited?;
        result
    }
}
