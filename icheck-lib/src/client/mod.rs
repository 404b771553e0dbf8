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

use icheck_core::config::{ConfigError, RestoreDirection, StaticConfig, TransferDirection};
use icheck_core::control::ServiceError;
use icheck_core::control::{BlockingConnection, ControllerLink};
use icheck_core::decide::agent_for_rank;
use icheck_core::delta::{changed_runs, BlockRun, BLOCK_SIZE};
use icheck_core::distribution::{Adapt, Attribute, GlobalLayout};
use icheck_core::fabric::{
    Access, AlignedBuffer, Domain, Endpoint, FabricError, LocalSource, MemoryRegion, Peer, ProgressThread,
    RegisteredBuffer, RemoteRegion, RmaOp, TransferOptions,
};
use icheck_core::format::{label_crcs, CHUNK_BYTES, CHUNK_SIZE};
use icheck_core::handoff::HostId;
use icheck_core::protocol::ProtocolError;
use icheck_core::protocol::{
    self, check_fetched, AgentInfo, AgentReply, AgentRequest, AppRegistration, ClientReply, ClientRequest, DataKind,
    FetchWanted, Fetched, LabelLayout, Manifest, PullSegment, TransferMode, TransferReport, VersionRecord,
};

use crate::comm::Communicator;
use crate::region::{as_bytes_mut, Element, RawSource, Region, Source};
use crate::segment::NodeSegment;

mod commit;
mod direction;
mod error;
mod fallback;
mod link;
mod prefault;
mod protection;
mod resize;
mod restart;
mod shmr;
mod watch;

pub use commit::CommitStats;
use commit::{Background, InFlight, Tracking, WrittenSince};
use direction::{AutoDirection, TransferTally};
pub use error::Error;
use error::Result;
use link::{commit_buffer, commit_incremental, commit_version, Piece, VersionHeader};
use link::{open_link, AgentLink, ServiceAccess, Shape, Waits};
pub use protection::Protection;
pub use resize::Recalc;
use resize::Resized;
pub use resize::{Global, Recalculate, Replicated, Resize};
use restart::{fetch_version, read_and_verify, read_files_and_verify, ReadFrom, Restored, RestoredData};
use shmr::node_layout;

/// Environment variable naming the configuration file when `init` gets none.
pub const CONFIG_ENV: &str = "ICHECK_CONFIG";
/// Configuration file used when neither `init` nor the environment names one.
pub const DEFAULT_CONFIG: &str = "/etc/icheck/icheck.toml";
/// How long a controller request may take (it may start agents: 15 s each
/// at most on the controller's side).
const CONTROLLER_TIMEOUT: Duration = Duration::from_secs(30);

/// Smallest async staging buffer backed ahead of the first async commit
/// ([`Icheck::prepare_async_staging`]): smaller ones fault in quickly.
const STAGING_AHEAD_MIN: usize = 16 << 20;

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

/// What one probe brought ([`Icheck::ask_for_agents`]).
enum Asked {
    /// The controller's answer.
    Outcome(ProbeOutcome),
    /// No node can take new agents now (the controller's reason); nothing
    /// changed, and asking again later may bring some.
    NoRoom(String),
}

struct Label {
    name: String,
    source: Box<dyn Source>,
    /// How a run with another process count restores it (adapt labels).
    adapt: Option<icheck_core::distribution::Adapt>,
    /// A VOLATILE label's recalculation.
    recalc: Option<Recalc>,
}

/// A checkpointing application process.
pub struct Icheck {
    app: String,
    /// The client token and the application's capability.
    access: ServiceAccess,
    /// Where rank 0 keeps the capability between runs.
    capabilities: icheck_core::credentials::CapabilityStore,
    comm: Box<dyn Communicator>,
    endpoint: Endpoint,
    /// The controllers (the primary, and its standby if configured).
    controller: Option<ControllerLink>,
    /// The configured controllers, as errors name them.
    controller_peer: String,
    /// The configuration init read (the controllers, to reach them again).
    config: StaticConfig,
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
    /// SHMR: this node's shared segment (mapped by every node process).
    segment: Option<NodeSegment>,
    labels: Vec<Label>,
    latest: Option<VersionRecord>,
    /// Resize epoch of the versions this run writes: the newest version's,
    /// plus one when this run's process count differs from its.
    epoch: u32,
    next_version: u64,
    /// The direction of the next commit (never `Auto`).
    direction: TransferDirection,
    /// `transfer = "auto"`: the measurement that sets `direction`.
    auto: Option<AutoDirection>,
    /// How a restart's data comes back from this rank's agent over the
    /// fabric (`Auto` resolved for the provider: never `Auto`).
    restore_direction: RestoreDirection,
    /// `restore = "auto"`: a restart takes the version's file from an agent
    /// on this host instead of the fabric ([`icheck_core::handoff`]).
    restore_same_host: bool,
    /// `prefault` (see `ClientConfig`): populate a restore's destination
    /// ahead of the transfer.
    prefault: bool,
    /// The staging buffer of this restart's pulls over shm, kept from
    /// label to label until the restart is released.
    restore_staging: restart::RestoreStaging,
    zero_copy: bool,
    /// `incremental` (see `ClientConfig`): send only changed blocks.
    incremental: bool,
    /// The block checksums of the version this rank sealed last, and its
    /// number: what an incremental commit compares against.
    sealed_blocks: Option<(u64, Vec<u32>)>,
    /// `page_tracking` (see `ClientConfig`), where the kernel offers it.
    tracking: Option<Tracking>,
    /// What the last blocking zero-copy commit did.
    last_commit: Option<CommitStats>,
    /// Bytes of the last size hint sent before the first commit
    /// (`u64::MAX` once a commit began: no more hints).
    size_hint: u64,
    /// Fraction of blocks the last incremental commit found changed.
    changed_last: f64,
    staging_size: usize,
    /// The staging buffer between commits: kept (an async commit's bytes
    /// may be stored again on new agents) but not registered; it is
    /// exposed to the fabric only during a transfer.
    staging: Option<AlignedBuffer>,
    /// A staging buffer for async commits being backed on a background
    /// thread ([`Icheck::prepare_async_staging`]); the next commit that
    /// needs a staging buffer takes it.
    staging_ahead: Option<std::thread::JoinHandle<AlignedBuffer>>,
    asynchronous: bool,
    in_flight: Option<InFlight>,
    restored: Option<Restored>,
    /// What the agent said is damaged in the version `restart` fetched (MR).
    restart_damage: Option<String>,
    finalized: bool,
    connect_timeout: Duration,
    /// `client.request_timeout`: the bound of agent requests that move no
    /// data (requests that do get more by their size).
    request_timeout: Duration,
    /// Whom agent sessions ask, during a long wait, whether their agent
    /// was given up.
    watch: Option<std::sync::Arc<watch::AgentWatch>>,
}

/// Saves `app`'s capability as the controller answered it, unless the
/// store holds it already (`held`). A capability that cannot be kept fails
/// init: a restarted job could not prove it owns its checkpoints.
fn keep_capability(
    store: &icheck_core::credentials::CapabilityStore,
    app: &str,
    answered: &str,
    held: Option<&str>,
) -> std::result::Result<(), icheck_core::credentials::CredentialError> {
    if answered.is_empty() || held == Some(answered) {
        return Ok(());
    }
    let capability = icheck_core::credentials::Capability::parse(answered, "the controller's answer")?;
    let path = store.save(app, &capability)?;
    tracing::info!(path = %path.display(), "kept the application's capability (a restart presents it)");
    Ok(())
}

impl Drop for Icheck {
    /// An asynchronous commit still running reads the SHMR segment through
    /// raw pointers: it must end before the segment is unmapped, so a
    /// handle dropped without `wait` or `finalize` still waits for it (its
    /// version stays incomplete).
    fn drop(&mut self) {
        if let Some(handle) = self.in_flight.take().and_then(|in_flight| in_flight.handle) {
            let _ = handle.join();
        }
    }
}

impl Icheck {
    /// Rank 0 keeps the capability a (re-)registration answered.
    pub(super) fn keep_capability(&self, answered: &str) -> Result<()> {
        let held = self.access.presented();
        keep_capability(&self.capabilities, &self.app, answered, held.as_deref()).map_err(Error::from)
    }
}

/// The key of the application's encrypted PFS copies, when it asked for
/// them: `ICHECK_ENCRYPTION_KEY`, else derived from its capability (so a
/// restart needs nothing but the capability it kept).
fn pfs_key(encrypted: bool, capability: &str) -> Result<Option<icheck_core::cipher::PfsKey>> {
    use icheck_core::config::ENCRYPTION_KEY_ENV;
    if !encrypted {
        return Ok(None);
    }
    if let Ok(hex) = std::env::var(ENCRYPTION_KEY_ENV) {
        let key = icheck_core::cipher::PfsKey::parse_hex(&hex)
            .map_err(|why| Error::Unsupported(format!("environment variable {ENCRYPTION_KEY_ENV}: {why}")))?;
        return Ok(Some(key));
    }
    if capability.is_empty() {
        return Err(Error::Unsupported(format!(
            "encrypted PFS copies need the application's key: it derives from the capability, which this \
             application does not have yet (the service was never reached), and {ENCRYPTION_KEY_ENV} is not set"
        )));
    }
    let capability = icheck_core::credentials::Capability::parse(capability, "the application's capability")?;
    Ok(Some(icheck_core::cipher::PfsKey::new(capability.derive_key("pfs"))))
}

fn config_path(config: Option<&Path>) -> PathBuf {
    match config {
        Some(path) => path.to_path_buf(),
        None => std::env::var_os(CONFIG_ENV).map_or_else(|| PathBuf::from(DEFAULT_CONFIG), PathBuf::from),
    }
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
        let direction = match std::env::var("ICHECK_TRANSFER") {
            Ok(text) => text
                .parse::<TransferDirection>()
                .map_err(|e| Error::Unsupported(format!("environment variable ICHECK_TRANSFER: {e}")))?,
            Err(_) => client.transfer,
        };
        // `auto` starts pulling; `AutoDirection` says when to switch.
        let (direction, auto) = match direction {
            TransferDirection::Auto => (TransferDirection::Pull, Some(AutoDirection::default())),
            configured => (configured, None),
        };
        let restore_direction = match std::env::var("ICHECK_RESTORE") {
            Ok(text) => text
                .parse::<RestoreDirection>()
                .map_err(|e| Error::Unsupported(format!("environment variable ICHECK_RESTORE: {e}")))?,
            Err(_) => client.restore,
        };
        let mode = match std::env::var("ICHECK_MODE") {
            Ok(text) => text
                .parse::<TransferMode>()
                .map_err(|e| Error::Unsupported(format!("environment variable ICHECK_MODE: {e}")))?,
            Err(_) => client.mode,
        };
        icheck_core::kernel_copy::check_placed_reads_env().map_err(Error::Unsupported)?;
        // Measured (a few ms) while the application starts, not during its
        // first restore.
        let _ = std::thread::Builder::new()
            .name("icheck-copy-probe".into())
            .spawn(icheck_core::kernel_copy::copies_slowly_behind_the_source);
        let zero_copy = env_flag("ICHECK_ZERO_COPY", client.zero_copy)?;
        let incremental = env_flag("ICHECK_INCREMENTAL", client.incremental)?;
        let page_tracking = env_flag("ICHECK_PAGE_TRACKING", client.page_tracking)?;
        let prefault = env_flag("ICHECK_PREFAULT", client.prefault)?;
        let tracking = (page_tracking && incremental).then(Tracking::start).flatten();
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
        let encrypted = client.encrypted().map_err(|expected| ConfigError::Invalid {
            file: path.clone(),
            key: "client.encryption (or ICHECK_ENCRYPTION)",
            expected,
        })?;
        let redundancy = client.redundancy().map_err(|expected| ConfigError::Invalid {
            file: path.clone(),
            key: "client.redundancy (or ICHECK_REDUNDANCY)",
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
        let request_timeout = match std::env::var("ICHECK_REQUEST_TIMEOUT") {
            Ok(text) => text.parse::<f64>().ok().filter(|t| t.is_finite() && *t > 0.0).ok_or_else(|| {
                Error::Unsupported(format!(
                    "environment variable ICHECK_REQUEST_TIMEOUT: {text:?} is not a number of seconds greater than 0"
                ))
            })?,
            Err(_) => client.request_timeout,
        };
        let request_timeout = Duration::from_secs_f64(request_timeout);
        let watch = watch::AgentWatch::from_config(&config);
        // An agent's transfers share its endpoint: one stalled on a dead rank
        // holds the agent's other ranks for up to the fabric's no-progress
        // bound. A shorter wait gives up on agents that are only finishing it.
        let stall = TransferOptions::default().timeout;
        if request_timeout <= stall && comm.rank() == 0 {
            tracing::warn!(
                ?request_timeout,
                ?stall,
                "client.request_timeout is not above the agents' transfer stall bound: a rank may give up on an \
                 agent that is busy ending another rank's stalled transfer"
            );
        }
        let (rank, size) = (comm.rank(), comm.size());
        let span = tracing::info_span!("icheck", app = app_name, rank);
        let _entered = span.enter();
        // The fabric opens on a thread of its own while rank 0 registers
        // (which may wait for managers to start agents): the first
        // `fi_getinfo` of a process loads every libfabric provider, and on
        // Debian's build the verbs provider scans /proc/kallsyms twice
        // (about 100 ms of kernel time per process, and a node's ranks
        // scan at once). Both times are logged with "initialised".
        let init_started = Instant::now();
        let fabric = config.fabric.clone();
        let opening_span = span.clone();
        let opening = std::thread::Builder::new()
            .name("icheck-fabric-open".into())
            .spawn(move || -> Result<(Endpoint, Duration)> {
                let _entered = opening_span.enter();
                // Tests make one rank's fabric fail to open.
                if icheck_core::failpoint::fails("client.open_fabric") {
                    return Err(FabricError::Config("the failpoint client.open_fabric refused it".into()).into());
                }
                let domain = Domain::open(&fabric)?;
                let endpoint = Endpoint::new(&domain)?;
                Ok((endpoint, init_started.elapsed()))
            })
            .map_err(|e| Error::Unsupported(format!("cannot start a thread to open the fabric: {e}")))?;

        // Rank 0 registers; everyone learns the outcome (or the error).
        let controller_peer = config.controller_endpoints().join(" or ");
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
            encrypted,
            redundancy,
        };
        let capabilities = config.capability_store();
        if rank == 0 {
            // A restart presents the capability the first run kept; a first
            // run draws one and keeps it before it asks, so a reply lost on
            // the way (a timeout) cannot leave the application without it.
            let held = capabilities.load(app_name).and_then(|held| match held {
                Some(held) => Ok(Some(held)),
                None => {
                    let drawn = icheck_core::credentials::Capability::generate()?;
                    capabilities.save(app_name, &drawn)?;
                    Ok(Some(drawn))
                }
            });
            // Registrations and probes may wait for managers to start agents.
            let mut link = ControllerLink::new(&config, &token, connect_timeout, CONTROLLER_TIMEOUT);
            let outcome = match &held {
                Err(err) => Err(err.to_string()),
                Ok(held) => {
                    let request = ClientRequest::RegisterApp {
                        registration: registration.clone(),
                        capability: held.as_ref().map(|c| c.expose().to_string()),
                        uid: icheck_core::credentials::current_uid(),
                    };
                    Ok(link.request(&request).map(|reply| (link, reply)))
                }
            };
            let result: std::result::Result<ClientReply, String> = match outcome {
                Err(unreadable) => Err(unreadable),
                Ok(Ok((connection, reply))) => {
                    let kept = match &reply {
                        ClientReply::Registered { capability, .. } => {
                            let fresh = held.as_ref().ok().and_then(Option::as_ref).map(|c| c.expose());
                            keep_capability(&capabilities, app_name, capability, fresh)
                        }
                        _ => Ok(()),
                    };
                    controller = Some(connection);
                    kept.map(|()| reply).map_err(|e| e.to_string())
                }
                // §6.5.1: no service, but a PFS: keep the application running
                // by writing versions there directly (an empty agent list).
                Ok(Err(err @ ServiceError::Io { .. }))
                | Ok(Err(err @ ServiceError::Protocol(ProtocolError::Timeout(_))))
                | Ok(Err(err @ ServiceError::Protocol(ProtocolError::NotPrimary { .. })))
                    if config.pfs_dir.is_some() =>
                {
                    let pfs = icheck_core::pfs::PfsStore::new(config.pfs_dir.clone().expect("checked"));
                    tracing::warn!(
                        controller = %controller_peer,
                        %err,
                        pfs = %config.pfs_dir.as_ref().expect("checked").display(),
                        "controller unreachable: checkpoints go directly to the PFS"
                    );
                    let capability = held.ok().flatten().map(|c| c.expose().to_string()).unwrap_or_default();
                    pfs.latest_record(app_name)
                        .map(|latest| ClientReply::Registered { agents: Vec::new(), latest, capability })
                        .map_err(|e| e.to_string())
                }
                // The controller's own words: the ranks wrap them once.
                Ok(Err(ServiceError::Remote(message))) => Err(message),
                Ok(Err(err)) => Err(err.to_string()),
            };
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = comm.broadcast_from_root(answer);
        let registered = init_started.elapsed();
        let opened =
            opening.join().unwrap_or_else(|_| Err(Error::Unsupported("the thread opening the fabric panicked".into())));
        // Every rank learns whether all opened the fabric: one that failed
        // ends init on every rank, not only its own.
        let all_opened = comm.all_true(opened.is_ok());
        if !all_opened {
            if let Some(controller) = controller.as_mut() {
                finish_unstarted(controller, app_name, &answer);
            }
        }
        let (endpoint, fabric_opened) = match opened {
            Err(err) => return Err(err),
            Ok(_) if !all_opened => {
                return Err(Error::Unsupported(
                    "another rank could not open the fabric (its own error says why)".into(),
                ))
            }
            Ok(opened) => opened,
        };
        let restore_same_host = restore_direction == RestoreDirection::Auto;
        let restore_direction = restore_direction.on(endpoint.provider());
        let result: std::result::Result<ClientReply, String> =
            protocol::decode(&answer).unwrap_or_else(|e| Err(format!("undecodable registration answer: {e}")));
        let (agents, latest, capability) = match result {
            Ok(ClientReply::Registered { agents, latest, capability })
                if !agents.is_empty() || config.pfs_dir.is_some() =>
            {
                (agents, latest, capability)
            }
            // The controller answers with no agents when no checkpoint node
            // can take any and the version to restart from is on the PFS.
            Ok(ClientReply::Registered { .. }) => {
                return Err(Error::Controller {
                    peer: controller_peer,
                    error: ServiceError::Remote(
                        "no checkpoint node can take agents now, and this job's configuration names no PfsDir to \
                         write its versions to meanwhile"
                            .into(),
                    ),
                })
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
        let pfs_key = pfs_key(encrypted, &capability)?;
        let access = ServiceAccess { token, capability, pfs_key: pfs_key.clone() };
        let fallback = agents.is_empty().then(|| {
            icheck_core::pfs::PfsStore::new(config.pfs_dir.clone().expect("checked")).with_key(pfs_key.clone())
        });
        if let (Some(pfs), Some(_)) = (&fallback, &controller) {
            // Rank 0 reached the controller, which has no node for agents.
            tracing::warn!(
                controller = %controller_peer,
                pfs = %pfs.root().display(),
                "no checkpoint node can take agents now: checkpoints go directly to the PFS until one can"
            );
        }
        let link = if fallback.is_some() {
            Ok(None)
        } else {
            let waits = Waits { connect: connect_timeout, request: request_timeout, watch: watch.clone() };
            open_link(comm.as_ref(), mode, &endpoint, &agents, &access, app_name, waits)
        };
        let all_ok = comm.all_true(link.is_ok());
        let unreached = link.as_ref().err().and_then(Error::unreached_agent);
        let unreachable = match &link {
            Err(err) => Some(err.to_string()),
            Ok(_) if !all_ok => Some("another rank could not reach its agent during init".to_string()),
            Ok(_) => None,
        };
        let link = link.unwrap_or(None);
        let status = match &latest {
            Some(record) => InitStatus::Restart { version: record.version },
            None => InitStatus::Fresh,
        };
        drop(_entered);
        let next_version = latest.as_ref().map_or(1, |l| l.version + 1);
        let epoch = latest.as_ref().map_or(0, |l| l.epoch + u32::from(l.ranks != size));
        let icheck = Icheck {
            app: app_name.to_string(),
            access,
            capabilities,
            comm,
            endpoint,
            controller,
            controller_peer,
            config: config.clone(),
            agents,
            link,
            mode,
            fallback,
            fallback_tried: Instant::now(),
            pfs: config.pfs_dir.clone().map(|dir| icheck_core::pfs::PfsStore::new(dir).with_key(pfs_key.clone())),
            t_wait,
            registration,
            segment: None,
            labels: Vec::new(),
            latest,
            epoch,
            next_version,
            direction,
            auto,
            restore_direction,
            restore_same_host,
            prefault,
            restore_staging: restart::RestoreStaging::default(),
            zero_copy,
            incremental,
            sealed_blocks: None,
            tracking,
            last_commit: None,
            size_hint: 0,
            // Nothing known: the second commit goes whole, and measures.
            changed_last: 1.0,
            staging_size: (staging_size.0 as usize).max(8192),
            staging: None,
            asynchronous: false,
            staging_ahead: None,
            in_flight: None,
            restored: None,
            restart_damage: None,
            finalized: false,
            connect_timeout,
            request_timeout,
            watch,
        };
        let mut icheck = icheck;
        if let Some(reason) = unreachable {
            // §6.5.2: an agent that cannot be reached at init is replaced
            // (the controller gives up agents whose node went silent).
            let _entered = span.enter();
            tracing::warn!(%reason, "an agent is unreachable at init; asking the controller for new agents");
            match icheck.ask_for_new_agents(true, unreached) {
                Ok(ProbeOutcome::Reconnected { agents }) => tracing::warn!(agents, "init continues with new agents"),
                Ok(ProbeOutcome::Unchanged) => {
                    return Err(Error::Incomplete {
                        version: 0,
                        detail: format!("{reason}; the controller has no other agents"),
                        previous: "nothing".into(),
                    })
                }
                Err(err) => return Err(err),
            }
        }
        let _entered = span.enter();
        let agent = icheck.link.as_ref().map(|l| l.info.id);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::info!(
            ?status,
            ?agent,
            ?direction,
            ?mode,
            zero_copy,
            incremental,
            fabric_ms = ms(fabric_opened),
            registered_ms = ms(registered),
            ms = ms(init_started.elapsed()),
            "initialised"
        );
        drop(_entered);
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
        self.hint_first_version_size();
        Ok(())
    }

    /// Before this process's first commit, tells its agent how many bytes
    /// the labels hold (from 1 MiB, each time they reach twice the last
    /// hint), so that the agent backs the first version's file while the
    /// application computes rather than inside the commit. A hint: a
    /// failure only costs that time back.
    fn hint_first_version_size(&mut self) {
        if self.size_hint == u64::MAX || self.mode != TransferMode::Mr {
            return;
        }
        let total: u64 = self.labels.iter().map(|l| l.source.bytes().len() as u64).sum();
        if total < (1 << 20) || total < self.size_hint.saturating_mul(2) {
            return;
        }
        self.size_hint = total;
        if let Some(link) = self.link.as_mut() {
            if let Err(err) = link.call(&AgentRequest::Prepare { len: total }) {
                tracing::debug!(%err, "the agent did not take the first version's size");
            }
        }
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
        let turned_on = asynchronous && !self.asynchronous;
        self.asynchronous = asynchronous;
        if turned_on {
            self.prepare_async_staging();
        }
    }

    /// Starts backing the staging buffer async commits copy the labels
    /// into, on a background thread at nice 19, while the application
    /// computes towards its first async commit.
    ///
    /// A new buffer's pages otherwise fault in during that commit's copy:
    /// a 256 MiB rank's first async commit staged in 179–193 ms against
    /// 45–53 ms for later ones (four ranks on two cores). The commit takes
    /// the buffer, waiting for what is left if it comes early. Labels
    /// added later than this make the buffer too small, and the commit
    /// allocates one as before. Not for SHMR, which stages in its node
    /// segment, nor for small data.
    fn prepare_async_staging(&mut self) {
        let total: usize = self.labels.iter().map(|label| label.source.bytes().len()).sum();
        let kept = self.staging.as_ref().map_or(0, icheck_core::fabric::StableBuffer::len);
        if self.mode == TransferMode::Shmr || total < STAGING_AHEAD_MIN || kept >= total || self.staging_ahead.is_some()
        {
            return;
        }
        let backing = std::thread::Builder::new().name("icheck-staging".into()).spawn(move || {
            icheck_core::fabric::lower_thread_priority();
            let mut buffer = AlignedBuffer::zeroed(total);
            buffer.prefault();
            buffer
        });
        match backing {
            Ok(handle) => self.staging_ahead = Some(handle),
            Err(err) => tracing::debug!(%err, "cannot start a thread to back the async staging buffer"),
        }
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

    /// How long this process waits for agents.
    fn waits(&self) -> Waits {
        Waits { connect: self.connect_timeout, request: self.request_timeout, watch: self.watch.clone() }
    }

    fn controller_error(&self, message: String) -> Error {
        Error::Controller { peer: self.controller_peer.clone(), error: ServiceError::Remote(message) }
    }

    /// Asks the controller whether this application's agents changed, and
    /// moves to the new ones if so (*collective*); the next commit goes there.
    pub fn probe_agents(&mut self, hints: ProbeHints) -> Result<ProbeOutcome> {
        self.check_open()?;
        self.wait()?;
        self.release_restart();
        match self.ask_for_agents(hints.remaining_commits, false, &[])? {
            Asked::Outcome(outcome) => Ok(outcome),
            Asked::NoRoom(reason) => Err(self.controller_error(reason)),
        }
    }

    /// After an agent failed: asks the controller for new agents, again
    /// for a moment while it has none (*collective*). The controller
    /// learns of an agent thread that died at its manager's next heartbeat,
    /// so the first answer may come too early. `at_init`: asked by `init`,
    /// before this job stored anything (see [`ClientRequest::Probe`]).
    /// `unreached`: the agent this rank could not reach, if that is how
    /// its failure came (the controller moves agents the job cannot reach
    /// off nodes that still heartbeat).
    fn ask_for_new_agents(&mut self, at_init: bool, unreached: Option<u64>) -> Result<ProbeOutcome> {
        const ATTEMPTS: u32 = 5;
        const PAUSE: Duration = Duration::from_millis(500);
        let unreachable = self.unreached_by_any(unreached);
        if !unreachable.is_empty() && self.comm.rank() == 0 {
            tracing::warn!(agents = ?unreachable, "ranks could not reach these agents; telling the controller");
        }
        // While no node can take agents (the only node missed a few
        // heartbeats and is coming back), a job with a PFS waits as long as
        // for an agent thread's death to be known, then writes there; one
        // without waits as long as for an agent's answer, since its commit
        // fails otherwise.
        let room_wait = if self.pfs.is_some() { PAUSE * (ATTEMPTS - 1) } else { self.request_timeout };
        let room_deadline = Instant::now() + room_wait;
        let (mut unchanged, mut told) = (0, false);
        loop {
            match self.ask_for_agents(0, at_init, &unreachable)? {
                Asked::Outcome(ProbeOutcome::Unchanged) if unchanged + 1 < ATTEMPTS => unchanged += 1,
                Asked::Outcome(outcome) => return Ok(outcome),
                // Every rank leaves the loop together, whichever clock ran out.
                Asked::NoRoom(reason) if !self.comm.all_true(Instant::now() < room_deadline) => {
                    return Err(self.controller_error(reason))
                }
                Asked::NoRoom(_) => {
                    if !told && self.comm.rank() == 0 {
                        tracing::warn!(
                            ?room_wait,
                            "no checkpoint node can take new agents now; asking again meanwhile"
                        );
                    }
                    told = true;
                }
            }
            std::thread::sleep(PAUSE);
        }
    }

    /// The application's agents that some rank could not reach
    /// (*collective*): each rank names its own, `unreached`, if any.
    fn unreached_by_any(&self, unreached: Option<u64>) -> Vec<u64> {
        let mut reported = Vec::new();
        // The same agents in the same order on every rank: one sum each.
        for agent in self.agents.iter().map(|a| a.id) {
            if self.comm.sum(u64::from(unreached == Some(agent))) > 0 {
                reported.push(agent);
            }
        }
        reported
    }

    /// The probe itself (*collective*): rank 0 asks the controller, every
    /// rank opens its session with its new agent when there are new ones.
    fn ask_for_agents(&mut self, remaining_commits: u32, at_init: bool, unreachable: &[u64]) -> Result<Asked> {
        let mut answer = Vec::new();
        if let Some(controller) = self.controller.as_mut() {
            let request = ClientRequest::Probe {
                name: self.app.clone(),
                agents: self.agents.iter().map(|a| a.id).collect(),
                remaining_commits,
                capability: self.access.capability.clone(),
                at_init,
                unreachable: unreachable.to_vec(),
            };
            let result = controller.request(&request).map_err(|e| e.to_string());
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = self.comm.broadcast_from_root(answer);
        let result: std::result::Result<ClientReply, String> =
            protocol::decode(&answer).unwrap_or_else(|e| Err(format!("undecodable probe answer: {e}")));
        let agents = match result {
            Ok(ClientReply::Unchanged) => return Ok(Asked::Outcome(ProbeOutcome::Unchanged)),
            Ok(ClientReply::NoRoom(reason)) => return Ok(Asked::NoRoom(reason)),
            Ok(ClientReply::Agents(agents)) if !agents.is_empty() => agents,
            Ok(other) => return Err(self.controller_error(format!("unexpected answer to Probe: {other:?}"))),
            Err(message) => return Err(self.controller_error(message)),
        };
        self.switch_agents(agents)?;
        Ok(Asked::Outcome(ProbeOutcome::Reconnected { agents: self.agents.len() }))
    }

    /// Opens every rank's session with its agent among `agents` and makes
    /// them the application's agents (*collective*); nothing changes unless
    /// every rank reached its new agent.
    fn switch_agents(&mut self, agents: Vec<AgentInfo>) -> Result<()> {
        let link = self.open_own_link(&agents);
        let all_ok = self.comm.all_true(link.is_ok());
        let link = link?;
        if !all_ok {
            return Err(Error::Order("another rank could not reach its new agent"));
        }
        tracing::info!(agent = ?link.as_ref().map(|l| l.info.id), "moved to new agents");
        self.link = link;
        self.agents = agents;
        Ok(())
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
            let request = ClientRequest::FinishApp {
                name: self.app.clone(),
                persist,
                capability: self.access.capability.clone(),
            };
            result = controller
                .request(&request)
                .map(|_| ())
                .map_err(|error| Error::Controller { peer: self.controller_peer.clone(), error });
        }
        waited?;
        result
    }
}

/// Rank 0 of a job whose `init` failed after it registered: the
/// application ends at once, as a finished run would, instead of holding
/// its agents like a crashed job until it comes back. Versions it would
/// have restarted from stay (`persist`); a failure to say so is only
/// logged, since `init` already fails with the reason that matters.
fn finish_unstarted(controller: &mut ControllerLink, app: &str, answer: &[u8]) {
    let decoded: std::result::Result<std::result::Result<ClientReply, String>, _> = protocol::decode(answer);
    let Ok(Ok(ClientReply::Registered { latest, capability, .. })) = decoded else {
        return;
    };
    let request = ClientRequest::FinishApp { name: app.to_string(), persist: latest.is_some(), capability };
    match controller.request(&request) {
        Ok(_) => tracing::info!(app, "init failed on a rank: the application is finished at the service"),
        Err(err) => tracing::warn!(app, %err, "init failed on a rank and the service could not be told"),
    }
}

/// The boolean environment variable `name` (`0`/`false`, `1`/`true`), or
/// `default` when it is unset or says something else.
/// A boolean switch from the environment (`default` when unset); a value
/// that is not one is refused by name rather than silently ignored.
fn env_flag(name: &str, default: bool) -> Result<bool> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(text) => parse_flag(&text).ok_or_else(|| {
            Error::Unsupported(format!("environment variable {name}: {text:?} is not 1, 0, true or false"))
        }),
    }
}

fn parse_flag(text: &str) -> Option<bool> {
    match text {
        "0" | "false" => Some(false),
        "1" | "true" => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_flag;

    #[test]
    fn switches_accept_only_their_four_spellings() {
        assert_eq!(parse_flag("1"), Some(true));
        assert_eq!(parse_flag("true"), Some(true));
        assert_eq!(parse_flag("0"), Some(false));
        assert_eq!(parse_flag("false"), Some(false));
        for wrong in ["yes", "on", "", "TRUE", " 1"] {
            assert_eq!(parse_flag(wrong), None, "{wrong:?}");
        }
    }
}
