//! `icheck`: the command administrators and users run.
//!
//! Daemons (`controller`, `manager`), the local service (`up`, `down`),
//! `status`, and the fabric tools.

mod local;
mod run;

use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use icheck_core::fabric::{libfabric_version, list_providers, FabricConfig, TransferOptions};
use icheck_core::units::ByteSize;
use icheck_service::selftest::{self, Target, TargetAnnouncement, TargetProcess};
use std::path::PathBuf;

/// icheck: an RDMA checkpoint service for MPI applications.
#[derive(Parser)]
#[command(
    name = "icheck",
    version,
    propagate_version = true,
    args_override_self = true,
    after_help = "Environment:\n  \
      ICHECK_LOG         log filter (tracing's EnvFilter): error, warn, info, debug, trace, or per module,\n                     \
      e.g. ICHECK_LOG=info,icheck_service::agent=debug. Default: info for the daemons\n                     \
      (controller, manager), warn for the other commands.\n  \
      ICHECK_LOG_FORMAT  text (default) or json: one JSON object per line, for sites that ship logs.\n  \
      ICHECK_CONFIG      the client configuration jobs read (icheck up prints its path).\n\n\
      Logs go to standard error, coloured only when it is a terminal."
)]
struct Cli {
    #[command(subcommand)]
    command: Command_,
}

#[derive(Subcommand)]
enum Command_ {
    /// Start a local service: a controller and N managers on loopback.
    ///
    /// Writes configuration, logs, pids and a ready client configuration
    /// into the state directory and prints the client configuration's path.
    /// Ports are picked free, so several services can run side by side.
    ///
    /// Example: icheck up --managers 2 --state-dir /tmp/ick --detach
    Up {
        /// Managers (checkpoint nodes) to start.
        #[arg(long, default_value_t = 2)]
        managers: u32,
        /// Directory for configuration, logs and pids.
        #[arg(long, default_value = "icheck-state")]
        state_dir: PathBuf,
        /// Fabric provider the agents and applications use: a libfabric
        /// name (`icheck fabric info` lists them), or auto: shm when every
        /// daemon runs on this host (one copy instead of tcp's loopback; tcp
        /// where shm is not offered), with --slurm libfabric's first choice
        /// that leaves the host. The choice and why go into the written
        /// configuration; `icheck status` shows each node's provider.
        #[arg(long, default_value = "auto")]
        provider: String,
        /// Seconds between manager heartbeats; managers report their
        /// status (memory, stored bytes, agents' rates) every second one.
        #[arg(long, default_value_t = 1.0)]
        heartbeat: f64,
        /// Controller port (0: a free one, written to the client configuration).
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Return once every manager is ready instead of staying in the
        /// foreground until Ctrl-C.
        #[arg(long)]
        detach: bool,
        /// Where the agents keep checkpoints (each node in a subdirectory).
        /// Default: a directory on /dev/shm named after the state directory.
        /// The node's memory budget never exceeds this file system's size.
        #[arg(long)]
        store_dir: Option<PathBuf>,
        /// Times the controller starts a dead manager again within ten
        /// minutes before it gives the node up (ManagerRelaunches; 0: never).
        #[arg(long, default_value_t = 3)]
        manager_relaunches: u32,
        /// Seconds a manager may stay silent while its process lives
        /// (stopped, hung) before the controller kills it, so that it is
        /// started again with the versions its store kept
        /// (KillSilentManagerAfter; 0: never, the node stays down).
        #[arg(long, default_value_t = 120.0, value_name = "SECS")]
        kill_silent_after: f64,
        /// Bytes of already-backed files each manager keeps ready for new
        /// version files (WarmPool), e.g. 2GiB: an application's first
        /// commits then skip the page zeroing that makes them slower than
        /// later ones. Held beside the versions; given back when the store
        /// fills. 0: none.
        #[arg(long, default_value = "0")]
        warm_pool: icheck_core::units::ByteSize,
        /// Whether the default store (on /dev/shm) gets a tmpfs of its own
        /// mounted with 2 MiB pages (huge=within_size; needs root and a new
        /// store). Measured on this project's VM (README, "Where the speed
        /// targets stand"): on restores the agents' files read about 20%
        /// faster, but a commit into memory the host has just reclaimed
        /// costs 2-10 times more, so the default stays off. `icheck status`
        /// shows each node's page size; `icheck down` unmounts the store.
        #[arg(long, value_enum, default_value_t = local::HugePagesChoice::Off)]
        huge_pages: local::HugePagesChoice,
        /// Also start a standby controller that follows the primary's
        /// journal and takes over when it is silent (TakeoverAfter).
        #[arg(long)]
        standby: bool,
        /// Seconds the standby waits for a silent primary before it takes
        /// over (TakeoverAfter; default: heartbeat × 3).
        #[arg(long, requires = "standby")]
        takeover_after: Option<f64>,
        /// Seconds the controller and the agents keep an idle client
        /// connection open (ClientIdleTimeout). Jobs open a new one when
        /// they next commit, so this bounds what idle clients hold.
        #[arg(long, default_value_t = 600.0)]
        client_idle_timeout: f64,
        /// Run the managers as Slurm batch jobs on checkpoint nodes Slurm
        /// chooses (sbatch of `icheck manager`, node names from Slurm),
        /// instead of on this host; `icheck down` cancels every job it
        /// submitted. The controller stays on this host and starts a dead
        /// manager again through Slurm. Slurm's commands must work here
        /// (SLURM_CONF), and the icheck binary and the state directory must
        /// be at the same paths on the checkpoint nodes.
        #[arg(long)]
        slurm: bool,
        /// The Slurm partition of the checkpoint nodes (with --slurm).
        #[arg(long, requires = "slurm")]
        partition: Option<String>,
        /// Checkpoint nodes to start with, MIN or MIN..MAX (with --slurm;
        /// overrides --managers). MAX bounds horizontal scaling, which is
        /// not built yet: today MIN managers run.
        #[arg(long, requires = "slurm", value_name = "MIN[..MAX]")]
        nodes: Option<String>,
        /// Another sbatch argument for the manager jobs (with --slurm;
        /// repeat it): --sbatch-arg=--account=ckpt --sbatch-arg=--time=12:00:00
        #[arg(long, requires = "slurm", allow_hyphen_values = true)]
        sbatch_arg: Vec<String>,
    },
    /// Stop the service that `icheck up` started in a state directory.
    ///
    /// Example: icheck down --state-dir /tmp/ick
    Down {
        /// The state directory given to `icheck up`.
        #[arg(long, default_value = "icheck-state")]
        state_dir: PathBuf,
    },
    /// Show checkpoint nodes, applications and agents.
    ///
    /// Example: icheck status --state-dir /tmp/ick
    ///          icheck status --config /etc/icheck/icheck.toml --json
    Status {
        #[command(flatten)]
        target: ConfigArgs,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// List an application's checkpoint versions and where each lives
    /// (agent memory, PFS), with the mode (MR or SHMR) a restart of each
    /// must use.
    ///
    /// Example: icheck versions heat2d --state-dir /tmp/ick
    Versions {
        #[command(flatten)]
        target: ConfigArgs,
        /// Application name.
        app: String,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Delete an application's checkpoints from agent memory and the PFS.
    ///
    /// Example: icheck delete heat2d --state-dir /tmp/ick --yes
    Delete {
        #[command(flatten)]
        target: ConfigArgs,
        /// Application name.
        app: String,
        /// Really delete (without it, only say what would go).
        #[arg(long)]
        yes: bool,
        /// Print JSON for scripts: what would go (or went), and whether
        /// it was deleted.
        #[arg(long)]
        json: bool,
    },
    /// Drain a checkpoint node: it takes no new agents, and the agents it
    /// runs move to other nodes (with their ranks' newest versions) at
    /// their applications' next probes.
    ///
    /// Example: icheck drain local-1 --state-dir /tmp/ick   (--undo opens it again)
    Drain {
        #[command(flatten)]
        target: ConfigArgs,
        /// Node name, as `icheck status` shows it.
        node: String,
        /// Open the node for agents again.
        #[arg(long)]
        undo: bool,
    },
    /// Give checkpoint nodes back to the resource manager (Slurm): their
    /// applications' agents move to other nodes first, over the fabric,
    /// then their managers' jobs are cancelled.
    ///
    /// Name the nodes, or let the controller pick --count of them (most
    /// free checkpoint memory and fewest agents first, thesis Algorithm 9).
    /// At least one live node stays. Draining a node in Slurm (`scontrol
    /// update NodeName=N State=DRAIN`) releases it the same way.
    ///
    /// Example: icheck release --count 2 --state-dir /shared/icheck --wait 300
    ///          icheck release ck7 --state-dir /shared/icheck
    Release {
        #[command(flatten)]
        target: ConfigArgs,
        /// Nodes to release, as `icheck status` shows them.
        nodes: Vec<String>,
        /// Without node names: how many nodes the controller picks.
        #[arg(long, conflicts_with = "nodes")]
        count: Option<u32>,
        /// Wait up to this many seconds until the nodes are gone.
        #[arg(long)]
        wait: Option<f64>,
    },
    /// Run the controller daemon in the foreground (logs to stderr; ICHECK_LOG sets the level).
    ///
    /// With two controllers in ControllerAddress, one runs as the primary and
    /// the other with --standby: the standby keeps a copy of the primary's
    /// journal and takes over (with a higher epoch) when the primary is
    /// silent for TakeoverAfter seconds; a primary that finds a newer one
    /// becomes its standby.
    ///
    /// Example: icheck controller --config config/icheck.toml --state-dir /var/lib/icheck
    ///          icheck controller --config config/icheck.toml --state-dir /var/lib/icheck --standby
    Controller {
        /// Static configuration file.
        #[arg(long)]
        config: PathBuf,
        /// Where to write controller.addr (the address actually listened on)
        /// and keep the journal (overrides ControllerStateDir).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// How to start a manager that died: `local` starts it on this host
        /// as `icheck up` did, recorded in --state-dir's pids file (what
        /// `icheck up` uses); `slurm` submits a manager job for its node
        /// with the sbatch arguments `icheck up --slurm` recorded in
        /// --state-dir. Without it, dead managers stay down until an
        /// operator starts them.
        #[arg(long, value_parser = ["local", "slurm"], requires = "state_dir")]
        launcher: Option<String>,
        /// Start as the standby controller (the second entry of
        /// ControllerAddress unless --listen names another).
        #[arg(long)]
        standby: bool,
        /// This controller's entry of ControllerAddress ("host:port";
        /// default: the first, or the second with --standby).
        #[arg(long)]
        listen: Option<String>,
        /// Where the journal is kept (default: --state-dir, else
        /// ControllerStateDir). Two controllers on one host need two.
        #[arg(long)]
        journal_dir: Option<PathBuf>,
    },
    /// Run a manager daemon for one checkpoint node in the foreground.
    ///
    /// Example: icheck manager --config config/icheck.toml --node cpnode1
    Manager {
        /// Static configuration file.
        #[arg(long)]
        config: PathBuf,
        /// This checkpoint node's name (default: the host name).
        #[arg(long)]
        node: Option<String>,
        /// Address the agents bind and advertise: a host, an IP, or a
        /// network interface (its first IPv4 address, e.g. ib0), so that
        /// one configuration serves every node (e.g. under srun).
        /// Default: ICHECK_AGENT_ADDRESS, else the file's AgentAddress.
        #[arg(long)]
        address: Option<String>,
    },
    /// Inspect and test the RDMA fabric (libfabric) on this machine.
    #[command(subcommand)]
    Fabric(FabricCommand),
    /// Run a job under supervision: relaunch it from its newest complete
    /// version when it fails.
    ///
    /// Starts the command after `--` (mpirun or srun), waits for it, and
    /// when it fails starts it again, so that the application restarts from
    /// its newest complete version (icheck_init reports RESTART), with the
    /// process count --policy gives. Ends with a summary on standard error:
    /// attempts, the versions each relaunch restarted from (with --app),
    /// the work lost and the wall time. SIGINT and SIGTERM go to the job and
    /// end the supervision. SIGUSR1 is Slurm's time-limit warning (`sbatch
    /// --signal=B:USR1@300`, with `exec icheck run` as the batch script):
    /// the application's newest version is copied to the PFS (with --app),
    /// the job keeps running (it gets the signal too with --signal-job) and
    /// is not relaunched after it. SIGUSR2 goes to the job.
    ///
    /// Exit status: 0 when an attempt succeeded; 3 when the last permitted
    /// attempt failed too; 130 when interrupted; 1 when the command could
    /// not be started.
    ///
    /// Examples:
    ///   icheck run --app heat -- mpirun -np 4 ./heat2d --app heat
    ///   icheck run --max-restarts 5 --policy shrink -- srun -n 64 ./app
    Run {
        #[command(flatten)]
        target: ConfigArgs,
        /// The application's name at the service, to report the versions
        /// relaunches restart from and the work lost (needs the admin token
        /// or the application's capability; optional).
        #[arg(long)]
        app: Option<String>,
        /// Relaunches after the first attempt.
        #[arg(long, default_value_t = 3)]
        max_restarts: u32,
        /// Process count of a relaunch: same (the command unchanged), shrink
        /// (one process fewer per failure; the application restores with
        /// icheck_add_adapt*), rebuild (the first attempt's count; a
        /// replacement takes the lost rank's place).
        #[arg(long, value_enum, default_value = "same")]
        policy: run::Policy,
        /// Pass SIGUSR1 on to the job as well (for applications that commit
        /// when it arrives; without a handler it would end them).
        #[arg(long)]
        signal_job: bool,
        /// The job: a launcher and its arguments.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell) to standard output.
    ///
    /// Example: icheck completions bash > /etc/bash_completion.d/icheck
    ///          icheck completions zsh > ~/.zfunc/_icheck  (with ~/.zfunc in fpath)
    /// (`make install` installs the bash, zsh and fish scripts.)
    Completions {
        /// The shell to complete in.
        shell: clap_complete::Shell,
    },
    /// Write the manual pages: icheck.1 and one per subcommand
    /// (icheck-up.1, icheck-fabric-info.1, ...).
    ///
    /// Example: icheck man --out-dir ~/.local/share/man/man1 && man icheck-up
    /// (`make install` installs them under share/man/man1.)
    Man {
        /// Directory to write the pages into (created if missing).
        #[arg(long)]
        out_dir: PathBuf,
    },
}

#[derive(Args)]
struct ConfigArgs {
    /// Static/client configuration file (default: ICHECK_CONFIG).
    #[arg(long, conflicts_with = "state_dir")]
    config: Option<PathBuf>,
    /// State directory of `icheck up` (uses its icheck.toml).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

impl ConfigArgs {
    /// The configuration file these arguments name, and where the name came from.
    fn path(&self) -> (PathBuf, &'static str) {
        match (&self.config, &self.state_dir) {
            (Some(path), _) => (path.clone(), "--config"),
            (None, Some(dir)) => (dir.join(local::CLIENT_CONFIG), "--state-dir"),
            (None, None) => match std::env::var_os("ICHECK_CONFIG") {
                Some(path) => (PathBuf::from(path), "ICHECK_CONFIG"),
                None => (PathBuf::from("icheck-state").join(local::CLIENT_CONFIG), "the default state directory"),
            },
        }
    }

    fn load(&self) -> Result<icheck_core::config::StaticConfig> {
        let (path, from) = self.path();
        if !path.exists() {
            bail!(
                "no configuration at {} (from {from}): is a service running? `icheck up --state-dir DIR` starts a \
                 local one; point --state-dir, --config or ICHECK_CONFIG at the one you mean",
                path.display()
            );
        }
        Ok(icheck_core::config::StaticConfig::load(&path)?)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

#[derive(Subcommand)]
enum FabricCommand {
    /// List the providers and domains that offer what icheck needs
    /// (reliable-datagram endpoints with RMA read and write).
    ///
    /// Example: icheck fabric info --provider tcp
    Info {
        #[command(flatten)]
        fabric: FabricArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Move a buffer between two processes with RMA and verify it word by word.
    ///
    /// Starts a second `icheck` process that registers a patterned buffer; this
    /// process reads it in chunks, verifies every word, and writes a new
    /// pattern back, which the other process verifies. The read is made
    /// twice: cold (it connects, and lands in memory never touched before,
    /// as a first restart does) and warm (connected, into touched memory:
    /// the rate to compare with the fabric's nominal one). The write is warm.
    ///
    /// Example: icheck fabric selftest --provider shm --size 256MiB --chunk 4MiB
    Selftest {
        #[command(flatten)]
        fabric: FabricArgs,
        #[command(flatten)]
        transfer: TransferArgs,
        /// Bytes to move (any size; need not be a multiple of the chunk).
        #[arg(long, default_value = "64MiB")]
        size: ByteSize,
    },
    /// The exposing half of the self-test: print where the buffer is as one
    /// JSON line, then answer `verify SEED` lines on stdin until `quit`/EOF.
    #[command(hide = true)]
    Target {
        #[command(flatten)]
        fabric: FabricArgs,
        /// Bytes to expose.
        #[arg(long)]
        size: ByteSize,
        /// Pattern the buffer is filled with.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Kill peers in the middle of RMA, many times, while this process keeps
    /// its endpoint (the reproducer for provider faults in error paths);
    /// prints a JSON report. Exits non-zero (or dies of a signal) on failure,
    /// and with 75 when a call into libfabric spins without returning (shm
    /// on the lock of a peer killed while it held it).
    ///
    /// Example: icheck fabric churn --provider tcp --role initiator --rounds 40
    #[command(hide = true)]
    Churn {
        #[command(flatten)]
        fabric: FabricArgs,
        /// The side this process plays; the other side is killed.
        #[arg(long, value_enum)]
        role: selftest::ChurnRole,
        /// Peers to kill.
        #[arg(long, default_value_t = 40)]
        rounds: u32,
        /// Seed of the kill delays.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// The initiating half of the self-test: read the target named by the
    /// JSON line in `--peer`, verify it against `--read-seed`, write
    /// `--write-seed` back, and print the transfer rates as JSON.
    #[command(hide = true)]
    Initiator {
        #[command(flatten)]
        fabric: FabricArgs,
        #[command(flatten)]
        transfer: TransferArgs,
        /// The target's announcement (JSON).
        #[arg(long)]
        peer: String,
        /// Pattern expected in the target's buffer.
        #[arg(long, default_value_t = 1)]
        read_seed: u64,
        /// Pattern written back.
        #[arg(long, default_value_t = 2)]
        write_seed: u64,
    },
}

#[derive(Args, Clone)]
struct FabricArgs {
    /// libfabric provider: tcp, shm, sockets, verbs;ofi_rxm, psm2, cxi, efa, ...
    /// or auto. FI_PROVIDER in the environment takes precedence.
    #[arg(long, default_value = "auto")]
    provider: String,
    /// Domain to use (for tcp and sockets: the interface, e.g. lo).
    #[arg(long)]
    domain: Option<String>,
}

impl FabricArgs {
    fn config(&self) -> FabricConfig {
        FabricConfig { provider: Some(self.provider.clone()), domain: self.domain.clone() }
    }

    fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--provider".to_string(), self.provider.clone()];
        if let Some(domain) = &self.domain {
            args.extend(["--domain".to_string(), domain.clone()]);
        }
        args
    }
}

#[derive(Args, Clone)]
struct TransferArgs {
    /// Largest single RMA operation.
    #[arg(long, default_value = "1MiB")]
    chunk: ByteSize,
    /// RMA operations kept in flight.
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Seconds without any completion before a transfer is abandoned.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
}

impl TransferArgs {
    fn options(&self) -> Result<TransferOptions> {
        let chunk_size = usize::try_from(self.chunk.0).context("--chunk does not fit this machine")?;
        Ok(TransferOptions {
            chunk_size,
            inflight: self.inflight,
            timeout: Duration::from_secs(self.timeout),
            delivery_complete: true,
        })
    }
}

fn main() {
    // Before anything else: undo the crash handlers libfabric's PSM
    // dependencies installed at load time (see the function's docs).
    let disarmed = icheck_core::fabric::disarm_provider_crash_handlers();
    // A blocked signal mask survives exec: a daemon started by a process
    // that blocks SIGTERM (a supervisor, a benchmark waiting for Ctrl-C)
    // would ignore `icheck down` until its SIGKILL. Unblocked here, before
    // any thread inherits the mask.
    let stop_signals: nix::sys::signal::SigSet =
        [nix::sys::signal::Signal::SIGINT, nix::sys::signal::Signal::SIGTERM, nix::sys::signal::Signal::SIGHUP]
            .into_iter()
            .collect();
    let _ = stop_signals.thread_unblock();
    // Still single-threaded, and before libfabric reads its parameters.
    icheck_core::fabric::set_daemon_provider_defaults();
    let cli = Cli::parse();
    init_logging(matches!(cli.command, Command_::Controller { .. } | Command_::Manager { .. }));
    if disarmed {
        tracing::debug!("reset the signal handlers libpsm installed at load time");
    }
    // The daemons' file reads (handed-over checks, the PFS level) follow it.
    if let Err(err) = icheck_core::kernel_copy::check_placed_reads_env() {
        eprintln!("icheck: error: {err}");
        std::process::exit(2);
    }
    if let Err(err) = run(cli) {
        eprintln!("icheck: error: {err:#}");
        std::process::exit(1);
    }
}

/// Logs to standard error: `ICHECK_LOG` filters (default info for a daemon,
/// which a site may start by hand under srun or systemd, warn otherwise);
/// ANSI colours only on a terminal, never into a log file or a pipe;
/// `ICHECK_LOG_FORMAT=json` for one JSON object per line.
fn init_logging(daemon: bool) {
    use std::io::IsTerminal;
    let default = if daemon { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("ICHECK_LOG").unwrap_or_else(|_| default.into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match std::env::var("ICHECK_LOG_FORMAT").as_deref() {
        Ok("json") => builder.json().init(),
        Ok(other) if !other.is_empty() && other != "text" => {
            builder.with_ansi(false).init();
            tracing::warn!(format = other, "ICHECK_LOG_FORMAT is text or json; logging text");
        }
        _ => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

fn run(cli: Cli) -> Result<()> {
    use icheck_core::protocol::{ClientReply, ClientRequest};
    match cli.command {
        Command_::Fabric(command) => run_fabric(command),
        Command_::Run { target, app, max_restarts, policy, signal_job, command } => {
            // The job talks to the service these arguments name.
            let config = match target.path() {
                (path, _) if path.exists() => Some(std::path::absolute(path)?),
                _ => None,
            };
            type Ask<T> = Option<Box<dyn Fn() -> T + Send + Sync>>;
            let (newest_version, flush): (Ask<Option<u64>>, Ask<Result<(), String>>) = match app {
                Some(app) => {
                    let service = target.load()?;
                    let (for_newest, for_flush, name) = (service.clone(), service, app.clone());
                    (
                        Some(Box::new(move || local::newest_complete_version(&for_newest, &app))),
                        Some(Box::new(move || local::flush_newest(&for_flush, &name))),
                    )
                }
                None => (None, None),
            };
            let options = run::RunOptions { max_restarts, policy, newest_version, config, flush, signal_job };
            let (attempts, gave_up) = run::supervise(&command, options)?;
            eprintln!("{}", run::summary(&attempts, gave_up));
            if gave_up {
                std::process::exit(run::EXIT_GAVE_UP);
            }
            Ok(())
        }
        Command_::Completions { shell } => {
            use std::io::Write;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut <Cli as clap::CommandFactory>::command(), "icheck", &mut script);
            match std::io::stdout().write_all(&script) {
                // `icheck completions bash | head` is not an error.
                Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => Err(err.into()),
                _ => Ok(()),
            }
        }
        Command_::Man { out_dir } => {
            std::fs::create_dir_all(&out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
            clap_mangen::generate_to(<Cli as clap::CommandFactory>::command(), &out_dir)
                .with_context(|| format!("cannot write manual pages into {}", out_dir.display()))?;
            Ok(())
        }
        Command_::Controller { config: path, state_dir, launcher, standby, listen, journal_dir } => {
            let config = icheck_core::config::StaticConfig::load(&path)?;
            let tokens = config.daemon_tokens(&path)?;
            let launcher: Option<std::sync::Arc<dyn icheck_service::launcher::Launcher>> =
                match (launcher.as_deref(), &state_dir) {
                    (Some("local"), Some(dir)) => {
                        Some(std::sync::Arc::new(icheck_service::launcher::LocalLauncher { dir: dir.clone() }))
                    }
                    (Some("slurm"), Some(dir)) => {
                        Some(std::sync::Arc::new(icheck_service::launcher::SlurmLauncher::from_state_dir(dir)))
                    }
                    _ => None,
                };
            let options = icheck_service::controller::ControllerOptions {
                state_dir,
                journal_dir,
                launcher,
                standby,
                listen,
                tokens,
            };
            icheck_service::controller::serve(config, options)?;
            Ok(())
        }
        Command_::Manager { config: path, node, address } => {
            let mut config = icheck_core::config::StaticConfig::load(&path)?;
            let chosen = address.or_else(|| std::env::var(icheck_core::config::AGENT_ADDRESS_ENV).ok());
            if let Some(chosen) = chosen.filter(|a| !a.is_empty()) {
                config.agent_address = icheck_service::manager::resolve_agent_address(&chosen);
            }
            config.manager_tokens(&path)?;
            icheck_core::fabric::check_provider(&config.fabric)
                .with_context(|| format!("configuration file {}: [fabric]", path.display()))?;
            let node = node.unwrap_or_else(|| {
                std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "node".into())
            });
            let span = tracing::info_span!("manager", %node);
            let _guard = span.enter();
            runtime()?.block_on(icheck_service::manager::run(config, node))?;
            Ok(())
        }
        Command_::Up {
            managers,
            state_dir,
            provider,
            heartbeat,
            port,
            detach,
            store_dir,
            manager_relaunches,
            kill_silent_after,
            warm_pool,
            huge_pages,
            standby,
            takeover_after,
            client_idle_timeout,
            slurm,
            partition,
            nodes,
            sbatch_arg,
        } => {
            let (managers, slurm) = match slurm {
                false => (managers, None),
                true => {
                    let (min, max) = match &nodes {
                        Some(range) => local::parse_node_range(range)?,
                        None => (managers, managers),
                    };
                    let mut sbatch_args: Vec<String> = partition.iter().map(|p| format!("--partition={p}")).collect();
                    sbatch_args.extend(sbatch_arg);
                    (min, Some(local::SlurmUp { sbatch_args, max_nodes: max }))
                }
            };
            if !(kill_silent_after.is_finite() && kill_silent_after >= 0.0) {
                bail!("--kill-silent-after {kill_silent_after}: expected a number of seconds, 0 or more");
            }
            let options = local::UpOptions {
                slurm,
                state_dir: state_dir.clone(),
                managers,
                provider,
                heartbeat,
                port,
                store_dir,
                manager_relaunches,
                kill_silent_after,
                warm_pool,
                huge_pages,
                standby,
                takeover_after,
                client_idle_timeout,
            };
            let config_path = local::up(&options)?;
            let config = icheck_core::config::StaticConfig::load(&config_path)?;
            if let ClientReply::Status(report) =
                icheck_core::control::request_blocking(&config, &ClientRequest::Status)?
            {
                local::print_status(&report);
            }
            if detach {
                println!(
                    "icheck up: running in the background; stop with `icheck down --state-dir {}`",
                    state_dir.display()
                );
                return Ok(());
            }
            println!("icheck up: press Ctrl-C to stop");
            runtime()?.block_on(tokio::signal::ctrl_c())?;
            local::down(&state_dir)
        }
        Command_::Down { state_dir } => local::down(&state_dir),
        Command_::Versions { target, app, json } => {
            let report = local::versions(&target.load()?, &app)?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => local::print_versions(&report),
            }
            Ok(())
        }
        Command_::Delete { target, app, yes, json } => {
            let config = target.load()?;
            let report = local::versions(&config, &app)?;
            if yes {
                icheck_core::control::request_blocking(&config, &ClientRequest::DeleteApp { name: app.clone() })?;
            }
            match (json, yes) {
                (true, _) => {
                    let out = serde_json::json!({ "deleted": yes, "versions": report });
                    println!("{}", serde_json::to_string_pretty(&out)?);
                }
                (false, false) => {
                    local::print_versions(&report);
                    println!("(nothing deleted: add --yes to delete these checkpoints)");
                }
                (false, true) => println!("deleted every checkpoint of {app}"),
            }
            Ok(())
        }
        Command_::Release { target, nodes, count, wait } => {
            let config = target.load()?;
            let request = ClientRequest::ReleaseNodes { count: count.unwrap_or(u32::from(nodes.is_empty())), nodes };
            let releasing = match icheck_core::control::request_blocking(&config, &request)? {
                ClientReply::Releasing(nodes) => nodes,
                ClientReply::Error(reason) => bail!("{reason}"),
                other => bail!("unexpected answer from the controller: {other:?}"),
            };
            println!("icheck release: releasing {}: their agents move to other nodes first", releasing.join(", "));
            if let Some(limit) = wait {
                let deadline = std::time::Instant::now() + Duration::from_secs_f64(limit);
                loop {
                    // A status request that fails (a busy or restarting
                    // controller) is asked again until the deadline.
                    let left = match icheck_core::control::request_blocking(&config, &ClientRequest::Status) {
                        Ok(ClientReply::Status(report)) => report
                            .nodes
                            .iter()
                            .filter(|n| n.alive && releasing.contains(&n.node))
                            .map(|n| n.node.clone())
                            .collect::<Vec<_>>()
                            .join(", "),
                        Ok(other) => format!("(unexpected answer from the controller: {other:?})"),
                        Err(err) => format!("(no status: {err})"),
                    };
                    if left.is_empty() {
                        println!("icheck release: released {}", releasing.join(", "));
                        break;
                    }
                    if std::time::Instant::now() > deadline {
                        bail!("{left} still running after {limit} s; the controller's log says why");
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
            Ok(())
        }
        Command_::Drain { target, node, undo } => {
            let config = target.load()?;
            let request = ClientRequest::DrainNode { node: node.clone(), drain: !undo };
            icheck_core::control::request_blocking(&config, &request)?;
            match undo {
                false => {
                    println!("{node} is draining: no new agents; its agents move at their applications' next probes")
                }
                true => println!("{node} takes agents again"),
            }
            Ok(())
        }
        Command_::Status { target, json } => {
            let config = target.load()?;
            match icheck_core::control::request_blocking(&config, &ClientRequest::Status)? {
                ClientReply::Status(report) if json => println!("{}", serde_json::to_string_pretty(&report)?),
                ClientReply::Status(report) => local::print_status(&report),
                other => bail!("unexpected answer from the controller: {other:?}"),
            }
            Ok(())
        }
    }
}

fn run_fabric(command: FabricCommand) -> Result<()> {
    match command {
        FabricCommand::Info { fabric, json } => {
            let providers = list_providers(&fabric.config())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&providers)?);
                return Ok(());
            }
            println!("{}", libfabric_version());
            let mut table = local::plain_table(&["PROVIDER", "FABRIC", "DOMAIN", "MR_MODE", "TX_SIZE"], &[4]);
            for p in providers {
                let m = p.mr_mode;
                let bits: Vec<&str> = [
                    (m.local, "LOCAL"),
                    (m.virt_addr, "VIRT_ADDR"),
                    (m.allocated, "ALLOCATED"),
                    (m.prov_key, "PROV_KEY"),
                    (m.endpoint, "ENDPOINT"),
                ]
                .into_iter()
                .filter_map(|(on, name)| on.then_some(name))
                .collect();
                let bits = if bits.is_empty() { "-".to_string() } else { bits.join(",") };
                table.add_row(vec![p.provider, p.fabric, p.domain, bits, p.tx_size.to_string()]);
            }
            println!("{}", table.trim_fmt());
            Ok(())
        }
        FabricCommand::Target { fabric, size, seed } => {
            let size = usize::try_from(size.0).context("--size does not fit this machine")?;
            // The halves of a churn or selftest run end themselves when a
            // killed peer wedged their fabric, as `churn` does: spinning
            // until a caller's bound, or for ever once that caller was
            // killed, would take a core from everything else on the host.
            icheck_service::wedge::exit_when_wedged("this fabric target exits with the wedge's exit code");
            let target = Target::start(&fabric.config(), size, seed)?;
            target.serve(std::io::stdin().lock(), std::io::stdout().lock())?;
            Ok(())
        }
        FabricCommand::Churn { fabric, role, rounds, seed } => {
            let icheck = std::env::current_exe().context("cannot find the icheck executable")?;
            // A peer killed while it held its shm region's lock leaves this
            // process's next call spinning inside libfabric 1.17 for ever:
            // say so by the exit code within seconds, as a manager does.
            icheck_service::wedge::exit_when_wedged("fabric churn exits with the wedge's exit code");
            let report = selftest::churn(&icheck, &fabric.config(), role, rounds, seed)?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        FabricCommand::Initiator { fabric, transfer, peer, read_seed, write_seed } => {
            let announcement: TargetAnnouncement =
                serde_json::from_str(&peer).context("--peer is not a target announcement (JSON)")?;
            icheck_service::wedge::exit_when_wedged("this fabric initiator exits with the wedge's exit code");
            let report =
                selftest::run_initiator(&fabric.config(), &announcement, &transfer.options()?, read_seed, write_seed)?;
            println!(
                "{}",
                serde_json::json!({
                    "bytes": report.read.bytes,
                    "read_gbps": report.read.gb_per_s(),
                    "warm_read_gbps": report.warm_read.gb_per_s(),
                    "warm_read_ops": report.warm_read.operations,
                    "write_gbps": report.write.gb_per_s(),
                    "read_ops": report.read.operations,
                    "write_ops": report.write.operations,
                })
            );
            Ok(())
        }
        FabricCommand::Selftest { fabric, transfer, size } => selftest_command(&fabric, &transfer, size),
    }
}

fn selftest_command(fabric: &FabricArgs, transfer: &TransferArgs, size: ByteSize) -> Result<()> {
    let (read_seed, write_seed) = (0x001c_4ec4, 0x00c4_ec1c);
    println!(
        "icheck fabric selftest: {size} between two processes, chunk {}, {} in flight",
        transfer.chunk, transfer.inflight
    );
    let exe = std::env::current_exe().context("cannot find the icheck executable")?;
    let mut command = Command::new(exe);
    command
        .args(["fabric", "target", "--size", &size.0.to_string(), "--seed", &read_seed.to_string()])
        .args(fabric.to_args());
    let mut target = TargetProcess::spawn(command)?;
    let announcement = target.announcement().clone();
    println!(
        "  target  pid {}: provider {}, {} bytes registered (key {:#x})",
        target.pid(),
        announcement.provider,
        announcement.region.len,
        announcement.region.key
    );
    let report = selftest::run_initiator(&fabric.config(), &announcement, &transfer.options()?, read_seed, write_seed)?;
    println!(
        "  fi_read : {:>8.3} GB/s, {} operations, every word verified (cold: connecting, into new memory)",
        report.read.gb_per_s(),
        report.read.operations
    );
    println!(
        "  fi_read : {:>8.3} GB/s, {} operations, every word verified (warm: the fabric's rate)",
        report.warm_read.gb_per_s(),
        report.warm_read.operations
    );
    println!(
        "  fi_write: {:>8.3} GB/s, {} operations (delivery complete)",
        report.write.gb_per_s(),
        report.write.operations
    );
    target.verify(write_seed).context("after the write")?;
    println!("  target verified the written data word by word: ok");
    let status = target.quit()?;
    if !status.success() {
        bail!("the target process exited with {status}");
    }
    println!("selftest passed");
    Ok(())
}
