//! The control-plane protocol: messages, frames and the handshake.
//!
//! A frame is a 4-byte little-endian length followed by that many bytes of a
//! bincode-encoded message. Frames larger than [`MAX_FRAME`] are refused
//! before anything is allocated, and decoding is bounded by the same limit,
//! so untrusted bytes can neither panic a daemon nor exhaust its memory.
//!
//! Every connection starts with a [`Hello`] (magic, protocol version, shared
//! token, role) answered by [`HelloReply`]. Bulk checkpoint data never travels
//! here: this is only the control plane.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::fmt;
use std::time::Duration;

use bincode::Options;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::fabric::{FabricAddress, RemoteRegion};
pub use crate::format::{DataKind, LabelLayout, Manifest, VersionRecord};

/// Version of this protocol; peers with another version are refused.
/// (6: `Probe` says whether it comes from `init`; 7: `Protect` and
/// `Protected` carry the protection's attempt; 8: `TakeOver`, `Rebuild`
/// and `TookOver` carry the controller's request number; 9: `NodeStatus`
/// carries the manager's own memory; 10: `Probe` names the agents the job
/// could not reach; 11: `NoRoom` answers a probe no node can serve yet.)
pub const PROTOCOL_VERSION: u32 = 11;
/// First bytes of every Hello.
pub const MAGIC: [u8; 4] = *b"ICHK";
/// Largest frame accepted, in bytes.
pub const MAX_FRAME: usize = 1 << 20;
/// Largest Hello any port accepts: a token and a few fields.
pub const MAX_HELLO: usize = 4096;
/// Largest request a client (application or operator) may send the
/// controller: names, a few numbers and agent ids.
pub const MAX_CLIENT_REQUEST: usize = 64 << 10;
/// Default time a request may take before the caller gives up.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Socket error.
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer announced a frame above the limit.
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME} bytes")]
    FrameTooLarge(usize),
    /// The frame's bytes are not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The handshake was refused.
    #[error("refused by {peer}: {reason}")]
    Refused {
        /// Who refused.
        peer: String,
        /// Their reason.
        reason: String,
    },
    /// A controller that is not the primary (a standby, or a primary that
    /// cannot confirm it still is): try the next controller.
    #[error("{peer} is not the primary controller: {reason}")]
    NotPrimary {
        /// Who answered.
        peer: String,
        /// Their reason.
        reason: String,
    },
    /// A controller whose fencing epoch is older than one already seen: it
    /// was replaced while paused or cut off, and must not be obeyed.
    #[error("{peer} is a stale controller (epoch {epoch}; epoch {seen} was already seen)")]
    StaleEpoch {
        /// Who answered.
        peer: String,
        /// Its epoch.
        epoch: u64,
        /// The highest epoch seen.
        seen: u64,
    },
    /// The peer answered something unexpected.
    #[error("unexpected answer from {peer}: {what}")]
    Unexpected {
        /// Who answered.
        peer: String,
        /// What came.
        what: String,
    },
}

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_FRAME as u64).reject_trailing_bytes()
}

/// Encodes a message into a frame payload.
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, ProtocolError> {
    let bytes = options().serialize(message).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if bytes.len() > MAX_FRAME {
        return Err(ProtocolError::FrameTooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes a frame payload; never panics on arbitrary input.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    options().deserialize(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// Encodes a message as one whole frame: the payload's length (4 bytes,
/// little-endian) and the payload. Every writer of frames, blocking or async,
/// sends these bytes.
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, ProtocolError> {
    let payload = encode(message)?;
    let len = u32::try_from(payload.len()).map_err(|_| ProtocolError::FrameTooLarge(payload.len()))?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// The payload length a frame's 4-byte prefix announces, refused above
/// `limit` (at most [`MAX_FRAME`]) before anything is allocated for it.
/// Every reader of frames checks prefixes here.
pub fn frame_len(prefix: [u8; 4], limit: usize) -> Result<usize, ProtocolError> {
    let len = usize::try_from(u32::from_le_bytes(prefix)).unwrap_or(usize::MAX);
    if len > limit.min(MAX_FRAME) {
        return Err(ProtocolError::FrameTooLarge(len));
    }
    Ok(len)
}

/// Writes one message as a frame on a blocking stream (client library and
/// agent sessions, which do not run an async runtime).
pub fn send_blocking<W: std::io::Write, T: Serialize>(writer: &mut W, message: &T) -> Result<(), ProtocolError> {
    writer.write_all(&encode_frame(message)?)?;
    writer.flush()?;
    Ok(())
}

/// Reads one frame from a blocking stream and decodes it. A read timeout set
/// on the socket surfaces as [`ProtocolError::Timeout`] with `timeout`.
pub fn recv_blocking<R: std::io::Read, T: DeserializeOwned>(
    reader: &mut R,
    timeout: Duration,
) -> Result<T, ProtocolError> {
    let map = |err: std::io::Error| match err.kind() {
        std::io::ErrorKind::UnexpectedEof => ProtocolError::Closed,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ProtocolError::Timeout(timeout),
        _ => ProtocolError::Io(err),
    };
    let mut len = [0u8; 4];
    reader.read_exact(&mut len).map_err(map)?;
    let len = frame_len(len, MAX_FRAME)?;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).map_err(map)?;
    decode(&payload)
}

/// Collects one frame from a non-blocking stream across several calls, so a
/// daemon can wait for many peers' first frame (the Hello) on one thread
/// instead of parking a thread on each idle socket.
#[derive(Debug)]
pub struct FrameAssembler {
    limit: usize,
    buf: Vec<u8>,
}

impl FrameAssembler {
    /// An assembler that refuses frames announcing more than `limit` bytes.
    pub fn new(limit: usize) -> FrameAssembler {
        FrameAssembler { limit: limit.min(MAX_FRAME), buf: Vec::new() }
    }

    /// Reads what `reader` has now. `Ok(Some(payload))` once the frame is
    /// whole (an assembler yields one frame: make a new one for the next),
    /// `Ok(None)` when more bytes are needed (the reader would block),
    /// an error when the peer closed, the frame is too large, or the read failed.
    pub fn poll<R: std::io::Read>(&mut self, reader: &mut R) -> Result<Option<Vec<u8>>, ProtocolError> {
        loop {
            // Before the prefix is in, read up to it; then up to the frame's end.
            let wanted = 4 + self.announced()?.unwrap_or(0);
            if self.buf.len() >= 4 && self.buf.len() == wanted {
                return Ok(Some(self.buf.split_off(4)));
            }
            let have = self.buf.len();
            self.buf.resize(wanted, 0);
            match reader.read(&mut self.buf[have..]) {
                Ok(0) => {
                    self.buf.truncate(have);
                    return Err(ProtocolError::Closed);
                }
                Ok(n) => self.buf.truncate(have + n),
                Err(err) => {
                    self.buf.truncate(have);
                    return match err.kind() {
                        std::io::ErrorKind::WouldBlock => Ok(None),
                        std::io::ErrorKind::Interrupted => continue,
                        _ => Err(err.into()),
                    };
                }
            }
        }
    }

    /// The announced payload length, once the 4-byte prefix is in.
    fn announced(&self) -> Result<Option<usize>, ProtocolError> {
        let Some(&[a, b, c, d]) = self.buf.get(..4) else { return Ok(None) };
        frame_len([a, b, c, d], self.limit).map(Some)
    }
}

/// Who is connecting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A manager daemon of a checkpoint node.
    Manager,
    /// An application (client library) or an operator's command.
    Client,
    /// A standby controller that follows the primary's journal.
    Standby,
}

/// First message of every connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Must be [`MAGIC`].
    pub magic: [u8; 4],
    /// Must be [`PROTOCOL_VERSION`].
    pub version: u32,
    /// The shared secret.
    pub token: String,
    /// Who is connecting.
    pub role: Role,
    /// The highest controller epoch the peer has seen (0: none). A
    /// controller whose own epoch is lower learns it was replaced.
    pub epoch: u64,
}

impl Hello {
    /// A Hello for this protocol version.
    pub fn new(token: &str, role: Role) -> Hello {
        Hello::with_epoch(token, role, 0)
    }

    /// A Hello that carries the highest controller epoch seen.
    pub fn with_epoch(token: &str, role: Role, epoch: u64) -> Hello {
        Hello { magic: MAGIC, version: PROTOCOL_VERSION, token: token.to_string(), role, epoch }
    }
}

/// Answer to a Hello.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum HelloReply {
    /// Accepted (by an agent).
    Welcome,
    /// Refused, with the reason.
    Refused(String),
    /// Accepted by the primary controller, at this fencing epoch.
    Primary {
        /// The controller's epoch: managers and clients obey only the
        /// highest they have seen.
        epoch: u64,
    },
    /// A controller that is not acting as the primary (it cannot confirm
    /// its lease, or it was replaced): try the next one.
    NotPrimary {
        /// Why, in words.
        reason: String,
        /// Its epoch (what another controller compares with its own).
        epoch: u64,
        /// Events its journal recorded: of two controllers at one epoch
        /// that both cannot act, the one with fewer yields.
        sequence: u64,
    },
    /// A standby controller: not the primary; try the next one.
    Standby {
        /// Whether it holds a copy of the primary's journal (and so may
        /// take over when the primary falls silent).
        synced: bool,
    },
}

/// The fencing rule managers and clients apply to a controller's answer
/// to their Hello: only the primary at the highest epoch seen (`seen`) is
/// obeyed. Returns the epoch to remember from now on.
pub fn accept_controller(peer: &str, reply: HelloReply, seen: u64) -> Result<u64, ProtocolError> {
    match reply {
        HelloReply::Primary { epoch } if epoch >= seen => Ok(epoch),
        HelloReply::Primary { epoch } => Err(ProtocolError::StaleEpoch { peer: peer.to_string(), epoch, seen }),
        HelloReply::NotPrimary { reason, .. } => Err(ProtocolError::NotPrimary { peer: peer.to_string(), reason }),
        HelloReply::Standby { synced } => Err(ProtocolError::NotPrimary {
            peer: peer.to_string(),
            reason: format!(
                "a standby controller ({})",
                if synced { "following the primary" } else { "not yet synced" }
            ),
        }),
        HelloReply::Refused(reason) => Err(ProtocolError::Refused { peer: peer.to_string(), reason }),
        HelloReply::Welcome => Err(ProtocolError::Unexpected {
            peer: peer.to_string(),
            what: "an agent's Welcome where a controller was expected".into(),
        }),
    }
}

/// What a peer's token admits it to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Privilege {
    /// An application: it may register, then act on its own application
    /// with that application's capability.
    Client,
    /// A checkpoint node (manager, standby controller, an agent taking a
    /// rank over from another agent).
    Node,
    /// An operator: delete, drain, the full status.
    Admin,
}

/// Checks a Hello's magic and version, then which of `accepted` tokens it
/// presents (compared in constant time). Managers and standby controllers
/// must present a [`Privilege::Node`] token. Returns the privilege or the
/// refusal reason.
pub fn admit_hello(hello: &Hello, accepted: &[(Privilege, &str)]) -> Result<Privilege, String> {
    if hello.magic != MAGIC {
        return Err("not an icheck peer (bad magic)".into());
    }
    if hello.version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} is not supported (this daemon speaks {PROTOCOL_VERSION})",
            hello.version
        ));
    }
    // Every token is compared, so timing tells nothing about which matched.
    let mut admitted = None;
    for (privilege, token) in accepted {
        if crate::credentials::secrets_equal(&hello.token, token) && admitted.is_none() {
            admitted = Some(*privilege);
        }
    }
    match (admitted, hello.role) {
        (None, Role::Client) => Err("wrong token (set Token in the configuration file or ICHECK_TOKEN)".into()),
        (None, Role::Manager | Role::Standby)
        | (Some(Privilege::Client | Privilege::Admin), Role::Manager | Role::Standby) => Err(format!(
            "a {:?} must present the node token (NodeToken in the configuration file or ICHECK_NODE_TOKEN)",
            hello.role
        )),
        (Some(privilege), _) => Ok(privilege),
    }
}

/// How the application moves data (thesis §6.2.1); defined with the
/// on-disk formats, whose file layout it decides.
pub use crate::format::TransferMode;

/// An application's registration (§6.1.2 step 1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppRegistration {
    /// Application name; a restart uses the same name.
    pub name: String,
    /// MPI processes.
    pub ranks: u32,
    /// Compute nodes.
    pub nodes: u32,
    /// Processes per node.
    pub ranks_per_node: u32,
    /// MR or SHMR.
    pub mode: TransferMode,
    /// Copy every this many versions to the PFS (0 = never).
    pub pfs_interval: u32,
    /// How the PFS copies are stored.
    pub compression: crate::pfs::CompressionPolicy,
    /// PFS copies are encrypted (AES-256-GCM) with the application's key,
    /// which only its ranks hold (agents get it at `Open`).
    pub encrypted: bool,
    /// The redundancy the application asks for (`client.redundancy`,
    /// `ICHECK_REDUNDANCY`); `None`: the service's default (the dynamic
    /// configuration's `redundancy`).
    #[serde(default)]
    pub redundancy: Option<crate::redundancy::Redundancy>,
}

/// An agent as the application sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Controller-wide agent id.
    pub id: u64,
    /// Node (manager) it runs on.
    pub node: String,
    /// Its fabric address.
    pub address: FabricAddress,
    /// Provider it runs on.
    pub provider: String,
    /// A small region holding a known pattern, for reachability checks.
    pub probe: RemoteRegion,
    /// TCP address ("host:port") of the agent's command channel, where
    /// application ranks open sessions ([`AgentRequest`]).
    pub control: String,
}

/// What a manager measured (§6.3), sent every status interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Available memory in bytes (from /proc/meminfo).
    pub mem_available: u64,
    /// Total memory in bytes.
    pub mem_total: u64,
    /// Agents running.
    pub agents: u32,
    /// Checkpoint bytes held by its agents.
    pub bytes_held: u64,
    /// Checkpoint operations served since start.
    pub checkpoint_ops: u64,
    /// Checkpoint bytes received since start (an incremental version's
    /// changed blocks only).
    #[serde(default)]
    pub checkpoint_bytes: u64,
    /// Aggregate bandwidth of the last interval, bytes/s (eq. 6.9).
    pub bandwidth: f64,
    /// Checkpoint operations per minute, over the last minute.
    #[serde(default)]
    pub cops_per_min: f64,
    /// Seconds between the last two checkpoint operations (Δcop, eq. 6.7).
    #[serde(default)]
    pub last_cop_interval: Option<f64>,
    /// Per agent: id and bytes/s of its last transfer (bw_agent, eq. 6.8).
    #[serde(default)]
    pub agent_bandwidth: Vec<(u64, f64)>,
    /// Package power draw in watts from RAPL (powercap), where readable.
    #[serde(default)]
    pub power_watts: Option<f64>,
    /// Bytes in the node's warm pool (`WarmPool`): backed files ready for
    /// the next new version files, not counted in `bytes_held`.
    #[serde(default)]
    pub warm_bytes: u64,
    /// Version files the node's agents handed to restarting ranks on their
    /// own host (read with `pread`, not over the fabric) since the manager
    /// started.
    #[serde(default)]
    pub files_handed_over: u64,
    /// The fabric provider the node's agents use, as libfabric names it
    /// (`shm`, `tcp;ofi_rxm`, ...); empty from a manager that predates it.
    #[serde(default)]
    pub provider: String,
    /// How the node's store backs new version files: huge pages or 4 KiB
    /// ones, and why (`pages::HugePages` in words); empty from a
    /// manager that predates it.
    #[serde(default)]
    pub store_pages: String,
    /// The manager process's resident memory that no file backs, in bytes:
    /// its heap, with the fabric endpoints' buffers (over tcp, at least
    /// 17 MiB per endpoint: one per agent, up to three lanes beside it,
    /// and its jobs' outgoing ones). The versions are files, counted in
    /// `bytes_held`.
    #[serde(default)]
    pub manager_anonymous_bytes: u64,
}

/// Messages a manager sends to the controller.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ManagerToController {
    /// First message after the Hello.
    Register {
        /// Node name.
        node: String,
        /// Manager process id (for operators).
        pid: u32,
        /// Initial measurements.
        status: NodeStatus,
        /// The agents the manager runs (after a controller restart the
        /// controller adopts those it journaled and stops the others).
        #[serde(default)]
        agents: Vec<AgentInfo>,
        /// The sealed versions its store holds, each verified against its
        /// manifest's checksums (for the controller's reconciliation).
        #[serde(default)]
        stored: Vec<StoredVersion>,
        /// The sealed pieces of redundancy its store holds (a node holding
        /// only pieces of a version says by them whether it kept them).
        #[serde(default)]
        pieces: Vec<StoredPiece>,
    },
    /// Liveness.
    Heartbeat,
    /// Measurements.
    Status(NodeStatus),
    /// An agent started and is reachable.
    AgentReady(AgentInfo),
    /// An agent could not start.
    AgentFailed {
        /// Agent id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// An agent thread died.
    AgentLost {
        /// Agent id.
        id: u64,
    },
    /// An agent finished (or failed) its part of a PFS copy.
    PfsCopied {
        /// Agent id.
        agent: u64,
        /// Version.
        version: u64,
        /// The files it wrote and what writing them cost, or why it could not.
        result: Result<(Vec<crate::pfs::RankEntry>, PfsCopyStats), String>,
        /// The copy could not start because a newer version of a rank had
        /// completed and retention had dropped this one first (the copy
        /// was asked for as the newest version, and a commit overtook the
        /// request): not a failure; the newest version is copied instead.
        #[serde(default)]
        superseded: bool,
    },
    /// An agent took over a rank's newest version from another agent
    /// (after a change of the application's agents), or rebuilt it from
    /// redundancy.
    TookOver {
        /// The agent that now holds the rank.
        agent: u64,
        /// Rank (MR) or node index (SHMR).
        rank: u32,
        /// The request it answers (the `request` of its `TakeOver` or
        /// `Rebuild`): an answer to an earlier request for the same rank,
        /// one the controller stopped waiting for, answers nothing else.
        request: u64,
        /// Bytes it moved, or why it could not.
        result: Result<u64, String>,
    },
    /// An agent built (or could not build) a piece of redundancy.
    Protected {
        /// The agent.
        agent: u64,
        /// The version it protects.
        version: u64,
        /// The protection attempt it answers ([`PieceTask::attempt`]).
        attempt: u64,
        /// The piece.
        piece: crate::redundancy::PieceId,
        /// Bytes it holds, or why it could not.
        result: Result<u64, String>,
    },
}

/// Messages the controller sends to a manager.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ControllerToManager {
    /// Registration accepted.
    Registered,
    /// Registration refused (e.g. the node name is taken by a live manager).
    Rejected(String),
    /// Answer to a heartbeat: the controller is alive (managers that hear
    /// nothing for the takeover window try the next controller).
    Beat,
    /// Start an agent for an application.
    StartAgent {
        /// Agent id.
        id: u64,
        /// Application it serves.
        app: String,
        /// Bytes of checkpoint memory the node may hold (`max_mem_node`);
        /// a version that does not fit is spilled to the PFS.
        mem_budget: u64,
        /// Who owns the application: the agent admits only sessions that
        /// present its capability.
        owner: crate::credentials::Owner,
        /// The application's newest complete version the controller
        /// recorded: the agent never overwrites or retires it on a rank's word.
        complete: Option<u64>,
        /// Its PFS copies must be encrypted: without the key (from a rank's
        /// `Open`) the agent writes none.
        encrypted: bool,
        /// The application's newest version protected by redundancy: each
        /// rank holds it back from pruning until a newer one is protected
        /// (`DropPieces`), so that a node lost before then costs at most the
        /// unprotected newest version.
        protected: Option<u64>,
    },
    /// Copy the agent's ranks of a complete version to the PFS.
    CopyToPfs {
        /// Agent id.
        agent: u64,
        /// Version.
        version: u64,
        /// How to store it.
        compression: crate::pfs::Compression,
        /// Ranks (MR) or node indices (SHMR) the agent serves: the
        /// controller's mapping, not whoever once opened a session.
        ranks: Vec<u32>,
    },
    /// The application's agents changed and `agent` serves `rank` now:
    /// fetch the rank's `version` from agent `from`, on another node, into
    /// this node's store (over the fabric, verified against its checksums).
    TakeOver {
        /// The agent taking the rank.
        agent: u64,
        /// Rank (MR) or node index (SHMR).
        rank: u32,
        /// The newest complete version.
        version: u64,
        /// The agent that served the rank until now.
        from: AgentInfo,
        /// The controller's number for this request, echoed in `TookOver`.
        request: u64,
    },
    /// Delete ranks of an application from this node's store: they moved to
    /// agents on other nodes.
    DropRanks {
        /// Application.
        app: String,
        /// Ranks (MR) or node indices (SHMR).
        ranks: Vec<u32>,
    },
    /// Stop an agent.
    StopAgent {
        /// Agent id.
        id: u64,
        /// Also delete the application's checkpoints from the node's store.
        discard: bool,
    },
    /// Build a piece of redundancy for a complete version at `agent`, from
    /// the primaries of the ranks it protects (agent to agent, by RMA).
    Protect {
        /// The agent that builds and keeps it.
        agent: u64,
        /// What to build.
        task: PieceTask,
    },
    /// Rebuild `rank`'s `version` at `agent` (its primary was lost with its
    /// node) from copies or the surviving shards of its group.
    Rebuild {
        /// The agent that serves the rank now.
        agent: u64,
        /// Rank (MR) or node index (SHMR).
        rank: u32,
        /// The version.
        version: u64,
        /// Where it is rebuilt from.
        source: RebuildSource,
        /// The controller's number for this request, echoed in `TookOver`.
        request: u64,
    },
    /// The application's `version` is being protected: its agents here
    /// hold it back from pruning until a newer one is protected, so that
    /// the encoders still read it when newer versions complete meanwhile.
    Protecting {
        /// Application.
        app: String,
        /// The version whose pieces are being built.
        version: u64,
    },
    /// Delete the application's pieces of redundancy for versions older
    /// than `below` (a newer one is protected).
    DropPieces {
        /// Application.
        app: String,
        /// The newest protected version.
        below: u64,
    },
    /// The controller no longer counts the application's versions
    /// `above + 1 ..= through` (lost with a node before they were
    /// protected, or dropped by reconciliation) and restarts it from
    /// `above`: delete them here, so that the application writes those
    /// numbers again (an agent never overwrites a stored complete version).
    /// Newer ones (a commit under way) stay.
    DropNewer {
        /// Application.
        app: String,
        /// The version the controller fell back to.
        above: u64,
        /// The newest version lost.
        through: u64,
    },
    /// The pieces of `version` this node holds other than `keep` (what the
    /// protected record places here) are deleted: the version was
    /// protected under a new plan (its old one no longer kept its pieces
    /// apart) and they belong to the old one, or this node's manager came
    /// back after a rebuild made them elsewhere (`keep` is empty for a
    /// version older than the protected one).
    DropStalePieces {
        /// Application.
        app: String,
        /// The version protected anew.
        version: u64,
        /// The new plan's pieces on this node.
        keep: Vec<crate::redundancy::PieceId>,
    },
}

/// Requests of clients (applications and operators).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ClientRequest {
    /// Register an application and get its agents. A known application
    /// must present its capability, from the Unix user that registered it.
    RegisterApp {
        /// The application.
        registration: AppRegistration,
        /// Its capability, if it has one (a restart).
        capability: Option<String>,
        /// The Unix user id of the process (checked against the socket's
        /// owner where the controller can see it).
        uid: u32,
    },
    /// Every rank of `name` has stored `version` at its agents: record it as
    /// the newest complete version.
    VersionComplete {
        /// Application name.
        name: String,
        /// The version.
        version: u64,
        /// Bytes of the version over all ranks.
        bytes: u64,
        /// Seconds the commit took, as the application measured it.
        commit_secs: f64,
        /// Some agent spilled its part to the PFS (memory budget): the
        /// other agents copy theirs, which completes the version there.
        #[serde(default)]
        spilled: bool,
        /// Resize epoch: how many times the application's process count
        /// changed before this version (0 for a rigid application).
        #[serde(default)]
        epoch: u32,
        /// The agents that stored it (their ids, in rank-mapping order).
        /// The controller records it only if they are the application's
        /// agents: a version stored on agents it gave up (their node went
        /// silent) may exist only where it will be deleted. Then it answers
        /// [`ClientReply::Agents`] instead: the application's new agents,
        /// or none while it has not placed them yet (the library asks for
        /// them with a [`ClientRequest::Probe`]).
        #[serde(default)]
        agents: Vec<u64>,
        /// The application's capability.
        capability: String,
        /// How commits move their bytes now, and where `transfer = "auto"`
        /// stands (what `icheck status` shows).
        #[serde(default)]
        transfer: Option<TransferReport>,
    },
    /// Have the application's agents changed? (§6.4.2)
    Probe {
        /// Application name.
        name: String,
        /// Ids of the agents the application uses now.
        agents: Vec<u64>,
        /// Commits the application still expects to make (0 = unknown):
        /// eq. 6.11/6.12 weigh a change's cost against them.
        #[serde(default)]
        remaining_commits: u32,
        /// The application's capability.
        capability: String,
        /// Asked by `init`, before this job committed anything: an agent
        /// it was given could not be reached. New agents then serve a
        /// restart (the job holds no data to store on them), so the
        /// controller answers as it would a registration: a restart of a
        /// version only a silent node holds is refused, naming it.
        #[serde(default)]
        at_init: bool,
        /// Agents (ids) some rank could not reach, or that did not answer
        /// it in time. Where their node still heartbeats to the controller,
        /// the path between the job and that node is cut (a partition only
        /// the job sees): the controller moves those agents to nodes the
        /// job has not reported, taking their newest versions over between
        /// the nodes, and keeps the job's agents off the node for a while.
        #[serde(default)]
        unreachable: Vec<u64>,
    },
    /// The application is done. Without `persist` its agents stop and
    /// delete its checkpoints; with it (IC_PERSIST) both stay for the next run.
    FinishApp {
        /// Application name.
        name: String,
        /// Keep checkpoints in agent memory.
        persist: bool,
        /// The application's capability.
        capability: String,
    },
    /// The whole status (an operator's; a client sees only the
    /// controller's own part).
    Status,
    /// One application's status, for its owner (or an operator).
    AppStatus {
        /// Application name.
        name: String,
        /// The application's capability (unused with the admin token).
        capability: String,
    },
    /// Delete an application's checkpoints everywhere (agent memory and
    /// PFS) and forget it (operators).
    DeleteApp {
        /// Application name.
        name: String,
    },
    /// Drain a checkpoint node (operators): it takes no new agents, and
    /// the agents it runs move to other nodes on their applications' next
    /// probes. `drain: false` opens it again.
    DrainNode {
        /// Node name.
        node: String,
        /// Drain (true) or undrain (false).
        drain: bool,
    },
    /// Copy the application's newest complete version to the PFS now (its
    /// owner or an operator), e.g. at a job's time-limit warning.
    FlushApp {
        /// Application name.
        name: String,
        /// The application's capability (unused with the admin token).
        capability: String,
    },
    /// Give checkpoint nodes back to the resource manager (operators;
    /// Algorithm 9's REMOVE_NODES): the named `nodes`, or else `count`
    /// nodes the controller picks (most free memory, fewest agents). Their
    /// applications' agents move to other nodes first.
    ReleaseNodes {
        /// Nodes to release (empty: let the controller pick `count`).
        nodes: Vec<String>,
        /// How many to pick when `nodes` is empty.
        count: u32,
    },
}

/// Answers to clients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ClientReply {
    /// The application's agents, in rank-mapping order.
    Agents(Vec<AgentInfo>),
    /// Answer to a registration: the agents and the newest complete version.
    Registered {
        /// The agents, in rank-mapping order.
        agents: Vec<AgentInfo>,
        /// Newest complete version, if a checkpoint exists.
        latest: Option<VersionRecord>,
        /// The application's capability: new at a first registration, the
        /// one presented otherwise. Keep it secret; every later request and
        /// agent session presents it.
        capability: String,
    },
    /// Answer to a probe when nothing changed.
    Unchanged,
    /// Done.
    Ok,
    /// The status.
    Status(StatusReport),
    /// One application's status (`None`: the controller does not know it).
    AppStatus(Option<Box<AppReport>>),
    /// The request failed.
    Error(String),
    /// This controller is not (or cannot confirm it still is) the primary;
    /// nothing was done: ask the next controller.
    NotPrimary(String),
    /// These nodes are being released (their agents move away first).
    Releasing(Vec<String>),
    /// Answer to a probe that needs new agents when no checkpoint node can
    /// take them now (none is live, or none has room): nothing changed,
    /// and asking again later may succeed (a silent node comes back).
    NoRoom(String),
}

/// A node as `icheck status` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// Node name.
    pub node: String,
    /// Manager pid.
    pub pid: u32,
    /// Whether heartbeats arrive.
    pub alive: bool,
    /// Seconds since the last heartbeat.
    pub last_heartbeat_secs: f64,
    /// Latest measurements.
    pub status: NodeStatus,
    /// What the controller derives from the node's reports over time.
    #[serde(default)]
    pub trend: crate::monitor::TrendReport,
    /// An operator is draining it (`icheck drain`).
    #[serde(default)]
    pub draining: bool,
    /// Times the controller started its dead manager again (last ten minutes).
    #[serde(default)]
    pub relaunches: u32,
    /// The manager died more often than `ManagerRelaunches` allows: the
    /// controller stopped starting it again (until an operator does).
    #[serde(default)]
    pub given_up: bool,
    /// Why its manager failed to start an agent lately, while the
    /// controller places no agents there (until the quarantine ends or the
    /// manager registers again).
    #[serde(default)]
    pub start_failure: Option<String>,
}

/// An application as `icheck status` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppReport {
    /// The registration.
    pub registration: AppRegistration,
    /// Its agents.
    pub agents: Vec<AgentInfo>,
    /// Latest complete checkpoint version, if any.
    pub latest: Option<VersionRecord>,
    /// Whether the application finished with IC_PERSIST (checkpoints kept).
    pub persisted: bool,
    /// Newest version copied to the PFS by this controller, if any.
    pub pfs_version: Option<u64>,
    /// What the newest completed agent copy to the PFS cost.
    #[serde(default)]
    pub pfs_copy: Option<PfsCopyStats>,
    /// The newest commits, oldest first (at most [`COMMIT_HISTORY`]).
    #[serde(default)]
    pub commits: Vec<CommitSample>,
    /// Changes of the agent count on probes, oldest first.
    #[serde(default)]
    pub agent_changes: Vec<AgentChange>,
    /// Algorithm 5 stopped changing the agent count (a change did not help,
    /// or the count reached its limit).
    #[serde(default)]
    pub scaling_settled: bool,
    /// Agent copies to the PFS that failed or were skipped.
    #[serde(default)]
    pub pfs_health: PfsCopyHealth,
    /// Versions the controller stopped counting as complete, and why (the
    /// journal said complete, but a rank's data was missing or damaged in
    /// every store that reported after a restart, or its node died).
    #[serde(default)]
    pub dropped: Vec<String>,
    /// Its redundancy policy across checkpoint nodes.
    #[serde(default)]
    pub redundancy: crate::redundancy::Redundancy,
    /// Newest version whose redundancy is in place (every copy or parity
    /// shard built), if any.
    #[serde(default)]
    pub protected: Option<u64>,
    /// The version whose redundancy is being built.
    #[serde(default)]
    pub protecting: Option<u64>,
    /// A newer complete version whose redundancy is built once the one
    /// under way ends (one protection at a time per application).
    #[serde(default)]
    pub protection_waiting: Option<u64>,
    /// A rebuild after a lost node is under way.
    #[serde(default)]
    pub rebuilding: bool,
    /// Why the newest version is not protected (or cannot be rebuilt).
    #[serde(default)]
    pub protection_problem: Option<String>,
    /// The newest protections: version and seconds from the version's
    /// record to its last piece built, oldest first.
    #[serde(default)]
    pub protection_secs: Vec<(u64, f64)>,
    /// Probability that the newest version is lost, from the data-loss
    /// model with the configured `node_failure_probability`.
    #[serde(default)]
    pub exposure: Option<f64>,
    /// How its commits move their bytes (the library's report with its
    /// newest version).
    #[serde(default)]
    pub transfer: Option<TransferReport>,
    /// Nodes its job reported it could not reach although they heartbeat
    /// to the controller, and seconds since the newest report: its agents
    /// are placed elsewhere until 10 minutes after it.
    #[serde(default)]
    pub unreached_nodes: Vec<(String, f64)>,
}

/// What went wrong with an application's agent copies to the PFS: every
/// failed or skipped copy is counted here (and in `/metrics`), not only
/// logged, because each one leaves the PFS level a version behind.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PfsCopyHealth {
    /// Copies that failed (an agent could not read or write its ranks, or
    /// the version could not be completed on the PFS).
    pub failed: u64,
    /// Due copies never made: the previous copy was still running, and by
    /// the time it ended a newer version was copied instead (commits come
    /// faster than the PFS takes them).
    pub skipped: u64,
    /// The newest failure: version and reason.
    pub last_failure: Option<String>,
}

impl PfsCopyHealth {
    /// Counts a failed copy of `version`, and why it failed.
    pub fn record_failure(&mut self, version: u64, reason: impl std::fmt::Display) {
        self.failed += 1;
        self.last_failure = Some(format!("version {version}: {reason}"));
    }
}

/// Commits the controller remembers per application.
pub const COMMIT_HISTORY: usize = 64;

/// One complete version as the controller saw it arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommitSample {
    /// Version.
    pub version: u64,
    /// Bytes over all ranks.
    pub bytes: u64,
    /// Seconds the commit took (the application's measurement).
    pub commit_secs: f64,
    /// Agents that received it.
    pub agents: u32,
}

/// How an application's ranks move their data, as its library reports it
/// with each complete version.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferReport {
    /// Commits push now: the library writes into agent memory (rather
    /// than the agents reading the application's).
    pub push: bool,
    /// With `transfer = "auto"`: the measurement behind the choice.
    pub auto: Option<AutoTransfer>,
}

/// Where `transfer = "auto"` stands: measuring, or decided and why.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AutoTransfer {
    /// The faster direction has been chosen for the rest of the run.
    pub decided: bool,
    /// Measured commits so far (of those the choice waits for).
    pub measured: u32,
    /// Commits the measurement takes.
    pub of: u32,
    /// GB/s per rank the agents' reads reached (over every rank's
    /// measured commits), once decided.
    pub pull_gb_per_s: Option<f64>,
    /// GB/s per rank the library's writes reached, once decided.
    pub push_gb_per_s: Option<f64>,
}

impl fmt::Display for TransferReport {
    /// `push (auto: push 2.91 GB/s, pull 2.10 GB/s per rank)`, or
    /// `pull (auto: measuring, 2 of 4 commits)`, or `pull (configured)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let direction = if self.push { "push" } else { "pull" };
        let rate = |r: Option<f64>| r.map_or("not measured".to_string(), |r| format!("{r:.2} GB/s"));
        match self.auto {
            None => write!(f, "{direction} (configured)"),
            Some(auto) if auto.decided => write!(
                f,
                "{direction} (auto: push {}, pull {} per rank)",
                rate(auto.push_gb_per_s),
                rate(auto.pull_gb_per_s)
            ),
            Some(auto) => write!(f, "{direction} (auto: measuring, {} of {} commits)", auto.measured, auto.of),
        }
    }
}

/// A change of an application's agents on a probe (§6.4.2).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentChange {
    /// Newest complete version when the agents changed.
    pub after_version: u64,
    /// Agents before.
    pub from: u32,
    /// Agents after.
    pub to: u32,
    /// Seconds the controller spent: starting agents and moving ranks.
    pub secs: f64,
    /// Bytes moved from old agents to new ones on other nodes.
    pub moved_bytes: u64,
}

/// Bytes and time of a copy to the PFS (one agent's part, or a whole
/// version summed over its agents).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PfsCopyStats {
    /// Version copied.
    pub version: u64,
    /// Bytes before compression.
    pub raw: u64,
    /// Bytes written (after compression).
    pub stored: u64,
    /// Seconds spent compressing (summed over writers).
    pub compress_secs: f64,
    /// Seconds spent writing (summed over writers).
    pub write_secs: f64,
}

impl PfsCopyStats {
    /// Raw bytes per stored byte (1.0 without compression or without data).
    pub fn ratio(&self) -> f64 {
        crate::pfs::compression_ratio(self.raw, self.stored)
    }

    /// Adds another writer's part.
    pub fn add(&mut self, other: &PfsCopyStats) {
        self.raw += other.raw;
        self.stored += other.stored;
        self.compress_secs += other.compress_secs;
        self.write_secs += other.write_secs;
    }
}

/// One piece an agent must read from an application in pull mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullSegment {
    /// Registered application memory.
    pub source: RemoteRegion,
    /// Offset inside `source`.
    pub source_offset: u64,
    /// Where it goes in the rank's data.
    pub file_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A range of a fetched version the agent writes into the restarting
/// rank's registered memory ([`AgentRequest::Deliver`]): the mirror of a
/// [`PullSegment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliverSegment {
    /// Registered application memory, writable by the agent.
    pub destination: RemoteRegion,
    /// Offset inside `destination`.
    pub destination_offset: u64,
    /// Where the bytes are in the rank's data.
    pub file_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Requests of an application rank on an agent session (after the Hello).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentRequest {
    /// Binds the session to one rank of one application.
    Open {
        /// Application name.
        app: String,
        /// Rank.
        rank: u32,
        /// Fabric address of the rank's endpoint.
        address: FabricAddress,
        /// The application's capability (empty on a session of another
        /// agent, which presented the node token instead).
        capability: String,
        /// The key of the application's encrypted PFS copies (kept in the
        /// agent's memory only, for copies, spills and PFS restarts).
        pfs_key: Option<[u8; 32]>,
    },
    /// Starts writing `version`; replies [`AgentReply::Target`].
    Begin {
        /// Version number.
        version: u64,
        /// Process count.
        ranks: u32,
        /// Resize epoch.
        epoch: u32,
        /// Label layout; lengths sum to the total.
        labels: Vec<LabelLayout>,
        /// Whether the rank will fi_write (push) rather than the agent fi_read (pull).
        push: bool,
    },
    /// Pull mode: read these segments from the rank; replies [`AgentReply::Pulled`].
    Pull(Vec<PullSegment>),
    /// All data of the open version is in place: write its manifest with
    /// these checksums; replies [`AgentReply::Sealed`].
    Seal {
        /// Per label: crc32c of each `format::CHUNK_SIZE` chunk, as the rank
        /// computed them from its own memory (an end-to-end check).
        crcs: Vec<Vec<u32>>,
    },
    /// `version` is complete at the controller: older versions of this rank
    /// may go.
    Complete {
        /// The complete version.
        version: u64,
    },
    /// Restart: expose `version` for reading; replies [`AgentReply::Fetch`].
    Fetch {
        /// Version number.
        version: u64,
        /// The rank's host, when it can take the version's file from an
        /// agent on the same host ([`crate::handoff`]); `None` reads over
        /// the fabric.
        reader: Option<crate::handoff::HostId>,
        /// The reader checks every chunk as it arrives (an agent copying
        /// or encoding the version): the agent serves the version without
        /// its own pass over the bytes first, and records no check.
        reader_checks: bool,
    },
    /// The rank has read what Fetch exposed.
    FetchDone,
    /// The session (another agent's, or a restarting rank's) will read
    /// what it fetches while others read this agent too: the agent serves
    /// the session's reads from one of a few endpoints of its own
    /// ([`crate::fabric::Endpoint::sibling`]; under `shm` concurrent
    /// readers of one endpoint take turns on its region's lock) and
    /// replies [`AgentReply::Apart`] with its address, for the session's
    /// reads only; where keys are bound to an endpoint it replies `Ok` and
    /// the reader keeps the agent's address.
    ServeApart,
    /// Another agent (node token only) reads a piece of redundancy this
    /// agent holds for `version`; replies [`AgentReply::Piece`]. Ended,
    /// like a Fetch, by `FetchDone`.
    FetchPiece {
        /// Version number.
        version: u64,
        /// Which piece.
        piece: crate::redundancy::PieceId,
    },
    /// The agent encoding a Reed-Solomon group (node token only) writes
    /// this agent's parity shard of `version`: the agent creates `len`
    /// bytes for it and replies [`AgentReply::Target`], writable by the
    /// encoder until `SealPiece` (or the session's end, which discards it).
    PutPiece {
        /// Version number.
        version: u64,
        /// Which piece (a parity shard).
        piece: crate::redundancy::PieceId,
        /// Bytes of the shard.
        len: u64,
    },
    /// The piece `PutPiece` opened is written: the agent checks its bytes
    /// against `meta` and keeps both; replies [`AgentReply::Ok`].
    SealPiece {
        /// What the piece is (its stripe checksums, as the encoder computed them).
        meta: PieceMeta,
    },
    /// The rank's first version will hold about `len` bytes: the agent may
    /// back and map a file of that size in the background, while the
    /// application computes, instead of inside the first commit. A hint:
    /// replies [`AgentReply::Ok`] whatever it does.
    Prepare {
        /// Bytes of the rank's labels so far.
        len: u64,
    },
    /// An incremental commit: as `Begin`, but only the blocks in `changed`
    /// (see [`crate::delta`]) differ from `parent`, the rank's previous
    /// version at this agent. When the agent holds `parent` sealed with the
    /// same length, it replies [`AgentReply::DeltaTarget`] and the rank
    /// sends the changed blocks packed back to back; otherwise it begins a
    /// whole version as `Begin` does and replies [`AgentReply::Target`].
    BeginDelta {
        /// Version number.
        version: u64,
        /// Process count.
        ranks: u32,
        /// Resize epoch.
        epoch: u32,
        /// Label layout; lengths sum to the total.
        labels: Vec<LabelLayout>,
        /// Whether the rank will fi_write (push) rather than the agent fi_read (pull).
        push: bool,
        /// The version the unchanged blocks are taken from.
        parent: u64,
        /// The changed blocks, in order.
        changed: Vec<crate::delta::BlockRun>,
    },
    /// Restart with the agent pushing (`restore = "push"`): write these
    /// ranges of the version `Fetch` exposed into the rank's memory, each
    /// delivered (in the rank's memory) before the reply; replies
    /// [`AgentReply::Delivered`]. The rank checks the bytes against the
    /// manifest's checksums itself, as after a read.
    Deliver(Vec<DeliverSegment>),
}

/// What a stored piece of redundancy is: written beside its data, and all
/// a rebuild needs besides the survivors' bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PieceMeta {
    /// A whole copy of a rank's version; the data verifies against it.
    Copy(Manifest),
    /// A parity shard of a Reed-Solomon group.
    Parity(ParityMeta),
    /// A slice of the one member of a sliced group (appended last: pieces
    /// stored before it existed still decode).
    Slice(SliceMeta),
}

impl PieceMeta {
    /// Checks that this describes `piece` of `app`'s `version` (from a file
    /// or a peer, before any length in it is used) and returns the bytes of
    /// its data.
    pub fn check(&self, app: &str, version: u64, piece: crate::redundancy::PieceId) -> Result<u64, String> {
        use crate::redundancy::PieceId;
        match (self, piece) {
            (PieceMeta::Copy(manifest), PieceId::Copy { rank })
                if manifest.app == app && manifest.rank == rank && manifest.version == version =>
            {
                manifest.validate().map_err(|e| e.to_string())?;
                Ok(manifest.total_len)
            }
            (PieceMeta::Parity(parity), PieceId::Parity { group, index })
                if parity.app == app && parity.version == version && parity.group == group && parity.index == index =>
            {
                parity.validate()?;
                Ok(parity.shard_len)
            }
            (PieceMeta::Slice(slice), PieceId::Slice { group, index })
                if slice.manifest.app == app
                    && slice.manifest.version == version
                    && slice.group == group
                    && slice.index == index =>
            {
                let (start, end) = slice.bounds()?;
                Ok(end - start)
            }
            _ => Err("it describes another piece".into()),
        }
    }
}

/// A parity shard's description.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParityMeta {
    /// Application.
    pub app: String,
    /// Version.
    pub version: u64,
    /// The group, in the plan's order.
    pub group: u32,
    /// This shard's index among the group's parity shards.
    pub index: u8,
    /// Parity shards of the group (M).
    pub parity: u8,
    /// Bytes of every shard of the group (the longest member or slice,
    /// rounded up to even; shorter ones count as zero-padded).
    pub shard_len: u64,
    /// Each member's manifest in shard order (`None`: no rank there): what
    /// a member rebuilt from the shards is verified against. The code is
    /// over the present members only, in this order (K' data shards,
    /// K' ≤ K; a plan lists present ranks only, so today K' is the
    /// group's length). A sliced group lists its one member K times, one
    /// entry per slice ([`ParityMeta::data_shards`]).
    pub members: Vec<Option<Manifest>>,
    /// crc32c of each [`STRIPE`] of this shard's bytes.
    pub crcs: Vec<u32>,
}

impl ParityMeta {
    /// Each data shard's rank and byte range of it, in shard order
    /// ([`data_shard_ranges`]: one rank listed K times is a sliced group).
    pub fn data_shards(&self) -> Vec<Option<(&Manifest, (u64, u64))>> {
        let members: Vec<Option<&Manifest>> = self.members.iter().map(Option::as_ref).collect();
        members.iter().zip(data_shard_ranges(&members)).map(|(m, range)| m.zip(range)).collect()
    }
}

/// Bytes of each shard coded at once: parity is built and decoded a stripe
/// at a time, through buffers of this size.
pub const STRIPE: u64 = 1 << 20;

/// The byte range of its rank that each data shard of a group holds, in
/// shard order, for members listed as a parity shard's description and a
/// task list them (`None`: a shard of zeros): a whole member each, or,
/// where every entry is the same rank (K ≥ 2 of them), that rank's K
/// slices ([`Manifest::slices`]): a sliced group.
pub fn data_shard_ranges(members: &[Option<&Manifest>]) -> Vec<Option<(u64, u64)>> {
    match sliced_member(members) {
        Some(manifest) => manifest.slices(members.len()).into_iter().map(Some).collect(),
        None => members.iter().map(|m| m.map(|m| (0, m.total_len))).collect(),
    }
}

/// The one member of a sliced group: every entry present and the same rank,
/// listed at least twice.
pub fn sliced_member<'a>(members: &[Option<&'a Manifest>]) -> Option<&'a Manifest> {
    one_rank_listed_again(members, |m| m.rank).copied()
}

/// The first of `entries` when every entry is present and of the same rank
/// (`rank_of`), and there are two or more: how a sliced group's one member
/// is listed, once per slice.
fn one_rank_listed_again<T>(entries: &[Option<T>], rank_of: impl Fn(&T) -> u32) -> Option<&T> {
    let first = entries.first()?.as_ref()?;
    let same = |entry: &Option<T>| entry.as_ref().is_some_and(|entry| rank_of(entry) == rank_of(first));
    (entries.len() >= 2 && entries.iter().all(same)).then_some(first)
}

/// A slice's description: the rank's manifest (its bytes verify against
/// the rank's chunk checksums, since slices are cut on chunk boundaries),
/// and which of the group's slices it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceMeta {
    /// The sliced rank's manifest.
    pub manifest: Manifest,
    /// The group, in the plan's order.
    pub group: u32,
    /// This slice (1..slices; 0 is the primary's own).
    pub index: u8,
    /// Slices the rank is cut into (the group's K).
    pub slices: u8,
}

impl SliceMeta {
    /// The slice's byte range of the rank, after checking what a peer or a
    /// file says: a valid manifest, and a slice index in range.
    pub fn bounds(&self) -> Result<(u64, u64), String> {
        self.manifest.validate().map_err(|e| e.to_string())?;
        if self.slices < 2 || self.slices > crate::redundancy::MAX_DATA_SHARDS || self.index >= self.slices {
            return Err(format!("slice {} of {}", self.index, self.slices));
        }
        Ok(self.manifest.slices(usize::from(self.slices))[usize::from(self.index)])
    }
}

impl ParityMeta {
    /// Checks what a peer or a file says before its lengths are used: K
    /// and M in range, every member a valid manifest of this version no
    /// longer than the shard, one checksum per stripe.
    pub fn validate(&self) -> Result<(), String> {
        let k = self.members.len();
        if k == 0 || k > usize::from(crate::redundancy::MAX_DATA_SHARDS) {
            return Err(format!("{k} data shards"));
        }
        if self.parity == 0 || self.parity > crate::redundancy::MAX_PARITY_SHARDS || self.index >= self.parity {
            return Err(format!("parity shard {} of {}", self.index, self.parity));
        }
        if !self.shard_len.is_multiple_of(2) || self.shard_len == 0 {
            return Err(format!("shard length {} is not a positive even number", self.shard_len));
        }
        for member in self.members.iter().flatten() {
            member.validate().map_err(|e| e.to_string())?;
            if member.app != self.app || member.version != self.version {
                return Err(format!("member rank {} does not belong to this group", member.rank));
            }
        }
        for (manifest, (start, end)) in self.data_shards().into_iter().flatten() {
            if end - start > self.shard_len {
                return Err(format!("member rank {} does not fit the group's shards", manifest.rank));
            }
        }
        if self.crcs.len() as u64 != self.shard_len.div_ceil(STRIPE) {
            return Err(format!("{} stripe checksums for {} bytes", self.crcs.len(), self.shard_len));
        }
        Ok(())
    }
}

/// A piece of redundancy to build at an agent ([`ControllerToManager::Protect`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceTask {
    /// The complete version it protects.
    pub version: u64,
    /// Which protection of the application asked for it, echoed in the
    /// answer ([`ManagerToController::Protected`]). One version can be
    /// protected twice (a rebuild asks again after a second node is lost),
    /// and a late failure of the first attempt must not end the second.
    pub attempt: u64,
    /// The piece.
    pub piece: crate::redundancy::PieceId,
    /// The ranks it is made of, in shard order, each with the agent holding
    /// its primary copy (`None`: a shard of zeros). A copy and a slice
    /// have one; a sliced group's parity lists its one rank K times.
    pub members: Vec<Option<(u32, AgentInfo)>>,
    /// Parity shards of the group (M; 0 for a copy).
    pub parity: u8,
    /// For parity shard 0 of a group with M > 1: the holders of shards
    /// 1..M, in order. Its agent encodes the group once and writes their
    /// shards to them, instead of every holder reading all K members. For
    /// a sliced group the task goes to the rank's primary's agent, which
    /// encodes from its own memory and keeps none: `also` then lists the
    /// holders of all M shards ([`PieceTask::keeps_nothing`]).
    pub also: Vec<AgentInfo>,
}

impl PieceTask {
    /// The one rank of a sliced group and its primary's agent, when the
    /// task lists that rank once per slice ([`sliced_member`]).
    pub fn sliced_member(&self) -> Option<&(u32, AgentInfo)> {
        one_rank_listed_again(&self.members, |(rank, _)| *rank)
    }

    /// Whether the building agent writes every parity shard to another
    /// holder and keeps none (a sliced group's encoder, at its primary).
    pub fn keeps_nothing(&self) -> bool {
        matches!(self.piece, crate::redundancy::PieceId::Parity { .. })
            && self.parity > 0
            && self.also.len() == usize::from(self.parity)
    }

    /// The pieces a task built at `agent` answers for, each with the agent
    /// holding it: its own piece (unless it keeps nothing), then the parity
    /// shards it writes to the holders in `also`.
    pub fn answers(&self, agent: u64) -> Vec<(u64, crate::redundancy::PieceId)> {
        use crate::redundancy::PieceId;
        let mut answers = Vec::with_capacity(1 + self.also.len());
        if !self.keeps_nothing() {
            answers.push((agent, self.piece));
        }
        if let PieceId::Parity { group, index } = self.piece {
            let first = if self.keeps_nothing() { 0 } else { index + 1 };
            answers.extend(self.also.iter().enumerate().map(|(j, holder)| {
                let index = first.saturating_add(u8::try_from(j).unwrap_or(u8::MAX));
                (holder.id, PieceId::Parity { group, index })
            }));
        }
        answers
    }
}

/// Where a lost rank's version is rebuilt from ([`ControllerToManager::Rebuild`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RebuildSource {
    /// Copies of the rank, at these agents (tried in order).
    Copies(Vec<AgentInfo>),
    /// The rank's Reed-Solomon group.
    Decode {
        /// The group, in the plan's order.
        group: u32,
        /// The rank's shard index in the group.
        shard: u8,
        /// The group's members in shard order with the agents holding their
        /// primaries: `None` for zeros, and no agent for a lost one.
        members: Vec<Option<(u32, Option<AgentInfo>)>>,
        /// The agents holding each parity shard (`None`: lost).
        parity: Vec<Option<AgentInfo>>,
    },
    /// The rank is the one member of a sliced group (appended last): its
    /// surviving slices and parity shards.
    Slices {
        /// The group, in the plan's order.
        group: u32,
        /// The agents holding slices 1..K (`None`: lost); slice 0 was in
        /// the lost primary.
        slices: Vec<Option<AgentInfo>>,
        /// The agents holding each parity shard (`None`: lost).
        parity: Vec<Option<AgentInfo>>,
    },
}

/// What a Fetch is for: the version asked for, and the application and
/// rank (or SHMR node index) its data must belong to.
#[derive(Clone, Copy, Debug)]
pub struct FetchWanted<'a> {
    /// The application.
    pub app: &'a str,
    /// The rank (the node index in SHMR mode).
    pub rank: u32,
    /// The version asked for.
    pub version: u64,
}

/// An agent's answer to Fetch, checked by [`check_fetched`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// The manifest, validated: its offsets and lengths may be used.
    pub manifest: Manifest,
    /// The exposed data; holds at least `manifest.total_len` bytes.
    pub region: RemoteRegion,
    /// What the agent found damaged, if anything (see [`AgentReply::Fetch`]).
    pub damaged: Option<String>,
    /// The version's file, offered to a reader on the agent's host.
    pub handoff: Option<crate::handoff::Handoff>,
}

/// Why an agent's answer to Fetch cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FetchRefused {
    /// The agent answered with an error.
    #[error("{0}")]
    Agent(String),
    /// The agent answered something other than Fetch.
    #[error("unexpected answer to Fetch: {0}")]
    Unexpected(String),
    /// The manifest contradicts itself.
    #[error("the manifest is unusable: {0}")]
    Manifest(#[from] crate::format::FormatError),
    /// The manifest is valid but describes other data than asked for.
    #[error("asked for version {wanted} of rank {rank} of {app:?}, the manifest describes {got}")]
    OtherData {
        /// Application asked for.
        app: String,
        /// Rank asked for.
        rank: u32,
        /// Version asked for.
        wanted: u64,
        /// What the manifest describes.
        got: String,
    },
    /// The exposed region is shorter than the manifest's data.
    #[error("the exposed region holds {region} bytes, the manifest describes {total}")]
    ShortRegion {
        /// Bytes exposed.
        region: u64,
        /// Bytes the manifest describes.
        total: u64,
    },
}

/// The one gate every answer to Fetch passes before anything in it is used:
/// a restarting rank's, an SHMR node leader's, and an agent taking a rank
/// over from a peer agent. A damaged or hostile manifest is a typed error
/// here, never an out-of-range offset later.
pub fn check_fetched(reply: AgentReply, wanted: FetchWanted<'_>) -> Result<Fetched, FetchRefused> {
    let (manifest, region, damaged, handoff) = match reply {
        AgentReply::Fetch { manifest, region, damaged, handoff } => (manifest, region, damaged, handoff),
        AgentReply::Error(message) => return Err(FetchRefused::Agent(message)),
        other => return Err(FetchRefused::Unexpected(format!("{other:?}"))),
    };
    manifest.validate()?;
    if manifest.app != wanted.app || manifest.rank != wanted.rank || manifest.version != wanted.version {
        return Err(FetchRefused::OtherData {
            app: wanted.app.to_string(),
            rank: wanted.rank,
            wanted: wanted.version,
            got: format!("version {} of rank {} of {:?}", manifest.version, manifest.rank, manifest.app),
        });
    }
    if region.len < manifest.total_len {
        return Err(FetchRefused::ShortRegion { region: region.len, total: manifest.total_len });
    }
    Ok(Fetched { manifest, region, damaged, handoff })
}

/// Answers of an agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentReply {
    /// Done.
    Ok,
    /// The registered memory the version goes into.
    Target(RemoteRegion),
    /// The registered memory an incremental version's changed blocks go
    /// into, packed back to back in the order of `BeginDelta`'s runs.
    DeltaTarget(RemoteRegion),
    /// Pull finished.
    Pulled {
        /// Bytes read.
        bytes: u64,
    },
    /// The version is stored; its manifest.
    Sealed(Manifest),
    /// The version did not fit the node's memory budget and was written to
    /// the PFS as it arrived (thesis agent-side step 4); its manifest.
    Spilled(Manifest),
    /// The version's manifest and the registered memory holding its data.
    Fetch {
        /// The manifest.
        manifest: Manifest,
        /// The data, readable by the rank.
        region: RemoteRegion,
        /// Set when the stored bytes do not match the rank's checksums and
        /// no PFS copy could replace them: what is damaged. The data is
        /// exposed all the same (intact labels still verify on restore).
        damaged: Option<String>,
        /// Offered to a reader on the agent's host: the version's file,
        /// read-only (the region is exposed over the fabric only when
        /// this is `None`).
        handoff: Option<crate::handoff::Handoff>,
    },
    /// The request failed.
    Error(String),
    /// The endpoint that serves this session's reads from now on
    /// (answers [`AgentRequest::ServeApart`]).
    Apart(FabricAddress),
    /// A piece of redundancy and the registered memory holding its data.
    Piece {
        /// What the piece is.
        meta: PieceMeta,
        /// Its data, readable by the asking agent.
        region: RemoteRegion,
    },
    /// Deliver finished: every byte is in the rank's memory.
    Delivered {
        /// Bytes written.
        bytes: u64,
    },
    /// Answer to a pushed `Begin` (or `BeginDelta`) on a node whose
    /// checkpoint memory is full: the agent spills the version to the PFS
    /// as it arrives, which it can only do for bytes it reads itself, so
    /// the rank moves this version with `Pull` instead of writing it.
    SpillByPull,
}

/// Everything the controller knows, for `icheck status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Checkpoint nodes.
    pub nodes: Vec<NodeReport>,
    /// Applications.
    pub apps: Vec<AppReport>,
    /// The dynamic configuration in force.
    pub init_agent_count: String,
    /// The controller's journal (absent when it runs without a state
    /// directory, and then remembers nothing across a restart).
    #[serde(default)]
    pub journal: Option<Box<JournalReport>>,
    /// Which controller answered, its epoch and its standby.
    #[serde(default)]
    pub controller: Option<Box<ControllerReport>>,
}

/// The controller that answered a status request, for operators.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ControllerReport {
    /// Its address (as configured).
    pub address: String,
    /// Its fencing epoch (raised by every takeover).
    pub epoch: u64,
    /// Every configured controller, in the order they are tried.
    pub controllers: Vec<String>,
    /// Whether it may act now (its standby answered within the lease, or
    /// it runs without one).
    pub lease: bool,
    /// Why it may act, or why not, in words.
    pub lease_reason: String,
    /// The standby following its journal, if one is attached.
    pub standby: Option<StandbyReport>,
    /// When its epoch began by a takeover (Unix ms), if it did.
    pub took_over_unix_ms: Option<u64>,
    /// Takeovers this journal has seen.
    pub takeovers: u64,
}

impl ControllerReport {
    /// A standby follows this primary's journal and the primary holds its
    /// lease: a takeover could happen now without losing anything.
    pub fn standby_follows(&self) -> bool {
        self.lease && self.standby.is_some()
    }
}

/// A standby controller as the primary sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StandbyReport {
    /// Its address.
    pub peer: String,
    /// Journal events sent to it and not yet acknowledged as durable.
    pub lag_events: u64,
    /// Seconds since it last acknowledged a heartbeat.
    pub last_ack_secs: f64,
}

/// The controller's journal, for operators.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalReport {
    /// The file.
    pub path: String,
    /// Events in it.
    pub records: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// Controller processes that used it, this one included.
    pub incarnation: u32,
    /// What was wrong with it when this controller started, if anything
    /// (a truncated or corrupted tail: the valid prefix was used).
    pub damage: Option<String>,
}

/// A sealed piece of redundancy in a manager's store, as the manager
/// announces it (its description checked, its data file long enough; the
/// data itself is checked when a rebuild reads it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredPiece {
    /// Application.
    pub app: String,
    /// The version it protects.
    pub version: u64,
    /// Which piece.
    pub piece: crate::redundancy::PieceId,
}

/// A sealed version in a manager's store, as the manager announces it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredVersion {
    /// Application.
    pub app: String,
    /// Rank (MR) or node index (SHMR): the file's writer.
    pub rank: u32,
    /// Version.
    pub version: u64,
    /// Writers of the version (the manifest's `ranks`).
    pub writers: u32,
    /// CRC-32C of the manifest file's bytes.
    pub manifest_crc: u32,
    /// Why the data does not verify against the manifest, if it does not.
    pub damage: Option<String>,
}

#[cfg(test)]
// Fixtures cut counters into bytes on purpose.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    #[test]
    fn transfer_reports_read_as_the_status_prints_them() {
        let configured = TransferReport { push: false, auto: None };
        assert_eq!(configured.to_string(), "pull (configured)");
        let measuring = AutoTransfer { decided: false, measured: 2, of: 4, pull_gb_per_s: None, push_gb_per_s: None };
        let report = TransferReport { push: true, auto: Some(measuring) };
        assert_eq!(report.to_string(), "push (auto: measuring, 2 of 4 commits)");
        let decided = AutoTransfer { decided: true, pull_gb_per_s: Some(2.104), push_gb_per_s: Some(2.9), ..measuring };
        let report = TransferReport { push: true, auto: Some(decided) };
        assert_eq!(report.to_string(), "push (auto: push 2.90 GB/s, pull 2.10 GB/s per rank)");
        let unmeasured = AutoTransfer { push_gb_per_s: None, ..decided };
        let report = TransferReport { push: false, auto: Some(unmeasured) };
        assert_eq!(report.to_string(), "pull (auto: push not measured, pull 2.10 GB/s per rank)");
    }

    /// A hostile or damaged agent's answer to Fetch, as the bytes a rank or
    /// a peer agent receives: every damaged manifest is a typed refusal.
    #[test]
    fn damaged_manifests_in_fetch_answers_are_refused_at_the_gate() {
        let data: Vec<u8> = (0..(9u32 << 20) + 7).map(|i| i.to_le_bytes()[0]).collect();
        let good = crate::format::samples::manifest(&data);
        let region = RemoteRegion { addr: 0, key: 1, len: data.len() as u64 };
        let wanted = FetchWanted { app: &good.app, rank: good.rank, version: good.version };
        let received = |manifest: Manifest, region: RemoteRegion| -> AgentReply {
            decode(&encode(&AgentReply::Fetch { manifest, region, damaged: None, handoff: None }).unwrap()).unwrap()
        };
        let fetched = check_fetched(received(good.clone(), region), wanted).unwrap();
        assert_eq!((fetched.manifest, fetched.region), (good.clone(), region));
        for (what, manifest) in crate::format::samples::damaged_manifests(&data) {
            let err = check_fetched(received(manifest, region), wanted).unwrap_err();
            assert!(matches!(err, FetchRefused::Manifest(_) | FetchRefused::OtherData { .. }), "{what}: {err}");
        }
        let short = RemoteRegion { len: 10, ..region };
        let err = check_fetched(received(good.clone(), short), wanted).unwrap_err();
        assert!(matches!(err, FetchRefused::ShortRegion { region: 10, .. }), "{err}");
        for other in [FetchWanted { version: 2, ..wanted }, FetchWanted { rank: 0, ..wanted }] {
            let err = check_fetched(received(good.clone(), region), other).unwrap_err().to_string();
            assert!(err.contains("the manifest describes version 3 of rank 1"), "{err}");
        }
        let err = check_fetched(AgentReply::Error("gone".into()), wanted).unwrap_err();
        assert_eq!(err.to_string(), "gone");
        assert!(matches!(check_fetched(AgentReply::Ok, wanted), Err(FetchRefused::Unexpected(_))));
    }

    #[test]
    fn round_trip_and_trailing_bytes() {
        let registration = AppRegistration {
            name: "heat2d".into(),
            ranks: 4,
            nodes: 2,
            ranks_per_node: 2,
            mode: TransferMode::Mr,
            pfs_interval: 0,
            compression: crate::pfs::CompressionPolicy::Never,
            encrypted: false,
            redundancy: None,
        };
        let msg = ClientRequest::RegisterApp { registration, capability: Some("00ff".repeat(8)), uid: 1000 };
        let mut bytes = encode(&msg).unwrap();
        assert_eq!(decode::<ClientRequest>(&bytes).unwrap(), msg);
        bytes.push(0);
        assert!(decode::<ClientRequest>(&bytes).is_err());
    }

    /// A reader that hands out its bytes a few at a time and then says
    /// "would block", as a non-blocking socket does.
    struct Trickle {
        bytes: Vec<u8>,
        step: usize,
        ready: bool,
    }

    impl std::io::Read for Trickle {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            self.ready = !self.ready;
            if !self.ready {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            if self.bytes.is_empty() {
                return Ok(0);
            }
            let n = self.step.min(out.len()).min(self.bytes.len());
            out[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes.drain(..n);
            Ok(n)
        }
    }

    fn framed(message: &Hello) -> Vec<u8> {
        let mut frame = Vec::new();
        send_blocking(&mut frame, message).unwrap();
        frame
    }

    #[test]
    fn frame_assembler_collects_a_frame_over_many_partial_reads() {
        let hello = Hello::new("secret", Role::Client);
        for step in [1, 3, 4, 7, 1000] {
            let mut reader = Trickle { bytes: framed(&hello), step, ready: false };
            let mut assembler = FrameAssembler::new(4096);
            let payload = loop {
                if let Some(payload) = assembler.poll(&mut reader).unwrap() {
                    break payload;
                }
            };
            assert_eq!(decode::<Hello>(&payload).unwrap(), hello, "step {step}");
        }
    }

    #[test]
    fn frame_assembler_refuses_oversized_and_truncated_frames() {
        let mut big = Trickle { bytes: 5000u32.to_le_bytes().to_vec(), step: 4, ready: false };
        let mut assembler = FrameAssembler::new(4096);
        let outcome = loop {
            match assembler.poll(&mut big) {
                Ok(None) => continue,
                other => break other,
            }
        };
        assert!(matches!(outcome, Err(ProtocolError::FrameTooLarge(5000))), "{outcome:?}");
        let mut frame = framed(&Hello::new("secret", Role::Client));
        frame.truncate(frame.len() - 2);
        let mut short = Trickle { bytes: frame, step: 5, ready: false };
        let mut assembler = FrameAssembler::new(4096);
        let outcome = loop {
            match assembler.poll(&mut short) {
                Ok(None) => continue,
                other => break other,
            }
        };
        assert!(matches!(outcome, Err(ProtocolError::Closed)), "{outcome:?}");
    }

    #[test]
    fn random_bytes_never_panic() {
        // Fixed-seed xorshift; every length up to 64 and some larger.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..20_000 {
            let len = if round % 10 == 0 { 1000 } else { round % 64 };
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = decode::<ClientRequest>(&bytes);
            let _ = decode::<ManagerToController>(&bytes);
            let _ = decode::<ControllerToManager>(&bytes);
            let _ = decode::<Hello>(&bytes);
        }
    }

    #[test]
    fn huge_length_prefix_inside_a_frame_is_bounded() {
        // A string claiming 2^60 bytes must fail, not allocate.
        let mut bytes = vec![0u8]; // variant 0: RegisterApp
        bytes.push(0xff); // varint marker for u64
        bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(decode::<ClientRequest>(&bytes).is_err());
    }

    #[test]
    fn tokens_decide_the_privilege_and_nodes_need_the_node_token() {
        let accepted = [(Privilege::Client, "c"), (Privilege::Admin, "a"), (Privilege::Node, "n")];
        assert_eq!(admit_hello(&Hello::new("c", Role::Client), &accepted), Ok(Privilege::Client));
        assert_eq!(admit_hello(&Hello::new("a", Role::Client), &accepted), Ok(Privilege::Admin));
        assert_eq!(admit_hello(&Hello::new("n", Role::Manager), &accepted), Ok(Privilege::Node));
        assert_eq!(admit_hello(&Hello::new("n", Role::Standby), &accepted), Ok(Privilege::Node));
        // A fake manager with the client (or admin) token is refused.
        let refused = admit_hello(&Hello::new("c", Role::Manager), &accepted).unwrap_err();
        assert!(refused.contains("node token"), "{refused}");
        assert!(admit_hello(&Hello::new("a", Role::Standby), &accepted).is_err());
        assert!(admit_hello(&Hello::new("x", Role::Client), &accepted).unwrap_err().contains("wrong token"));
    }

    #[test]
    fn hello_checks_magic_version_and_token() {
        let check_hello = |hello: &Hello, token: &str| admit_hello(hello, &[(Privilege::Client, token)]);
        assert!(check_hello(&Hello::new("s3cret", Role::Client), "s3cret").is_ok());
        assert!(check_hello(&Hello::new("wrong", Role::Client), "s3cret").unwrap_err().contains("wrong token"));
        assert!(check_hello(&Hello::new("s3cret1", Role::Client), "s3cret").is_err());
        let mut old = Hello::new("s3cret", Role::Client);
        old.version = 0;
        assert!(check_hello(&old, "s3cret").unwrap_err().contains("version 0"));
        old.magic = *b"HTTP";
        assert!(check_hello(&old, "s3cret").unwrap_err().contains("magic"));
    }
}
