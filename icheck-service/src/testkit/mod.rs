//! Helpers for multi-process tests: a local service started with the real
//! `icheck up` in its own state directory and stopped (by PID, through
//! `icheck down`) when dropped, even when the test fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

pub mod interrupt;
pub mod netns;
pub mod slurm;

use icheck_core::config::StaticConfig;
use icheck_core::protocol::StatusReport;

/// A local service in its own state directory.
pub struct LocalService {
    /// The `icheck` executable.
    pub icheck: PathBuf,
    /// Arguments `icheck up` was given (before `--state-dir`).
    up_args: Vec<String>,
    /// Environment for the daemons (they inherit `icheck up`'s), such as
    /// `ICHECK_FAILPOINTS` or `ICHECK_LOG`, so one test can arm failpoints
    /// or read debug logs without touching the environment of the other
    /// tests in its process.
    daemon_env: Vec<(String, String)>,
    /// State directory (config, logs, pids).
    pub dir: PathBuf,
    /// The client configuration `icheck up` wrote.
    pub config: StaticConfig,
    /// Stops the service if the process is interrupted before it drops
    /// ([`interrupt::stop_on_interrupt`]).
    _on_interrupt: interrupt::Registered,
}

impl LocalService {
    /// Runs `icheck up --detach` with `managers` managers and `extra` flags
    /// in a fresh directory named after `name` and this process.
    pub fn up(icheck: &Path, name: &str, managers: u32, extra: &[&str]) -> LocalService {
        LocalService::up_with_dynamic(icheck, name, managers, extra, None)
    }

    /// [`up`](Self::up), with `dynamic` as the dynamic configuration file.
    pub fn up_with_dynamic(
        icheck: &Path,
        name: &str,
        managers: u32,
        extra: &[&str],
        dynamic: Option<&str>,
    ) -> LocalService {
        LocalService::up_with_failpoints(icheck, name, managers, extra, dynamic, None)
    }

    /// [`up_with_dynamic`](Self::up_with_dynamic), with the daemons started
    /// under `ICHECK_FAILPOINTS=failpoints` (see [`icheck_core::failpoint`]).
    pub fn up_with_failpoints(
        icheck: &Path,
        name: &str,
        managers: u32,
        extra: &[&str],
        dynamic: Option<&str>,
        failpoints: Option<&str>,
    ) -> LocalService {
        let env: Vec<(&str, &str)> =
            failpoints.map(|spec| (icheck_core::failpoint::FAILPOINTS_ENV, spec)).into_iter().collect();
        LocalService::up_with_env(icheck, name, managers, extra, dynamic, &env)
    }

    /// [`up_with_dynamic`](Self::up_with_dynamic), with the daemons started
    /// with `env` added to this process's environment (e.g.
    /// `("ICHECK_LOG", "info,icheck_service::agent=debug")` for a test that
    /// reads the agents' debug lines).
    pub fn up_with_env(
        icheck: &Path,
        name: &str,
        managers: u32,
        extra: &[&str],
        dynamic: Option<&str>,
        env: &[(&str, &str)],
    ) -> LocalService {
        let dir = std::env::temp_dir().join(format!("icheck-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(text) = dynamic {
            std::fs::create_dir_all(&dir).expect("create the state directory");
            std::fs::write(dir.join("dynamic.toml"), text).expect("write dynamic.toml");
        }
        let mut up_args: Vec<String> = ["up", "--detach", "--managers", &managers.to_string()].map(String::from).into();
        // Fast failure detection unless the test sets its own heartbeat.
        if !extra.contains(&"--heartbeat") {
            up_args.extend(["--heartbeat", "0.5"].map(String::from));
        }
        // The tests were written against tcp, which `icheck up` took by
        // default before it chose shm on one host; a test that means
        // another provider (or `auto`) says so.
        if !extra.contains(&"--provider") {
            up_args.extend(["--provider", "tcp"].map(String::from));
        }
        up_args.extend(extra.iter().map(|s| s.to_string()));
        let (stopper, state) = (icheck.to_path_buf(), dir.clone());
        let on_interrupt = interrupt::on_interrupt(format!("the service in {}", dir.display()), move || {
            let config = StaticConfig::load(&state.join("icheck.toml")).ok();
            stop_service(&stopper, &state, config.as_ref(), true);
        });
        let mut service = LocalService {
            icheck: icheck.to_path_buf(),
            up_args,
            daemon_env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            config: StaticConfig::default(),
            dir,
            _on_interrupt: on_interrupt,
        };
        service.start();
        service
    }

    fn start(&mut self) {
        let _starting = interrupt::hold_off();
        let mut up = Command::new(&self.icheck);
        up.args(&self.up_args).arg("--state-dir").arg(&self.dir);
        up.envs(self.daemon_env.iter().map(|(k, v)| (k, v)));
        let out = up.output().expect("run icheck up");
        assert!(
            out.status.success(),
            "icheck up failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.config = StaticConfig::load(&self.config_path()).expect("icheck up wrote a valid config");
    }

    /// `icheck down` then `icheck up` again in the same state directory: a
    /// fresh service (new controller, managers and agent memory) that keeps
    /// the directory's PFS level.
    pub fn relaunch(&mut self) {
        let _ = Command::new(&self.icheck).args(["down", "--state-dir"]).arg(&self.dir).output();
        self.start();
    }

    /// `icheck up` again in the running service's directory: starts again
    /// just the daemons that died (as an operator would after a crash).
    pub fn up_again(&self) -> String {
        let _starting = interrupt::hold_off();
        let mut up = Command::new(&self.icheck);
        up.args(&self.up_args).arg("--state-dir").arg(&self.dir);
        up.envs(self.daemon_env.iter().map(|(k, v)| (k, v)));
        let out = up.output().expect("run icheck up");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "icheck up (again) failed: {text}");
        text
    }

    /// A copy of the client configuration without `PfsDir`: a job using it
    /// has no PFS level, so whatever it restores came from agent memory.
    pub fn config_without_pfs(&self) -> PathBuf {
        let text = std::fs::read_to_string(self.config_path()).expect("read the client configuration");
        let kept: String = text.lines().filter(|l| !l.starts_with("PfsDir")).map(|l| format!("{l}\n")).collect();
        let path = self.dir.join("client-no-pfs.toml");
        std::fs::write(&path, kept).expect("write the client configuration without a PFS");
        path
    }

    /// Path of the client configuration.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("icheck.toml")
    }

    /// `icheck status --json`.
    pub fn status(&self) -> StatusReport {
        let out = Command::new(&self.icheck).args(["status", "--json", "--state-dir"]).arg(&self.dir).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("status --json prints a StatusReport")
    }

    /// The controllers' status report, or why there is none.
    pub fn try_status(&self) -> Result<StatusReport, String> {
        use icheck_core::protocol::{ClientReply, ClientRequest};
        match icheck_core::control::request_blocking(&self.config, &ClientRequest::Status) {
            Ok(ClientReply::Status(status)) => Ok(status),
            other => Err(format!("no status: {other:?}")),
        }
    }

    /// With `--standby`: the pids-file name of the controller acting as
    /// the primary now ("controller" or "standby"; each keeps its address
    /// for life).
    pub fn primary_name(&self) -> Option<&'static str> {
        let address = self.try_status().ok()?.controller?.address;
        Some(if address == self.config.controller_endpoints()[0] { "controller" } else { "standby" })
    }

    /// PID of a daemon by its name in the pids file ("controller", "manager-local-1").
    pub fn pid_of(&self, name: &str) -> u32 {
        let pids = std::fs::read_to_string(self.dir.join("pids")).unwrap();
        pids.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).unwrap().trim().parse().unwrap()
    }

    /// Starts another manager for `node` (e.g. after killing the first);
    /// it is killed when the returned guard drops.
    pub fn start_manager(&self, node: &str) -> ChildGuard {
        let child = Command::new(&self.icheck)
            .args(["manager", "--node", node, "--config"])
            .arg(self.config_path())
            .spawn()
            .expect("start a manager");
        ChildGuard(child)
    }

    /// Drains `node` as an operator would (`icheck drain NODE`): its
    /// agents move away on their applications' next probes.
    pub fn drain(&self, node: &str) {
        let out = Command::new(&self.icheck).args(["drain", node, "--state-dir"]).arg(&self.dir).output().unwrap();
        assert!(out.status.success(), "icheck drain {node}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// A daemon's log.
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("logs").join(name)).unwrap_or_default()
    }

    /// Prints the last `lines` lines of every daemon's log to stderr.
    fn print_log_tails(&self, lines: usize) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("logs")) else { return };
        for entry in entries.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let tail = all[all.len().saturating_sub(lines)..].join("\n");
            eprintln!("---- last lines of {} ----\n{tail}", entry.path().display());
        }
    }
}

impl Drop for LocalService {
    fn drop(&mut self) {
        // A failing test leaves the daemons' last words behind, since the
        // directory holding their logs goes next.
        if std::thread::panicking() {
            self.print_log_tails(40);
        }
        stop_service(&self.icheck, &self.dir, Some(&self.config), false);
    }
}

/// Stops the service in `dir` (`icheck down`: its daemons, by PID) and
/// removes what it leaves: the directory, the store of `config` (when it
/// was read), the capabilities its jobs kept, and the shm regions of the
/// processes that died. With `report`, `icheck down`'s lines go to
/// standard error (the daemons it stopped, and any it had to kill).
fn stop_service(icheck: &Path, dir: &Path, config: Option<&StaticConfig>, report: bool) {
    let down = Command::new(icheck).args(["down", "--state-dir"]).arg(dir).output();
    if let (true, Ok(out)) = (report, &down) {
        for line in String::from_utf8_lossy(&out.stdout).lines().chain(String::from_utf8_lossy(&out.stderr).lines()) {
            eprintln!("    {line}");
        }
    }
    // ICHECK_KEEP_LOGS=1 keeps the directory (logs, configuration) to
    // read after a test or benchmark; the store goes either way.
    if std::env::var_os("ICHECK_KEEP_LOGS").is_some() {
        eprintln!("kept the service's directory {}", dir.display());
        if let Some(config) = config {
            let _ = std::fs::remove_dir_all(&config.agent_store_dir);
        }
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
    if let Some(config) = config {
        forget_capabilities(config);
    }
    // Daemons and ranks this test killed left their shm regions.
    icheck_core::fabric::reclaim_dead_processes_shm_regions();
}

/// Removes the capabilities jobs kept for the service of `config` (its
/// tokens are random per test, so the directory is this test's alone).
pub fn forget_capabilities(config: &StaticConfig) {
    let _ = std::fs::remove_dir_all(config.capability_store().dir());
}

/// The capability a job of `app` kept for the service of `config`.
pub fn kept_capability(config: &StaticConfig, app: &str) -> Option<String> {
    config.capability_store().load(app).ok().flatten().map(|c| c.expose().to_string())
}

/// A process a test started; killed (by its PID) and reaped on drop.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether `pid` is a running process: one of its threads is neither gone
/// nor a zombie. (A killed process's main thread can turn zombie while
/// its other threads are still exiting, its sockets still open: a
/// manager so took 5 s to close its controller connection on a busy host,
/// and a test that took the zombie main thread for the end raced the
/// controller's noticing.)
pub fn process_running(pid: u32) -> bool {
    thread_states(pid).is_some_and(|states| states.iter().any(|state| state.is_some_and(|s| s != 'Z')))
}

/// Whether every thread of `pid` is stopped (SIGSTOP takes effect thread
/// by thread; a test that needs the whole process paused waits for this).
pub fn process_stopped(pid: u32) -> bool {
    thread_states(pid).is_some_and(|states| states.iter().all(|state| *state == Some('T')))
}

/// The state letter (`R`, `S`, `T`, `Z`, ...) of each thread of `pid`, from
/// `/proc/PID/task/*/stat` (`None` for a thread whose stat could not be
/// read); `None` when the process is gone.
fn thread_states(pid: u32) -> Option<Vec<Option<char>>> {
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let state = |stat: String| stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    Some(
        threads
            .flatten()
            .map(|thread| std::fs::read_to_string(thread.path().join("stat")).ok().and_then(state))
            .collect(),
    )
}

/// An `mpirun` command for `np` ranks as the tests and benchmarks run
/// them: as root, oversubscribed, unbound, in its own process group, with
/// Open MPI's shared-memory files and its session directory in a directory
/// of the job's own (named after `label`, created, and returned: remove it
/// when the job is done, and kill the job with [`kill_process_tree`]). A
/// killed `mpirun` cannot remove its session directory, about 8 MB of PMIx
/// segments, which otherwise stays in TMPDIR for good.
pub fn mpirun(label: &str, np: u32) -> std::io::Result<(Command, PathBuf)> {
    use std::os::unix::process::CommandExt;
    // Once an interrupt's clean-up has begun this waits for good: no job
    // starts while (or after) the jobs are killed.
    drop(interrupt::hold_off());
    static JOBS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let shm = PathBuf::from(format!("/dev/shm/icheck-{label}-mpi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&shm)?;
    // Each job leads a process group of its own, out of a terminal's
    // Ctrl-C: an interrupted benchmark kills them itself.
    static ON_INTERRUPT: std::sync::OnceLock<interrupt::Registered> = std::sync::OnceLock::new();
    ON_INTERRUPT.get_or_init(|| interrupt::on_interrupt("the MPI jobs this process started", kill_own_mpi_jobs));
    let mut command = Command::new("mpirun");
    command
        .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &np.to_string()])
        .env("OMPI_MCA_btl", "self,vader")
        .env("OMPI_MCA_btl_vader_backing_directory", &shm)
        .env("OMPI_MCA_orte_tmpdir_base", &shm)
        .process_group(0);
    Ok((command, shm))
}

/// Kills every job this process started: each child of this process
/// that is an `mpirun` or runs one below it (a supervisor such as `icheck
/// run`, which would start the job again) is killed with all it started
/// ([`kill_process_tree`]). Then removes the jobs' shm directories
/// ([`mpirun`] names them after this process).
fn kill_own_mpi_jobs() {
    let me = std::process::id();
    let is_mpirun =
        |pid: &u32| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "mpirun");
    let children: Vec<u32> = processes_and_parents().filter(|(_, parent)| *parent == me).map(|(pid, _)| pid).collect();
    for child in children {
        if process_tree(child).iter().any(is_mpirun) {
            kill_process_tree(child);
        }
    }
    let ours = format!("-mpi-{me}-");
    for entry in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("icheck-") && name.contains(&ours) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Every process (from /proc) with its parent's PID.
fn processes_and_parents() -> impl Iterator<Item = (u32, u32)> {
    std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|entry| {
        let child: u32 = entry.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
        // Fields after the command name: state, then the parent's pid.
        let parent = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        Some((child, parent))
    })
}

/// `pid` and every process descended from it, parents first (from /proc).
pub fn process_tree(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = processes_and_parents().collect();
    let mut tree = vec![pid];
    let mut at = 0;
    while at < tree.len() {
        let parent = tree[at];
        tree.extend(parents.iter().filter(|(_, p)| *p == parent).map(|(c, _)| *c));
        at += 1;
    }
    tree
}

/// SIGKILLs `pid` and all its descendants and waits (up to 10 s) until
/// they are gone. `mpirun` puts every rank in a process group of its own,
/// so killing its group leaves the ranks running (and checkpointing) for a
/// while; a test that starts the next run at once must kill them all.
pub fn kill_process_tree(pid: u32) {
    use nix::sys::signal::{kill, Signal};
    let tree = process_tree(pid);
    for member in &tree {
        let _ = kill(nix::unistd::Pid::from_raw(*member as i32), Signal::SIGKILL);
    }
    poll_until(Duration::from_secs(10), || tree.iter().all(|member| !process_running(*member)));
}

/// Polls `done` every 100 ms; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, done: impl FnMut() -> bool) {
    assert!(poll_until(timeout, done), "timed out after {timeout:?} waiting for {what}");
}

/// Reads all of `pipe` (a child's stdout or stderr) on a thread of its
/// own, so that a chatty child never blocks on a full pipe while its
/// caller waits for it to end; the handle gives the text (invalid UTF-8
/// replaced).
pub fn read_in_background(mut pipe: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Waits up to `bound` for `child` to exit; if it is still running then,
/// kills (SIGKILL) and reaps it and returns `None`. A child that cannot
/// be waited for counts as still running.
pub fn wait_or_kill(child: &mut std::process::Child, bound: Duration) -> Option<std::process::ExitStatus> {
    if poll_until(bound, || matches!(child.try_wait(), Ok(Some(_)))) {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Polls `done` every 100 ms until it holds (true) or `timeout` passes
/// (false), for callers that explain a timeout themselves.
pub fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !done() {
        if start.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    true
}

/// The `icheck` executable next to the running test's target directory
/// (`target/<profile>/icheck`), which `cargo test --workspace` builds.
pub fn icheck_in_target() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("test binary lives in target/<profile>/deps");
    let icheck = profile_dir.join("icheck");
    assert!(icheck.exists(), "{} is missing: build the workspace first (cargo build --workspace)", icheck.display());
    icheck
}

impl LocalService {
    /// The address of the controller's `/metrics` (`metrics.addr`).
    pub fn metrics_address(&self) -> String {
        let address = std::fs::read_to_string(self.dir.join("metrics.addr")).expect("icheck up enables /metrics");
        address.trim().to_string()
    }

    /// The body of the controller's `GET /metrics`, asked with the admin token.
    pub fn metrics(&self) -> String {
        scrape_metrics(&self.metrics_address(), &self.config.admin_token().expect("icheck up writes AdminToken"))
    }
}

/// The body of `GET /metrics` at `address` (host:port), asked with the
/// bearer secret `token` (the admin or metrics token).
pub fn scrape_metrics(address: &str, token: &str) -> String {
    let response = http_get_metrics(address, Some(token));
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
}

/// The whole response to `GET /metrics` at `address`, with a bearer
/// secret or without one.
pub fn http_get_metrics(address: &str, token: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).expect("connect to /metrics");
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    stream.write_all(format!("GET /metrics HTTP/1.1\r\nHost: icheck\r\n{auth}\r\n").as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// The value of the sample `name{labels}` in a Prometheus text body.
pub fn metric_sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' ')?.parse().ok())
}
