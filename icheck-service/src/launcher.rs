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

/// `n` loopback ports nothing listens on now (the kernel's picks), all
/// different: each is held until all are picked, because a port released
/// at once can be the kernel's next answer (two daemons given the same
/// port, as a test Slurm's controller and node once were: "slurmctld is
/// talking with itself").
pub fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let held = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<Vec<_>>>()?;
    held.iter().map(|listener| Ok(listener.local_addr()?.port())).collect()
}

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

/// Writes `pids` as `dir/pids`, atomically (through a temporary file of
/// this process: the threads of one process change it through
/// [`record_pid`], one at a time).
pub fn write_pids(dir: &Path, pids: &[(String, u32)]) -> std::io::Result<()> {
    let text: String = pids.iter().map(|(name, pid)| format!("{name} {pid}\n")).collect();
    let tmp = dir.join(format!("{PIDS}.tmp-{}", std::process::id()));
    fs::write(&tmp, text).and_then(|_| fs::rename(&tmp, dir.join(PIDS)))
}

/// Records `name` as running with `pid` in `dir/pids` (replacing its line),
/// holding an exclusive lock on `dir/pids.lock` from the read to the write:
/// two managers started again at once (two nodes lost together) each read
/// the file and wrote it back with only their own line changed, and the
/// second write lost the first's (through the same temporary file), so
/// `icheck down` never stopped that manager (a test's teardown left one
/// running).
pub fn record_pid(dir: &Path, name: &str, pid: u32) -> std::io::Result<()> {
    let lock = fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(PIDS_LOCK))?;
    lock.lock()?;
    let mut pids = read_pids(dir);
    match pids.iter_mut().find(|(n, _)| n == name) {
        Some(entry) => entry.1 = pid,
        None => pids.push((name.to_string(), pid)),
    }
    write_pids(dir, &pids)
    // The lock goes with `lock`.
}

/// The lock file serializing changes to a state directory's [`PIDS`].
pub const PIDS_LOCK: &str = "pids.lock";

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
    /// Kills the manager of `node` (process `pid`, as it registered) that
    /// stays silent while alive (stopped, hung): once it is dead, the
    /// controller starts it again like any dead manager, and its store
    /// comes back with it. Says what was done.
    fn kill_silent(&self, node: &str, pid: u32) -> Result<String, String> {
        Err(format!("this launcher cannot stop the silent manager of {node} (pid {pid})"))
    }
    /// Whether it can give the service new checkpoint nodes (horizontal
    /// scaling, Algorithm 8).
    fn can_scale(&self) -> bool {
        false
    }
    /// Asks for one more checkpoint node with a manager on it; says what
    /// was asked (e.g. the Slurm job).
    fn add_node(&self) -> Result<String, String> {
        Err("this launcher cannot add checkpoint nodes".into())
    }
    /// Idle nodes the resource manager could give now, if it says.
    fn idle_nodes(&self) -> Option<u32> {
        None
    }
    /// Withdraws what still waits to start a manager on the lost `node`
    /// and asks for another checkpoint node in its place; says what was
    /// asked. Used by a rebuild that has no free node to place on (the
    /// controller then gives the lost node up).
    fn replace_node(&self, node: &str) -> Result<String, String> {
        Err(format!("this launcher cannot replace the lost node {node}"))
    }
    /// Checkpoint nodes the resource manager asks back (Algorithm 9's
    /// REMOVE_NODES): the controller empties and releases them.
    fn reclaimed(&self) -> Vec<String> {
        Vec::new()
    }
    /// Stops the manager of an emptied `node` and gives the node back; it
    /// is never started again.
    fn release(&self, node: &str) -> Result<String, String> {
        Err(format!("this launcher cannot release {node}"))
    }
    /// Whether `node` was given back (a manager there is not started again).
    fn released(&self, _node: &str) -> bool {
        false
    }
}

/// Starts managers as local processes of the service in a state directory,
/// as `icheck up` did, and records them in its `pids`.
pub struct LocalLauncher {
    /// The state directory.
    pub dir: PathBuf,
}

impl LocalLauncher {
    /// The pid the state directory's `pids` file records for `node`'s manager.
    fn recorded_manager(&self, node: &str) -> Option<u32> {
        let name = format!("manager-{node}");
        read_pids(&self.dir).into_iter().find(|(n, _)| *n == name).map(|(_, pid)| pid)
    }
}

impl Launcher for LocalLauncher {
    fn is_dead(&self, node: &str, pid: u32) -> bool {
        // Someone (`icheck up`, an operator) may have started it again
        // already: then the pids file names the live one.
        let recorded = self.recorded_manager(node);
        !is_icheck_process(pid) && recorded.is_none_or(|current| !is_icheck_process(current))
    }

    fn relaunch(&self, node: &str) -> Result<u32, String> {
        let config = self.dir.join(CLIENT_CONFIG);
        let config = config.to_string_lossy();
        let name = format!("manager-{node}");
        let child =
            spawn_daemon(&self.dir, &format!("{name}.log"), &["manager", "--config", &config, "--node", node], true)
                .map_err(|err| format!("cannot start a manager for {node} from {}: {err}", self.dir.display()))?;
        let pid = child.id();
        // Reap it when it ends, so a manager that dies again is seen dead
        // (not a zombie child of the controller), and free the shm regions
        // it could not.
        std::thread::Builder::new()
            .name(format!("icheck-reap-{pid}"))
            .spawn(move || reap_and_reclaim(child))
            .map_err(|err| format!("cannot watch the manager started for {node}: {err}"))?;
        record_pid(&self.dir, &name, pid).map_err(|err| {
            format!(
                "started the manager of {node} (pid {pid}) but cannot record it in {}/{PIDS}: {err}",
                self.dir.display()
            )
        })?;
        Ok(pid)
    }

    fn kill_silent(&self, node: &str, pid: u32) -> Result<String, String> {
        // Only the process this service started for the node: a pid the
        // system reused since belongs to someone else.
        let recorded = self.recorded_manager(node);
        if recorded != Some(pid) {
            return Err(format!(
                "the manager of {node} registered as pid {pid}, but {}/{PIDS} records {}: not killing it",
                self.dir.display(),
                recorded.map_or("no manager of it".to_string(), |p| format!("pid {p}"))
            ));
        }
        if !is_icheck_process(pid) {
            return Ok(format!("pid {pid} is already gone"));
        }
        let target = nix::unistd::Pid::from_raw(i32::try_from(pid).map_err(|_| format!("pid {pid} is out of range"))?);
        nix::sys::signal::kill(target, nix::sys::signal::Signal::SIGKILL)
            .map_err(|err| format!("cannot SIGKILL the manager of {node} (pid {pid}): {err}"))?;
        Ok(format!("sent SIGKILL to pid {pid}"))
    }
}

/// Waits for `child` to end, removes the libfabric shm regions it left
/// (`/dev/shm/<pid>:*`: a killed process never closes its endpoints, and
/// each region is 16 MiB of memory), then reaps it. Until reaped its pid
/// cannot be given to another process, so the regions removed are its
/// own and no newcomer's.
fn reap_and_reclaim(mut child: std::process::Child) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let flags = nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT;
    if nix::sys::wait::waitid(nix::sys::wait::Id::Pid(pid), flags).is_ok() {
        icheck_core::fabric::remove_shm_regions_of(child.id());
    }
    let _ = child.wait();
}

/// The file of a Slurm-backed service naming the Slurm jobs that run its
/// managers: `JOBID NODE` per line (`NODE` is `*` for a job placed by
/// Slurm). `icheck down` cancels exactly these.
pub const SLURM_JOBS: &str = "slurm-jobs";
/// The file naming the nodes a Slurm-backed service gave back, one per line.
pub const SLURM_RELEASED: &str = "slurm-released";
/// The file holding the most checkpoint nodes a Slurm-backed service may
/// run (`icheck up --slurm --nodes MIN..MAX`).
pub const SLURM_MAX_NODES: &str = "slurm-max-nodes";
/// The file holding the sbatch arguments of a Slurm-backed service (one
/// per line: partition, account, time limit, ...), shared by `icheck up`
/// and the controller's launcher.
pub const SLURM_ARGS: &str = "slurm-sbatch-args";

/// Managers as Slurm batch jobs: `sbatch` of `icheck manager` on a
/// checkpoint node, named by Slurm (`$SLURMD_NODENAME`), logged to the
/// state directory's `logs/manager-slurm-JOBID.log`, recorded in
/// [`SLURM_JOBS`]. The `u32` a [`Launcher`] returns is the job id.
///
/// Architecture invariant: only jobs recorded in [`SLURM_JOBS`] are ever
/// cancelled or counted as this service's managers.
pub struct SlurmLauncher {
    /// The state directory (shared between the host of `icheck up` and the
    /// controller; on a cluster, a shared file system).
    pub dir: PathBuf,
    /// Extra `sbatch` arguments (`--partition=ckpt`, `--account=...`).
    pub sbatch_args: Vec<String>,
}

/// `squeue -h -o "%i %T %N"` output as (job id, state, node list); a
/// pending job's node list is empty.
pub fn parse_squeue(text: &str) -> Vec<(u64, String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            Some((parts.next()?.parse().ok()?, parts.next()?.to_string(), parts.next().unwrap_or("").to_string()))
        })
        .collect()
}

/// Runs `scancel ARGS`: cancels the jobs named, or signals them when
/// `--signal` is among the options.
fn scancel(args: &[String]) -> Result<(), String> {
    let out = Command::new("scancel")
        .args(args)
        .output()
        .map_err(|err| format!("cannot run scancel (is SLURM_CONF set?): {err}"))?;
    if !out.status.success() {
        return Err(format!("scancel {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// A Slurm job of a manager, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlurmJob {
    /// Slurm's job id.
    pub id: u64,
    /// The node asked for, if any.
    pub node: Option<String>,
}

impl SlurmLauncher {
    /// The launcher of the service in `dir`, with the sbatch arguments
    /// `icheck up --slurm` recorded there.
    pub fn from_state_dir(dir: &Path) -> SlurmLauncher {
        let sbatch_args = fs::read_to_string(dir.join(SLURM_ARGS))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        SlurmLauncher { dir: dir.to_path_buf(), sbatch_args }
    }

    /// The manager jobs recorded in the state directory.
    pub fn recorded(&self) -> Vec<SlurmJob> {
        fs::read_to_string(self.dir.join(SLURM_JOBS))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let (id, node) = line.split_once(' ').unwrap_or((line, "*"));
                Some(SlurmJob {
                    id: id.trim().parse().ok()?,
                    node: (node.trim() != "*").then(|| node.trim().to_string()),
                })
            })
            .collect()
    }

    /// Submits one manager job (on `node`, or where Slurm places it) and
    /// records it; returns the job id.
    pub fn submit(&self, node: Option<&str>) -> Result<u64, String> {
        let config = self.dir.join(CLIENT_CONFIG);
        let exe = std::env::current_exe().map_err(|err| format!("cannot find the icheck executable: {err}"))?;
        let script =
            format!("exec '{}' manager --config '{}' --node \"$SLURMD_NODENAME\"", exe.display(), config.display());
        let mut sbatch = Command::new("sbatch");
        sbatch
            // Not requeued when its node fails: the controller decides
            // where a lost node's manager goes (relaunched, or replaced).
            .args(["--parsable", "--nodes=1", "--ntasks=1", "--no-requeue", "--job-name=icheck-manager"])
            .arg(format!("--output={}/logs/manager-slurm-%j.log", self.dir.display()))
            .args(&self.sbatch_args);
        if let Some(node) = node {
            sbatch.arg(format!("--nodelist={node}"));
        }
        let out = sbatch
            .arg(format!("--wrap={script}"))
            .env("ICHECK_LOG", std::env::var("ICHECK_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .output()
            .map_err(|err| format!("cannot run sbatch (is Slurm's client installed and SLURM_CONF set?): {err}"))?;
        if !out.status.success() {
            return Err(format!(
                "sbatch refused the manager job{}: {}",
                node.map_or(String::new(), |n| format!(" for node {n}")),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        // --parsable prints "JOBID" or "JOBID;CLUSTER".
        let id: u64 = text
            .trim()
            .split(';')
            .next()
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| format!("sbatch answered {text:?}, not a job id"))?;
        let mut jobs = fs::read_to_string(self.dir.join(SLURM_JOBS)).unwrap_or_default();
        jobs.push_str(&format!("{id} {}\n", node.unwrap_or("*")));
        let tmp = self.dir.join(format!("{SLURM_JOBS}.tmp-{}", std::process::id()));
        fs::write(&tmp, jobs).and_then(|_| fs::rename(&tmp, self.dir.join(SLURM_JOBS))).map_err(|err| {
            format!("submitted manager job {id} but cannot record it in {}: {err}", self.dir.display())
        })?;
        Ok(id)
    }

    /// Of the `live` jobs ([`SlurmLauncher::live_jobs`]), the recorded ones
    /// pinned to `node` (relaunches) that wait to run.
    fn pinned_pending(&self, node: &str, live: &[(u64, String, String)]) -> Vec<u64> {
        let recorded = self.recorded();
        let pinned = |id: &u64| recorded.iter().any(|j| j.id == *id && j.node.as_deref() == Some(node));
        live.iter().filter(|(id, state, _)| state == "PENDING" && pinned(id)).map(|(id, _, _)| *id).collect()
    }

    /// Cancels the relaunch jobs pinned to `node` that wait to run; their ids.
    fn cancel_pinned(&self, node: &str) -> Result<Vec<String>, String> {
        let jobs: Vec<String> = self.pinned_pending(node, &self.live_jobs()).iter().map(u64::to_string).collect();
        if jobs.is_empty() {
            return Ok(jobs);
        }
        scancel(&jobs).map_err(|err| format!("giving up {node}: {err}"))?;
        Ok(jobs)
    }

    /// The recorded jobs that run or wait to run, with their state and
    /// node (`PENDING` jobs have none yet).
    pub fn live_jobs(&self) -> Vec<(u64, String, String)> {
        let mut jobs = self.known_jobs();
        jobs.retain(|(_, state, _)| matches!(state.as_str(), "PENDING" | "CONFIGURING" | "RUNNING"));
        jobs
    }

    /// The recorded jobs Slurm still lists, in any state (a `COMPLETING`
    /// job still holds its node).
    fn known_jobs(&self) -> Vec<(u64, String, String)> {
        let ids: Vec<String> = self.recorded().iter().map(|j| j.id.to_string()).collect();
        if ids.is_empty() {
            return Vec::new();
        }
        let Ok(out) = Command::new("squeue").args(["-h", "-o", "%i %T %N", "-j", &ids.join(",")]).output() else {
            return Vec::new();
        };
        parse_squeue(&String::from_utf8_lossy(&out.stdout))
    }

    /// Cancels every recorded job and waits (at most `wait`) until Slurm
    /// has released their nodes; returns the ids cancelled.
    pub fn cancel_all(&self, wait: std::time::Duration) -> Result<Vec<u64>, String> {
        let ids: Vec<u64> = self.recorded().iter().map(|j| j.id).collect();
        if ids.is_empty() {
            return Ok(ids);
        }
        scancel(&ids.iter().map(u64::to_string).collect::<Vec<_>>())?;
        let deadline = std::time::Instant::now() + wait;
        while !self.known_jobs().is_empty() {
            if std::time::Instant::now() > deadline {
                let left: Vec<String> =
                    self.known_jobs().iter().map(|(id, state, _)| format!("{id} ({state})")).collect();
                return Err(format!("cancelled, but Slurm still lists job(s) {} after {wait:?}", left.join(", ")));
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let _ = fs::remove_file(self.dir.join(SLURM_JOBS));
        Ok(ids)
    }
}

impl Launcher for SlurmLauncher {
    fn is_dead(&self, node: &str, _pid: u32) -> bool {
        // A manager of `node` lives while a recorded job runs there or
        // waits to run there.
        let recorded = self.recorded();
        !self.live_jobs().iter().any(|(id, state, nodes)| {
            nodes == node
                || (state == "PENDING" && recorded.iter().any(|j| j.id == *id && j.node.as_deref() == Some(node)))
        })
    }

    fn relaunch(&self, node: &str) -> Result<u32, String> {
        let id = self.submit(Some(node))?;
        Ok(u32::try_from(id).unwrap_or(u32::MAX))
    }

    fn kill_silent(&self, node: &str, _pid: u32) -> Result<String, String> {
        let jobs: Vec<String> = (self.live_jobs().into_iter())
            .filter(|(_, state, n)| state == "RUNNING" && n == node)
            .map(|(id, _, _)| id.to_string())
            .collect();
        if jobs.is_empty() {
            return Err(format!("no manager job of this service runs on {node}"));
        }
        // SIGKILL to the batch step too, which is the manager itself (the
        // job script execs it): a plain scancel would send SIGTERM first
        // and wait KillWait on a process that does not answer.
        let mut args = vec!["--full".to_string(), "--signal=KILL".to_string()];
        args.extend(jobs.iter().cloned());
        scancel(&args).map_err(|err| format!("killing the silent manager of {node}: {err}"))?;
        Ok(format!("sent SIGKILL to Slurm job(s) {} on {node}", jobs.join(", ")))
    }

    fn can_scale(&self) -> bool {
        true
    }

    fn add_node(&self) -> Result<String, String> {
        let live = self.live_jobs().len() as u32;
        let max = fs::read_to_string(self.dir.join(SLURM_MAX_NODES))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(u32::MAX);
        if live >= max {
            return Err(format!("already {live} manager job(s), the most this service may run (--nodes ..{max})"));
        }
        self.submit(None).map(|id| format!("Slurm job {id}"))
    }

    fn replace_node(&self, node: &str) -> Result<String, String> {
        // A relaunch waiting for the lost node (pending while Slurm has it
        // down) goes first: the new job takes its place in the count.
        let cancelled = self.cancel_pinned(node)?;
        let added = self.add_node()?;
        Ok(match cancelled.is_empty() {
            true => added,
            false => format!("{added}; cancelled the pending relaunch job(s) {} for {node}", cancelled.join(", ")),
        })
    }

    fn reclaimed(&self) -> Vec<String> {
        // An administrator (or a Slurm policy) drains a node to have it
        // back: `scontrol update NodeName=X State=DRAIN Reason=...`.
        let ours: Vec<String> = self
            .live_jobs()
            .into_iter()
            .filter(|(_, state, node)| state == "RUNNING" && !node.is_empty())
            .map(|(_, _, node)| node)
            .collect();
        if ours.is_empty() {
            return Vec::new();
        }
        let Ok(out) = Command::new("sinfo").args(["-h", "-N", "-o", "%N %t", "-n", &ours.join(",")]).output() else {
            return Vec::new();
        };
        let mut nodes: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| {
                let (node, state) = line.split_once(' ')?;
                state
                    .trim()
                    .trim_end_matches(['*', '~', '#', '!', '%', '$', '@', '^', '-'])
                    .starts_with("dr")
                    .then(|| node.to_string())
            })
            .filter(|node| !self.released(node))
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    fn release(&self, node: &str) -> Result<String, String> {
        let mut released = fs::read_to_string(self.dir.join(SLURM_RELEASED)).unwrap_or_default();
        released.push_str(&format!("{node}\n"));
        fs::write(self.dir.join(SLURM_RELEASED), released)
            .map_err(|err| format!("cannot record {node} as released in {}: {err}", self.dir.display()))?;
        // Running there, or waiting to (a relaunch pinned to the node).
        let live = self.live_jobs();
        let pinned = self.pinned_pending(node, &live);
        let jobs: Vec<String> = (live.into_iter())
            .filter(|(id, _, n)| n == node || pinned.contains(id))
            .map(|(id, _, _)| id.to_string())
            .collect();
        if jobs.is_empty() {
            return Ok(format!("no manager job ran on {node}"));
        }
        scancel(&jobs).map_err(|err| format!("releasing {node}: {err}"))?;
        Ok(format!("cancelled Slurm job(s) {} on {node}", jobs.join(", ")))
    }

    fn released(&self, node: &str) -> bool {
        fs::read_to_string(self.dir.join(SLURM_RELEASED)).is_ok_and(|text| text.lines().any(|l| l.trim() == node))
    }

    fn idle_nodes(&self) -> Option<u32> {
        // In the manager jobs' own partition, when they name one.
        let mut sinfo = Command::new("sinfo");
        sinfo.args(["-h", "-t", "idle", "-o", "%D"]);
        if let Some(partition) = self.sbatch_args.iter().find_map(|a| a.strip_prefix("--partition=")) {
            sinfo.arg(format!("--partition={partition}"));
        }
        let out = sinfo.output().ok().filter(|o| o.status.success())?;
        Some(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.trim().parse::<u32>().ok()).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managers_recorded_at_once_from_many_threads_are_all_in_the_pids_file() {
        let dir = std::env::temp_dir().join(format!("icheck-pids-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        write_pids(&dir, &[("controller".to_string(), 1)]).unwrap();
        std::thread::scope(|scope| {
            for i in 0..16u32 {
                let dir = &dir;
                scope.spawn(move || {
                    for round in 0..20u32 {
                        record_pid(dir, &format!("manager-local-{i}"), 1000 * i + round).unwrap();
                    }
                });
            }
        });
        let pids = read_pids(&dir);
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(pids.len(), 17, "{pids:?}");
        for i in 0..16u32 {
            assert!(pids.contains(&(format!("manager-local-{i}"), 1000 * i + 19)), "{i}: {pids:?}");
        }
    }

    #[test]
    fn a_reaped_child_leaves_no_shm_region() {
        // The child makes a region named after itself, as the shm
        // provider does, and dies without removing it.
        let child = Command::new("sh").args(["-c", "touch /dev/shm/$$:0:91 && kill -9 $$"]).spawn().unwrap();
        let region = std::path::PathBuf::from(format!("/dev/shm/{}:0:91", child.id()));
        reap_and_reclaim(child);
        assert!(!region.exists(), "{} is left", region.display());
    }
}
