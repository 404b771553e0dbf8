//! Fault-injection campaign with an invariant checker: a real local
//! service (`icheck up`, two managers, a PFS level) and real `mpirun` jobs
//! (this binary again, as the ranks), hit by one fault per round, drawn at
//! random from a seed it prints:
//!
//! * SIGKILL, or SIGSTOP then SIGCONT, of one rank, of a manager or of
//!   the controller, at a random moment of a commit loop;
//! * a manager SIGSTOPped for good ("hang manager"): the controller must
//!   kill it after `KillSilentManagerAfter` and start it again, with the
//!   versions its store kept;
//! * a named failpoint (`exit`) in the library's seal and restart, the
//!   agents' seal, the controller's version recording and journal, and
//!   the PFS copy;
//! * with `--standby` (a standby controller beside the primary), controller
//!   takeovers: the current primary SIGKILLed, or SIGSTOPped past the
//!   takeover window; the time from the fault to the job's next completed
//!   commit is the takeover time the table reports;
//! * with `--redundancy POLICY` (the job's policy, and no PFS copies, so
//!   that only redundancy can save a version), lost nodes: a manager
//!   holding the job's agents SIGKILLed and its store deleted. The version
//!   protected when the node was lost (or a newer one) must come back
//!   bit-exact; newer unprotected ones may go, as the policy says. Where
//!   the policy survives more than one lost node (`rs:4+2`, `partner:3`),
//!   "lose nodes" loses as many as it tolerates at once: a node holding
//!   some of the job's agents and others drawn from all of them.
//!
//! The job commits blocking in MR mode by default, every byte changed at
//! each step; `--async` (a version counts once `wait` returned for it),
//! `--mode shmr` and `--change-one-block-in N` (incremental commits that
//! move, and agents that share, only part of each version, for N ≥ 3)
//! vary it. The table prints what blocking commits moved.
//!
//! After every fault the checker starts again what died (`icheck up`) and
//! checks the invariants with the next round's job, which restarts:
//! every version the library reported complete is restorable bit-exact
//! (or a newer complete one is); no partial version is visible (a
//! restored version's every byte matches the pattern of its step); no
//! start, restart or commit waits past its bound; the stores hold no more
//! files per rank than retention allows. Once healed, `icheck status`
//! matches what runs, no daemon keeps a core busy, and (under a
//! redundancy policy) each application's newest complete version has its
//! redundancy in place again. It prints a table at the end and
//! exits non-zero if a version was lost or anything hung.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/fault-campaign --faults 200 --seed 1
//! target/release/fault-campaign --faults 100 --seed 1 --standby
//! target/release/fault-campaign --faults 40 --seed 1 --redundancy rs:2+1
//! target/release/fault-campaign --faults 40 --seed 1 --async --mode shmr --change-one-block-in 4 --size 8MiB
//! ```

#[path = "siblings.rs"]
mod siblings;
#[path = "thread_cpu.rs"]
mod thread_cpu;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::units::ByteSize;
use icheck_examples::{fill_bytes, first_mismatch};
use icheck_lib::{CommitStats, Icheck, InitStatus, MpiComm, Region};
use icheck_service::launcher::is_icheck_process;
use icheck_service::testkit::{interrupt, LocalService};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[derive(Parser)]
#[command(about = "Injects faults into a local icheck service and its MPI jobs and checks that no version is lost")]
struct Cli {
    /// Faults to inject (one per round).
    #[arg(long, default_value_t = 20)]
    faults: u32,
    /// Seed of the fault sequence (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Processes of the job.
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// Bytes each rank checkpoints.
    #[arg(long, default_value = "4MiB")]
    size: ByteSize,
    /// Seconds any start, restart or commit may take before it counts as a hang.
    #[arg(long, default_value_t = 90)]
    bound: u64,
    /// On a broken invariant, leave the service's state directory (logs,
    /// stores, journal) for inspection; its daemons are stopped.
    #[arg(long)]
    keep: bool,
    /// Run a standby controller beside the primary (TakeoverAfter 3 s) and
    /// add controller takeovers to the faults.
    #[arg(long)]
    standby: bool,
    /// Fabric provider of the service (`icheck up --provider`): tcp, as in
    /// the README's runs, or shm (what `icheck up` takes on one host), or
    /// auto.
    #[arg(long, default_value = "tcp")]
    provider: String,
    /// Draw faults only of these kinds (comma-separated, as the table
    /// names them, e.g. "kill rank,takeover: kill primary"); default: all.
    #[arg(long, value_delimiter = ',')]
    kinds: Vec<String>,
    /// The job's redundancy policy across checkpoint nodes (`partner:2`,
    /// `rs:2+1`, ...; ICHECK_REDUNDANCY). The job then makes no PFS copies,
    /// and lost nodes (a manager killed and its store deleted) join the
    /// faults.
    #[arg(long)]
    redundancy: Option<String>,
    /// Managers (checkpoint nodes) of the service [default: 2, or 4 with
    /// --redundancy: the policy's nodes and a spare to rebuild on].
    #[arg(long)]
    managers: Option<u32>,
    /// Commit asynchronously: `commit` returns once the data is staged,
    /// the job computes, and a version counts as reported complete only
    /// when `wait` has returned for it.
    #[arg(long = "async")]
    asynchronous: bool,
    /// The job's transfer mode (`ICHECK_MODE`): mr (each process
    /// registers its own memory) or shmr (one segment per node).
    #[arg(long, default_value = "mr", value_parser = ["mr", "shmr"])]
    mode: String,
    /// Each step rewrites one 1 MiB block in this many (1: every byte),
    /// so that incremental commits move, and agents share, only part of
    /// each version (3 or more: a commit with more than 0.4 of its blocks
    /// changed moves whole); a restart checks every block against the step
    /// that last wrote it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    change_one_block_in: u64,
    /// Internal: run as one rank of the job, with this client configuration.
    #[arg(long, hide = true)]
    rank_of: Option<PathBuf>,
}

/// splitmix64: a seeded, printable sequence of choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

const APP: &str = "campaign";

/// What `icheck up` starts again: the service's managers and provider.
struct Shape {
    managers: u32,
    provider: String,
}

/// The bytes of one block of the job's data that a step rewrites whole.
const BLOCK: usize = 1 << 20;

/// The step that last wrote block `block` by step `step`, when each step
/// rewrites one block in `every` (block `b` at the steps `s` with
/// `s % every == b % every`); 0 for a block no step has written yet (its
/// bytes are still zero).
fn last_written(block: u64, step: u64, every: u64) -> u64 {
    let back = (step % every + every - block % every) % every;
    step.saturating_sub(back)
}

/// Writes what step `step` writes into `data`: the blocks it rewrites get
/// their pattern of (rank, step).
fn write_step(data: &mut [u8], rank: u32, step: u64, every: u64) {
    for (block, bytes) in data.chunks_mut(BLOCK).enumerate() {
        if last_written(block as u64, step, every) == step {
            fill_bytes(bytes, rank, step);
        }
    }
}

/// The first byte of `data` that differs from what the job held after
/// step `step`: each block as the step that last wrote it left it.
fn first_wrong_byte(data: &[u8], rank: u32, step: u64, every: u64) -> Option<usize> {
    data.chunks(BLOCK).enumerate().find_map(|(block, bytes)| {
        let wrong = match last_written(block as u64, step, every) {
            0 => bytes.iter().position(|byte| *byte != 0),
            written => first_mismatch(bytes, rank, written),
        };
        wrong.map(|at| block * BLOCK + at)
    })
}

/// One rank of the job: restore and verify (when there is a version), then
/// commit what each step writes until killed. Rank 0 prints what the
/// checker reads (a version as `COMMITTED` only once it is complete: after
/// `commit` when blocking, after `wait` when asynchronous); every rank
/// prints its PID.
fn rank_main(config: &Path, cli: &Cli) -> Result<()> {
    use mpi::traits::*;
    let universe = mpi::initialize().context("MPI initialises")?;
    let world = universe.world();
    let rank = world.rank() as u32;
    let every = cli.change_one_block_in;
    let say = |line: String| {
        if rank == 0 {
            let _ = std::io::stdout().write_all(format!("{line}\n").as_bytes());
        }
    };
    let _ = std::io::stdout().write_all(format!("PID rank={rank} pid={}\n", std::process::id()).as_bytes());
    let complain = |what: String| -> ! {
        let _ = std::io::stderr().write_all(format!("rank {rank}: {what}\n").as_bytes());
        std::process::exit(5);
    };
    let (mut ic, status) =
        Icheck::init(Some(config), APP, MpiComm::new(&world)).unwrap_or_else(|e| complain(format!("init: {e}")));
    let step = Region::<i64>::zeroed(1);
    let data = Region::<u8>::zeroed(cli.size.0 as usize + rank as usize * 4096 + 13);
    // The data first: its 1 MiB blocks are then the version's own blocks,
    // which incremental commits compare. Behind an 8-byte label, each block
    // the job rewrote straddled two of the version's, so one block in four
    // changed half the version's blocks, more than the 0.4 above which a
    // commit moves whole: every commit of `--change-one-block-in 4` did.
    ic.add("data", &data).and_then(|_| ic.add("step", &step)).unwrap_or_else(|e| complain(format!("add: {e}")));
    ic.set_async(cli.asynchronous);
    let mut current = 0;
    match status {
        InitStatus::Fresh => say("FRESH".into()),
        InitStatus::Restart { .. } => {
            let version = ic.restart().unwrap_or_else(|e| complain(format!("restart: {e}")));
            ic.restore_all().unwrap_or_else(|e| complain(format!("restore: {e}")));
            current = u64::try_from(step.read()[0]).unwrap_or_default();
            if let Some(at) = first_wrong_byte(&data.read(), rank, current, every) {
                let _ = std::io::stdout()
                    .write_all(format!("MISMATCH rank={rank} version={version} step={current} byte={at}\n").as_bytes());
                std::process::exit(4);
            }
            world.barrier();
            say(format!("RESTORED version={version} step={current}"));
        }
    }
    // What the checker reads of a complete version; `stats`, what a
    // blocking commit moved of rank 0's bytes (before `secs=`, which the
    // checker reads from the end of the line).
    let complete = |version: u64, at_step: u64, started: Instant, stats: Option<CommitStats>| {
        let moved = stats.map_or(String::new(), |s| format!(" moved={}/{}", s.moved_bytes, s.total_bytes));
        say(format!("COMMITTED version={version} step={at_step}{moved} secs={:.3}", started.elapsed().as_secs_f64()))
    };
    // An asynchronous commit not yet waited for: (version, step, started).
    let mut in_flight: Option<(u64, u64, Instant)> = None;
    loop {
        current += 1;
        // Computing, while an asynchronous commit's transfer runs.
        std::thread::sleep(Duration::from_millis(20));
        if let Some((version, at_step, started)) = in_flight.take() {
            ic.wait().unwrap_or_else(|e| complain(format!("wait for version {version}: {e}")));
            complete(version, at_step, started, None);
        }
        write_step(&mut data.write(), rank, current, every);
        step.write()[0] = i64::try_from(current).unwrap_or(i64::MAX);
        let started = Instant::now();
        let version = ic.commit().unwrap_or_else(|e| complain(format!("commit: {e}")));
        match cli.asynchronous {
            true => in_flight = Some((version, current, started)),
            false => complete(version, current, started, ic.last_commit()),
        }
    }
}

/// The share of its bytes a `COMMITTED ... moved=M/T ...` line moved.
fn moved_share(line: &str) -> Option<f64> {
    let (moved, total) = line.split(' ').find_map(|field| field.strip_prefix("moved="))?.split_once('/')?;
    let total: f64 = total.parse().ok().filter(|t| *t > 0.0)?;
    Some(moved.parse::<f64>().ok()? / total)
}

/// A running job: `mpirun` in its own process group, its stdout lines.
struct Job {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    shm: PathBuf,
}

impl Job {
    fn start(cli: &Cli, config: &Path, env: &[(&str, String)]) -> Result<Job> {
        let (mut command, shm) = icheck_service::testkit::mpirun("campaign", cli.ranks)?;
        command
            .arg(std::env::current_exe()?)
            .arg("--rank-of")
            .arg(config)
            .args(["--size", &cli.size.0.to_string()])
            .args(["--change-one-block-in", &cli.change_one_block_in.to_string()])
            .args(cli.asynchronous.then_some("--async"))
            .env("ICHECK_MODE", &cli.mode)
            // Short bounds, so a frozen agent is given up within a round, yet
            // above the agents' 10 s transfer stall bound (an agent ending a
            // killed rank's transfer answers its other ranks after it).
            .env("ICHECK_REQUEST_TIMEOUT", "12")
            .env("ICHECK_PFS_INTERVAL", "3")
            .env("ICHECK_T_WAIT", "2")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().context("mpirun starts (is openmpi-bin installed?)")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let drain = |from: Box<dyn std::io::Read + Send>, sink: Arc<Mutex<Vec<String>>>| {
            std::thread::spawn(move || {
                for line in BufReader::new(from).lines().map_while(Result::ok) {
                    sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                }
            });
        };
        drain(Box::new(child.stdout.take().expect("piped")), lines.clone());
        drain(Box::new(child.stderr.take().expect("piped")), stderr.clone());
        Ok(Job { child, lines, stderr, shm })
    }

    /// The job's last lines of error output.
    fn stderr_tail(&self) -> String {
        let lines = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        // The ranks' own complaints say more than mpirun's summary.
        let ranks: Vec<&str> = lines.iter().filter(|l| l.starts_with("rank ")).map(String::as_str).collect();
        match ranks.is_empty() {
            true => lines[lines.len().saturating_sub(6)..].join(" | "),
            false => ranks.join(" | "),
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// Waits until `done` holds for the lines (Ok(true)), the job ends
    /// (Ok(false)) or `bound` passes (Err: a hang).
    fn wait_for(&mut self, bound: Duration, done: impl Fn(&[String]) -> bool) -> Result<bool, Duration> {
        let start = Instant::now();
        loop {
            if done(&self.lines()) {
                return Ok(true);
            }
            if !self.running() {
                std::thread::sleep(Duration::from_millis(100));
                return Ok(done(&self.lines()));
            }
            if start.elapsed() > bound {
                return Err(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn rank_pids(&self) -> Vec<u32> {
        self.lines().iter().filter_map(|l| l.strip_prefix("PID ")?.split("pid=").nth(1)?.parse().ok()).collect()
    }

    /// Kills mpirun, its ranks (each in a process group of its own) and
    /// anything else it started, and waits until they are gone: the next
    /// round's run must not meet this one's ranks still committing.
    fn kill(&mut self) {
        icheck_service::testkit::kill_process_tree(self.child.id());
        // Only processes that still are this job's ranks (PIDs get reused).
        let is_rank = |pid: u32| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains("--rank-of"))
        };
        for pid in self.rank_pids().into_iter().filter(|pid| is_rank(*pid)) {
            icheck_service::testkit::kill_process_tree(pid);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.running() {
            self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.shm);
    }
}

fn committed(lines: &[String]) -> Vec<u64> {
    lines.iter().filter_map(|l| l.strip_prefix("COMMITTED version=")?.split(' ').next()?.parse().ok()).collect()
}

/// The fault kinds, as the table names them.
const KINDS: [&str; 8] = [
    "kill rank",
    "stop rank",
    "kill manager",
    "stop manager",
    "hang manager",
    "kill controller",
    "stop controller",
    "failpoint",
];
/// `KillSilentManagerAfter` of the campaign's service: past the longest
/// "stop manager" pause (4 s), so only "hang manager" meets it.
const KILL_SILENT_AFTER: &str = "8";
/// `ManagerRelaunches` of the campaign's service. The default (3 in ten
/// minutes) guards against a manager that dies as it starts: a node past
/// it is given up, and a rebuild then counts its memory lost at once,
/// falling back from a newest version not yet protected (the data-loss
/// model). A campaign kills, stops and hangs one of a few managers several
/// times a minute, far past that guard, and expects every such manager
/// back with its store (seed 91, `rs:2+1` on four managers, lost version
/// 637 that way: the fourth relaunch of one node in three minutes).
const MANAGER_RELAUNCHES: &str = "1000";
/// With `--standby`: takeovers (the primary, wherever it runs, killed or
/// stopped past the window).
const TAKEOVERS: [&str; 2] = ["takeover: kill primary", "takeover: stop primary"];
/// With `--redundancy`: a node lost with its memory.
const LOSE_NODE: &str = "lose node";
/// With a `--redundancy` that tolerates more than one lost node: as many
/// nodes lost at once as it tolerates.
const LOSE_NODES: &str = "lose nodes";
/// `TakeoverAfter` of the campaign's service with a standby.
const TAKEOVER_AFTER: Duration = Duration::from_secs(3);

/// Failpoints: (where, name). Library ones arm the job; the others arm
/// the daemon they live in, started again with them before the job.
const FAILPOINTS: [(&str, &str); 7] = [
    ("job", "client.before_seal"),
    ("job", "client.before_fetch"),
    ("manager", "store.before_manifest_rename"),
    ("manager", "manager.before_pfs_copy"),
    ("manager", "pfs.before_manifest_rename"),
    ("controller", "controller.after_record_version"),
    ("controller", "journal.before_append"),
];

#[derive(Default)]
struct Tally {
    rounds: u32,
    faults: BTreeMap<String, u32>,
    verified: u32,
    lost: Vec<String>,
    hangs: Vec<String>,
    status_mismatches: Vec<String>,
    /// Daemons that kept a core busy after healing, with no job running
    /// (a thread spinning where nothing should run: libfabric 1.17's shm
    /// provider can leave one spinning on the lock of a peer killed while
    /// it held it).
    busy: Vec<String>,
    /// Rounds after which, healed and settled, an application's newest
    /// complete version was left without the redundancy its policy asks
    /// for (every node is alive again, so nothing excuses it).
    unprotected: Vec<String>,
    slowest_recovery: Duration,
    /// The longest commit a rank reported (a commit during a fault waits
    /// for its bounds, then completes on new agents or fails).
    slowest_commit: f64,
    /// Of each blocking commit rank 0 reported, the share of its bytes
    /// that crossed the fabric (incremental commits move changed blocks).
    moved_shares: Vec<f64>,
    max_files_per_rank: usize,
    rss: BTreeMap<String, (u64, u64)>,
    /// Fault to the job's next completed commit, per takeover, by kind.
    takeovers: BTreeMap<&'static str, Vec<Duration>>,
    /// How long each manager that exited on a wedged fabric had been inside
    /// the call (its log's "has not returned" line): not a finding (the
    /// manager is started again with its store), but each one costs a
    /// restart that time.
    wedged_exits: Vec<Duration>,
}

impl Tally {
    /// Every broken invariant the campaign found, each a line naming its round.
    fn findings(&self) -> impl Iterator<Item = &String> {
        [&self.lost, &self.hangs, &self.status_mismatches, &self.busy, &self.unprotected].into_iter().flatten()
    }
}

/// For each "has not returned" line in the service's logs (a manager that
/// exited on a wedged fabric), how long its call had been inside.
fn wedged_exits(service: &LocalService) -> Vec<Duration> {
    let logs = std::fs::read_dir(service.dir.join("logs")).into_iter().flatten().filter_map(|e| e.ok());
    let text: String = logs.filter_map(|entry| std::fs::read_to_string(entry.path()).ok()).collect();
    text.lines()
        .filter(|line| line.contains("a call into libfabric has not returned"))
        .filter_map(|line| debug_duration(line.split("inside=").nth(1)?.split_whitespace().next()?))
        .collect()
}

/// A `Duration` as its `Debug` form writes it (`4.041s`, `950ms`, ...).
fn debug_duration(text: &str) -> Option<Duration> {
    let units = [("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)];
    let (number, scale) = units.iter().find_map(|(unit, scale)| Some((text.strip_suffix(unit)?, *scale)))?;
    Some(Duration::from_secs_f64(number.parse::<f64>().ok()? * scale))
}

fn signal(pid: u32, sig: Signal) {
    if is_icheck_process(pid) {
        let _ = kill(Pid::from_raw(pid as i32), sig);
    }
}

/// `icheck up` again in the service's directory (starts what died), with
/// `failpoints` armed in what it starts.
fn up_again(service: &LocalService, shape: &Shape, failpoints: Option<&str>) -> Result<()> {
    let managers = shape.managers.to_string();
    let mut up = Command::new(&service.icheck);
    up.args(["up", "--detach", "--managers", &managers, "--heartbeat", "0.5", "--provider", &shape.provider])
        .args(["--kill-silent-after", KILL_SILENT_AFTER, "--manager-relaunches", MANAGER_RELAUNCHES])
        .arg("--state-dir")
        .arg(&service.dir);
    if let Some(spec) = failpoints {
        up.env(icheck_core::failpoint::FAILPOINTS_ENV, spec);
    }
    let out = {
        let _starting = interrupt::hold_off();
        up.output()?
    };
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && !text.contains("are alive") {
        bail!("icheck up failed: {}{text}", String::from_utf8_lossy(&out.stdout));
    }
    Ok(())
}

/// Waits until every daemon recorded in the service's pids runs and every
/// node is alive (and, with a standby, the standby follows the primary
/// again); starts again what died (`icheck up`).
fn heal(service: &LocalService, shape: &Shape, bound: Duration, standby: bool) -> Result<(), String> {
    let start = Instant::now();
    while start.elapsed() < bound {
        let pids = icheck_service::launcher::read_pids(&service.dir);
        if pids.iter().any(|(_, pid)| !is_icheck_process(*pid)) {
            up_again(service, shape, None).map_err(|e| e.to_string())?;
        }
        let healthy = service.try_status().is_ok_and(|status| {
            status.nodes.len() == shape.managers as usize
                && status.nodes.iter().all(|n| n.alive)
                && (!standby || status.controller.is_some_and(|c| c.standby_follows()))
        });
        if healthy {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!("the service did not heal within {bound:?}"))
}

/// Whether `icheck status` matches what runs: every node alive with the
/// manager the pids file names, and each manager running exactly the
/// agents the controller lists for the application on its node. Polled
/// for a few seconds (reports come every heartbeat); the mismatch, if any.
fn status_matches_reality(service: &LocalService) -> Result<(), String> {
    let pids = icheck_service::launcher::read_pids(&service.dir);
    let mut last = String::new();
    // Agents running that no application listed, at the last look.
    let mut unlisted: Vec<u64> = Vec::new();
    for _ in 0..50 {
        let status = match service.try_status() {
            Ok(status) => status,
            Err(why) => {
                last = why;
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let listed = || status.apps.iter().flat_map(|a| &a.agents);
        let agents_on = |node: &str| listed().filter(|agent| agent.node == node).count() as u32;
        let wrong: Vec<String> = status
            .nodes
            .iter()
            .filter_map(|n| {
                let pid = pids.iter().find(|(name, _)| *name == format!("manager-{}", n.node)).map(|(_, p)| *p);
                let ok = n.alive && Some(n.pid) == pid && n.status.agents == agents_on(&n.node);
                (!ok).then(|| {
                    format!(
                        "{}: alive {}, pid {} (pids file {pid:?}), {} agents running, {} listed",
                        n.node,
                        n.alive,
                        n.pid,
                        n.status.agents,
                        agents_on(&n.node)
                    )
                })
            })
            .collect();
        if wrong.is_empty() {
            return Ok(());
        }
        last = wrong.join("; ");
        unlisted = (status.nodes.iter().flat_map(|n| &n.status.agent_bandwidth))
            .map(|(id, _)| *id)
            .filter(|id| !listed().any(|a| a.id == *id))
            .collect();
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(last + &agent_history(service, &unlisted))
}

/// What the controller's log says about each of `agents` (running, listed
/// by no application): its last lines naming the agent, so that a
/// mismatch in CI shows how the agent was left over.
fn agent_history(service: &LocalService, agents: &[u64]) -> String {
    let log = service.log("controller.log");
    let mut history = String::new();
    for id in agents {
        let number = id.to_string();
        let lines: Vec<&str> = log.lines().filter(|l| names_number(l, &number)).collect();
        history.push_str(&format!("\n    agent {id}, unlisted; the controller's last lines naming it:"));
        for line in &lines[lines.len().saturating_sub(6)..] {
            history.push_str(&format!("\n      {line}"));
        }
    }
    history
}

/// Whether `line` holds `number` as a whole number (agent ids are
/// logged as `agent=N`, `agent N` and in lists).
fn names_number(line: &str, number: &str) -> bool {
    line.split(|c: char| !c.is_ascii_digit()).any(|word| word == number)
}

/// The retention bound on one rank's store directory for a job that
/// rewrites one block in `every` per step. Retention keeps at most a few
/// versions per rank (the newest complete, one in progress, one pinned by
/// a PFS copy), each a data and a manifest file, and the spare and
/// prepared files: 9 with some slack. Incremental commits (`every` > 1)
/// add each kept version's block map, and the shared-blocks files of the
/// older versions whose blocks the kept ones still use: a block is
/// rewritten every `every` steps, so each kept version uses blocks of at
/// most `every - 1` older ones.
fn most_files_per_rank(every: u64) -> usize {
    const KEPT: usize = 3;
    match every {
        0 | 1 => 9,
        every => 9 + KEPT + KEPT * (every as usize - 1),
    }
}

/// Most files in one rank's directory of the store (retention bound).
fn files_per_rank(store: &Path) -> usize {
    let mut most = 0;
    for node in std::fs::read_dir(store).into_iter().flatten().flatten() {
        // `pieces/` holds redundancy's copies and shards, not a rank's versions.
        let ranks = std::fs::read_dir(node.path().join(APP)).into_iter().flatten().flatten();
        for rank in ranks.filter(|entry| entry.file_name() != "pieces") {
            most = most.max(std::fs::read_dir(rank.path()).map_or(0, |d| d.count()));
        }
    }
    most
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// Longest the status and busy-daemon checks wait for protections and
/// rebuilds the job left behind to end (slow in debug builds, as CI's are).
const PROTECTION_SETTLE: Duration = Duration::from_secs(60);

/// Waits (at most `bound`) until no application's redundancy is being
/// built or rebuilt.
fn protection_settled(service: &LocalService, bound: Duration) {
    let start = Instant::now();
    while start.elapsed() < bound {
        let busy = service
            .try_status()
            .map_or(true, |status| status.apps.iter().any(|app| app.protecting.is_some() || app.rebuilding));
        if !busy {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// How long the newest versions may take to be protected again once the
/// service has healed: a restarted controller protects the newest version
/// after reconciling (at its next liveness tick), and an agent whose
/// transfer to a killed rank times out (10 s) ends and is replaced before
/// the version it holds can be protected.
const PROTECTED_AGAIN_WITHIN: Duration = Duration::from_secs(30);

/// With every node alive: the applications whose newest complete version
/// still lacks the redundancy their policy asks for after
/// [`PROTECTED_AGAIN_WITHIN`], each with what status says about it.
fn unprotected_versions(service: &LocalService) -> Vec<String> {
    let start = Instant::now();
    loop {
        let unprotected: Vec<String> = match service.try_status() {
            Err(why) => vec![format!("status did not answer: {why}")],
            Ok(status) => status
                .apps
                .iter()
                .filter(|app| !app.redundancy.is_none())
                .filter_map(|app| {
                    let newest = app.latest.as_ref()?.version;
                    (app.protected != Some(newest)).then(|| {
                        format!(
                            "{}: newest complete version {newest}, protected {:?}, protecting {:?}, rebuilding {}, \
                             problem {:?}",
                            app.registration.name,
                            app.protected,
                            app.protecting,
                            app.rebuilding,
                            app.protection_problem
                        )
                    })
                })
                .collect(),
        };
        if unprotected.is_empty() || start.elapsed() > PROTECTED_AGAIN_WITHIN {
            return unprotected;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// How long each daemon's CPU is watched after healing, and the share of
/// a core above which it counts as busy: an idle service uses well under
/// 1% (`commit-bench`'s idle case), a spinning thread a whole core.
const BUSY_WINDOW: Duration = Duration::from_secs(2);
const BUSY_SHARE: f64 = 0.5;

/// The daemons of `service` that used more than [`BUSY_SHARE`] of a core
/// over [`BUSY_WINDOW`], and again over the window after it (a spin lasts;
/// a daemon finishing a short task does not): each with its share in the
/// second window and its busiest thread's name.
fn busy_daemons(service: &LocalService) -> Vec<(String, f64, String)> {
    let daemons = icheck_service::launcher::read_pids(&service.dir);
    let busy_once = busy_over_a_window(&daemons);
    if busy_once.is_empty() {
        return busy_once;
    }
    // A manager wedged inside libfabric (shm spinning on a dead process's
    // lock) exits after 20 s and is started again: a spin counts only if it
    // outlasts that, in the daemon the pids file names by then.
    std::thread::sleep(OUTLAST_WEDGE);
    let suspects: Vec<(String, u32)> = icheck_service::launcher::read_pids(&service.dir)
        .into_iter()
        .filter(|(daemon, _)| busy_once.iter().any(|(busy, ..)| busy == daemon))
        .collect();
    busy_over_a_window(&suspects)
}

/// How long a daemon busy over one [`BUSY_WINDOW`] is given before it is
/// watched again: beyond a manager's wedged-fabric bound (20 s) and the
/// heartbeat on which it looks, and its relaunch.
const OUTLAST_WEDGE: Duration = Duration::from_secs(25);

/// Where a busy thread (`/proc/PID/task/TID name`, as [`busy_daemons`]
/// names it) is: its kernel stack and, where `gdb` is installed, its
/// backtrace, so that a spin found once in CI can be read afterwards.
fn thread_stacks(thread: &str) -> String {
    let Some(task) = thread.split_whitespace().next() else { return String::new() };
    let kernel = std::fs::read_to_string(format!("{task}/stack")).unwrap_or_else(|err| format!("({err})"));
    let mut out = format!("kernel stack of {task}:\n{kernel}");
    let mut parts = task.trim_start_matches("/proc/").split("/task/");
    let (Some(pid), Some(tid)) = (parts.next(), parts.next()) else { return out };
    let gdb = Command::new("gdb")
        .args(["-p", pid, "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt 40"])
        .output();
    match gdb {
        Ok(gdb) => {
            // Only the busy thread's part of every thread's backtrace.
            let text = String::from_utf8_lossy(&gdb.stdout);
            let marker = format!("(LWP {tid})");
            let thread = text.split("\nThread ").find(|part| part.contains(&marker)).unwrap_or("(not found)");
            out.push_str(&format!("backtrace (gdb):\nThread {thread}"));
        }
        Err(err) => out.push_str(&format!("(no backtrace: gdb: {err})\n")),
    }
    out
}

/// [`busy_daemons`]' measure: those of `daemons` above [`BUSY_SHARE`] over
/// one [`BUSY_WINDOW`].
fn busy_over_a_window(daemons: &[(String, u32)]) -> Vec<(String, f64, String)> {
    let before: Vec<_> = daemons.iter().map(|(_, pid)| thread_cpu::thread_cpu(&[*pid])).collect();
    std::thread::sleep(BUSY_WINDOW);
    let mut busy = Vec::new();
    for ((daemon, pid), before) in daemons.iter().zip(before) {
        let after = thread_cpu::thread_cpu(&[*pid]);
        let used = thread_cpu::used_between(&before, &after);
        let nanos: u64 = used.iter().map(|(nanos, _)| nanos).sum();
        let share = nanos as f64 / 1e9 / BUSY_WINDOW.as_secs_f64();
        if share > BUSY_SHARE {
            let busiest = used.first().map_or(String::new(), |(_, thread)| thread.to_string());
            busy.push((daemon.clone(), share, busiest));
        }
    }
    busy
}

fn campaign(cli: &Cli) -> Result<Tally> {
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let shape = Shape {
        managers: cli.managers.unwrap_or(if cli.redundancy.is_some() { 4 } else { 2 }),
        provider: cli.provider.clone(),
    };
    println!(
        "fault campaign: seed {seed}, {} faults, {} ranks x {}, provider {}, {} managers, redundancy {}, \
         mode {}, {} commits, one block in {} rewritten per step",
        cli.faults,
        cli.ranks,
        cli.size,
        cli.provider,
        shape.managers,
        cli.redundancy.as_deref().unwrap_or("none"),
        cli.mode,
        if cli.asynchronous { "async" } else { "blocking" },
        cli.change_one_block_in,
    );
    let mut rng = Rng(seed);
    let icheck = siblings::sibling_binary("icheck")?;
    let takeover_after = TAKEOVER_AFTER.as_secs().to_string();
    let mut args = vec![
        "--provider",
        &cli.provider,
        "--kill-silent-after",
        KILL_SILENT_AFTER,
        "--manager-relaunches",
        MANAGER_RELAUNCHES,
    ];
    if cli.standby {
        args.extend(["--standby", "--takeover-after", &takeover_after]);
    }
    let service = LocalService::up(&icheck, "campaign", shape.managers, &args);
    // Nodes the policy survives losing at once.
    let tolerated = match &cli.redundancy {
        Some(policy) => policy
            .parse::<icheck_core::redundancy::Redundancy>()
            .with_context(|| format!("--redundancy {policy}"))?
            .tolerates(),
        None => 0,
    };
    let losses: &[&str] = match tolerated {
        0 => &[],
        1 => &[LOSE_NODE],
        _ => &[LOSE_NODE, LOSE_NODES],
    };
    let kinds: Vec<&str> = KINDS
        .iter()
        .chain(if cli.standby { &TAKEOVERS[..] } else { &[] })
        .chain(losses)
        .copied()
        .filter(|kind| cli.kinds.is_empty() || cli.kinds.iter().any(|k| k == kind))
        .collect();
    if kinds.is_empty() {
        bail!(
            "--kinds {:?} names no fault kind of {:?}",
            cli.kinds,
            KINDS.iter().chain(&TAKEOVERS).chain(losses).collect::<Vec<_>>()
        );
    }
    let bound = Duration::from_secs(cli.bound);
    let config = service.config_path();
    let mut tally = Tally::default();
    // The newest version the library reported complete so far.
    let mut told: Option<u64> = None;
    let mut fault_at: Option<Instant> = None;
    for round in 0..=cli.faults {
        let last = round == cli.faults;
        // A failpoint fault arms its daemon (started again with it) or the job.
        let kind = if last { "" } else { kinds[rng.below(kinds.len() as u64) as usize] };
        let failpoint = (kind == "failpoint").then(|| FAILPOINTS[rng.below(FAILPOINTS.len() as u64) as usize]);
        let mut job_env = Vec::new();
        if let Some(policy) = &cli.redundancy {
            // No PFS copies: a lost node's versions come back from the
            // other nodes or not at all.
            job_env.push((icheck_core::config::REDUNDANCY_ENV, policy.clone()));
            job_env.push(("ICHECK_PFS_INTERVAL", "0".to_string()));
        }
        let mut armed: Option<u32> = None;
        if let Some((place, name)) = failpoint {
            // A restart fetches once per job: only its first hit can strike.
            // A starting controller appends to its journal once (the
            // incarnation): that hit passes, or it would never start.
            let skip = match name {
                "client.before_fetch" => 0,
                "journal.before_append" => 1 + rng.below(4),
                _ => rng.below(4),
            };
            let spec = format!("{name}={skip}*exit(86)");
            match place {
                "job" => job_env.push((icheck_core::failpoint::FAILPOINTS_ENV, spec.clone())),
                daemon => {
                    let target = if daemon == "controller" {
                        "controller".to_string()
                    } else {
                        format!("manager-local-{}", 1 + rng.below(u64::from(shape.managers)))
                    };
                    let pid = service.pid_of(&target);
                    signal(pid, Signal::SIGKILL);
                    while is_icheck_process(pid) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    if let Err(err) = up_again(&service, &shape, Some(&spec)) {
                        tally.hangs.push(format!("round {round}: arming {spec}: {err:#}"));
                        break;
                    }
                    armed = Some(service.pid_of(&target));
                }
            }
            println!("round {round}: failpoint {spec} in the {place}");
        }
        let mut job = Job::start(cli, &config, &job_env)?;
        // Check: the restart restores the newest reported version (or newer), bit-exact.
        match job.wait_for(bound, |l| {
            l.iter().any(|l| l.starts_with("RESTORED") || l == "FRESH" || l.starts_with("MISMATCH"))
        }) {
            Err(waited) => tally.hangs.push(format!("round {round}: no restart within {waited:?}")),
            Ok(_) => {
                let lines = job.lines();
                let restored = lines
                    .iter()
                    .find_map(|l| l.strip_prefix("RESTORED version=")?.split(' ').next()?.parse::<u64>().ok());
                let fresh = lines.iter().any(|l| l == "FRESH");
                match (told, restored) {
                    _ if lines.iter().any(|l| l.starts_with("MISMATCH")) => {
                        tally.lost.push(format!("round {round}: restored data differs: {lines:?}"))
                    }
                    (None, _) => {}
                    (Some(t), Some(r)) if r >= t => tally.verified += 1,
                    (Some(t), Some(r)) => tally
                        .lost
                        .push(format!("round {round}: version {t} was reported complete, the restart found {r}")),
                    (Some(t), None) if fresh => tally
                        .lost
                        .push(format!("round {round}: version {t} was reported complete, the restart was fresh")),
                    // The armed failpoint struck during the restart (the
                    // library's fetch, the controller's journal at
                    // registration): the next round checks again.
                    (Some(_), None) if failpoint.is_some() => {}
                    (Some(t), None) => tally.lost.push(format!(
                        "round {round}: version {t} was reported complete, the restart failed: {}",
                        job.stderr_tail()
                    )),
                }
                if let (Some(at), Some(version)) = (fault_at.take(), restored) {
                    tally.slowest_recovery = tally.slowest_recovery.max(at.elapsed());
                    println!("  restarted from version {version}, {:.1} s after the fault", at.elapsed().as_secs_f64());
                }
            }
        }
        if last {
            job.kill();
            break;
        }
        // Let it commit a few versions, then strike at a random moment.
        let before = committed(&job.lines()).len();
        let wanted = before + 1 + rng.below(3) as usize;
        if let Err(waited) = job.wait_for(bound, |l| committed(l).len() >= wanted) {
            tally.hangs.push(format!("round {round}: no commit within {waited:?}"));
        }
        std::thread::sleep(rng.millis(0, 150));
        let pause = match kind {
            // Past the takeover window, and past the managers' silence bound.
            "takeover: stop primary" => rng.millis(4500, 7000),
            _ => rng.millis(500, 4000),
        };
        let at = Instant::now();
        let mut protected_at_fault: Option<u64> = None;
        let mut lost_nodes: Vec<String> = Vec::new();
        let (what, pid) = match kind {
            "kill rank" | "stop rank" => {
                let pids = job.rank_pids();
                let pid = pids.get(rng.below(pids.len().max(1) as u64) as usize).copied().unwrap_or(0);
                (format!("rank pid {pid}"), pid)
            }
            "kill manager" | "stop manager" | "hang manager" => {
                let name = format!("manager-local-{}", 1 + rng.below(u64::from(shape.managers)));
                (name.clone(), service.pid_of(&name))
            }
            LOSE_NODE | LOSE_NODES => {
                // A node holding some of the job's agents, with the version
                // protected at that moment: what must survive. "lose nodes"
                // adds others, drawn from every node, up to the tolerance.
                let status = service.try_status().ok();
                let app = status.as_ref().and_then(|s| s.apps.iter().find(|a| a.registration.name == APP));
                let mut nodes: Vec<String> =
                    app.map(|a| a.agents.iter().map(|agent| agent.node.clone()).collect()).unwrap_or_default();
                nodes.sort();
                nodes.dedup();
                if nodes.is_empty() {
                    nodes.push(format!("local-{}", 1 + rng.below(u64::from(shape.managers))));
                }
                lost_nodes.push(nodes[rng.below(nodes.len() as u64) as usize].clone());
                let wanted = if kind == LOSE_NODES { tolerated.min(shape.managers as usize) } else { 1 };
                while lost_nodes.len() < wanted {
                    let node = format!("local-{}", 1 + rng.below(u64::from(shape.managers)));
                    if !lost_nodes.contains(&node) {
                        lost_nodes.push(node);
                    }
                }
                protected_at_fault = app.and_then(|a| a.protected);
                (format!("{}, version {protected_at_fault:?} protected", lost_nodes.join(" and ")), 0)
            }
            "kill controller" | "stop controller" => ("controller".to_string(), service.pid_of("controller")),
            "takeover: kill primary" | "takeover: stop primary" => {
                let name = service.primary_name().unwrap_or("controller");
                (format!("primary: {name}"), service.pid_of(name))
            }
            _ => ("armed failpoint".to_string(), 0),
        };
        let raw = |pid: u32, sig| {
            let _ = kill(Pid::from_raw(pid as i32), sig);
        };
        match kind {
            "kill rank" => raw(pid, Signal::SIGKILL),
            "stop rank" => raw(pid, Signal::SIGSTOP),
            "kill manager" | "kill controller" | "takeover: kill primary" => signal(pid, Signal::SIGKILL),
            LOSE_NODE | LOSE_NODES => {
                // Every lost node's manager dies first, then the stores go:
                // the nodes are lost together.
                let managers: Vec<u32> =
                    lost_nodes.iter().map(|node| service.pid_of(&format!("manager-{node}"))).collect();
                for pid in &managers {
                    signal(*pid, Signal::SIGKILL);
                }
                for pid in managers {
                    while is_icheck_process(pid) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                for node in &lost_nodes {
                    let store = service.config.agent_store_dir.join(node);
                    // A node that has stored nothing yet has no directory (the
                    // store makes it at its first file): it loses nothing.
                    match std::fs::remove_dir_all(&store) {
                        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                            tally.hangs.push(format!("round {round}: deleting {}: {err}", store.display()))
                        }
                        _ => {}
                    }
                }
            }
            "stop manager" | "hang manager" | "stop controller" | "takeover: stop primary" => {
                signal(pid, Signal::SIGSTOP)
            }
            _ => {}
        }
        *tally.faults.entry(kind.to_string()).or_default() += 1;
        let before_fault = committed(&job.lines()).len();
        if kind == "takeover: stop primary" {
            // The job commits on through the new primary while the old one sleeps.
            match job.wait_for(bound, |l| committed(l).len() > before_fault) {
                Ok(_) => tally.takeovers.entry(TAKEOVERS[1]).or_default().push(at.elapsed()),
                Err(waited) => tally.hangs.push(format!("round {round}: no commit within {waited:?} of {kind}")),
            }
            std::thread::sleep(pause.saturating_sub(at.elapsed()));
            raw(pid, Signal::SIGCONT);
            println!("round {round}: {kind} ({what}) for {:?}", at.elapsed());
        } else if kind.starts_with("stop") {
            std::thread::sleep(pause);
            raw(pid, Signal::SIGCONT);
            println!("round {round}: {kind} ({what}) for {pause:?}");
        } else if kind == "takeover: kill primary" {
            match job.wait_for(bound, |l| committed(l).len() > before_fault) {
                Ok(_) => tally.takeovers.entry(TAKEOVERS[0]).or_default().push(at.elapsed()),
                Err(waited) => tally.hangs.push(format!("round {round}: no commit within {waited:?} of {kind}")),
            }
            println!("round {round}: {kind} ({what}), next commit after {:?}", at.elapsed());
        } else if kind != "failpoint" {
            println!("round {round}: {kind} ({what})");
        }
        // The job goes on or ends; either way it is stopped after a while.
        let _ = job.wait_for(Duration::from_secs(3), |_| false);
        let reported = committed(&job.lines());
        let lost_nodes_kind = matches!(kind, LOSE_NODE | LOSE_NODES);
        if lost_nodes_kind {
            // Versions reported complete before the loss but not protected
            // may go (the rebuild falls back to the protected one, and the
            // job writes their numbers again); those reported after it (the
            // first one aside, which may have completed before) must stay.
            let after: Vec<u64> = reported.iter().skip(before_fault + 1).copied().collect();
            told = after.iter().copied().max().max(protected_at_fault);
        }
        let slowest =
            job.lines().iter().filter_map(|l| l.rsplit_once("secs=")?.1.parse::<f64>().ok()).fold(0.0, f64::max);
        tally.slowest_commit = tally.slowest_commit.max(slowest);
        tally.moved_shares.extend(job.lines().iter().filter_map(|l| moved_share(l)));
        job.kill();
        if let (false, Some(newest)) = (lost_nodes_kind, reported.iter().max()) {
            told = Some(told.map_or(*newest, |t| t.max(*newest)));
        }
        fault_at = Some(at);
        // A daemon still armed with a failpoint is started again without it
        // (gone first, so that healing sees it dead).
        if let Some(pid) = armed {
            signal(pid, Signal::SIGKILL);
            while is_icheck_process(pid) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // A rebuild lists the agents it started only when it ends, and one
        // held up by a manager wedged inside libfabric's shm provider ends
        // when that manager exits (20 s) and is started again: status is
        // compared with what runs once rebuilds have settled and the
        // service has healed from such an exit (seed 91 found an agent
        // "running, not listed" 5 s into such a rebuild).
        let healed = heal(&service, &shape, bound, cli.standby).and_then(|()| {
            protection_settled(&service, PROTECTION_SETTLE);
            heal(&service, &shape, bound, cli.standby)
        });
        if let Err(why) = healed {
            tally.hangs.push(format!("round {round}: {why}"));
        } else if let Err(wrong) = status_matches_reality(&service) {
            tally.status_mismatches.push(format!("round {round}: status does not match what runs: {wrong}"));
        } else {
            // Building the last versions' redundancy, or a rebuild, is work
            // the job left behind, not a spin: the check waits for it.
            protection_settled(&service, PROTECTION_SETTLE);
            for why in unprotected_versions(&service) {
                tally.unprotected.push(format!("round {round}: left unprotected after healing: {why}"));
            }
            // Protections the wait above saw start are work too.
            protection_settled(&service, PROTECTION_SETTLE);
            for (daemon, share, thread) in busy_daemons(&service) {
                tally.busy.push(format!(
                    "round {round}: {daemon} used {:.0}% of a core with no job running (busiest thread: {thread})\n{}",
                    share * 100.0,
                    thread_stacks(&thread)
                ));
            }
        }
        tally.max_files_per_rank = tally.max_files_per_rank.max(files_per_rank(&service.config.agent_store_dir));
        for (name, pid) in icheck_service::launcher::read_pids(&service.dir) {
            if let Some(kib) = rss_kib(pid) {
                let entry = tally.rss.entry(name).or_insert((kib, kib));
                entry.1 = kib;
            }
        }
        tally.rounds += 1;
        let _ = std::io::stdout().flush();
    }
    tally.wedged_exits = wedged_exits(&service);
    if cli.keep && tally.findings().next().is_some() {
        let copy = service.dir.with_extension("kept");
        let _ = std::fs::remove_dir_all(&copy);
        std::fs::create_dir_all(&copy)?;
        Command::new("cp").arg("-a").arg(&service.dir).arg(&service.config.agent_store_dir).arg(&copy).status()?;
        println!("state directory and checkpoint store copied to {}", copy.display());
    }
    Ok(tally)
}

/// Prints the campaign's table; `every`: the job rewrote one block in
/// `every` per step.
fn print_table(tally: &Tally, every: u64) {
    println!();
    println!("| what | value |");
    println!("|---|---|");
    println!("| rounds (one fault each) | {} |", tally.rounds);
    let shown = TAKEOVERS.iter().chain([&LOSE_NODE, &LOSE_NODES]).filter(|k| tally.faults.contains_key(**k));
    for kind in KINDS.iter().chain(shown) {
        println!("| faults: {kind} | {} |", tally.faults.get(*kind).copied().unwrap_or(0));
    }
    println!("| versions verified bit-exact after a fault | {} |", tally.verified);
    println!("| versions lost (must be 0) | {} |", tally.lost.len());
    println!("| hangs (must be 0) | {} |", tally.hangs.len());
    println!("| status not matching what runs, after healing (must be 0) | {} |", tally.status_mismatches.len());
    println!("| daemons busy with no job running, after healing (must be 0) | {} |", tally.busy.len());
    println!("| newest versions left unprotected, after healing (must be 0) | {} |", tally.unprotected.len());
    println!("| slowest recovery (fault to verified restart) | {:.1} s |", tally.slowest_recovery.as_secs_f64());
    println!("| slowest commit reported complete | {:.1} s |", tally.slowest_commit);
    println!(
        "| most files in one rank's store directory (at most {}) | {} |",
        most_files_per_rank(every),
        tally.max_files_per_rank
    );
    if !tally.moved_shares.is_empty() {
        let mut shares = tally.moved_shares.clone();
        shares.sort_by(f64::total_cmp);
        let whole = shares.iter().filter(|s| **s >= 0.999).count();
        println!(
            "| rank 0's blocking commits: share of its bytes moved, median; commits that moved everything | {:.1}%; {} of {} |",
            shares[shares.len() / 2] * 100.0,
            whole,
            shares.len()
        );
    }
    let longest = tally.wedged_exits.iter().max().copied().unwrap_or_default();
    println!(
        "| managers that exited on a wedged fabric (shm), and the longest inside the call | {}, {:.1} s |",
        tally.wedged_exits.len(),
        longest.as_secs_f64()
    );
    for (kind, times) in &tally.takeovers {
        let mut times = times.clone();
        times.sort();
        let median = times[times.len() / 2].as_secs_f64();
        let max = times.last().map_or(0.0, Duration::as_secs_f64);
        println!(
            "| {kind}: fault to the next completed commit, median / max of {} | {median:.1} s / {max:.1} s |",
            times.len()
        );
    }
    for (name, (first, last)) in &tally.rss {
        println!("| RSS of {name}, first -> last round | {} -> {} MiB |", first / 1024, last / 1024);
    }
    for line in tally.findings() {
        println!("{line}");
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(config) = &cli.rank_of {
        return rank_main(config, &cli);
    }
    // Ctrl-C stops the service and the job this run started.
    interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    let tally = campaign(&cli)?;
    print_table(&tally, cli.change_one_block_in);
    if tally.findings().next().is_some() || tally.max_files_per_rank > most_files_per_rank(cli.change_one_block_in) {
        bail!("the campaign broke an invariant (see above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each block holds what the step that last wrote it wrote, and a
    /// restart's check tells a block of another step, or one written
    /// too early, from the right one.
    #[test]
    fn a_partly_rewritten_job_checks_each_block_against_its_own_step() {
        assert_eq!([1, 2, 3, 4, 5].map(|step| last_written(2, step, 4)), [0, 2, 2, 2, 2]);
        assert_eq!([5, 6, 7, 8, 9].map(|step| last_written(0, step, 4)), [4, 4, 4, 8, 8]);
        assert_eq!(last_written(7, 9, 1), 9, "one block in one: every block at every step");
        let mut data = vec![0u8; 3 * BLOCK + 13];
        for step in 1..=5 {
            write_step(&mut data, 1, step, 2);
            assert_eq!(first_wrong_byte(&data, 1, step, 2), None, "step {step}");
        }
        // Blocks 1 and 3 were last written at step 5, blocks 0 and 2 at 4:
        // as the job after step 4, block 1 is of a later step.
        assert_eq!(first_wrong_byte(&data, 1, 4, 2).map(|at| at / BLOCK), Some(1));
        let mut stale = data.clone();
        fill_bytes(&mut stale[BLOCK..2 * BLOCK], 1, 2);
        assert_eq!(first_wrong_byte(&stale, 1, 5, 2).map(|at| at / BLOCK), Some(1));
        let mut first = vec![0u8; 2 * BLOCK];
        write_step(&mut first, 0, 1, 2);
        assert_eq!(first_wrong_byte(&first, 0, 1, 2), None, "block 0 is still zero after step 1");
        first[7] = 1;
        assert_eq!(first_wrong_byte(&first, 0, 1, 2), Some(7));
    }

    #[test]
    fn what_a_commit_moved_is_read_from_its_line_and_the_time_still_from_the_end() {
        let line = "COMMITTED version=7 step=7 moved=2097152/8388621 secs=0.031";
        assert_eq!(moved_share(line), Some(2097152.0 / 8388621.0));
        assert_eq!(line.rsplit_once("secs=").map(|(_, s)| s), Some("0.031"));
        assert_eq!(moved_share("COMMITTED version=7 step=7 secs=0.031"), None, "async commits say nothing");
        assert_eq!(moved_share("COMMITTED version=7 step=7 moved=5/0 secs=0.031"), None);
    }

    #[test]
    fn incremental_jobs_may_keep_block_maps_and_shared_blocks_but_no_more() {
        assert_eq!(most_files_per_rank(1), 9, "whole commits: versions, the spare and the prepared file");
        assert_eq!(most_files_per_rank(2), 15);
        assert_eq!(most_files_per_rank(4), 21);
    }

    #[test]
    fn a_wedged_managers_time_inside_is_read_from_its_debug_form() {
        assert_eq!(debug_duration("4.041s"), Some(Duration::from_millis(4041)));
        assert_eq!(debug_duration("950ms"), Some(Duration::from_millis(950)));
        assert_eq!(debug_duration("12µs"), Some(Duration::from_micros(12)));
        assert_eq!(debug_duration("4.041"), None);
        assert_eq!(debug_duration("fast"), None);
    }
}
