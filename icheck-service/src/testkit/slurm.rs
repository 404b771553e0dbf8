//! A real Slurm for tests: Debian's `munged`, `slurmctld` and several
//! `slurmd` (one per node name, each on its own port, all on this host),
//! started from a generated `slurm.conf` in a directory of the test's own,
//! and stopped by PID when the test ends. Tests drive it with Slurm's own
//! commands (`sbatch`, `squeue`, `scancel`), which find it through
//! `SLURM_CONF`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::interrupt;

/// How long a node may stay unregistered before its slurmd is started again.
const SLURMD_RESTART_AFTER: Duration = Duration::from_secs(15);

/// Where node 0's slurmd is in `TestSlurm::daemons`: munged and slurmctld
/// come first, then one slurmd per node in node order.
const FIRST_SLURMD: usize = 2;

/// Where slurmctld is in `TestSlurm::daemons`.
const CONTROLLER: usize = 1;

/// Starts of slurmctld before a test gives up on its Slurm (each on ports
/// chosen anew).
const CONTROLLER_TRIES: u32 = 3;

/// `n` ports free now, below the kernel's ephemeral range. Slurm's daemons
/// bind theirs a while after they are chosen; a port from the ephemeral
/// range (as `bind(0)` gives) can be taken meanwhile by any outgoing
/// connection of the tests running beside, which made slurmctld exit with
/// "Address already in use" in CI. Below that range only a listener asking
/// for that very port can take it; the search starts at a place that
/// differs per process and call, so parallel test Slurms seldom meet.
fn ports_below_ephemeral(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let floor = 10_000u32.min(ephemeral_from / 2);
    let span = ephemeral_from - floor;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let seed =
        std::process::id().wrapping_mul(7919) ^ nanos ^ CALLS.fetch_add(1, Ordering::Relaxed).wrapping_mul(104_729);
    // Held until all are found, so the same port is not handed out twice.
    let mut held = Vec::with_capacity(n);
    for step in 0..span {
        if held.len() == n {
            break;
        }
        let port = u16::try_from(floor + seed.wrapping_add(step) % span).expect("below 65536");
        // Slurm's daemons listen on every address.
        if let Ok(listener) = std::net::TcpListener::bind(("0.0.0.0", port)) {
            held.push(listener);
        }
    }
    assert_eq!(held.len(), n, "no {n} free ports between {floor} and {ephemeral_from}");
    held.iter().map(|listener| listener.local_addr().expect("a bound listener").port()).collect()
}

/// A running test-local Slurm cluster.
pub struct TestSlurm {
    /// Everything it writes: configuration, munge key and socket, state,
    /// spool directories and logs.
    pub dir: PathBuf,
    /// Its `slurm.conf` (give it to Slurm's commands as `SLURM_CONF`).
    pub conf: PathBuf,
    /// The partition holding every node.
    pub partition: String,
    /// Its node names.
    pub nodes: Vec<String>,
    /// Shared with the clean-up that runs if the process is interrupted.
    daemons: Arc<Mutex<Vec<Child>>>,
    /// Stops the cluster if the process is interrupted before it drops.
    _on_interrupt: interrupt::Registered,
}

impl TestSlurm {
    /// Starts munged, slurmctld and `nodes` slurmd named `{name}1`,
    /// `{name}2`, ... in partition `ckpt`, and waits until every node is idle.
    pub fn start(label: &str, name: &str, nodes: usize) -> TestSlurm {
        let dir = std::env::temp_dir().join(format!("icheck-slurm-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["munge", "state", "log"] {
            std::fs::create_dir_all(dir.join(sub)).expect("create the Slurm test directory");
        }
        // Interrupted, the process stops the jobs and daemons as a drop does.
        let _starting = interrupt::hold_off();
        let daemons: Arc<Mutex<Vec<Child>>> = Arc::default();
        let (stopped, at, conf) = (daemons.clone(), dir.clone(), dir.join("slurm.conf"));
        let on_interrupt = interrupt::on_interrupt(format!("the Slurm cluster in {}", dir.display()), move || {
            stop_cluster(&conf, &mut stopped.lock().unwrap_or_else(|p| p.into_inner()), &at);
        });
        let mut slurm = TestSlurm {
            conf: dir.join("slurm.conf"),
            dir,
            partition: "ckpt".into(),
            nodes: (1..=nodes).map(|i| format!("{name}{i}")).collect(),
            daemons,
            _on_interrupt: on_interrupt,
        };
        slurm.start_munge();
        // slurmctld answering first: a node that then does not register
        // is its slurmd's doing (a slurmd started before slurmctld still
        // registered within a second of it, when tried).
        slurm.start_controller(Duration::from_secs(30));
        for node in slurm.nodes.clone() {
            std::fs::create_dir_all(slurm.dir.join("spool").join(&node)).unwrap();
            // Each node's own temporary directory: the "nodes" share this
            // host, and PMIx keys its directories by job and step only.
            std::fs::create_dir_all(slurm.dir.join("tmp").join(&node)).unwrap();
            slurm.spawn("slurmd", &slurm.slurmd_args(&node));
        }
        slurm.wait_idle(Duration::from_secs(60));
        slurm
    }

    fn slurmd_args(&self, node: &str) -> Vec<String> {
        ["-D", "-f", &self.conf.to_string_lossy(), "-N", node].map(String::from).to_vec()
    }

    /// Writes the configuration, starts slurmctld and waits (each try up
    /// to `timeout`) until it answers `scontrol ping`. Its ports were free
    /// when chosen, but another test may bind one first: slurmctld then
    /// exits ("Address already in use", seen in CI), and it is started
    /// again on new ports, up to [`CONTROLLER_TRIES`] times.
    fn start_controller(&mut self, timeout: Duration) {
        let conf = self.conf.to_string_lossy().into_owned();
        for _ in 0..CONTROLLER_TRIES {
            self.write_conf();
            self.spawn("slurmctld", &["-D", "-f", &conf]);
            let mut exited = false;
            let settled = crate::testkit::poll_until(timeout, || {
                if self.controller_answers() {
                    return true;
                }
                exited = self.daemons()[CONTROLLER].try_wait().is_ok_and(|ended| ended.is_some());
                exited
            });
            match (settled, exited) {
                (true, false) => return,
                // Reaped already: only its entry goes, and it starts again.
                (_, true) => drop(self.daemons().remove(CONTROLLER)),
                (false, false) => break,
            }
        }
        panic!(
            "the test Slurm's slurmctld did not answer within {timeout:?}\nslurmctld log:\n{}",
            self.log("slurmctld.log")
        );
    }

    /// Whether slurmctld answers `scontrol ping`.
    fn controller_answers(&self) -> bool {
        self.command("scontrol").arg("ping").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("UP"))
    }

    fn start_munge(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let munge = self.dir.join("munge");
        std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o711)).unwrap();
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key).unwrap();
        let key_file = munge.join("munge.key");
        std::fs::write(&key_file, key).unwrap();
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o400)).unwrap();
        let arg = |flag: &str, file: &str| format!("--{flag}={}", munge.join(file).display());
        let args = [
            "--foreground".to_string(),
            "--force".to_string(),
            arg("key-file", "munge.key"),
            arg("socket", "munge.sock"),
            arg("pid-file", "munged.pid"),
            arg("log-file", "munged.log"),
            arg("seed-file", "munged.seed"),
        ];
        self.spawn("munged", &args);
        let socket = munge.join("munge.sock");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            assert!(Instant::now() < deadline, "munged did not create {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn write_conf(&self) {
        let host = nix::unistd::gethostname().expect("hostname").to_string_lossy().into_owned();
        let host = host.split('.').next().unwrap_or("localhost").to_string();
        let d = self.dir.display();
        let ports = ports_below_ephemeral(2 + self.nodes.len());
        let mut text = format!(
            "ClusterName=icheck-test\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             SlurmctldPort={ctld}\n\
             SlurmdPort={slurmd}\n\
             AuthType=auth/munge\n\
             AuthInfo=socket={d}/munge/munge.sock\n\
             CredType=cred/munge\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd-%n.log\n\
             ProctrackType=proctrack/pgid\n\
             TaskPlugin=task/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\n\
             SchedulerType=sched/backfill\n\
             MpiDefault=pmix\n\
             ReturnToService=2\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             KillWait=5\n\
             TmpFS={d}/tmp/%n\n",
            ctld = ports[0],
            slurmd = ports[1],
        );
        for (node, port) in self.nodes.iter().zip(&ports[2..]) {
            text.push_str(&format!(
                "NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=1 RealMemory=1000 State=UNKNOWN\n"
            ));
        }
        text.push_str(&format!(
            "PartitionName={} Nodes={} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO\n",
            self.partition,
            self.nodes.join(",")
        ));
        std::fs::write(&self.conf, text).unwrap();
    }

    fn spawn<A: AsRef<std::ffi::OsStr>>(&mut self, program: &str, args: &[A]) {
        let child = self.launch(program, args, &format!("{program}-{}.out", self.daemons().len()));
        self.daemons().push(child);
    }

    /// Starts `program` with its output appended to `log` (under `log/`).
    fn launch<A: AsRef<std::ffi::OsStr>>(&self, program: &str, args: &[A], log: &str) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("log").join(log))
            .expect("daemon log");
        Command::new(program)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program} (are slurm-wlm and munge installed?): {e}"))
    }

    /// Takes `node` out as a failed machine would: its slurmd is killed
    /// (it never answers again) and Slurm marks the node down; jobs that
    /// ran there are Slurm's to end, their processes the caller's to kill.
    pub fn fail_node(&self, node: &str) {
        let at = self.nodes.iter().position(|n| n == node).unwrap_or_else(|| panic!("{node} is not a test node"));
        // It is reaped when the cluster is dropped.
        let slurmd = nix::unistd::Pid::from_raw(self.daemons()[FIRST_SLURMD + at].id() as i32);
        nix::sys::signal::kill(slurmd, nix::sys::signal::Signal::SIGKILL).expect("kill the node's slurmd");
        self.run("scontrol", &["update", &format!("NodeName={node}"), "State=DOWN", "Reason=icheck-test-failed"]);
    }

    /// A Slurm command (`sbatch`, `squeue`, ...) of this cluster.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", &self.conf);
        command
    }

    /// Output of a Slurm command that must succeed.
    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let out = self.command(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
        assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Submits a batch job (`sbatch --parsable` with `args`); its id.
    pub fn sbatch(&self, args: &[&str]) -> u64 {
        let submitted = self.run("sbatch", &[&["--parsable"], args].concat());
        submitted.trim().parse().unwrap_or_else(|_| panic!("sbatch said {submitted:?}"))
    }

    /// Kills the first step of `job` (as a failing node would) and waits
    /// until Slurm lists the job no more. A job still listed after
    /// `within` fails the test with everything needed to tell why: the
    /// job's output (`output`), its steps, Slurm's account of it and the
    /// end of slurmctld's log.
    pub fn kill_first_step_and_wait(&self, job: u64, output: &Path, within: std::time::Duration) {
        self.run("scancel", &["--signal=KILL", &format!("{job}.0")]);
        let ended = || !self.jobs().iter().any(|(id, _, _)| *id == job);
        if !crate::testkit::poll_until(within, ended) {
            panic!("timed out after {within:?} waiting for job {job} to end\n{}", self.diagnose(job, output));
        }
    }

    /// What a test that waited in vain for `job` should print: the job's
    /// output file, its steps, `scontrol show job` and the last lines of
    /// slurmctld's log.
    pub fn diagnose(&self, job: u64, output: &Path) -> String {
        let quiet = |program: &str, args: &[&str]| {
            self.command(program).args(args).output().map_or_else(
                |e| format!("{program}: {e}"),
                |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
            )
        };
        let log = self.log("slurmctld.log");
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        format!(
            "--- {} ---\n{}\n--- steps ---\n{}\n--- scontrol show job ---\n{}\n--- slurmctld.log (last 40 lines) ---\n{}",
            output.display(),
            std::fs::read_to_string(output).unwrap_or_else(|e| format!("(unreadable: {e})")),
            quiet("squeue", &["-s", "-j", &job.to_string()]),
            quiet("scontrol", &["show", "job", &job.to_string()]),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        )
    }

    /// `scontrol show job`'s account of `job`.
    pub fn job_state(&self, job: u64) -> String {
        self.run("scontrol", &["show", "job", &job.to_string()])
    }

    /// The cluster's jobs as (id, state, node list).
    pub fn jobs(&self) -> Vec<(u64, String, String)> {
        crate::launcher::parse_squeue(&self.run("squeue", &["-h", "-o", "%i %T %N"]))
    }

    /// Waits until every node is idle. A node still not idle after
    /// [`SLURMD_RESTART_AFTER`] gets its slurmd started again (a new
    /// slurmd registers at once), every such interval, until `timeout`.
    fn wait_idle(&mut self, timeout: Duration) {
        let started = Instant::now();
        let mut restarted_at = started;
        loop {
            let out = self.command("sinfo").args(["-h", "-N", "-o", "%N %T"]).output();
            let text = out.as_ref().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
            let idle: Vec<&str> = text.lines().filter_map(|l| l.strip_suffix(" idle")).map(str::trim).collect();
            if self.nodes.iter().all(|node| idle.contains(&node.as_str())) {
                return;
            }
            if started.elapsed() > timeout {
                let slurmd_logs: String = self
                    .nodes
                    .iter()
                    .map(|node| format!("--- slurmd-{node}.log ---\n{}\n", self.log(&format!("slurmd-{node}.log"))))
                    .collect();
                panic!(
                    "the test Slurm's nodes did not become idle: {text}\nslurmctld log:\n{}\n{slurmd_logs}",
                    self.log("slurmctld.log")
                );
            }
            if restarted_at.elapsed() > SLURMD_RESTART_AFTER {
                restarted_at = Instant::now();
                for (at, node) in self.nodes.clone().iter().enumerate() {
                    if !idle.contains(&node.as_str()) {
                        let exited = self.daemons()[FIRST_SLURMD + at].try_wait().ok().flatten();
                        let state = exited.map_or("still running".to_string(), |status| format!("exited: {status}"));
                        eprintln!(
                            "test Slurm: node {node} is not idle after {:?} (its slurmd {state}); starting it again",
                            started.elapsed()
                        );
                        self.respawn_slurmd(at);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills node `at`'s slurmd (by its PID) and starts another in its
    /// place, its output appended to `slurmd-<node>-restarted.out`.
    fn respawn_slurmd(&mut self, at: usize) {
        let node = &self.nodes[at];
        let mut daemons = self.daemons();
        let old = &mut daemons[FIRST_SLURMD + at];
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.id() as i32), nix::sys::signal::Signal::SIGKILL);
        let _ = old.wait();
        daemons[FIRST_SLURMD + at] =
            self.launch("slurmd", &self.slurmd_args(node), &format!("slurmd-{node}-restarted.out"));
    }

    /// The log of a daemon of this cluster.
    pub fn log(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join("log").join(file)).unwrap_or_default()
    }

    /// munged, slurmctld, then the slurmds in the order of `nodes`.
    fn daemons(&self) -> std::sync::MutexGuard<'_, Vec<Child>> {
        self.daemons.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the cluster keeps its files.
    pub fn path(&self, relative: &str) -> PathBuf {
        Path::new(&self.dir).join(relative)
    }
}

impl Drop for TestSlurm {
    fn drop(&mut self) {
        stop_cluster(&self.conf, &mut self.daemons(), &self.dir);
    }
}

/// Stops the Slurm cluster of `conf` and removes `dir`: its jobs first
/// (this cluster's slurmctld knows only this test's jobs), so that their
/// steps end before the daemons do, then the daemons (SIGTERM, SIGKILL
/// after 5 s), newest first.
fn stop_cluster(conf: &Path, daemons: &mut [Child], dir: &Path) {
    let slurm = |program: &str| {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", conf);
        command
    };
    let _ = slurm("scancel").args(["--user", "root"]).output();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline && slurm("squeue").args(["-h"]).output().is_ok_and(|o| !o.stdout.is_empty()) {
        std::thread::sleep(Duration::from_millis(200));
    }
    for child in daemons.iter_mut().rev() {
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM);
    }
    for child in daemons.iter_mut().rev() {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[cfg(test)]
mod tests {
    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let ephemeral_from: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
        let ports = super::ports_below_ephemeral(6);
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), 6, "{ports:?}");
        assert!(ports.iter().all(|p| *p < ephemeral_from), "{ports:?}");
        for port in ports {
            std::net::TcpListener::bind(("0.0.0.0", port)).unwrap_or_else(|e| panic!("port {port}: {e}"));
        }
    }
}
