//! Configuration files (thesis §6.3.6): a static file read once (Listing 6.3)
//! and a dynamic file re-read every `readInterval` seconds (Listing 6.2).
//! Both are TOML and keep the thesis's key names.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fabric::FabricConfig;

/// Environment variable that overrides the `Token` key.
pub const TOKEN_ENV: &str = "ICHECK_TOKEN";
/// Environment variable that overrides the `AdminToken` key.
pub const ADMIN_TOKEN_ENV: &str = "ICHECK_ADMIN_TOKEN";
/// Environment variable that overrides the `NodeToken` key.
pub const NODE_TOKEN_ENV: &str = "ICHECK_NODE_TOKEN";
/// Environment variable a manager takes its agents' address from (over
/// `AgentAddress`): one configuration file for every checkpoint node.
pub const AGENT_ADDRESS_ENV: &str = "ICHECK_AGENT_ADDRESS";
/// Environment variable that overrides `client.capability_dir`.
pub const CAPABILITY_DIR_ENV: &str = "ICHECK_CAPABILITY_DIR";
/// Environment variable that overrides `client.encryption`.
pub const ENCRYPTION_ENV: &str = "ICHECK_ENCRYPTION";
/// Environment variable that overrides `client.redundancy`.
pub const REDUNDANCY_ENV: &str = "ICHECK_REDUNDANCY";
/// Environment variable holding a user-supplied key for encrypted PFS
/// copies (64 hex digits) instead of the one derived from the capability.
pub const ENCRYPTION_KEY_ENV: &str = "ICHECK_ENCRYPTION_KEY";

/// The secrets a daemon runs with, each checked (not empty, not a
/// placeholder, all different).
#[derive(Clone, PartialEq, Eq)]
pub struct DaemonTokens {
    /// Admits applications (registration) and agent sessions' Hellos.
    pub client: String,
    /// Admits operators' commands (delete, drain, full status, `/metrics`).
    pub admin: String,
    /// Admits managers and standby controllers.
    pub node: String,
    /// Admits a Prometheus scraper to `/metrics` (read-only), if set.
    pub metrics: Option<String>,
}

impl std::fmt::Debug for DaemonTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DaemonTokens(..)")
    }
}

/// Why a configuration file was rejected. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {file}: {error}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        error: std::io::Error,
    },
    /// The file is not valid TOML for this schema (the message names the key
    /// and the line).
    #[error("configuration file {file}: {message}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// toml's description, with key, line and what was expected.
        message: String,
    },
    /// A key has a value outside its allowed range.
    #[error("configuration file {file}: key `{key}`: {expected}")]
    Invalid {
        /// The file.
        file: PathBuf,
        /// The offending key.
        key: &'static str,
        /// What was expected.
        expected: String,
    },
    /// A key asks for something this build does not do.
    #[error("configuration file {file}: key `{key}`: not supported: {why}")]
    Unsupported {
        /// The file.
        file: PathBuf,
        /// The offending key.
        key: &'static str,
        /// What is missing, and what to set instead.
        why: &'static str,
    },
}

fn read(file: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(file).map_err(|error| ConfigError::Read { file: file.to_path_buf(), error })
}

fn parse<T: serde::de::DeserializeOwned>(file: &Path, text: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|err| ConfigError::Parse { file: file.to_path_buf(), message: err.to_string() })
}

/// The static configuration (Listing 6.3), read once at start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticConfig {
    /// Where the controller listens and clients and managers connect: one
    /// host (with `ControllerPort`), or the list of controllers in the
    /// order everyone tries them, `["host1:7777", "host2:7777"]` (a
    /// primary and its standby; an entry without a port uses
    /// `ControllerPort`).
    #[serde(rename = "ControllerAddress", default)]
    pub controller_address: ControllerAddress,
    /// Controller TCP port; 0 lets the controller pick a free one and write it
    /// to `controller.addr` in its state directory.
    #[serde(rename = "ControllerPort", default = "default_port")]
    pub controller_port: u16,
    /// Port of the controller's Prometheus endpoint (`GET /metrics`) on
    /// `ControllerAddress`; 0 picks a free one; absent: no endpoint.
    #[serde(rename = "MetricsPort", default)]
    pub metrics_port: Option<u16>,
    /// Checkpoint nodes expected to run a manager (informational for now:
    /// managers announce themselves).
    #[serde(rename = "iCheckManagerNode", default)]
    pub manager_nodes: Vec<String>,
    /// Seconds between manager heartbeats.
    #[serde(rename = "HeartBeatInterval", default = "default_heartbeat")]
    pub heartbeat_interval: f64,
    /// Seconds between manager status messages.
    #[serde(rename = "StatusMessageInterval", default = "default_status")]
    pub status_interval: f64,
    /// Heartbeats a manager may miss before the controller marks it down.
    #[serde(rename = "MissedHeartbeats", default = "default_missed")]
    pub missed_heartbeats: u32,
    /// Seconds a standby controller hears nothing from the primary before
    /// it takes over (and the primary's lease: it acts only while its
    /// standby answered within half of it). Unset: `HeartBeatInterval` ×
    /// `MissedHeartbeats`.
    #[serde(rename = "TakeoverAfter", default)]
    pub takeover_after: Option<f64>,
    /// Seconds an authenticated client connection (to the controller, or a
    /// rank's session with its agent) may wait idle before the daemon closes
    /// it. The library notices a closed connection and opens a new one, so
    /// this bounds what idle clients hold, not how long jobs compute.
    #[serde(rename = "ClientIdleTimeout", default = "default_client_idle")]
    pub client_idle_timeout: f64,
    /// Failure domains of the checkpoint nodes (a rack, a power group):
    /// node name → group. Redundancy places an application's copies and
    /// parity shards in other groups than the data they protect where it can.
    #[serde(rename = "NodeGroup", default)]
    pub node_groups: std::collections::BTreeMap<String, String>,
    /// Times the controller starts a dead manager again within ten minutes
    /// (through its launcher) before it gives the node up for good.
    #[serde(rename = "ManagerRelaunches", default = "default_relaunches")]
    pub manager_relaunches: u32,
    /// Seconds a manager may stay silent (no heartbeat) while its process
    /// lives before the controller kills it through its launcher, so that
    /// it is started again with the store it kept (a stopped or hung
    /// manager otherwise stays down for good, and the versions in its
    /// memory with it). 0: never.
    #[serde(rename = "KillSilentManagerAfter", default = "default_kill_silent")]
    pub kill_silent_manager_after: f64,
    /// The thesis's resource manager host (Listing 6.3). Read so that its
    /// configuration files load, and not used: icheck asks Slurm for
    /// checkpoint nodes through Slurm's own commands (`icheck up --slurm`,
    /// `icheck controller --launcher slurm`). The controller says so at
    /// start when it is set ([`StaticConfig::ignored_keys`]).
    #[serde(rename = "iRMNodeName", default)]
    pub rm_node: Option<String>,
    /// The thesis's resource manager port; read and not used, as
    /// `iRMNodeName`.
    #[serde(rename = "iRMiCheckPort", default)]
    pub rm_port: Option<u16>,
    /// Shared secret every peer presents in the handshake. `ICHECK_TOKEN`
    /// in the environment overrides it.
    #[serde(rename = "Token", default)]
    pub token: Option<String>,
    /// The operators' secret: `icheck delete`, `drain`, the full status
    /// and `/metrics`. `ICHECK_ADMIN_TOKEN` overrides it. It opens no
    /// application's data.
    #[serde(rename = "AdminToken", default)]
    pub admin_token: Option<String>,
    /// The checkpoint nodes' secret: managers and standby controllers join
    /// with it, and agents present it to each other. `ICHECK_NODE_TOKEN`
    /// overrides it. Applications never need it.
    #[serde(rename = "NodeToken", default)]
    pub node_token: Option<String>,
    /// A read-only secret for Prometheus (`Authorization: Bearer ...` on
    /// `/metrics`); the admin token works there too.
    #[serde(rename = "MetricsToken", default)]
    pub metrics_token: Option<String>,
    /// Path of the dynamic configuration file (relative to this file).
    #[serde(rename = "DynamicConfig", default)]
    pub dynamic_config: Option<PathBuf>,
    /// Directory under which agents keep checkpoint memory, one
    /// subdirectory per node. A tmpfs (the default, /dev/shm/icheck) keeps
    /// it in RAM yet outside the manager, so a restarted manager finds it.
    #[serde(rename = "AgentStoreDir", default = "default_store")]
    pub agent_store_dir: PathBuf,
    /// Bytes of already-backed files each manager keeps in its store for
    /// the next new version files of any application (`.warm/`): tmpfs
    /// allocates and zeroes every page of a new file, which made an
    /// application's first two commits several times slower than later
    /// ones when it commits back to back. Filled at low priority while the
    /// node is quiet; held in addition to what versions hold, and given
    /// back first when the store's file system is full. 0 (the default):
    /// no pool.
    #[serde(rename = "WarmPool", default = "no_warm_pool")]
    pub warm_pool: crate::units::ByteSize,
    /// The parallel file system directory for the PFS level (version copies
    /// by agents); unset: no PFS level.
    #[serde(rename = "PfsDir", default)]
    pub pfs_dir: Option<PathBuf>,
    /// Where the controller keeps its journal (applications, agents and
    /// complete versions it must not forget across a restart); the
    /// controller's `--state-dir` overrides it. Unset and no `--state-dir`:
    /// a restarted controller forgets every version held in agent memory.
    #[serde(rename = "ControllerStateDir", default)]
    pub controller_state_dir: Option<PathBuf>,
    /// Host agents bind their command channel to and advertise to ranks.
    #[serde(rename = "AgentAddress", default = "default_address")]
    pub agent_address: String,
    /// Fabric provider and domain for agents and clients.
    #[serde(default)]
    pub fabric: FabricConfig,
    /// How applications move their data (the client library's settings).
    #[serde(default)]
    pub client: ClientConfig,
}

/// `[client]`: the client library's settings (thesis §6.2.1).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// `pull` (agents fi_read the application's memory), `push` (the
    /// library fi_writes into agent memory) or `auto` (both measured on the
    /// application's own commits, then the faster kept). `ICHECK_TRANSFER`
    /// overrides it.
    pub transfer: TransferDirection,
    /// How a restart's data comes back from the rank's agent: `pull` (the
    /// rank fi_reads it, checking each chunk as it arrives), `push` (the
    /// agent fi_writes it in steps, each checked while the next moves) or
    /// `auto` (the default: push over the shm provider, pull over the
    /// others, the faster of the two on each in `commit-bench`).
    /// `ICHECK_RESTORE` overrides it.
    pub restore: RestoreDirection,
    /// `mr` (each process registers its memory) or `shmr` (one shared
    /// segment per node). `ICHECK_MODE` overrides it.
    pub mode: crate::protocol::TransferMode,
    /// Bytes of the staging buffer used when data is copied before
    /// transfer; used double-buffered (e.g. "64MiB").
    pub staging_buffer: crate::units::ByteSize,
    /// Register the application's own regions (no staging copy) for
    /// blocking MR commits.
    pub zero_copy: bool,
    /// Incremental commits (on by default): blocking zero-copy commits
    /// send only the 1 MiB blocks whose checksum changed since this
    /// process's previous version, and the agent shares the others with
    /// that version. A commit after one that changed most blocks sends the
    /// whole version (checksummed while it moves, as with this off). Off:
    /// every commit sends every byte. `ICHECK_INCREMENTAL` (0/1) overrides it.
    pub incremental: bool,
    /// Page tracking (opt-in, Linux 6.7 or later): incremental commits
    /// ask the kernel which pages this process wrote since its previous
    /// commit (userfaultfd asynchronous write-protection read with
    /// `PAGEMAP_SCAN`) and checksum only those, instead of every byte.
    /// Writes a NIC makes by DMA into the memory are not seen, so leave it
    /// off where the application receives RDMA into checkpointed memory.
    /// Where the kernel cannot track pages the library says so once and
    /// compares checksums. `ICHECK_PAGE_TRACKING` (0/1) overrides it.
    pub page_tracking: bool,
    /// Fault a restore's destination in ahead of the transfer (on by
    /// default): a helper thread asks the kernel to populate the pages the
    /// restore is about to write (`MADV_POPULATE_WRITE`), so freshly
    /// allocated memory is faulted beside the copy instead of inside it
    /// (1 GiB restored into fresh memory: 0.75-0.94 s without, 0.39-0.48 s
    /// with). Memory already present is left alone. `ICHECK_PREFAULT` (0/1)
    /// overrides it.
    pub prefault: bool,
    /// Seconds to wait for the controller at init before giving up.
    pub connect_timeout: f64,
    /// Agents copy every this many versions to the PFS (0 = never).
    /// `ICHECK_PFS_INTERVAL` overrides it.
    pub pfs_interval: u32,
    /// How PFS copies are stored: "none", "zstd" or "zstd:LEVEL".
    pub compression: String,
    /// Seconds between attempts to reach the service again while writing
    /// directly to the PFS (fallback). `ICHECK_T_WAIT` overrides it.
    pub t_wait: f64,
    /// Seconds an agent may take to answer a request that moves no data;
    /// requests that move or check a version get one more second per
    /// 10 MB of it. Past that, the agent counts as unreachable (a stopped,
    /// hung or cut-off node) and the library asks the controller for new
    /// agents. `ICHECK_REQUEST_TIMEOUT` overrides it.
    pub request_timeout: f64,
    /// Where the library keeps each application's capability (the secret
    /// that proves a restarted job owns its checkpoints), in files only
    /// their owner can read. `ICHECK_CAPABILITY_DIR` overrides it; unset:
    /// `$HOME/.icheck/capabilities`.
    pub capability_dir: Option<PathBuf>,
    /// PFS copies: `"none"` (stored as they are) or `"aes-256-gcm"`
    /// (encrypted with the application's key: derived from its capability,
    /// or `ICHECK_ENCRYPTION_KEY`). `ICHECK_ENCRYPTION` overrides it.
    pub encryption: String,
    /// Protection against lost checkpoint nodes this application asks for:
    /// `"none"`, `"partner"`, `"partner:C"` or `"rs:K+M"`; unset: the
    /// service's default (the dynamic configuration's `redundancy`).
    /// `ICHECK_REDUNDANCY` overrides it.
    pub redundancy: Option<String>,
}

impl ClientConfig {
    /// The `redundancy` key (or `ICHECK_REDUNDANCY`); `None`: the service decides.
    pub fn redundancy(&self) -> Result<Option<crate::redundancy::Redundancy>, String> {
        match std::env::var(REDUNDANCY_ENV).ok().or_else(|| self.redundancy.clone()) {
            None => Ok(None),
            Some(text) => text.parse().map(Some).map_err(|e: crate::redundancy::RedundancyError| e.to_string()),
        }
    }

    /// The `encryption` key (or `ICHECK_ENCRYPTION`): whether PFS copies
    /// are encrypted.
    pub fn encrypted(&self) -> Result<bool, String> {
        let value = std::env::var(ENCRYPTION_ENV).unwrap_or_else(|_| self.encryption.clone());
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "none" => Ok(false),
            "aes-256-gcm" => Ok(true),
            other => Err(format!("encryption {other:?}: expected \"none\" or \"aes-256-gcm\"")),
        }
    }

    /// The `compression` key: `none`, `zstd[:LEVEL]` (every copy) or
    /// `auto[:LEVEL]` (copies of versions of at least `max_cp_size`).
    pub fn compression(&self) -> Result<crate::pfs::CompressionPolicy, String> {
        use crate::pfs::CompressionPolicy;
        let expected = || {
            format!(
                "compression {:?}: expected \"none\", \"zstd\", \"zstd:LEVEL\", \"auto\" or \"auto:LEVEL\" (LEVEL 1 to 22)",
                self.compression
            )
        };
        let (kind, level) = match self.compression.split_once(':') {
            Some((kind, level)) => {
                (kind, level.parse::<i32>().ok().filter(|l| (1..=22).contains(l)).ok_or_else(expected)?)
            }
            None => (self.compression.as_str(), 3),
        };
        match kind {
            "none" | "" => Ok(CompressionPolicy::Never),
            "zstd" => Ok(CompressionPolicy::Always { level }),
            "auto" => Ok(CompressionPolicy::Large { level }),
            _ => Err(expected()),
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            transfer: TransferDirection::Pull,
            restore: RestoreDirection::Auto,
            mode: crate::protocol::TransferMode::Mr,
            staging_buffer: crate::units::ByteSize(64 << 20),
            zero_copy: true,
            incremental: true,
            page_tracking: false,
            prefault: true,
            connect_timeout: 5.0,
            pfs_interval: 0,
            compression: "auto".into(),
            t_wait: 30.0,
            request_timeout: 30.0,
            capability_dir: None,
            encryption: "none".into(),
            redundancy: None,
        }
    }
}

/// Direction of checkpoint data between application and agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransferDirection {
    /// Agents read the application's registered memory.
    Pull,
    /// The application writes into agent memory. A version its agent must
    /// spill to the PFS (the node's checkpoint memory is full) is pulled
    /// instead: agents spill only bytes they read.
    Push,
    /// Measured per application: after the first commits (which touch
    /// fresh agent memory), commits alternate pull and push, and the
    /// direction that moved bytes faster over all ranks is kept for the
    /// rest of the run.
    Auto,
}

/// A setting's keyword from the environment, by the same names the
/// configuration file uses (the enum's serde names, so the two cannot
/// drift apart); a word it does not know is refused naming it, `what` the
/// setting is and the `choices`.
fn parse_keyword<T: serde::de::DeserializeOwned>(text: &str, what: &str, choices: &str) -> Result<T, String> {
    use serde::de::value::{Error, StrDeserializer};
    T::deserialize(StrDeserializer::<Error>::new(text)).map_err(|_| format!("{text:?} is not {what}: use {choices}"))
}

impl std::str::FromStr for TransferDirection {
    type Err = String;

    /// `pull`, `push` or `auto` (what `ICHECK_TRANSFER` holds).
    fn from_str(text: &str) -> Result<Self, String> {
        parse_keyword(text, "a transfer direction", "pull, push or auto")
    }
}

impl std::str::FromStr for crate::protocol::TransferMode {
    type Err = String;

    /// `mr` or `shmr` (what `ICHECK_MODE` holds).
    fn from_str(text: &str) -> Result<Self, String> {
        parse_keyword(text, "a transfer mode", "mr or shmr")
    }
}

/// Direction of a restart's data between the rank's agent and the rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RestoreDirection {
    /// From an agent on the rank's own host (and network namespace): the
    /// version's file, handed over and read with `pread`
    /// ([`crate::handoff`]). Otherwise whichever `commit-bench` measured
    /// faster on the provider: push over `shm` (four ranks restored in
    /// 0.56-0.87 of the pulled time, one rank alike), pull over the others
    /// (tcp: pushes took 1.02-1.60×).
    #[default]
    Auto,
    /// The rank reads its data from the agent's memory over the fabric.
    Pull,
    /// The agent writes the data into the rank's registered memory over the
    /// fabric.
    Push,
}

impl RestoreDirection {
    /// Pull or push on `provider` (`Auto` resolved).
    pub fn on(self, provider: &str) -> RestoreDirection {
        match (self, provider) {
            (RestoreDirection::Auto, "shm") => RestoreDirection::Push,
            (RestoreDirection::Auto, _) => RestoreDirection::Pull,
            (chosen, _) => chosen,
        }
    }
}

impl std::str::FromStr for RestoreDirection {
    type Err = String;

    /// `pull`, `push` or `auto` (what `ICHECK_RESTORE` holds).
    fn from_str(text: &str) -> Result<Self, String> {
        parse_keyword(text, "a restore direction", "pull, push or auto")
    }
}

fn default_store() -> PathBuf {
    PathBuf::from("/dev/shm/icheck")
}

/// Controllers a configuration may list: a primary and its standby (with
/// more, two standbys could both hold the journal at one epoch and both
/// take over).
pub const MAX_CONTROLLERS: usize = 2;

/// `ControllerAddress`: one host, or the list of controllers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ControllerAddress {
    /// One controller on this host (at `ControllerPort`).
    One(String),
    /// Controllers in the order they are tried (`host` or `host:port`).
    List(Vec<String>),
}

impl Default for ControllerAddress {
    fn default() -> Self {
        ControllerAddress::One(default_address())
    }
}

impl ControllerAddress {
    /// The entries as written.
    pub fn entries(&self) -> Vec<&str> {
        match self {
            ControllerAddress::One(host) => vec![host.as_str()],
            ControllerAddress::List(list) => list.iter().map(String::as_str).collect(),
        }
    }
}

/// The port of `host:port` (an IPv6 address must be bracketed: `[::1]:7777`).
pub fn split_port(endpoint: &str) -> Option<(&str, u16)> {
    let (host, port) = endpoint.rsplit_once(':')?;
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return None;
    }
    Some((host, port.parse().ok()?))
}

fn default_address() -> String {
    "127.0.0.1".into()
}
fn default_port() -> u16 {
    7777
}
fn default_heartbeat() -> f64 {
    1.0
}
fn default_status() -> f64 {
    2.0
}
fn default_missed() -> u32 {
    3
}

fn default_client_idle() -> f64 {
    600.0
}

fn no_warm_pool() -> crate::units::ByteSize {
    crate::units::ByteSize(0)
}

fn default_relaunches() -> u32 {
    3
}

fn default_kill_silent() -> f64 {
    120.0
}

impl Default for StaticConfig {
    fn default() -> Self {
        parse(Path::new("<defaults>"), "").expect("an empty static configuration is valid")
    }
}

impl StaticConfig {
    /// Reads and validates `file`.
    pub fn load(file: &Path) -> Result<StaticConfig, ConfigError> {
        StaticConfig::from_text(file, &read(file)?)
    }

    /// Parses and validates `text`, the contents of `file` (which errors
    /// name; relative paths in it are relative to its directory).
    pub fn from_text(file: &Path, text: &str) -> Result<StaticConfig, ConfigError> {
        let mut config: StaticConfig = parse(file, text)?;
        config.validate(file)?;
        if let Some(dynamic) = &config.dynamic_config {
            if dynamic.is_relative() {
                let base = file.parent().unwrap_or(Path::new("."));
                config.dynamic_config = Some(base.join(dynamic));
            }
        }
        Ok(config)
    }

    fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        let invalid = |key, expected: &str| ConfigError::Invalid { file: file.into(), key, expected: expected.into() };
        if !(self.heartbeat_interval.is_finite() && self.heartbeat_interval > 0.0) {
            return Err(invalid("HeartBeatInterval", "a number of seconds greater than 0"));
        }
        if !(self.status_interval.is_finite() && self.status_interval > 0.0) {
            return Err(invalid("StatusMessageInterval", "a number of seconds greater than 0"));
        }
        if self.missed_heartbeats == 0 {
            return Err(invalid("MissedHeartbeats", "at least 1"));
        }
        let hosts = self.controller_address.entries();
        if hosts.is_empty() || hosts.iter().any(|h| h.trim().is_empty()) {
            return Err(invalid(
                "ControllerAddress",
                "a host name or IP address, or a non-empty list of \"host:port\"",
            ));
        }
        let endpoints = self.controller_endpoints();
        if (1..endpoints.len()).any(|i| endpoints[..i].contains(&endpoints[i])) {
            return Err(invalid("ControllerAddress", "a list of distinct controllers (an address appears twice)"));
        }
        if endpoints.len() > MAX_CONTROLLERS {
            return Err(invalid(
                "ControllerAddress",
                &format!("at most {MAX_CONTROLLERS} controllers (a primary and its standby)"),
            ));
        }
        if self.takeover_after.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
            return Err(invalid("TakeoverAfter", "a number of seconds greater than 0"));
        }
        if !(self.client_idle_timeout.is_finite() && self.client_idle_timeout > 0.0) {
            return Err(invalid("ClientIdleTimeout", "a number of seconds greater than 0"));
        }
        if !(self.kill_silent_manager_after.is_finite() && self.kill_silent_manager_after >= 0.0) {
            return Err(invalid("KillSilentManagerAfter", "a number of seconds (0: never)"));
        }
        if !(self.client.request_timeout.is_finite() && self.client.request_timeout > 0.0) {
            return Err(invalid("client.request_timeout", "a number of seconds greater than 0"));
        }
        Ok(())
    }

    /// The token in force: `ICHECK_TOKEN`, else the file's `Token`, else empty.
    pub fn effective_token(&self) -> String {
        std::env::var(TOKEN_ENV).ok().or_else(|| self.token.clone()).unwrap_or_default()
    }

    /// The admin token in force: `ICHECK_ADMIN_TOKEN`, else `AdminToken`.
    pub fn admin_token(&self) -> Option<String> {
        std::env::var(ADMIN_TOKEN_ENV).ok().or_else(|| self.admin_token.clone()).filter(|t| !t.is_empty())
    }

    /// The node token in force: `ICHECK_NODE_TOKEN`, else `NodeToken`.
    pub fn node_token(&self) -> Option<String> {
        std::env::var(NODE_TOKEN_ENV).ok().or_else(|| self.node_token.clone()).filter(|t| !t.is_empty())
    }

    /// The token an operator's command presents: the admin token where one
    /// is configured, else the client token (which the controller answers
    /// with what a client may see).
    pub fn operator_token(&self) -> String {
        self.admin_token().unwrap_or_else(|| self.effective_token())
    }

    /// The directory of [`capability_store`](Self::capability_store).
    fn capability_dir(&self) -> PathBuf {
        std::env::var_os(CAPABILITY_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| self.client.capability_dir.clone())
            .unwrap_or_else(crate::credentials::CapabilityStore::default_dir)
    }

    /// The capabilities this configuration's jobs keep: under
    /// `ICHECK_CAPABILITY_DIR`, else `client.capability_dir`, else
    /// `$HOME/.icheck/capabilities`, for the service its client token admits to.
    pub fn capability_store(&self) -> crate::credentials::CapabilityStore {
        crate::credentials::CapabilityStore::for_service(self.capability_dir(), &self.effective_token())
    }

    /// The secrets a daemon runs with, refused when one is missing, empty
    /// or a placeholder (`change-me`), or when two are equal: a weak or
    /// shared secret would let anyone who can reach the ports act as an
    /// operator or a checkpoint node. `file` is the configuration the
    /// daemon was started with.
    pub fn daemon_tokens(&self, file: &Path) -> Result<DaemonTokens, ConfigError> {
        let (client, node) = self.manager_tokens(file)?;
        let admin = self.checked_token(file, "AdminToken", ADMIN_TOKEN_ENV, self.admin_token())?;
        let metrics = match self.metrics_token.clone().filter(|t| !t.is_empty()) {
            Some(token) => Some(self.checked_token(file, "MetricsToken", "MetricsToken", Some(token))?),
            None => None,
        };
        let same = |key: &'static str, other: &str| self.same_token(file, key, other);
        if crate::credentials::secrets_equal(&admin, &client) {
            return Err(same("AdminToken", "Token"));
        }
        if crate::credentials::secrets_equal(&node, &admin) {
            return Err(same("NodeToken", "AdminToken"));
        }
        let shared = |m: &str| [&client, &admin, &node].iter().any(|t| crate::credentials::secrets_equal(m, t));
        if metrics.as_deref().is_some_and(shared) {
            return Err(same("MetricsToken", "the other tokens"));
        }
        Ok(DaemonTokens { client, admin, node, metrics })
    }

    /// The secrets a manager runs with: the client token (its agents admit
    /// ranks with it) and the node token (it joins the controller, and its
    /// agents admit each other, with it), checked as in
    /// [`daemon_tokens`](Self::daemon_tokens). A checkpoint node needs no
    /// admin token.
    pub fn manager_tokens(&self, file: &Path) -> Result<(String, String), ConfigError> {
        let client = self.checked_token(file, "Token", TOKEN_ENV, Some(self.effective_token()))?;
        let node = self.checked_token(file, "NodeToken", NODE_TOKEN_ENV, self.node_token())?;
        if crate::credentials::secrets_equal(&node, &client) {
            return Err(self.same_token(file, "NodeToken", "Token"));
        }
        Ok((client, node))
    }

    fn checked_token(
        &self,
        file: &Path,
        key: &'static str,
        env: &str,
        value: Option<String>,
    ) -> Result<String, ConfigError> {
        let value = value.unwrap_or_default();
        match crate::credentials::weak_token(&value) {
            None => Ok(value),
            Some(why) => Err(ConfigError::Invalid {
                file: file.to_path_buf(),
                key,
                expected: format!(
                    "a random secret (or {env} in the environment); the value {why}: daemons do not run without \
                     authentication (`icheck up` writes random ones; `openssl rand -hex 16` makes one)"
                ),
            }),
        }
    }

    fn same_token(&self, file: &Path, key: &'static str, other: &str) -> ConfigError {
        ConfigError::Invalid {
            file: file.to_path_buf(),
            key,
            expected: format!("a secret different from {other}: each token admits different peers"),
        }
    }

    /// `host:port` of the first controller (the only one, or the one
    /// tried first).
    pub fn controller_endpoint(&self) -> String {
        self.controller_endpoints().swap_remove(0)
    }

    /// `host:port` of every controller, in the order they are tried.
    pub fn controller_endpoints(&self) -> Vec<String> {
        let port = self.controller_port;
        let mut endpoints: Vec<String> = self
            .controller_address
            .entries()
            .iter()
            .map(|entry| match split_port(entry) {
                Some(_) => entry.to_string(),
                // A bare IPv6 address gets its brackets.
                None if entry.contains(':') && !entry.starts_with('[') => format!("[{entry}]:{port}"),
                None => format!("{entry}:{port}"),
            })
            .collect();
        if endpoints.is_empty() {
            endpoints.push(format!("{}:{port}", default_address()));
        }
        endpoints
    }

    /// How long a standby hears nothing from the primary before it takes over.
    pub fn takeover_after(&self) -> Duration {
        match self.takeover_after {
            Some(secs) => Duration::from_secs_f64(secs),
            None => self.heartbeat() * self.missed_heartbeats.max(1),
        }
    }

    /// The keys this file sets that icheck reads but does not act on (the
    /// thesis's `iRMNodeName` and `iRMiCheckPort`), each with what to use
    /// instead: an administrator who sets one expects it to do something.
    pub fn ignored_keys(&self) -> Vec<String> {
        let instead = "icheck asks Slurm through its own commands: `icheck up --slurm` or \
                       `icheck controller --launcher slurm`";
        [("iRMNodeName", self.rm_node.is_some()), ("iRMiCheckPort", self.rm_port.is_some())]
            .into_iter()
            .filter(|(_, set)| *set)
            .map(|(key, _)| format!("{key} is set in the static configuration but not used: {instead}"))
            .collect()
    }

    /// How long a manager may be silent while alive before the controller
    /// kills it to start it again; `None`: never.
    pub fn kill_silent_manager_after(&self) -> Option<Duration> {
        (self.kill_silent_manager_after > 0.0).then(|| Duration::from_secs_f64(self.kill_silent_manager_after))
    }

    /// How long a daemon keeps an idle authenticated client connection.
    pub fn client_idle_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.client_idle_timeout)
    }

    /// Heartbeat interval as a Duration.
    pub fn heartbeat(&self) -> Duration {
        Duration::from_secs_f64(self.heartbeat_interval)
    }

    /// Status interval as a Duration.
    pub fn status(&self) -> Duration {
        Duration::from_secs_f64(self.status_interval)
    }
}

/// `init_agent_count`: a number, or `"num_nodes"` (one agent per application node).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InitAgentCount {
    /// A fixed count.
    Fixed(u32),
    /// The thesis default: as many agents as application nodes.
    Named(AgentCountRule),
}

/// Named rules for `init_agent_count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentCountRule {
    /// One agent per application node.
    NumNodes,
}

/// `agent_selection`: which nodes are preferred (Algorithm 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentSelection {
    /// Most available bandwidth.
    #[serde(rename = "BW")]
    Bandwidth,
    /// Lowest checkpoint frequency.
    #[serde(rename = "CP")]
    CheckpointFrequency,
    /// Most available memory.
    #[serde(rename = "MEM")]
    Memory,
    /// Lowest power draw.
    #[serde(rename = "POWER")]
    Power,
}

/// `node_selection`: how agents are spread over the chosen nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeSelection {
    /// Round-robin.
    #[serde(rename = "RR")]
    RoundRobin,
    /// Equal share per node.
    #[serde(rename = "EQ")]
    Equal,
    /// Blocks of agents per node.
    #[serde(rename = "BLK")]
    Block,
    /// Fill to completion: each node up to `max_agents_node` before the next.
    #[serde(rename = "FTC")]
    FillToCompletion,
}

/// `agent_change_strategy`: what a malleable application's agents do when
/// its process (MR) or node (SHMR) count changes (§7.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AgentChangeStrategy {
    /// Malleable application, rigid agents: the agents stay and the new
    /// processes are mapped onto them.
    #[serde(rename = "MA-RA")]
    RigidAgents,
    /// Malleable application, malleable agents: the agent count follows the
    /// new count, keeping the processes-per-agent ratio (Algorithm 7).
    #[serde(rename = "MA-MA")]
    MalleableAgents,
}

/// The dynamic configuration (Listing 6.2), re-read while running.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicConfig {
    /// Seconds between re-reads of this file.
    #[serde(rename = "readInterval", default = "default_read_interval")]
    pub read_interval: f64,
    /// Most agents one checkpoint node runs.
    #[serde(default = "default_max_agents")]
    pub max_agents_node: u32,
    /// Most agents one application gets.
    #[serde(default = "default_max_agents")]
    pub max_agents_app: u32,
    /// Most checkpoint memory per node, in GB.
    #[serde(default = "default_max_mem")]
    pub max_mem_node: f64,
    /// Versions at least this large have their PFS copies compressed, for
    /// applications with `compression = "auto"` (the thesis's MAX_CP_SIZE).
    #[serde(default = "default_max_cp_size")]
    pub max_cp_size: crate::units::ByteSize,
    /// Agents an application gets when it first registers.
    #[serde(default = "default_init_agents")]
    pub init_agent_count: InitAgentCount,
    /// Candidate nodes considered for placement.
    #[serde(default = "default_candidates")]
    pub candidate_count: u32,
    /// The most checkpoint nodes horizontal scaling grows the service to
    /// (the proactive scaler asks for no node beyond it; unset: only the
    /// resource manager's bound, e.g. `icheck up --slurm --nodes ..MAX`).
    #[serde(default)]
    pub manager_count: Option<u32>,
    /// Node preference.
    #[serde(default = "default_agent_selection")]
    pub agent_selection: AgentSelection,
    /// Agent distribution.
    #[serde(default = "default_node_selection")]
    pub node_selection: NodeSelection,
    /// Agent scaling on probe allowed.
    #[serde(default = "default_true")]
    pub is_dynamic_as: bool,
    /// Horizontal scaling of checkpoint nodes allowed.
    #[serde(default)]
    pub is_dynamic_hs: bool,
    /// PFS level enabled.
    #[serde(default = "default_true")]
    pub enable_multi_level: bool,
    /// Apply this configuration over application hints.
    #[serde(default)]
    pub force_config: bool,
    /// Scaling factor of Algorithm 5.
    #[serde(default = "default_factor")]
    pub factor: u32,
    /// What agents do when a malleable application's size changes (MA-RA
    /// or MA-MA), applied at the application's first probe after its first
    /// version with the new size.
    #[serde(default = "default_agent_change_strategy")]
    pub agent_change_strategy: AgentChangeStrategy,
    /// Protection of versions against lost checkpoint nodes for
    /// applications that do not ask for their own (`client.redundancy`):
    /// `"none"`, `"partner"`, `"partner:C"` or `"rs:K+M"`. With
    /// `force_config`, it applies to every application.
    #[serde(default)]
    pub redundancy: crate::redundancy::Redundancy,
    /// Probability that a checkpoint node fails before the next version,
    /// for the exposure `icheck status` prints (the data-loss model).
    #[serde(default = "default_node_failure")]
    pub node_failure_probability: f64,
    /// Algorithm 8's LOWER_THRESHOLD: fraction of a node's memory in use
    /// above which it is flagged.
    #[serde(default = "default_lower_threshold")]
    pub lower_threshold: f64,
    /// Algorithm 8's UPPER_THRESHOLD: fraction in use above which a node
    /// that keeps filling needs another node.
    #[serde(default = "default_upper_threshold")]
    pub upper_threshold: f64,
    /// Memory depletion rate (per second) that counts as filling fast.
    #[serde(default = "default_depletion_threshold")]
    pub depletion_threshold: crate::units::ByteSize,
    /// BW_THRESHOLD: bytes per second a node's agents move above which its
    /// network counts as saturated.
    #[serde(default = "default_bw_threshold")]
    pub bw_threshold: crate::units::ByteSize,
    /// CP_THRESHOLD: checkpoint operations per minute above which a node
    /// counts as busy.
    #[serde(default = "default_cp_threshold")]
    pub cp_threshold: f64,
    /// SCALER_INTERVAL: seconds between passes of the proactive scaler.
    #[serde(default = "default_scaler_interval")]
    pub scaler_interval: f64,
}

fn default_lower_threshold() -> f64 {
    0.8
}

fn default_upper_threshold() -> f64 {
    0.9
}

fn default_depletion_threshold() -> crate::units::ByteSize {
    crate::units::ByteSize(16 << 20)
}

fn default_bw_threshold() -> crate::units::ByteSize {
    crate::units::ByteSize(1 << 30)
}

fn default_cp_threshold() -> f64 {
    30.0
}

fn default_scaler_interval() -> f64 {
    10.0
}

fn default_node_failure() -> f64 {
    0.001
}

impl DynamicConfig {
    /// Algorithm 8's thresholds from this configuration.
    pub fn scaling_thresholds(&self) -> crate::scaling::ScalingThresholds {
        crate::scaling::ScalingThresholds {
            lower: self.lower_threshold,
            upper: self.upper_threshold,
            depletion: self.depletion_threshold.0 as f64,
            bandwidth: self.bw_threshold.0 as f64,
            cops_per_min: self.cp_threshold,
        }
    }

    /// The redundancy `registration` gets: its own, unless this
    /// configuration forces its own or the application asks for none.
    pub fn redundancy_for(&self, registration: &crate::protocol::AppRegistration) -> crate::redundancy::Redundancy {
        match registration.redundancy {
            Some(asked) if !self.force_config => asked,
            _ => self.redundancy,
        }
    }
}

fn default_agent_change_strategy() -> AgentChangeStrategy {
    AgentChangeStrategy::MalleableAgents
}

fn default_read_interval() -> f64 {
    30.0
}
fn default_max_agents() -> u32 {
    80
}
impl DynamicConfig {
    /// `max_mem_node` in bytes (the key is in GiB).
    pub fn max_mem_node_bytes(&self) -> u64 {
        (self.max_mem_node * (1u64 << 30) as f64) as u64
    }
}

fn default_max_cp_size() -> crate::units::ByteSize {
    crate::units::ByteSize(1 << 30)
}

fn default_max_mem() -> f64 {
    90.0
}
fn default_init_agents() -> InitAgentCount {
    InitAgentCount::Named(AgentCountRule::NumNodes)
}
fn default_candidates() -> u32 {
    5
}
fn default_agent_selection() -> AgentSelection {
    AgentSelection::Bandwidth
}
fn default_node_selection() -> NodeSelection {
    NodeSelection::RoundRobin
}
fn default_true() -> bool {
    true
}
fn default_factor() -> u32 {
    2
}

impl Default for DynamicConfig {
    fn default() -> Self {
        parse(Path::new("<defaults>"), "").expect("an empty dynamic configuration is valid")
    }
}

impl DynamicConfig {
    /// Parses and validates dynamic configuration text; `file` names it in errors.
    pub fn parse(file: &Path, text: &str) -> Result<DynamicConfig, ConfigError> {
        let config: DynamicConfig = parse(file, text)?;
        let invalid = |key, expected: &str| ConfigError::Invalid { file: file.into(), key, expected: expected.into() };
        if !(config.read_interval.is_finite() && config.read_interval > 0.0) {
            return Err(invalid("readInterval", "a number of seconds greater than 0"));
        }
        if config.max_agents_node == 0 {
            return Err(invalid("max_agents_node", "at least 1"));
        }
        if config.max_agents_app == 0 {
            return Err(invalid("max_agents_app", "at least 1"));
        }
        if !(config.max_mem_node.is_finite() && config.max_mem_node > 0.0) {
            return Err(invalid("max_mem_node", "a number of GB greater than 0"));
        }
        if config.init_agent_count == InitAgentCount::Fixed(0) {
            return Err(invalid("init_agent_count", "at least 1, or \"num_nodes\""));
        }
        if config.candidate_count == 0 {
            return Err(invalid("candidate_count", "at least 1"));
        }
        if config.manager_count == Some(0) {
            return Err(invalid("manager_count", "at least 1 checkpoint node"));
        }
        if config.factor < 2 {
            return Err(invalid("factor", "at least 2"));
        }
        if !(0.0..=1.0).contains(&config.node_failure_probability) {
            return Err(invalid("node_failure_probability", "a probability from 0 to 1"));
        }
        if !(config.lower_threshold > 0.0 && config.lower_threshold <= 1.0) {
            return Err(invalid("lower_threshold", "a fraction of the node's memory, above 0 and at most 1"));
        }
        if !(config.upper_threshold >= config.lower_threshold && config.upper_threshold <= 1.0) {
            return Err(invalid("upper_threshold", "a fraction from lower_threshold to 1"));
        }
        if !(config.cp_threshold.is_finite() && config.cp_threshold >= 0.0) {
            return Err(invalid("cp_threshold", "checkpoint operations per minute, 0 or more"));
        }
        if !(config.scaler_interval.is_finite() && config.scaler_interval > 0.0) {
            return Err(invalid("scaler_interval", "a number of seconds greater than 0"));
        }
        Ok(config)
    }

    /// Reads and validates `file`.
    pub fn load(file: &Path) -> Result<DynamicConfig, ConfigError> {
        DynamicConfig::parse(file, &read(file)?)
    }

    /// Errors for keys whose values this controller parses but cannot
    /// honour (rather than doing nothing): `can_scale` says whether it has
    /// a resource manager that gives and takes nodes. The controller checks
    /// at start and at each re-read.
    pub fn supported(&self, file: &Path, can_scale: bool) -> Result<(), ConfigError> {
        if self.is_dynamic_hs && !can_scale {
            return Err(ConfigError::Unsupported {
                file: file.into(),
                key: "is_dynamic_hs",
                why: "horizontal scaling needs a resource manager that gives and takes checkpoint nodes \
                      (icheck up --slurm, or icheck controller --launcher slurm); \
                      set is_dynamic_hs = false here (manager_count applies only with it)",
            });
        }
        Ok(())
    }

    /// Re-read interval as a Duration.
    pub fn read_every(&self) -> Duration {
        Duration::from_secs_f64(self.read_interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> &'static Path {
        Path::new("dynamic.toml")
    }

    #[test]
    fn the_thesis_resource_manager_keys_load_and_are_named_as_not_used() {
        let parsed = |text: &str| StaticConfig::from_text(Path::new("icheck.toml"), text);
        let plain = parsed("ControllerAddress = \"host1\"").unwrap();
        assert!(plain.ignored_keys().is_empty());
        let thesis = parsed("ControllerAddress = \"host1\"\niRMNodeName = \"rmhost\"\niRMiCheckPort = 9999").unwrap();
        let ignored = thesis.ignored_keys();
        assert_eq!(ignored.len(), 2, "{ignored:?}");
        assert!(ignored[0].starts_with("iRMNodeName is set") && ignored[0].contains("--launcher slurm"), "{ignored:?}");
        assert!(ignored[1].starts_with("iRMiCheckPort is set"), "{ignored:?}");
    }

    #[test]
    fn the_shipped_example_files_parse() {
        let static_path = Path::new("config/icheck.toml");
        let config: StaticConfig = parse(static_path, include_str!("../../config/icheck.toml")).unwrap();
        assert_eq!(config.client.transfer, TransferDirection::Pull);
        assert_eq!(config.agent_store_dir, PathBuf::from("/dev/shm/icheck"));
        DynamicConfig::parse(Path::new("config/dynamic.toml"), include_str!("../../config/dynamic.toml")).unwrap();
    }

    #[test]
    fn transfer_auto_parses_from_the_file_and_the_environment_form() {
        let config: StaticConfig = parse(Path::new("icheck.toml"), "[client]\ntransfer = \"auto\"\n").unwrap();
        assert_eq!(config.client.transfer, TransferDirection::Auto);
        assert_eq!("push".parse::<TransferDirection>(), Ok(TransferDirection::Push));
        let wrong = "fast".parse::<TransferDirection>().unwrap_err();
        assert!(wrong.contains("\"fast\"") && wrong.contains("pull, push or auto"), "{wrong}");
        let error = parse::<StaticConfig>(Path::new("icheck.toml"), "[client]\ntransfer = \"fast\"\n").unwrap_err();
        assert!(error.to_string().contains("transfer"), "{error}");
    }

    #[test]
    fn restore_direction_parses_from_the_file_and_the_environment_form() {
        let config: StaticConfig = parse(Path::new("icheck.toml"), "[client]\nrestore = \"push\"\n").unwrap();
        assert_eq!(config.client.restore, RestoreDirection::Push);
        let config: StaticConfig = parse(Path::new("icheck.toml"), "[client]\n").unwrap();
        assert_eq!(config.client.restore, RestoreDirection::Auto, "auto is the default");
        assert_eq!("pull".parse::<RestoreDirection>(), Ok(RestoreDirection::Pull));
        assert_eq!("auto".parse::<RestoreDirection>(), Ok(RestoreDirection::Auto));
        let wrong = "fastest".parse::<RestoreDirection>().unwrap_err();
        assert!(wrong.contains("\"fastest\"") && wrong.contains("pull, push or auto"), "{wrong}");
        assert_eq!(RestoreDirection::Auto.on("shm"), RestoreDirection::Push);
        assert_eq!(RestoreDirection::Auto.on("tcp"), RestoreDirection::Pull);
        assert_eq!(RestoreDirection::Auto.on("verbs;ofi_rxm"), RestoreDirection::Pull);
        assert_eq!(RestoreDirection::Pull.on("shm"), RestoreDirection::Pull, "a choice is kept");
        assert_eq!(RestoreDirection::Push.on("tcp"), RestoreDirection::Push, "a choice is kept");
        let error = parse::<StaticConfig>(Path::new("icheck.toml"), "[client]\nrestore = \"fast\"\n").unwrap_err();
        assert!(error.to_string().contains("restore"), "{error}");
    }

    #[test]
    fn transfer_mode_parses_the_environment_form_and_names_a_wrong_value() {
        use crate::protocol::TransferMode;
        assert_eq!("shmr".parse::<TransferMode>(), Ok(TransferMode::Shmr));
        assert_eq!("mr".parse::<TransferMode>(), Ok(TransferMode::Mr));
        let wrong = "SHMR ".parse::<TransferMode>().unwrap_err();
        assert!(wrong.contains("\"SHMR \"") && wrong.contains("mr or shmr"), "{wrong}");
    }

    #[test]
    fn daemons_refuse_placeholder_missing_and_shared_tokens() {
        let text = |tokens: &str| format!("{tokens}\n[fabric]\nprovider = \"tcp\"\n");
        let load = |tokens: &str| parse::<StaticConfig>(Path::new("s.toml"), &text(tokens)).unwrap();
        // The shipped sample's placeholders are refused, naming the file and key.
        let sample: StaticConfig =
            parse(Path::new("config/icheck.toml"), include_str!("../../config/icheck.toml")).unwrap();
        let err = sample.daemon_tokens(Path::new("config/icheck.toml")).unwrap_err().to_string();
        assert!(err.contains("config/icheck.toml") && err.contains("Token") && err.contains("placeholder"), "{err}");
        let missing = load("Token = \"a1\"\nNodeToken = \"n1\"");
        let err = missing.daemon_tokens(Path::new("s.toml")).unwrap_err().to_string();
        assert!(err.contains("AdminToken") && err.contains("empty"), "{err}");
        // A manager needs no admin token.
        assert!(missing.manager_tokens(Path::new("s.toml")).is_ok());
        let shared = load("Token = \"a1\"\nAdminToken = \"a1\"\nNodeToken = \"n1\"");
        let err = shared.daemon_tokens(Path::new("s.toml")).unwrap_err().to_string();
        assert!(err.contains("AdminToken") && err.contains("different from Token"), "{err}");
        let good = load("Token = \"a1\"\nAdminToken = \"b2\"\nNodeToken = \"c3\"\nMetricsToken = \"d4\"");
        let tokens = good.daemon_tokens(Path::new("s.toml")).unwrap();
        assert_eq!((tokens.admin.as_str(), tokens.metrics.as_deref()), ("b2", Some("d4")));
        assert_eq!(format!("{tokens:?}"), "DaemonTokens(..)", "secrets never printed");
    }

    #[test]
    fn scaling_thresholds_default_to_the_thesis_examples_and_are_checked() {
        let config = DynamicConfig::default();
        let t = config.scaling_thresholds();
        assert_eq!((t.lower, t.upper), (0.8, 0.9));
        assert_eq!(config.scaler_interval, 10.0);
        let set = DynamicConfig::parse(file(), "bw_threshold = \"100MiB\"\ncp_threshold = 5\n").unwrap();
        assert_eq!(set.scaling_thresholds().bandwidth, 100.0 * 1024.0 * 1024.0);
        for (text, key) in [
            ("lower_threshold = 0", "lower_threshold"),
            ("lower_threshold = 0.95", "upper_threshold"),
            ("upper_threshold = 1.5", "upper_threshold"),
            ("cp_threshold = -1", "cp_threshold"),
            ("scaler_interval = 0", "scaler_interval"),
        ] {
            let err = DynamicConfig::parse(file(), text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    fn horizontal_scaling_is_refused_by_name_without_a_resource_manager() {
        let dir = std::env::temp_dir().join(format!("icheck-hs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dynamic.toml");
        std::fs::write(&path, "is_dynamic_hs = true\nmanager_count = 4\n").unwrap();
        let config = DynamicConfig::load(&path).unwrap();
        let err = config.supported(&path, false).unwrap_err().to_string();
        assert!(
            err.contains("is_dynamic_hs") && err.contains("not supported") && err.contains("dynamic.toml"),
            "{err}"
        );
        assert!(config.supported(&path, true).is_ok(), "a resource manager makes it work");
        std::fs::write(&path, "is_dynamic_hs = false\nmanager_count = 4\n").unwrap();
        let config = DynamicConfig::load(&path).unwrap();
        assert!(config.supported(&path, false).is_ok());
        assert_eq!(config.manager_count, Some(4));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn thesis_listing_6_2_parses() {
        let text = r#"
            readInterval = 30
            max_agents_node = 80
            max_agents_app = 80
            max_mem_node = 90
            init_agent_count = "num_nodes"
            candidate_count = 5
            manager_count = 10
            agent_selection = "BW"
            node_selection = "RR"
            is_dynamic_as = true
            is_dynamic_hs = true
            enable_multi_level = true
            force_config = false
        "#;
        let config = DynamicConfig::parse(file(), text).unwrap();
        assert_eq!(config.init_agent_count, InitAgentCount::Named(AgentCountRule::NumNodes));
        assert_eq!(config.agent_selection, AgentSelection::Bandwidth);
        assert_eq!(
            DynamicConfig::parse(file(), "init_agent_count = 3").unwrap().init_agent_count,
            InitAgentCount::Fixed(3)
        );
    }

    #[test]
    fn compression_key_and_its_threshold() {
        use crate::pfs::{Compression, CompressionPolicy};
        let policy = |text: &str| ClientConfig { compression: text.into(), ..ClientConfig::default() }.compression();
        assert_eq!(policy("none"), Ok(CompressionPolicy::Never));
        assert_eq!(policy("zstd"), Ok(CompressionPolicy::Always { level: 3 }));
        assert_eq!(policy("zstd:19"), Ok(CompressionPolicy::Always { level: 19 }));
        assert_eq!(policy("auto:1"), Ok(CompressionPolicy::Large { level: 1 }));
        assert_eq!(ClientConfig::default().compression(), Ok(CompressionPolicy::Large { level: 3 }));
        for bad in ["zstd:0", "zstd:23", "lz4", "auto:x"] {
            assert!(policy(bad).unwrap_err().contains(bad), "{bad}");
        }
        let large = CompressionPolicy::Large { level: 2 };
        assert_eq!(large.for_version(1 << 30, 1 << 30), Compression::Zstd { level: 2 });
        assert_eq!(large.for_version((1 << 30) - 1, 1 << 30), Compression::None);
        assert_eq!(CompressionPolicy::Always { level: 5 }.for_version(1, 1 << 30), Compression::Zstd { level: 5 });
        assert_eq!(CompressionPolicy::Never.for_version(u64::MAX, 0), Compression::None);
        let dynamic: DynamicConfig = toml::from_str("max_cp_size = \"2GiB\"").unwrap();
        assert_eq!(dynamic.max_cp_size.0, 2 << 30);
    }

    #[test]
    fn errors_name_file_and_key() {
        let cases = [
            ("max_agents_node = 0", "max_agents_node"),
            ("init_agent_count = 0", "init_agent_count"),
            ("readInterval = -1", "readInterval"),
            ("agent_selection = \"FAST\"", "agent_selection"),
            ("max_agnets_node = 3", "max_agnets_node"),
            ("max_agents_node = \"many\"", "max_agents_node"),
        ];
        for (text, key) in cases {
            let err = DynamicConfig::parse(file(), text).unwrap_err().to_string();
            assert!(err.contains("dynamic.toml") && err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    fn static_listing_6_3_parses_and_validates() {
        let dir = std::env::temp_dir().join(format!("icheck-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("icheck.toml");
        std::fs::write(
            &path,
            "ControllerAddress = \"host1\"\niCheckManagerNode = [\"host1\", \"host2\"]\nHeartBeatInterval = 5\n\
             StatusMessageInterval = 5\niRMNodeName = \"host5\"\niRMiCheckPort = 9999\nControllerPort = 7777\n\
             DynamicConfig = \"dynamic.toml\"\n",
        )
        .unwrap();
        let config = StaticConfig::load(&path).unwrap();
        assert_eq!(config.controller_endpoint(), "host1:7777");
        assert_eq!(config.dynamic_config, Some(dir.join("dynamic.toml")));
        std::fs::write(&path, "HeartBeatInterval = 0\n").unwrap();
        let err = StaticConfig::load(&path).unwrap_err().to_string();
        assert!(err.contains("icheck.toml") && err.contains("HeartBeatInterval"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn controller_address_is_one_host_or_an_ordered_list() {
        let parsed = |text: &str| {
            let config: StaticConfig = parse(Path::new("icheck.toml"), text).unwrap();
            config.validate(Path::new("icheck.toml")).map(|_| config)
        };
        let one = parsed("ControllerAddress = \"host1\"\nControllerPort = 7000").unwrap();
        assert_eq!(one.controller_endpoints(), ["host1:7000"]);
        let two = parsed("ControllerAddress = [\"a:7777\", \"b\"]\nControllerPort = 7000").unwrap();
        assert_eq!(two.controller_endpoints(), ["a:7777", "b:7000"]);
        let six = parsed("ControllerAddress = [\"[::1]:9\", \"::1\"]").unwrap();
        assert_eq!(six.controller_endpoints(), ["[::1]:9", "[::1]:7777"]);
        assert_eq!(two.controller_endpoint(), "a:7777");
        assert_eq!(two.takeover_after(), Duration::from_secs(3), "HeartBeatInterval x MissedHeartbeats");
        let set = parsed("ControllerAddress = [\"a:1\"]\nTakeoverAfter = 1.5").unwrap();
        assert_eq!(set.takeover_after(), Duration::from_millis(1500));
        assert_eq!(two.client_idle_timeout(), Duration::from_secs(600), "the default");
        let idle = parsed("ClientIdleTimeout = 2.5").unwrap();
        assert_eq!(idle.client_idle_timeout(), Duration::from_millis(2500));
        assert_eq!(two.kill_silent_manager_after(), Some(Duration::from_secs(120)), "the default");
        assert_eq!(parsed("KillSilentManagerAfter = 0").unwrap().kill_silent_manager_after(), None);
        let groups = parsed("[NodeGroup]\ncp1 = \"rack1\"\ncp2 = \"rack2\"").unwrap();
        assert_eq!(groups.node_groups.get("cp2").map(String::as_str), Some("rack2"));
        for (bad, key) in [
            ("ControllerAddress = []", "ControllerAddress"),
            ("ControllerAddress = [\"a:1\", \"a:1\"]", "appears twice"),
            ("ControllerAddress = [\"\"]", "ControllerAddress"),
            ("ControllerAddress = [\"a:1\", \"b:1\", \"c:1\"]", "a primary and its standby"),
            ("TakeoverAfter = 0", "TakeoverAfter"),
            ("ClientIdleTimeout = -1", "ClientIdleTimeout"),
            ("KillSilentManagerAfter = -1", "KillSilentManagerAfter"),
        ] {
            let err = parsed(bad).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains("icheck.toml"), "{bad}: {err}");
        }
    }
}
