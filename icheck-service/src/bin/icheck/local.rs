//! `icheck up` / `icheck down`: a controller and N managers as local
//! processes on loopback, with a state directory holding the configuration,
//! logs, pids and the controller's address.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use icheck_core::config::StaticConfig;
use icheck_core::control::request_blocking;
use icheck_core::fabric::{choose_provider, ProviderChoice, Reach};
use icheck_core::protocol::{ClientReply, ClientRequest, StatusReport};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub use icheck_service::launcher::CLIENT_CONFIG;
use icheck_service::launcher::{self, free_ports, is_icheck_process, read_pids, PIDS};

/// Options of `icheck up`.
pub struct UpOptions {
    pub state_dir: PathBuf,
    pub managers: u32,
    pub provider: String,
    pub heartbeat: f64,
    /// Controller port; 0 picks a free one.
    pub port: u16,
    /// The agents' checkpoint store; `None`: on tmpfs, see [`store_dir`].
    pub store_dir: Option<PathBuf>,
    /// `ManagerRelaunches` of the controller.
    pub manager_relaunches: u32,
    /// `KillSilentManagerAfter` of the controller (seconds; 0: never).
    pub kill_silent_after: f64,
    /// Start a standby controller beside the primary.
    pub standby: bool,
    /// `TakeoverAfter` (unset: heartbeat × missed heartbeats).
    pub takeover_after: Option<f64>,
    /// `ClientIdleTimeout`: seconds daemons keep an idle client connection.
    pub client_idle_timeout: f64,
    /// Managers as Slurm jobs instead of local processes.
    pub slurm: Option<SlurmUp>,
    /// `WarmPool` of every manager.
    pub warm_pool: icheck_core::units::ByteSize,
    /// Whether the default store gets a tmpfs of its own with huge pages.
    pub huge_pages: HugePagesChoice,
}

/// `icheck up --huge-pages`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HugePagesChoice {
    /// Mount the default store as a tmpfs with `huge=within_size`.
    On,
    /// Keep the store a plain directory on /dev/shm.
    Off,
}

/// Mounts a tmpfs with 2 MiB pages for new files (`huge=within_size`) at
/// the default store `store`, as large as the tmpfs it sits on, and says
/// how the store backs its files. A store that already is a mount (an
/// earlier `icheck up` left it) is kept; one that holds files is not
/// mounted over, because that would hide the versions a previous service
/// left there. Fails when this process may not mount (not root) or the
/// kernel refuses, naming the store.
fn mount_huge_store(store: &Path) -> Result<String> {
    use icheck_core::pages;
    if pages::is_mount_point(store) {
        return Ok(format!("{} (mounted by an earlier `icheck up`)", pages::huge_pages_under(store)));
    }
    if fs::read_dir(store).is_ok_and(|mut entries| entries.next().is_some()) {
        return Ok(format!(
            "{} (it holds an earlier service's files; huge pages need `icheck down` first)",
            pages::huge_pages_under(store)
        ));
    }
    if !nix::unistd::geteuid().is_root() {
        bail!("--huge-pages on: mounting a tmpfs at the checkpoint store {} needs root", store.display());
    }
    let parent = store.parent().unwrap_or(Path::new("/"));
    let size = nix::sys::statvfs::statvfs(parent).map_or(0, |s| s.blocks() * s.fragment_size());
    let options = match size {
        0 => "huge=within_size,mode=0755".to_string(),
        size => format!("huge=within_size,mode=0755,size={size}"),
    };
    let flags = nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV;
    fs::create_dir_all(store).with_context(|| format!("creating the checkpoint store {}", store.display()))?;
    nix::mount::mount(Some("icheck-store"), store, Some("tmpfs"), flags, Some(options.as_str())).with_context(
        || format!("--huge-pages on: mounting a tmpfs ({options}) at the checkpoint store {}", store.display()),
    )?;
    Ok(pages::huge_pages_under(store).to_string())
}

/// Removes the store at `store`, unmounting it first when `icheck up`
/// mounted it (detached: a process still mapping a file keeps its pages
/// until it lets go, and the directory goes at once).
fn remove_store(store: &Path) -> Result<()> {
    if icheck_core::pages::is_mount_point(store) {
        nix::mount::umount2(store, nix::mount::MntFlags::MNT_DETACH)
            .with_context(|| format!("unmounting the checkpoint store {}", store.display()))?;
    }
    fs::remove_dir_all(store).with_context(|| format!("removing the checkpoint store {}", store.display()))
}

/// `icheck up --slurm`: how the manager jobs are submitted.
pub struct SlurmUp {
    /// sbatch arguments (partition, account, time, ...).
    pub sbatch_args: Vec<String>,
    /// The most checkpoint nodes scaling may use (recorded, not yet used).
    pub max_nodes: u32,
}

/// `MIN` or `MIN..MAX` checkpoint nodes.
pub fn parse_node_range(text: &str) -> Result<(u32, u32)> {
    let bad = || anyhow::anyhow!("--nodes {text:?}: expected MIN or MIN..MAX, e.g. 2..8");
    let (min, max) = match text.split_once("..") {
        Some((min, max)) => (min.trim().parse().map_err(|_| bad())?, max.trim().parse().map_err(|_| bad())?),
        None => {
            let n = text.trim().parse().map_err(|_| bad())?;
            (n, n)
        }
    };
    if min == 0 || max < min {
        bail!("--nodes {text:?}: needs 1 <= MIN <= MAX");
    }
    Ok((min, max))
}

/// Journal directory of the local standby controller, inside the state directory.
pub const STANDBY_DIR: &str = "standby";

/// How long `up` waits for a live controller to listen and write its address.
const CONTROLLER_START_LIMIT: Duration = Duration::from_secs(60);

/// The three secrets of a local service, drawn fresh at every `icheck up`.
struct Tokens {
    client: String,
    admin: String,
    node: String,
}

impl Tokens {
    fn random() -> Result<Tokens> {
        let draw = || icheck_core::credentials::random_hex(16).context("drawing a random token");
        Ok(Tokens { client: draw()?, admin: draw()?, node: draw()? })
    }

    /// The secrets of the service that last ran in `dir`, if its
    /// configuration holds them: a service started again keeps its
    /// secrets, so its users' capabilities (filed under the client token)
    /// still open their applications' copies on the PFS.
    fn kept_or_random(dir: &Path) -> Result<Tokens> {
        let kept = StaticConfig::load(&dir.join(CLIENT_CONFIG)).ok().and_then(|config| {
            let strong = |t: Option<String>| t.filter(|t| icheck_core::credentials::weak_token(t).is_none());
            Some(Tokens {
                client: strong(config.token)?,
                admin: strong(config.admin_token)?,
                node: strong(config.node_token)?,
            })
        });
        match kept {
            Some(tokens) => Ok(tokens),
            None => Tokens::random(),
        }
    }
}

/// The agents' checkpoint store of the service in `dir`: on tmpfs, named
/// after the state directory so two local services never share one.
pub fn store_dir(dir: &Path) -> PathBuf {
    // FNV-1a: a stable, dependency-free name for the path.
    let hash = dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    PathBuf::from(format!("/dev/shm/icheck-{hash:016x}"))
}

fn write_static(
    dir: &Path,
    port: u16,
    standby: Option<u16>,
    tokens: &Tokens,
    options: &UpOptions,
    provider: &ProviderChoice,
) -> Result<PathBuf> {
    let path = dir.join(CLIENT_CONFIG);
    let mut controllers = match standby {
        None => "ControllerAddress = \"127.0.0.1\"".to_string(),
        Some(second) => format!(
            "# The primary and its standby, in the order clients and managers try them.\n\
             ControllerAddress = [\"127.0.0.1:{port}\", \"127.0.0.1:{second}\"]"
        ),
    };
    if let Some(secs) = options.takeover_after {
        controllers.push_str(&format!("\nTakeoverAfter = {secs}"));
    }
    let text = format!(
        "# Written by `icheck up`; also the client configuration (ICHECK_CONFIG={path}).\n\
         # Only its owner may read it (mode 0600): it holds the service's secrets. Give other\n\
         # users a copy without AdminToken and NodeToken (their jobs need only Token).\n\
         {controllers}\nControllerPort = {port}\nMetricsPort = 0\nToken = \"{client}\"\n\
         AdminToken = \"{admin}\"\nNodeToken = \"{node}\"\n\
         HeartBeatInterval = {hb}\nStatusMessageInterval = {status}\nDynamicConfig = \"dynamic.toml\"\n\
         ManagerRelaunches = {relaunches}\nKillSilentManagerAfter = {kill_silent}\nClientIdleTimeout = {idle}\n\
         AgentStoreDir = \"{store}\"\nPfsDir = \"{pfs}\"\n\
         # Backed files each manager keeps for new version files (0: none).\n\
         WarmPool = \"{warm}\"\n\n\
         [fabric]\n# {why}\nprovider = \"{provider}\"\n\n\
         # How applications move data; ICHECK_TRANSFER, ICHECK_RESTORE and ICHECK_MODE override.\n\
         [client]\ntransfer = \"pull\"   # or \"push\", or \"auto\" (both measured, the faster kept)\n\
         restore = \"auto\"    # a restart's data: \"pull\", \"push\" (the agent writes), auto: the agent's file on this host\n\
         mode = \"mr\"         # or \"shmr\"\n\
         staging_buffer = \"64MiB\"\nzero_copy = true\n\
         pfs_interval = 0          # agents copy every Nth version to PfsDir (0: never)\n\
         compression = \"auto\"    # zstd from max_cp_size bytes on; or \"none\", \"zstd\", \"zstd:LEVEL\"\n",
        path = path.display(),
        client = tokens.client,
        admin = tokens.admin,
        node = tokens.node,
        hb = options.heartbeat,
        // Status every second heartbeat: the measurements (memory, the
        // store's bytes, the agents' rates) feed decisions taken over
        // seconds, and each report wakes a manager and the controller (an
        // idle service's cost is mostly such wake-ups).
        status = options.heartbeat * 2.0,
        relaunches = options.manager_relaunches,
        kill_silent = options.kill_silent_after,
        idle = options.client_idle_timeout,
        provider = provider.provider,
        why = provider.reason,
        store = options
            .store_dir
            .as_ref()
            .map_or_else(|| store_dir(dir), |given| std::path::absolute(given).unwrap_or_else(|_| given.clone()))
            .display(),
        pfs = dir.join("pfs").display(),
        warm = options.warm_pool,
    );
    icheck_core::credentials::write_private(&path, text.as_bytes())?;
    Ok(path)
}

fn spawn_daemon(dir: &Path, log_name: &str, args: &[&str]) -> Result<std::process::Child> {
    launcher::spawn_daemon(dir, log_name, args, false).with_context(|| format!("starting {log_name}"))
}

/// [`spawn_daemon`], appending to the daemon's log instead of replacing it.
fn spawn_daemon_appending(dir: &Path, log_name: &str, args: &[&str]) -> Result<std::process::Child> {
    launcher::spawn_daemon(dir, log_name, args, true).with_context(|| format!("starting {log_name}"))
}

fn log_tail(dir: &Path, log_name: &str) -> String {
    let text = fs::read_to_string(dir.join("logs").join(log_name)).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

/// The provider `up` writes into the configuration, with the reason it
/// writes beside it: the one `--provider`
/// names (checked to be offered here), the one `FI_PROVIDER` names (which
/// every daemon obeys anyway), or for `auto` the one
/// [`choose_provider`] takes among those libfabric offers here: `shm`
/// when every daemon runs on this host, libfabric's first that leaves the
/// host when Slurm places the managers.
fn resolve_provider(given: &str, other_hosts: bool) -> Result<ProviderChoice> {
    use icheck_core::fabric::{check_provider, list_providers, FabricConfig};
    let checked = |choice: ProviderChoice| -> Result<ProviderChoice> {
        check_provider(&FabricConfig::provider(&choice.provider)).context("--provider")?;
        Ok(choice)
    };
    if let Ok(named) = std::env::var("FI_PROVIDER") {
        let reason = "FI_PROVIDER in the environment names it; it wins over the configuration".to_string();
        return checked(ProviderChoice { provider: named, reason });
    }
    if !given.is_empty() && given != "auto" {
        return checked(ProviderChoice { provider: given.to_string(), reason: "given with --provider".into() });
    }
    let offered: Vec<String> = list_providers(&FabricConfig::default())
        .context("--provider auto: listing the providers libfabric offers here")?
        .into_iter()
        .map(|p| p.provider)
        .collect();
    let reach = if other_hosts { Reach::Hosts } else { Reach::OneHost };
    let choice = choose_provider(&offered, reach).with_context(|| {
        format!(
            "--provider auto: no provider here reaches {} (offered: {}); name one with --provider",
            if other_hosts { "other hosts" } else { "this host's daemons" },
            if offered.is_empty() { "none".to_string() } else { offered.join(", ") }
        )
    })?;
    let reason = format!("chosen by `icheck up` (--provider auto): {}", choice.reason);
    checked(ProviderChoice { reason, ..choice })
}

/// Starts the local service and waits until every manager is registered.
pub fn up(options: &UpOptions) -> Result<PathBuf> {
    let dir = &options.state_dir;
    fs::create_dir_all(dir.join("logs")).with_context(|| format!("creating state directory {}", dir.display()))?;
    let dir = &dir.canonicalize()?;
    let recorded = read_pids(dir);
    if recorded.iter().any(|(_, pid)| is_icheck_process(*pid)) {
        return restart_dead(dir, &recorded);
    }
    if options.huge_pages == HugePagesChoice::On && (options.store_dir.is_some() || options.slurm.is_some()) {
        bail!(
            "--huge-pages on mounts the local default store; with --store-dir or --slurm, mount the store \
             directory as a tmpfs with huge=within_size yourself (`icheck status` shows what it uses)"
        );
    }
    let provider = resolve_provider(&options.provider, options.slurm.is_some())?;
    println!("icheck up: fabric provider {} ({})", provider.provider, provider.reason);
    if options.store_dir.is_none() && options.slurm.is_none() {
        let store = store_dir(dir);
        let pages = match options.huge_pages {
            HugePagesChoice::On => mount_huge_store(&store)?,
            HugePagesChoice::Off => icheck_core::pages::huge_pages_under(&store).to_string(),
        };
        println!("icheck up: checkpoint store {}: {pages}", store.display());
    }
    let dynamic = dir.join("dynamic.toml");
    if !dynamic.exists() {
        fs::write(&dynamic, include_str!("../../../../config/dynamic.toml")).context("writing dynamic.toml")?;
    }
    let _ = fs::remove_file(dir.join("controller.addr"));
    let tokens = Tokens::kept_or_random(dir)?;
    // With a standby, both addresses are in the configuration before either
    // controller starts (each must know the other).
    let (port, standby_port) = match options.standby {
        false => (options.port, None),
        true if options.port == 0 => {
            let ports = free_ports(2).context("finding two free ports")?;
            (ports[0], Some(ports[1]))
        }
        true => (options.port, Some(free_ports(1).context("finding a free port")?[0])),
    };
    let config_path = write_static(dir, port, standby_port, &tokens, options, &provider)?;
    let config_arg = config_path.to_string_lossy().into_owned();
    let dir_arg = dir.to_string_lossy().into_owned();
    let launcher = match &options.slurm {
        Some(slurm) => {
            fs::write(dir.join(launcher::SLURM_ARGS), slurm.sbatch_args.join("\n") + "\n")
                .context("recording the sbatch arguments")?;
            fs::write(dir.join(launcher::SLURM_MAX_NODES), format!("{}\n", slurm.max_nodes))
                .context("recording the most nodes")?;
            "slurm"
        }
        None => {
            let _ = fs::remove_file(dir.join(launcher::SLURM_ARGS));
            "local"
        }
    };
    let mut controller_process = spawn_daemon(
        dir,
        "controller.log",
        &["controller", "--config", &config_arg, "--state-dir", &dir_arg, "--launcher", launcher],
    )?;
    let controller = controller_process.id();
    fs::write(dir.join(PIDS), format!("controller {controller}\n"))?;
    println!("icheck up: controller started (pid {controller}), waiting for it to listen ...");
    let started = Instant::now();
    let mut told = false;
    let addr = loop {
        if let Ok(addr) = fs::read_to_string(dir.join("controller.addr")) {
            break addr;
        }
        // Our own child: ask its handle (its /proc entry can read empty mid-exec).
        let exited = controller_process.try_wait()?.is_some();
        // A live controller may be slow to open its journal (each step is
        // synced to disk, and a loaded disk takes seconds): wait for it.
        if exited || started.elapsed() > CONTROLLER_START_LIMIT {
            bail!(
                "the controller did not start{}; its log ({}/logs/controller.log) ends with:\n{}",
                if exited { "" } else { " within a minute" },
                dir.display(),
                log_tail(dir, "controller.log")
            );
        }
        if !told && started.elapsed() > Duration::from_secs(5) {
            println!("icheck up: the controller is still opening its journal in {} ...", dir.display());
            told = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let port: u16 =
        addr.trim().rsplit(':').next().and_then(|p| p.parse().ok()).context("controller.addr is malformed")?;
    let config_path = write_static(dir, port, standby_port, &tokens, options, &provider)?;
    let mut pids = format!("controller {controller}\n");
    if options.standby {
        let args = standby_args(&config_arg, &dir_arg);
        let pid = spawn_daemon(dir, "standby.log", &args.iter().map(String::as_str).collect::<Vec<_>>())?.id();
        pids.push_str(&format!("standby {pid}\n"));
        println!("icheck up: standby controller started (pid {pid})");
    }
    let mut wait = Duration::from_secs(20);
    if let Some(slurm) = &options.slurm {
        let launcher = launcher::SlurmLauncher::from_state_dir(dir);
        for _ in 0..options.managers {
            let id = launcher.submit(None).map_err(anyhow::Error::msg)?;
            println!(
                "icheck up: manager submitted to Slurm as job {id} (log: {}/logs/manager-slurm-{id}.log)",
                dir.display()
            );
        }
        println!(
            "icheck up: {} manager job(s); with is_dynamic_hs = true in {}/dynamic.toml the controller asks for up to {} nodes",
            options.managers,
            dir.display(),
            slurm.max_nodes
        );
        // Slurm schedules, then starts: give it longer than local processes.
        wait = Duration::from_secs(120);
    } else {
        for index in 1..=options.managers {
            let node = format!("local-{index}");
            let pid = spawn_daemon(
                dir,
                &format!("manager-{node}.log"),
                &["manager", "--config", &config_arg, "--node", &node],
            )?
            .id();
            pids.push_str(&format!("manager-{node} {pid}\n"));
            println!("icheck up: manager {node} started (pid {pid})");
        }
    }
    fs::write(dir.join(PIDS), pids)?;
    let config = StaticConfig::load(&config_path)?;
    wait_for_managers(&config, options.managers as usize, dir, wait)?;
    if options.standby {
        wait_for_standby(&config, dir)?;
        println!("icheck up: the standby follows the primary's journal");
    }
    println!("icheck up: controller at {}, {} manager(s) ready", addr.trim(), options.managers);
    println!("icheck up: client config: {}", config_path.display());
    println!("           (export ICHECK_CONFIG={})", config_path.display());
    Ok(config_path)
}

/// `icheck up` in a state directory whose service partly runs: starts
/// again, with the directory's configuration, just the daemons that died
/// (a killed manager, a crashed controller), and waits until all answer.
fn restart_dead(dir: &Path, recorded: &[(String, u32)]) -> Result<PathBuf> {
    let dead: Vec<&(String, u32)> = recorded.iter().filter(|(_, pid)| !is_icheck_process(*pid)).collect();
    if dead.is_empty() {
        bail!(
            "a service already runs from {} and all its {} daemons are alive; stop it with `icheck down --state-dir {}`",
            dir.display(),
            recorded.len(),
            dir.display()
        );
    }
    let config_path = dir.join(CLIENT_CONFIG);
    let config = StaticConfig::load(&config_path)?;
    let config_arg = config_path.to_string_lossy().into_owned();
    let dir_arg = dir.to_string_lossy().into_owned();
    println!("icheck up: {} of the {} daemons in {} died; restarting them", dead.len(), recorded.len(), dir.display());
    let mut pids: Vec<(String, u32)> = recorded.to_vec();
    for (name, old_pid) in dead {
        let args: Vec<String> = match name.strip_prefix("manager-") {
            Some(node) => ["manager", "--config", &config_arg, "--node", node].map(String::from).to_vec(),
            None if name == "controller" => ["controller", "--config", &config_arg, "--state-dir", &dir_arg]
                .iter()
                .chain(&["--launcher", if dir.join(launcher::SLURM_ARGS).exists() { "slurm" } else { "local" }])
                .map(|arg| arg.to_string())
                .collect(),
            // A standby started again follows whichever controller is primary.
            None if name == "standby" => standby_args(&config_arg, &dir_arg),
            None => bail!("the pids file in {} names an unknown daemon {name:?}", dir.display()),
        };
        // Appends to the log, so what the dead daemon wrote last stays readable.
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let pid = spawn_daemon_appending(dir, &format!("{name}.log"), &args)?.id();
        println!("icheck up: {name} (pid {old_pid}) had died; started again (pid {pid})");
        // Recorded at once: the controller's launcher reads it before it
        // starts a dead manager itself.
        launcher::record_pid(dir, name, pid)
            .with_context(|| format!("recording {name} in {}/{PIDS}", dir.display()))?;
        if let Some(entry) = pids.iter_mut().find(|(n, _)| n == name) {
            entry.1 = pid;
        }
    }
    let managers = pids.iter().filter(|(name, _)| name.starts_with("manager-")).count();
    wait_for_managers(&config, managers, dir, Duration::from_secs(20))?;
    println!("icheck up: all {} daemons of {} are running again", pids.len(), dir.display());
    Ok(config_path)
}

/// The command line of the local standby controller: the second address,
/// the same state directory (addresses, pids), a journal of its own.
fn standby_args(config_arg: &str, dir_arg: &str) -> Vec<String> {
    let journal = format!("{dir_arg}/{STANDBY_DIR}");
    ["controller", "--standby", "--config", config_arg, "--state-dir", dir_arg, "--journal-dir", &journal]
        .iter()
        .chain(&["--launcher", "local"])
        .map(|arg| arg.to_string())
        .collect()
}

/// Waits until the primary reports a standby attached to its journal.
fn wait_for_standby(config: &StaticConfig, dir: &Path) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Ok(ClientReply::Status(report)) = request_blocking(config, &ClientRequest::Status) {
            if report.controller.is_some_and(|c| c.standby_follows()) {
                return Ok(());
            }
        }
        if started.elapsed() > Duration::from_secs(20) {
            bail!(
                "the standby did not attach to the primary within 20 s; its log ({}/logs/standby.log) ends with:\n{}",
                dir.display(),
                log_tail(dir, "standby.log")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the controller answers and `managers` nodes are alive.
fn wait_for_managers(config: &StaticConfig, managers: usize, dir: &Path, limit: Duration) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Ok(ClientReply::Status(report)) = request_blocking(config, &ClientRequest::Status) {
            if report.nodes.iter().filter(|n| n.alive).count() >= managers {
                return Ok(());
            }
        }
        if started.elapsed() > limit {
            bail!("managers did not all register within {} s; see the logs in {}/logs", limit.as_secs(), dir.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends each of `daemons` (name, pid) that is still an icheck process
/// SIGTERM, then SIGKILL to those still running after 5 s.
fn stop_daemons(daemons: &[(String, u32)]) {
    for (name, pid) in daemons {
        if is_icheck_process(*pid) {
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGTERM);
            println!("icheck down: stopping {name} (pid {pid})");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for (name, pid) in daemons {
        while is_icheck_process(*pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if is_icheck_process(*pid) {
            println!("icheck down: {name} (pid {pid}) ignored SIGTERM; sending SIGKILL");
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
        }
    }
}

/// Stops what `up` started in `dir`: SIGTERM, then SIGKILL after 5 s.
pub fn down(dir: &Path) -> Result<()> {
    let pids = read_pids(dir);
    if pids.is_empty() {
        bail!("no service recorded in {} (no pids file); nothing to stop", dir.display());
    }
    // The controllers first: one still running when a manager exits starts
    // that manager again, under a pid the list read above does not hold
    // (a test's teardown left such a manager running).
    let is_manager = |name: &str| name.starts_with("manager-");
    let controllers: Vec<(String, u32)> = pids.iter().filter(|(name, _)| !is_manager(name)).cloned().collect();
    stop_daemons(&controllers);
    // A manager started again meanwhile is in the file by now.
    let mut managers: Vec<(String, u32)> = pids.into_iter().filter(|(name, _)| is_manager(name)).collect();
    for (name, pid) in read_pids(dir).into_iter().filter(|(name, _)| is_manager(name)) {
        if !managers.iter().any(|(_, known)| *known == pid) {
            managers.push((name, pid));
        }
    }
    stop_daemons(&managers);
    // Manager jobs after the controller, which would otherwise start them again.
    if dir.join(launcher::SLURM_JOBS).exists() {
        let slurm = launcher::SlurmLauncher::from_state_dir(dir);
        let cancelled = slurm.cancel_all(Duration::from_secs(60)).map_err(anyhow::Error::msg)?;
        let ids: Vec<String> = cancelled.iter().map(u64::to_string).collect();
        println!("icheck down: cancelled the manager job(s) {} in Slurm", ids.join(", "));
    }
    let _ = fs::remove_file(dir.join(PIDS));
    let _ = fs::remove_file(dir.join(launcher::PIDS_LOCK));
    let _ = fs::remove_file(dir.join("controller.addr"));
    // Checkpoints in agent memory die with the service.
    let store = StaticConfig::load(&dir.join(CLIENT_CONFIG)).map_or_else(|_| store_dir(dir), |c| c.agent_store_dir);
    if store.exists() {
        remove_store(&store)?;
        println!("icheck down: removed the checkpoint store {}", store.display());
    }
    // The journal describes that memory; without it, it would only make the
    // next `icheck up` wait for versions that no longer exist.
    for journal_dir in [dir.to_path_buf(), dir.join(STANDBY_DIR)] {
        let journal = journal_dir.join(icheck_service::controller::journal::JOURNAL_FILE);
        if journal.exists() {
            fs::remove_file(&journal)
                .with_context(|| format!("removing the controller journal {}", journal.display()))?;
        }
    }
    println!("icheck down: stopped");
    Ok(())
}

/// `init_agent_count` as dynamic.toml spells it, from the status API's
/// form of it (`Fixed(2)`, `Named(NumNodes)`, kept for scripts).
fn init_agent_count_text(api: &str) -> String {
    match api.strip_prefix("Fixed(").and_then(|rest| rest.strip_suffix(')')) {
        Some(count) => count.to_string(),
        None if api == "Named(NumNodes)" => "num_nodes (one agent per application node)".to_string(),
        None => api.to_string(),
    }
}

/// Bytes for people: three significant digits in the largest binary unit
/// that keeps the number at least 1 (a 0.5 MiB checkpoint is 512.0KiB, not 0B).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes}B"),
        _ if value >= 100.0 => format!("{value:.0}{}", UNITS[unit]),
        _ => format!("{value:.1}{}", UNITS[unit]),
    }
}

/// A plain table for a terminal or a pipe: aligned columns, no borders
/// (like `squeue` or `kubectl get`), each column as wide as its widest
/// cell; columns listed in `right` are right-aligned (numbers).
pub fn plain_table(header: &[&str], right: &[usize]) -> comfy_table::Table {
    let mut table = comfy_table::Table::new();
    table.load_style(comfy_table::presets::NOTHING).set_header(header.iter().copied());
    for &column in right {
        if let Some(column) = table.column_mut(column) {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    table
}

/// Prints the status report as tables.
pub fn print_status(report: &StatusReport) {
    println!("NODES");
    let mut nodes = plain_table(
        &["NODE", "PID", "STATE", "HEARTBEAT", "MEM_AVAIL", "AGENTS", "HELD", "NCOPS", "BW", "COPS/MIN", "POWER"],
        &[1, 3, 4, 5, 6, 7, 8, 9, 10],
    );
    let mut details = Vec::new();
    for n in &report.nodes {
        let s = &n.status;
        nodes.add_row(vec![
            n.node.clone(),
            n.pid.to_string(),
            match (n.alive, n.draining, n.given_up) {
                (false, _, true) => "GONE",
                (false, _, false) => "DOWN",
                (true, true, _) => "DRAIN",
                (true, false, _) => "up",
            }
            .to_string(),
            format!("{:.1}s", n.last_heartbeat_secs),
            human_bytes(s.mem_available),
            s.agents.to_string(),
            human_bytes(s.bytes_held),
            s.checkpoint_ops.to_string(),
            format!("{:.2} GB/s", s.bandwidth / 1e9),
            format!("{:.1}", s.cops_per_min),
            s.power_watts.map_or("n/a".to_string(), |w| format!("{w:.1} W")),
        ]);
        let t = &n.trend;
        let rate = t.mem_depletion_rate.map_or("n/a".into(), |r| format!("{:.1} MB/s", r / 1e6));
        let forecast = t.mem_forecast.map_or("n/a".into(), |(low, high)| {
            format!("{}..{} in {:.0}s", human_bytes(low), human_bytes(high), t.horizon_secs)
        });
        let fill = t.agent_fill_rate.map_or("n/a".into(), |f| format!("{f:.3}/s"));
        let dcop = s.last_cop_interval.map_or("n/a".into(), |d| format!("{d:.1}s"));
        details.push(format!(
            "  {}: memory depletion {rate}, forecast {forecast}, agent fill {fill}, Δcop {dcop}",
            n.node
        ));
        if !s.provider.is_empty() {
            details.push(format!("  {}: fabric provider {}", n.node, s.provider));
        }
        if !s.store_pages.is_empty() {
            details.push(format!("  {}: store backs new version files with {}", n.node, s.store_pages));
        }
        if s.manager_anonymous_bytes > 0 {
            details.push(format!(
                "  {}: the manager's own memory {} (heap and fabric buffers, beside the versions)",
                n.node,
                human_bytes(s.manager_anonymous_bytes)
            ));
        }
        if s.warm_bytes > 0 {
            details.push(format!("  {}: warm pool {} ready for new version files", n.node, human_bytes(s.warm_bytes)));
        }
        if s.files_handed_over > 0 {
            details.push(format!(
                "  {}: {} version file(s) handed to restarting ranks on this host (read without the fabric)",
                n.node, s.files_handed_over
            ));
        }
        if let Some(failure) = &n.start_failure {
            details.push(format!("  {}: takes no new agents for now: {failure}", n.node));
        }
    }
    if !report.nodes.is_empty() {
        println!("{}", nodes.trim_fmt());
        for line in details {
            println!("{line}");
        }
    }
    if report.nodes.is_empty() && report.apps.is_empty() && report.journal.is_none() {
        println!("  (not shown: nodes and applications need the admin token, AdminToken or ICHECK_ADMIN_TOKEN)");
    }
    println!("APPLICATIONS");
    if report.apps.is_empty() {
        println!("  (none)");
    }
    for a in &report.apps {
        let r = &a.registration;
        let agents: Vec<String> = a.agents.iter().map(|g| format!("{}@{}", g.id, g.node)).collect();
        let version = a.latest.as_ref().map_or("none".to_string(), |v| {
            // A malleable application's versions say which size wrote them.
            let resized = if v.epoch > 0 || v.ranks != r.ranks {
                format!(", written by {} processes, resize epoch {}", v.ranks, v.epoch)
            } else {
                String::new()
            };
            format!("{} ({}, committed in {:.3}s{resized})", v.version, human_bytes(v.bytes), v.commit_secs)
        });
        let persisted = if a.persisted { "  [finished, persisted]" } else { "" };
        let persisted =
            if r.encrypted { format!("{persisted}  [PFS copies encrypted]") } else { persisted.to_string() };
        println!(
            "  {:<16} ranks {:<4} nodes {:<3} mode {}  agents [{}]  latest complete version: {version}{persisted}",
            r.name,
            r.ranks,
            r.nodes,
            r.mode,
            agents.join(", ")
        );
        if let Some(copy) = &a.pfs_copy {
            println!(
                "  {:<16} PFS copy of version {}: {} -> {} (ratio {:.2}), compression {:.3}s, writing {:.3}s",
                "",
                copy.version,
                human_bytes(copy.raw),
                human_bytes(copy.stored),
                copy.ratio(),
                copy.compress_secs,
                copy.write_secs
            );
        }
        println!("  {:<16} {}", "", protection_line(a));
        if let Some(transfer) = &a.transfer {
            println!("  {:<16} transfer: {transfer}", "");
        }
        let health = &a.pfs_health;
        if health.failed > 0 || health.skipped > 0 {
            println!(
                "  {:<16} PFS copies failed: {}, skipped (previous copy still running): {}{}",
                "",
                health.failed,
                health.skipped,
                health.last_failure.as_ref().map_or(String::new(), |f| format!("; last failure: {f}"))
            );
        }
        if !a.commits.is_empty() {
            let recent: Vec<String> = a
                .commits
                .iter()
                .rev()
                .take(8)
                .rev()
                .map(|c| format!("v{} {:.3}s/{}ag", c.version, c.commit_secs, c.agents))
                .collect();
            println!("  {:<16} commits (newest {} of {}): {}", "", recent.len(), a.commits.len(), recent.join(", "));
        }
        for c in &a.agent_changes {
            println!(
                "  {:<16} agents {} -> {} after version {} ({:.3}s, {} moved)",
                "",
                c.from,
                c.to,
                c.after_version,
                c.secs,
                human_bytes(c.moved_bytes)
            );
        }
        if a.scaling_settled {
            println!("  {:<16} agent count settled (Algorithm 5)", "");
        }
        for reason in &a.dropped {
            println!("  {:<16} dropped: {reason}", "");
        }
        for (node, since) in &a.unreached_nodes {
            println!(
                "  {:<16} the job cannot reach node {node} (reported {since:.0} s ago): its agents go elsewhere",
                ""
            );
        }
    }
    println!("init_agent_count in force: {}", init_agent_count_text(&report.init_agent_count));
    if let Some(c) = &report.controller {
        let standby = c.standby.as_ref().map_or("no standby attached".to_string(), |s| {
            format!("standby {} (lag {} events, last ack {:.1}s ago)", s.peer, s.lag_events, s.last_ack_secs)
        });
        let takeover = c.took_over_unix_ms.map_or("no takeover".to_string(), |ms| {
            let ago = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |now| now.as_millis().saturating_sub(u128::from(ms)) as f64 / 1000.0);
            format!("{} takeover(s), the last {ago:.0}s ago", c.takeovers)
        });
        let acting = if c.lease { "PRIMARY" } else { "NOT ACTING" };
        println!("controller: {} {acting} at epoch {}; {standby}; {takeover}", c.address, c.epoch);
        if !c.lease || c.controllers.len() > 1 {
            println!("  lease: {}", c.lease_reason);
        }
    }
    match &report.journal {
        Some(j) => {
            println!(
                "journal: {} ({} events, {} bytes, controller incarnation {})",
                j.path, j.records, j.bytes, j.incarnation
            );
            if let Some(damage) = &j.damage {
                println!("journal DAMAGED at start: {damage}");
            }
        }
        None => println!("journal: none (no ControllerStateDir): a restarted controller forgets agent memory"),
    }
}

/// `icheck versions APP`: what the controller holds in agent memory and what
/// the PFS directory holds.
/// What the controller knows of `app`: with the admin token, from the
/// whole status; otherwise asked with the capability the application's
/// jobs kept for this user.
/// The application's newest complete version as the controller knows it
/// (None: unknown, unreachable or not allowed to ask).
pub fn newest_complete_version(config: &StaticConfig, app: &str) -> Option<u64> {
    app_report(config, app).ok().flatten()?.latest.map(|v| v.version)
}

/// Asks the controller to copy the application's newest version to the
/// PFS, as an operator (admin token) or as its owner (kept capability).
pub fn flush_newest(config: &StaticConfig, app: &str) -> Result<(), String> {
    let capability = match config.admin_token() {
        Some(_) => String::new(),
        None => kept_capability(config, app)?,
    };
    match request_blocking(config, &ClientRequest::FlushApp { name: app.to_string(), capability }) {
        Ok(ClientReply::Ok) => Ok(()),
        Ok(ClientReply::Error(reason)) => Err(reason),
        Ok(other) => Err(format!("unexpected answer from the controller: {other:?}")),
        Err(err) => Err(format!("controller unreachable ({err})")),
    }
}

/// The application's capability as this user's capability store keeps it,
/// for requests made without the admin token; the error names the file.
fn kept_capability(config: &StaticConfig, app: &str) -> Result<String, String> {
    let store = config.capability_store();
    match store.load(app) {
        Ok(Some(capability)) => Ok(capability.expose().to_string()),
        Ok(None) => Err(format!(
            "this needs the admin token or {app}'s capability, and none is kept at {}",
            store.path(app).display()
        )),
        Err(err) => Err(err.to_string()),
    }
}

fn app_report(config: &StaticConfig, app: &str) -> Result<Option<icheck_core::protocol::AppReport>, String> {
    if config.admin_token().is_some() {
        return match request_blocking(config, &ClientRequest::Status) {
            Ok(ClientReply::Status(report)) => Ok(report.apps.into_iter().find(|a| a.registration.name == app)),
            Ok(other) => Err(format!("unexpected answer from the controller: {other:?}")),
            Err(err) => Err(format!("controller unreachable ({err})")),
        };
    }
    let capability = kept_capability(config, app).map_err(|why| format!("not shown: {why}"))?;
    match request_blocking(config, &ClientRequest::AppStatus { name: app.to_string(), capability }) {
        Ok(ClientReply::AppStatus(report)) => Ok(report.map(|r| *r)),
        Ok(ClientReply::Error(reason)) => Err(reason),
        Ok(other) => Err(format!("unexpected answer from the controller: {other:?}")),
        Err(err) => Err(format!("controller unreachable ({err})")),
    }
}

/// What `icheck versions` reports of one application (also as JSON).
#[derive(serde::Serialize)]
pub struct VersionsReport {
    /// The application.
    pub app: String,
    /// Its newest complete version in agent memory, if the controller has one.
    pub agent_memory: Option<MemoryVersion>,
    /// The agents holding it ("id@node").
    pub agents: Vec<String>,
    /// Why agent memory could not be asked (no token or capability, no
    /// controller), or that the application is not registered.
    pub agent_memory_note: Option<String>,
    /// The PFS directory, if one is configured.
    pub pfs_dir: Option<PathBuf>,
    /// Complete versions on the PFS, oldest first.
    pub pfs: Vec<PfsVersion>,
}

/// A complete version in agent memory.
#[derive(serde::Serialize)]
pub struct MemoryVersion {
    /// Version number.
    pub version: u64,
    /// Bytes of all ranks.
    pub bytes: u64,
    /// Ranks that wrote it.
    pub ranks: u32,
    /// The mode of the registration it was recorded under, which a restart
    /// must use ("mr" or "shmr").
    pub mode: icheck_core::protocol::TransferMode,
}

/// A complete version on the PFS.
#[derive(serde::Serialize)]
pub struct PfsVersion {
    /// Version number.
    pub version: u64,
    /// Files it is made of.
    pub files: usize,
    /// Bytes of the ranks' data.
    pub raw_bytes: u64,
    /// Bytes on the PFS (after compression).
    pub stored_bytes: u64,
    /// Who wrote it.
    pub writer: String,
    /// The mode its files were written in ("mr": one per process, "shmr":
    /// one per node), which a restart must use; `null` for copies written
    /// before the PFS recorded it.
    pub mode: Option<icheck_core::protocol::TransferMode>,
}

/// Gathers what `icheck versions` reports.
pub fn versions(config: &StaticConfig, app: &str) -> Result<VersionsReport> {
    let mut report = VersionsReport {
        app: app.to_string(),
        agent_memory: None,
        agents: Vec::new(),
        agent_memory_note: None,
        pfs_dir: config.pfs_dir.clone(),
        pfs: Vec::new(),
    };
    match app_report(config, app) {
        Ok(Some(a)) => {
            report.agents = a.agents.iter().map(|g| format!("{}@{}", g.id, g.node)).collect();
            report.agent_memory = a.latest.as_ref().map(|v| MemoryVersion {
                version: v.version,
                bytes: v.bytes,
                ranks: v.ranks,
                mode: a.registration.mode,
            });
        }
        Ok(None) => report.agent_memory_note = Some("not registered with the controller".into()),
        Err(why) => report.agent_memory_note = Some(why),
    }
    if let Some(dir) = &config.pfs_dir {
        let pfs = icheck_core::pfs::PfsStore::new(dir);
        for version in pfs.versions(app)? {
            let manifest = pfs.manifest(app, version)?;
            report.pfs.push(PfsVersion {
                version,
                files: manifest.entries.len(),
                raw_bytes: manifest.entries.iter().map(|e| e.manifest.total_len).sum(),
                stored_bytes: manifest.entries.iter().map(|e| e.stored_len).sum(),
                writer: manifest.writer.to_string(),
                mode: manifest.mode,
            });
        }
    }
    Ok(report)
}

/// Prints what `icheck versions` reports, for people.
pub fn print_versions(report: &VersionsReport) {
    println!("{}", report.app);
    let agents = report.agents.join(", ");
    match (&report.agent_memory, &report.agent_memory_note) {
        (Some(v), _) => println!(
            "  agent memory: version {} ({}, {} ranks, in {} mode) on agents [{agents}]",
            v.version,
            human_bytes(v.bytes),
            v.ranks,
            v.mode
        ),
        (None, Some(note)) => println!("  agent memory: {note}"),
        (None, None) => println!("  agent memory: no complete version (agents [{agents}])"),
    }
    let Some(dir) = &report.pfs_dir else {
        println!("  PFS: no PfsDir configured");
        return;
    };
    if report.pfs.is_empty() {
        println!("  PFS ({}): no complete version", dir.display());
    }
    for v in &report.pfs {
        println!(
            "  PFS ({}): version {}, {} file(s), {} raw, {} stored, written by {}, {}",
            dir.display(),
            v.version,
            v.files,
            human_bytes(v.raw_bytes),
            human_bytes(v.stored_bytes),
            v.writer,
            v.mode.map_or("mode not recorded".to_string(), |mode| format!("in {mode} mode"))
        );
    }
}

/// One application's redundancy across nodes, for `icheck status`: the
/// policy, which version is protected (or being protected or rebuilt), why
/// not, and the data-loss model's exposure of the newest version.
fn protection_line(a: &icheck_core::protocol::AppReport) -> String {
    let state = match (a.rebuilding, a.protecting, a.protected, &a.protection_problem) {
        (true, ..) => "rebuilding after a lost node".to_string(),
        (_, _, _, Some(problem)) => format!("NOT PROTECTED: {problem}"),
        (_, Some(v), Some(p), _) => format!("protected: version {p}; protecting version {v}"),
        (_, Some(v), None, _) => format!("protecting version {v}"),
        (_, None, Some(p), _) => format!("protected: version {p}"),
        (_, None, None, _) if a.redundancy.is_none() => "primary copies only".to_string(),
        (_, None, None, _) => "nothing protected yet".to_string(),
    };
    let waiting = a.protection_waiting.map_or(String::new(), |v| format!("; version {v} waits to be protected next"));
    let exposure = a.exposure.map_or(String::new(), |p| format!("; chance the newest version is lost: {p:.2e}"));
    format!("redundancy {}: {state}{waiting}{exposure}", a.redundancy)
}

#[cfg(test)]
mod tests {
    use super::{human_bytes, init_agent_count_text, plain_table};

    #[test]
    fn table_columns_fit_long_node_names_and_numbers_align_right() {
        let mut table = plain_table(&["NODE", "PID", "STATE"], &[1]);
        table.add_row(vec!["n1", "7", "up"]);
        table.add_row(vec!["checkpoint-node-17.cluster.example", "123456", "DOWN"]);
        let text = table.trim_fmt();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        // Each column starts where its header does, whatever the name's length.
        let state = lines[0].find("STATE").unwrap();
        assert_eq!(lines[1].find("up"), Some(state), "{text}");
        assert_eq!(lines[2].find("DOWN"), Some(state), "{text}");
        // Numbers end where their header ends.
        let pid_end = lines[0].find("PID").unwrap() + 3;
        assert_eq!(lines[1].find('7').map(|i| i + 1), Some(pid_end), "{text}");
        assert_eq!(lines[2].find("123456").map(|i| i + 6), Some(pid_end), "{text}");
    }

    #[test]
    fn init_agent_count_is_printed_as_configured() {
        assert_eq!(init_agent_count_text("Fixed(2)"), "2");
        assert!(init_agent_count_text("Named(NumNodes)").starts_with("num_nodes"));
    }

    #[test]
    fn sizes_keep_their_magnitude() {
        assert_eq!(human_bytes(0), "0B");
        assert_eq!(human_bytes(1000), "1000B");
        assert_eq!(human_bytes(512 << 10), "512KiB");
        assert_eq!(human_bytes(1536 << 10), "1.5MiB");
        assert_eq!(human_bytes(256 << 20), "256MiB");
        assert_eq!(human_bytes(3 << 30), "3.0GiB");
    }
}
