//! Starting daemons: how `icheck up` starts a local service, and how the
//! controller starts again a manager that died (§6.5.2).
//!
//! A local service lives in a state directory: `pids` names each daemon
//! and its process id (`controller 123`, `manager-local-1 124`), `logs/`
//! holds one log per daemon, `icheck.toml` is the configuration. `icheck
//! down` stops exactly the processes `pids` names, so whoever starts a
//! daemon there records it there.
//!
//! Architecture invariant: a process is signalled or counted as running
//! only if its command line mentions icheck and it is not a zombie, so a
//! recycled PID is never mistaken for a daemon.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The file naming the daemons of a local service and their PIDs.
pub const PIDS: &str = "pids";
/// The configuration file of a local service.
pub const CLIENT_CONFIG: &str = "icheck.toml";

/// Whether `pid` is a live process whose command line mentions icheck (so a
/// recycled PID is never signalled).
pub fn is_icheck_process(pid: u32) -> bool {
    fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains("icheck"))
        && fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
}

/// The daemons `dir/pids` records, as (name, pid).
pub fn read_pids(dir: &Path) -> Vec<(String, u32)> {
    fs::read_to_string(dir.join(PIDS))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (name, pid) = line.rsplit_once(' ')?;
            Some((name.to_string(), pid.parse().ok()?))
        })
        .collect()
}

/// Writes `pids` as `dir/pids`, atomically (through a temporary file).
pub fn write_pids(dir: &Path, pids: &[(String, u32)]) -> std::io::Result<()> {
    let text: String = pids.iter().map(|(name, pid)| format!("{name} {pid}\n")).collect();
    let tmp = dir.join(format!("{PIDS}.tmp-{}", std::process::id()));
    fs::write(&tmp, text).and_then(|_| fs::rename(&tmp, dir.join(PIDS)))
}

/// Records `name` as running with `pid` in `dir/pids` (replacing its line).
pub fn record_pid(dir: &Path, name: &str, pid: u32) -> std::io::Result<()> {
    let mut pids = read_pids(dir);
    match pids.iter_mut().find(|(n, _)| n == name) {
        Some(entry) => entry.1 = pid,
        None => pids.push((name.to_string(), pid)),
    }
    write_pids(dir, &pids)
}

/// Starts `icheck ARGS` (this executable) as a daemon of the service in
/// `dir`: its own process group (a terminal's Ctrl-C meant for the caller
/// does not reach it), stdin closed, output to `dir/logs/LOG_NAME`
/// (appended to with `append`, so what a dead daemon wrote last stays).
pub fn spawn_daemon(dir: &Path, log_name: &str, args: &[&str], append: bool) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    let log_path = dir.join("logs").join(log_name);
    let log = fs::OpenOptions::new().create(true).write(true).append(append).truncate(!append).open(&log_path)?;
    let exe = std::env::current_exe()?;
    Command::new(exe)
        .args(args)
        .envs(icheck_core::fabric::NO_BACKTRACE_ENV)
        .env("ICHECK_LOG", std::env::var("ICHECK_LOG").unwrap_or_else(|_| "info".into()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
}

/// How the controller starts a manager again (the local launcher for
/// `icheck up`; a resource manager's for a cluster).
pub trait Launcher: Send + Sync {
    /// Whether the manager process `pid` of `node` is gone (a live one,
    /// even a stopped or hung one, is never started twice).
    fn is_dead(&self, node: &str, pid: u32) -> bool;
    /// Starts the manager of `node` again; returns its process id.
    fn relaunch(&self, node: &str) -> Result<u32, String>;
}

/// Starts managers as local processes of the service in a state directory,
/// as `icheck up` did, and records them in its `pids`.
pub struct LocalLauncher {
    /// The state directory.
    pub dir: PathBuf,
}

impl Launcher for LocalLauncher {
    fn is_dead(&self, node: &str, pid: u32) -> bool {
        // Someone (`icheck up`, an operator) may have started it again
        // already: then the pids file names the live one.
        let name = format!("manager-{node}");
        let recorded = read_pids(&self.dir).into_iter().find(|(n, _)| *n == name).map(|(_, pid)| pid);
        !is_icheck_process(pid) && recorded.is_none_or(|current| !is_icheck_process(current))
    }

    fn relaunch(&self, node: &str) -> Result<u32, String> {
        let config = self.dir.join(CLIENT_CONFIG);
        let config = config.to_string_lossy();
        let name = format!("manager-{node}");
        let mut child =
            spawn_daemon(&self.dir, &format!("{name}.log"), &["manager", "--config", &config, "--node", node], true)
                .map_err(|err| format!("cannot start a manager for {node} from {}: {err}", self.dir.display()))?;
        let pid = child.id();
        // Reap it when it ends, so a manager that dies again is seen dead
        // (not a zombie child of the controller).
        std::thread::Builder::new()
            .name(format!("icheck-reap-{pid}"))
            .spawn(move || {
                let _ = child.wait();
            })
            .map_err(|err| format!("cannot watch the manager started for {node}: {err}"))?;
        record_pid(&self.dir, &name, pid).map_err(|err| {
            format!(
                "started the manager of {node} (pid {pid}) but cannot record it in {}/{PIDS}: {err}",
                self.dir.display()
            )
        })?;
        Ok(pid)
    }
}
