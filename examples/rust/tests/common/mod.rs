//! What the multi-process test files share: `mpirun` jobs of the example
//! application, started and cleaned up by PID.

#![allow(dead_code)] // each test file uses its own subset

pub mod install;
pub mod python;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use icheck_core::config::StaticConfig;
use icheck_core::control::BlockingConnection;
use icheck_service::testkit::{poll_until, LocalService};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// The example application.
pub const EXAMPLE: &str = env!("CARGO_BIN_EXE_mpi_checkpoint");

/// An `mpirun` job in its own process group; killed (the whole group) on
/// drop. Open MPI's shared-memory files go to a directory of the job's own,
/// removed on drop, so a killed job leaves nothing in /dev/shm.
pub struct Job {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
    shm_dir: PathBuf,
}

/// A spawned child's standard output as lines and its standard error as
/// text, collected by two threads as they arrive (both must be piped).
pub fn collect_output(child: &mut Child) -> (Arc<Mutex<Vec<String>>>, Arc<Mutex<String>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stderr = Arc::new(Mutex::new(String::new()));
    let (out, err) = (child.stdout.take().expect("stdout piped"), child.stderr.take().expect("stderr piped"));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    let sink = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let mut text = sink.lock().unwrap();
            text.push_str(&line);
            text.push('\n');
        }
    });
    (lines, stderr)
}

impl Job {
    pub fn start(np: u32, config: &Path, args: &[&str], env: &[(&str, &str)]) -> Job {
        Job::start_program(EXAMPLE, np, config, args, env)
    }

    /// [`start`](Self::start) for another program.
    pub fn start_program(program: &str, np: u32, config: &Path, args: &[&str], env: &[(&str, &str)]) -> Job {
        let (mut command, shm_dir) =
            icheck_service::testkit::mpirun("test", np).expect("create the job's shared-memory directory");
        command.arg(program).args(args).env("ICHECK_CONFIG", config).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("mpirun starts (is openmpi-bin installed?)");
        let (lines, stderr) = collect_output(&mut child);
        Job { child, lines, stderr, shm_dir }
    }

    pub fn output(&self) -> String {
        format!("stdout:\n{}\nstderr:\n{}", self.lines.lock().unwrap().join("\n"), self.stderr.lock().unwrap())
    }

    /// Waits for a stdout line starting with `prefix`.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(line) = self.lines.lock().unwrap().iter().find(|l| l.starts_with(prefix)) {
                return line.clone();
            }
            let exited = self.child.try_wait().unwrap().is_some();
            assert!(
                !exited || start.elapsed() < Duration::from_millis(200) || self.has(prefix),
                "job exited before printing {prefix:?}\n{}",
                self.output()
            );
            assert!(start.elapsed() < timeout, "no {prefix:?} within {timeout:?}\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for a stdout line starting with any of `prefixes`; returns it.
    pub fn wait_line_any(&mut self, prefixes: &[&str], timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            let found = self.lines.lock().unwrap().iter().find(|l| prefixes.iter().any(|p| l.starts_with(p))).cloned();
            if let Some(line) = found {
                return line;
            }
            let exited = self.child.try_wait().unwrap().is_some();
            assert!(!exited, "job exited before printing any of {prefixes:?}\n{}", self.output());
            assert!(start.elapsed() < timeout, "none of {prefixes:?} within {timeout:?}\n{}", self.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The stdout lines so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn has(&self, prefix: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.starts_with(prefix))
    }

    /// Waits for the job to finish successfully; returns its stdout lines.
    pub fn finish(self, timeout: Duration) -> Vec<String> {
        self.finish_with_stderr(timeout).0
    }

    /// Waits for the job to finish successfully; returns its stdout lines and its stderr.
    pub fn finish_with_stderr(mut self, timeout: Duration) -> (Vec<String>, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100)); // let the readers drain
                assert!(status.success(), "job failed with {status}\n{}", self.output());
                return (self.lines.lock().unwrap().clone(), self.stderr.lock().unwrap().clone());
            }
            assert!(start.elapsed() < timeout, "job still running after {timeout:?}\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the job to end, successfully or not; returns whether it
    /// succeeded and its whole output (stdout, then stderr).
    pub fn finish_any(mut self, timeout: Duration) -> (bool, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100)); // let the readers drain
                return (status.success(), self.output());
            }
            assert!(start.elapsed() < timeout, "job still running after {timeout:?}\n{}", self.output());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// mpirun and every process it started, parents first.
    pub fn processes(&self) -> Vec<u32> {
        icheck_service::testkit::process_tree(self.child.id())
    }

    /// Stops (SIGSTOP) every process of the job but mpirun, then waits
    /// until mpirun has forwarded what they printed (no new stdout line
    /// for 300 ms, at most 5 s): the lines read afterwards are all the job
    /// says before it is killed. Killed at once instead, a job committing
    /// every few milliseconds may have completed versions whose lines
    /// mpirun never forwarded.
    pub fn freeze_ranks(&self) {
        for pid in self.processes().into_iter().skip(1) {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGSTOP);
        }
        let started = Instant::now();
        let mut seen = self.lines.lock().unwrap().len();
        while started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(300));
            let now = self.lines.lock().unwrap().len();
            if now == seen {
                break;
            }
            seen = now;
        }
    }

    /// SIGKILL to mpirun, its ranks and whatever else it started (each rank
    /// sits in a process group of its own), waiting until they are gone.
    pub fn kill(&mut self) {
        // Once mpirun has been reaped its pid (and group id) may be another
        // process's: only a job still running is killed.
        if matches!(self.child.try_wait(), Ok(None)) {
            icheck_service::testkit::kill_process_tree(self.child.id());
            let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.shm_dir);
    }
}

/// Version files the service's agents handed to restarting ranks on their
/// host, as the managers last reported.
pub fn files_handed_over(service: &LocalService) -> u64 {
    service.status().nodes.iter().map(|n| n.status.files_handed_over).sum()
}

/// A client configuration with the service's PFS directory but a
/// controller address nobody listens on.
pub fn without_a_controller(service: &LocalService) -> PathBuf {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let path = service.dir.join("no-controller.toml");
    let text = format!(
        "ControllerPort = {port}\nPfsDir = \"{}\"\n[fabric]\nprovider = \"tcp\"\n[client]\nconnect_timeout = 1.0\n",
        service.dir.join("pfs").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The versions in a job's `COMMITTED version=V` lines, in order.
pub fn committed(lines: &[String]) -> Vec<u64> {
    lines.iter().filter_map(|l| l.strip_prefix("COMMITTED version=")?.split(' ').next()?.parse().ok()).collect()
}

/// The version in a job's `RESTORED version=V step=S verified` line.
pub fn restored(lines: &[String]) -> Option<u64> {
    lines.iter().find_map(|l| l.strip_prefix("RESTORED version=")?.split(' ').next()?.parse().ok())
}

/// Kills `job` and returns the last version it reported complete, once a
/// restart would no longer be handed an agent still busy with the job: an
/// agent pulling from a killed rank waits out the stall bound before it is
/// replaced. The ranks are stopped first, so that every version they
/// reported is read (a restart may find one more, the one in flight).
pub fn kill_for_a_restart(mut job: Job) -> u64 {
    job.freeze_ranks();
    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");
    std::thread::sleep(icheck_core::fabric::TransferOptions::default().timeout + Duration::from_secs(2));
    told
}

/// Restarts `app` (`np` ranks of `mib` MiB, with `config` and `env`) and
/// checks that it restores, verified, the last version its killed run
/// reported complete (`told`) or the one that run was completing. Returns
/// the restart's stderr (its warnings).
pub fn assert_restarts_from(told: u64, np: u32, config: &Path, env: &[(&str, &str)], app: &str, mib: &str) -> String {
    let restart = ["--app", app, "--steps", "0", "--every", "1", "--mib", mib];
    let (lines, stderr) = Job::start(np, config, &restart, env).finish_with_stderr(Duration::from_secs(120));
    let back = restored(&lines).unwrap_or_else(|| panic!("no restart after version {told}: {lines:?}"));
    assert!(back == told || back == told + 1, "told {told}, restored {back}: {lines:?}");
    stderr
}

/// Waits until the job has committed `count` more versions than `after`.
pub fn wait_for_more_commits(job: &Job, after: u64, count: u64, timeout: Duration) -> u64 {
    let ok = poll_until(timeout, || committed(&job.lines()).last().is_some_and(|v| *v >= after + count));
    let last = committed(&job.lines()).last().copied().unwrap_or(0);
    assert!(ok, "the job stopped committing at version {last} (waited for {}):\n{}", after + count, job.output());
    last
}

/// How many of `config`'s controllers answer a Hello as the primary, and
/// the epochs they answer with.
pub fn primaries(config: &StaticConfig) -> Vec<(String, u64)> {
    config
        .controller_endpoints()
        .iter()
        .filter_map(|peer| {
            BlockingConnection::connect_controller(peer, &config.effective_token(), Duration::from_secs(2), 0)
                .ok()
                .map(|(_, epoch)| (peer.clone(), epoch))
        })
        .collect()
}

/// Lines of a controller log that record something (a version, a
/// registration) — what a replaced primary must never write again.
pub fn records(log: &str) -> usize {
    log.lines().filter(|l| l.contains("version complete") || l.contains("application registered")).count()
}

/// Open descriptors and threads of a process, from /proc.
pub fn descriptors_and_threads(pid: u32) -> (usize, usize) {
    let count = |what: &str| std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join(what)).unwrap().count();
    (count("fd"), count("task"))
}

/// What each open descriptor of a process points at (`/proc/PID/fd`
/// links: files, `socket:[inode]`, `anon_inode:[eventfd]`, ...), counted by
/// target, for failure messages about descriptors left open.
pub fn descriptor_targets(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let mut targets = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join("fd")).into_iter().flatten().flatten()
    {
        let target = std::fs::read_link(entry.path()).map_or_else(|e| format!("({e})"), |t| t.display().to_string());
        // Sockets differ by inode only: count them as one kind.
        let kind = if target.starts_with("socket:") { "socket".to_string() } else { target };
        *targets.entry(kind).or_insert(0) += 1;
    }
    targets
}

/// Resident memory of a process in bytes, from /proc.
pub fn resident_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// The resident memory of `pid` that no file backs (heap, stacks, libfabric's
/// buffers; an agent's versions are files and not counted), in bytes.
pub fn anonymous_resident_bytes(pid: u32) -> u64 {
    status_bytes(pid, "RssAnon:")
}

/// The kB figure after `field` in `/proc/PID/status`, in bytes (0 if absent).
fn status_bytes(pid: u32, field: &str) -> u64 {
    icheck_service::kib_field(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap(), field)
}

/// The environment that turns on the agents' debug lines, among them the
/// one [`wait_for_lanes`] waits for.
pub const AGENT_DEBUG_LOG: [(&str, &str); 1] = [("ICHECK_LOG", "info,icheck_service::agent=debug")];

/// Waits until the agent of `app` on `manager` (started with
/// [`AGENT_DEBUG_LOG`]) has opened `lanes` lanes ahead of a restart. It
/// opens them at low priority once a rank completes a version: each is an
/// endpoint of its own, with its sockets and, over tcp, at least 17 MiB
/// of libfabric's buffers, so a count of the manager's descriptors or memory
/// taken before they are open reads them as a leak of what follows.
pub fn wait_for_lanes(service: &LocalService, manager: &str, app: &str, lanes: usize) {
    let log = format!("manager-{manager}.log");
    let (span, count) = (format!("app={app}}}"), format!("lanes={lanes} "));
    let open = poll_until(Duration::from_secs(60), || {
        service
            .log(&log)
            .lines()
            .any(|l| l.contains("lane opened ahead of a restart") && l.contains(&span) && l.contains(&count))
    });
    assert!(open, "the agent of {app} did not open {lanes} lanes\n{}", service.log(&log));
}

/// Connects and closes at once with a reset, as a port scanner does (and
/// leaving no TIME_WAIT behind on this side, so 20,000 of them do not use up
/// the loopback's ephemeral ports).
pub fn connect_and_reset(address: &str) {
    use nix::sys::socket::{setsockopt, sockopt::Linger};
    let stream = std::net::TcpStream::connect(address).unwrap();
    setsockopt(&stream, Linger, &nix::libc::linger { l_onoff: 1, l_linger: 0 }).unwrap();
}

/// A session with the agent at `control` as rank 0 of `app` opens it: the
/// client token in the Hello, then `Open` with the capability `app`'s jobs
/// kept; each answer waited for at most `timeout`.
pub fn open_own_session(
    service: &LocalService,
    app: &str,
    control: &str,
    endpoint: &icheck_core::fabric::Endpoint,
    timeout: Duration,
) -> BlockingConnection {
    use icheck_core::protocol::{AgentReply, AgentRequest};
    let capability =
        icheck_service::testkit::kept_capability(&service.config, app).expect("the job kept its capability");
    let token = service.config.effective_token();
    let mut conn = BlockingConnection::connect(control, &token, Duration::from_secs(5)).unwrap();
    conn.set_timeout(timeout);
    let open =
        AgentRequest::Open { app: app.into(), rank: 0, address: endpoint.address().clone(), capability, pfs_key: None };
    assert_eq!(conn.call::<_, AgentReply>(&open).unwrap(), AgentReply::Ok);
    conn
}

/// Asserts (polling up to 10 s, as reports come every heartbeat) that every
/// live manager runs exactly the agents the status lists on its node.
pub fn managers_run_what_is_listed(service: &LocalService) {
    let mut mismatch = String::new();
    let matches = poll_until(Duration::from_secs(10), || {
        let status = service.status();
        let listed = |node: &str| status.apps.iter().flat_map(|app| &app.agents).filter(|a| a.node == node).count();
        mismatch = (status.nodes.iter().filter(|n| n.alive))
            .filter(|n| n.status.agents as usize != listed(&n.node))
            .map(|n| format!("{} runs {} agents, {} listed", n.node, n.status.agents, listed(&n.node)))
            .collect::<Vec<_>>()
            .join("; ");
        mismatch.is_empty()
    });
    assert!(matches, "{mismatch}");
}

/// Kills the manager of `node` and deletes its store: the node and
/// everything in its memory are gone.
pub fn lose_node(service: &LocalService, node: &str) {
    lose_nodes(service, &[node]);
}

/// [`lose_node`] for several nodes at once (all killed before any store goes).
pub fn lose_nodes(service: &LocalService, nodes: &[&str]) {
    let pids: Vec<u32> = nodes.iter().map(|node| service.pid_of(&format!("manager-{node}"))).collect();
    for pid in &pids {
        nix::sys::signal::kill(Pid::from_raw(*pid as i32), Signal::SIGKILL).unwrap();
    }
    for pid in pids {
        assert!(poll_until(Duration::from_secs(10), || !icheck_service::testkit::process_running(pid)));
    }
    for node in nodes {
        std::fs::remove_dir_all(service.config.agent_store_dir.join(node)).unwrap();
    }
}
