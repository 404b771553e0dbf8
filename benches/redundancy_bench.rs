//! Redundancy benchmark, from one run: for `none`, `partner`, `rs:2+1` and
//! `rs:4+2`, on the same data (4 ranks × 256 MiB under `mpirun`, and one
//! rank × 1 GiB), through a local service of six checkpoint nodes:
//!
//! * the commit time the application sees, as a ratio to `none`. Every
//!   policy has a service of its own, all up at once, and one job commits
//!   into all of them in turn, round after round (the order rotating each
//!   round): each policy's commit is compared with the `none` commit of
//!   the same round, seconds away, since this host drifts over minutes by
//!   as much as the target bounds;
//! * the time from the version's record at the controller until it is
//!   protected (every copy or parity shard built by the agents, while the
//!   ranks compute), against FTI L2's partner copy of the same data on
//!   this machine kind (2.31 s in the issue; `--fti-l2` takes a figure
//!   measured beside the run);
//! * the checkpoint memory the nodes hold, per byte of one version (a
//!   rank's previous version stays as its spare file in every policy, and
//!   each piece's previous version as the piece's spare);
//! * commit + until protected: when, after the commit starts, the version
//!   is protected (FTI's L2 checkpoint returns with its copy made);
//! * after a node is lost (its manager killed, its store deleted): the
//!   rebuild time and the restart time, against a restart with no loss.
//!   A restart is `restart` + `restore_all` into memory the ranks touched
//!   first; each rank's steps (touching its fresh memory, `init`, restart,
//!   restore) are printed on stderr, and with `--keep-logs` the ranks' own
//!   log (`ICHECK_LOG`) is kept as `ranks.log`.
//!
//! memcpy of the same bytes is measured in the same run.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/redundancy-bench --rank-size 256MiB --size 1GiB --runs 15
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::fabric::AlignedBuffer;
use icheck_core::units::ByteSize;
use icheck_lib::{Communicator, Icheck, MpiComm, Region, SingleProcess};
use icheck_service::selftest::fill_pattern;
use icheck_service::testkit::{poll_until, LocalService};
use serde::{Deserialize, Serialize};

#[path = "siblings.rs"]
mod siblings;

/// FTI L2 (partner copy) of 4 ranks × 256 MiB on this machine kind, from
/// the issue: `--fti-l2`'s default.
const ISSUE_FTI_L2_SECS: f64 = 2.31;

#[derive(Parser)]
#[command(about = "Commit, protection, memory and restart-after-loss cost of each redundancy policy")]
struct Cli {
    /// Bytes per rank of the four-rank case (0 skips it).
    #[arg(long, default_value = "256MiB")]
    rank_size: ByteSize,
    /// Bytes of the one-rank case (0 skips it).
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Rounds of commits timed (one commit per case each); the median is
    /// reported. At most 15 (the controller keeps 16 protections' times).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Restart jobs per restart column (each a new job that restores the
    /// version, before the loss and after it); the median is reported:
    /// one job's restart spreads by up to 2× between runs on two cores.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    restarts: u32,
    /// Fabric provider.
    #[arg(long, default_value = "tcp")]
    provider: String,
    /// Policies to compare (each once, `none` among them), each with a
    /// service of its own; one job commits into them in turn, round after
    /// round. "÷ none" is the median over rounds of each round's commit
    /// divided by that round's `none` commit: a host that drifts over
    /// minutes (a `none` case run last took 1.18× one run first) moves
    /// both alike.
    #[arg(long, value_delimiter = ',', default_value = "none,partner,rs:2+1,rs:4+2")]
    policies: Vec<String>,
    /// Copy each case's daemon logs under this directory before the
    /// service goes (to see where a case's time went).
    #[arg(long)]
    keep_logs: Option<PathBuf>,
    /// Where the agents keep checkpoints (`icheck up --store-dir`; each
    /// case in a subdirectory of its own), e.g. a tmpfs mounted with
    /// `huge=within_size`. Default: `icheck up`'s, on /dev/shm.
    #[arg(long)]
    store_dir: Option<PathBuf>,
    /// Commit incrementally (the library's default): each version then
    /// moves one changed block. Off here, so every commit moves its whole
    /// version, as FTI's and VeloC's checkpoints do, and the figures compare
    /// with theirs. Protection copies or encodes whole versions either way.
    #[arg(long)]
    incremental: bool,
    /// Seconds of FTI's L2 checkpoint (a local write plus a partner copy,
    /// inline) of 4 ranks × 256 MiB, which the "FTI L2 ÷" columns divide.
    /// The default is the issue's figure for this machine kind; hosts of
    /// one kind differ by 2× (benches/results/JOURNAL.md), so pass FTI measured on this host
    /// beside the run where you can.
    #[arg(long, default_value_t = ISSUE_FTI_L2_SECS)]
    fti_l2: f64,
    /// Internal: run as one rank of the four-rank case, against these
    /// services' configurations.
    #[arg(long, hide = true, value_delimiter = ',')]
    mpi_rank: Vec<PathBuf>,
    /// Internal: "commit" or "restart".
    #[arg(long, hide = true, default_value = "commit")]
    phase: String,
    /// Internal: the application name.
    #[arg(long, hide = true, default_value = "bench")]
    app: String,
}

/// What the ranks measured (rank 0's view of the collective steps).
#[derive(Debug, Default, Serialize, Deserialize)]
struct Measured {
    commit_secs: Vec<f64>,
    protect_secs: Vec<f64>,
    /// `restart` + `restore_all`: rank 0's in a rank's own RESULT, the
    /// slowest rank's once [`Dataset::run`] has every rank's steps.
    restart_secs: f64,
    /// Each rank's restart in steps, slowest rank first: where a slow
    /// restart's time went (printed with the case's line).
    restart_steps: Vec<RestartSteps>,
}

/// One rank's restart: the first touch of its fresh memory, `Icheck::init`
/// (fabric, registration, agent session), `restart` (the agent exposes the
/// version) and `restore_all`, in seconds.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize)]
struct RestartSteps {
    rank: u32,
    touch: f64,
    init: f64,
    restart: f64,
    restore: f64,
}

impl RestartSteps {
    /// What the benchmark counts as the restart.
    fn total(&self) -> f64 {
        self.restart + self.restore
    }
}

impl std::fmt::Display for RestartSteps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |s: f64| s * 1e3;
        write!(
            f,
            "rank {}: touch {:.0} ms, init {:.0} ms, restart {:.0} ms, restore {:.0} ms",
            self.rank,
            ms(self.touch),
            ms(self.init),
            ms(self.restart),
            ms(self.restore)
        )
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The rank's data after `commits` commits: a pattern with one byte per
/// commit flipped (so every version differs and a restart can be checked).
fn expected(rank: u32, size: usize, commits: usize) -> Vec<u8> {
    let mut data = vec![0u8; size];
    fill_pattern(&mut data, u64::from(rank) + 11);
    for i in 0..commits {
        data[i * 4099 % size] ^= 0x5a;
    }
    data
}

/// Seconds the ranks "compute" after each commit, asleep (the ranks do not
/// spin in MPI meanwhile: on two cores that would starve the agents). The
/// version's protection runs in this time (at most 0.6 s on this machine
/// kind), and the next commit waits for it if it has not ended, so no
/// commit of any service is timed while another's protection runs.
const COMPUTE_SECS: u64 = 3;

/// Most timed rounds: the controller's status keeps the times of its
/// newest 16 protections (`PROTECTION_HISTORY`), and the first round,
/// untimed, is one of them.
const MAX_RUNS: usize = 15;

/// Commits the same data into every service of `configs` (one `Icheck`
/// each), `runs + 1` rounds (the first warms up): each round changes the
/// data once, then commits it into every service in turn, starting one
/// further along each round, with a computation phase after each commit
/// that lasts until the version is protected. So a round's commits lie
/// seconds apart, and no policy always follows the same one. Finishes
/// with IC_PERSIST. Returns one `Measured` per service, its commits in
/// round order. The time to protect each version is the controller's
/// record (from the version's record to its last piece).
fn commit_phase<C: Communicator + 'static>(
    configs: &[PathBuf],
    app: &str,
    comm: impl Fn() -> C,
    size: usize,
    runs: usize,
) -> Result<Vec<Measured>> {
    let data = Region::<u8>::zeroed(size);
    let mut services = Vec::new();
    let mut protects = Vec::new();
    for config in configs {
        let comm = comm();
        let rank = comm.rank();
        let (mut ic, _) = Icheck::init(Some(config), app, comm)?;
        if services.is_empty() {
            data.write().copy_from_slice(&expected(rank, size, 0));
        }
        ic.add("data", &data)?;
        protects.push(ic.protection()?.policy != "none");
        services.push(ic);
    }
    let mut measured: Vec<Measured> = configs.iter().map(|_| Measured::default()).collect();
    let mut versions = vec![0; configs.len()];
    for round in 0..=runs {
        data.write()[round * 4099 % size] ^= 0x5a;
        for turn in 0..services.len() {
            let which = (round + turn) % services.len();
            let started = Instant::now();
            versions[which] = services[which].commit()?;
            let committed = started.elapsed().as_secs_f64();
            std::thread::sleep(Duration::from_secs(COMPUTE_SECS));
            if protects[which] {
                services[which].wait_protected(versions[which], Duration::from_secs(300))?;
            }
            if round > 0 {
                measured[which].commit_secs.push(committed);
            }
        }
    }
    for mut ic in services {
        ic.finalize(true)?;
    }
    Ok(measured)
}

/// Restarts from the newest version and checks every byte. The time is
/// `restart` + `restore_all` into memory the rank has touched, as
/// commit-bench's restart rows: a restarted job's `Icheck::init` (which
/// opens the fabric: every libfabric provider loads once per process) and
/// its first touch of fresh memory cost the same with or without a lost
/// node, and on this VM the second varies with how much memory was freed
/// just before (freed pages go back to the host, and a page taken again is
/// faulted in from it), so both are reported apart, in each rank's steps.
fn restart_phase<C: Communicator + 'static>(
    config: &Path,
    app: &str,
    comm: C,
    size: usize,
    runs: usize,
) -> Result<Measured> {
    let rank = comm.rank();
    let data = Region::<u8>::zeroed(size);
    let started = Instant::now();
    data.write().fill(0xa5);
    let touched = started.elapsed().as_secs_f64();
    let (mut ic, _) = Icheck::init(Some(config), app, comm)?;
    let initialized = started.elapsed().as_secs_f64();
    ic.add("data", &data)?;
    ic.restart()?;
    let restarted = started.elapsed().as_secs_f64();
    ic.restore_all()?;
    let restored = started.elapsed().as_secs_f64();
    if *data.read() != expected(rank, size, runs + 1)[..] {
        bail!("rank {rank}: the restored data differs from the last commit");
    }
    let mine = RestartSteps {
        rank,
        touch: touched,
        init: initialized - touched,
        restart: restarted - initialized,
        restore: restored - restarted,
    };
    let restart_secs = mine.total();
    ic.finalize(true)?;
    Ok(Measured { restart_secs, restart_steps: vec![mine], ..Measured::default() })
}

/// Runs `phase` as one rank of the communicators `comm` makes: "commit"
/// into every service of `configs`, else a restart from the first.
fn run_phase<C: Communicator + 'static>(
    phase: &str,
    configs: &[PathBuf],
    app: &str,
    comm: impl Fn() -> C,
    size: usize,
    runs: usize,
) -> Result<Vec<Measured>> {
    match (phase, configs) {
        ("commit", _) => commit_phase(configs, app, comm, size, runs),
        (_, [config]) => Ok(vec![restart_phase(config, app, comm(), size, runs)?]),
        _ => bail!("a restart reads one service, not {}", configs.len()),
    }
}

fn mpi_rank(cli: &Cli, configs: &[PathBuf]) -> Result<()> {
    // The library's own log (ICHECK_LOG, as the daemons'): kept with
    // `--keep-logs`.
    icheck_examples::log_to_stderr(None);
    let universe = mpi::initialize().context("MPI init")?;
    let world = universe.world();
    let size = usize::try_from(cli.rank_size.0)?;
    let rank = mpi::traits::Communicator::rank(&world).unsigned_abs();
    let measured = run_phase(&cli.phase, configs, &cli.app, || MpiComm::new(&world), size, cli.runs);
    match measured {
        Ok(measured) => {
            for steps in measured.iter().flat_map(|m| &m.restart_steps) {
                println!("STEPS {}", serde_json::to_string(steps)?);
            }
            if rank == 0 {
                println!("RESULT {}", serde_json::to_string(&measured)?);
            }
        }
        Err(err) => {
            eprintln!("rank {rank}: {err}");
            std::process::exit(3);
        }
    }
    Ok(())
}

/// One dataset: ranks and bytes per rank.
#[derive(Clone, Copy)]
struct Dataset {
    ranks: u32,
    per_rank: usize,
}

impl Dataset {
    fn label(&self) -> String {
        format!("{} × {}", self.ranks, ByteSize(self.per_rank as u64))
    }

    fn bytes(&self) -> f64 {
        f64::from(self.ranks) * self.per_rank as f64
    }

    /// Runs the restart phase `cli.restarts` times, each a new job, and
    /// returns the run whose restart time is the median (its ranks' steps
    /// are the ones printed).
    fn median_restart(&self, cli: &Cli, config: &Path, app: &str) -> Result<Measured> {
        let mut runs = Vec::new();
        for _ in 0..cli.restarts {
            let mut restarted = self.run(cli, &[config.to_path_buf()], app, "restart")?;
            runs.push(restarted.pop().context("a restart measured nothing")?);
        }
        runs.sort_by(|a, b| a.restart_secs.total_cmp(&b.restart_secs));
        Ok(runs.swap_remove(runs.len() / 2))
    }

    /// Runs `phase` against the services of `configs`: in this process
    /// (one rank) or under mpirun. One `Measured` per service.
    fn run(&self, cli: &Cli, configs: &[PathBuf], app: &str, phase: &str) -> Result<Vec<Measured>> {
        if self.ranks == 1 {
            return run_phase(phase, configs, app, || SingleProcess, self.per_rank, cli.runs);
        }
        let paths: Vec<String> = configs.iter().map(|c| c.display().to_string()).collect();
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &self.ranks.to_string()])
            .arg(std::env::current_exe()?)
            .args(["--rank-size", &self.per_rank.to_string(), "--runs", &cli.runs.to_string()])
            .args(["--phase", phase, "--app", app, "--mpi-rank", &paths.join(",")])
            .output()
            .context("running mpirun")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(dir) = &cli.keep_logs {
            // The ranks' log, each phase appended (`ICHECK_LOG` sets what).
            std::fs::create_dir_all(dir)?;
            let mut log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("ranks.log"))?;
            writeln!(log, "== {} ranks, {phase}", self.ranks)?;
            log.write_all(&out.stderr)?;
        }
        let Some(json) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
            bail!("{phase} printed no result:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        };
        let mut measured: Vec<Measured> = serde_json::from_str(json)?;
        if let ([restarted], "restart") = (&mut measured[..], phase) {
            // Every rank's steps, not only rank 0's, slowest first.
            restarted.restart_steps = stdout
                .lines()
                .filter_map(|l| serde_json::from_str::<RestartSteps>(l.strip_prefix("STEPS ")?).ok())
                .collect();
            restarted.restart_steps.sort_by(|a, b| b.total().total_cmp(&a.total()));
            // `restart` agrees across ranks, `restore_all` does not: rank 0
            // often restored in a third of the slowest rank's time, and a
            // restart lasts until every rank has restored.
            if let Some(slowest) = restarted.restart_steps.first() {
                restarted.restart_secs = slowest.total();
            }
        }
        Ok(measured)
    }
}

/// What one policy cost on one dataset.
struct Row {
    policy: String,
    /// Timed versions that were protected before the next one completed.
    protected_count: usize,
    /// Every timed commit (seconds); `commit` is their median.
    commits: Vec<f64>,
    commit: f64,
    protect: f64,
    /// Median over versions of commit + until protected: how long after the
    /// commit starts the version is protected (FTI's checkpoint call returns
    /// with its partner copy made).
    commit_and_protect: Option<f64>,
    memory: f64,
    restart: f64,
    rebuild: Option<f64>,
    restart_after_loss: Option<f64>,
}

fn icheck_binary() -> Result<PathBuf> {
    siblings::sibling_binary("icheck")
}

/// One policy's service, up from before the commits until its row is
/// measured.
struct Case {
    policy: String,
    name: String,
    service: LocalService,
    /// The service's client configuration with the policy added.
    config: PathBuf,
}

/// The application's name in every case's service.
const APP: &str = "bench";

/// Starts the service of `policy`'s case: six checkpoint nodes.
fn start_case(cli: &Cli, data: Dataset, policy: &str) -> Result<Case> {
    let name = format!("red-{}-{}", data.ranks, policy.replace([':', '+'], "-"));
    // One agent per rank, on nodes of its own, in every policy: the
    // policies differ in their redundancy only (rs:4+2 adds agents).
    let dynamic = format!("init_agent_count = {}\ncandidate_count = 6\nreadInterval = 5\n", data.ranks);
    // Heartbeats every 2 s: six managers and the encoding share two cores.
    let mut args = vec!["--provider", cli.provider.as_str(), "--manager-relaunches", "0", "--heartbeat", "2"];
    let store = cli.store_dir.as_ref().map(|dir| dir.join(&name).display().to_string());
    if let Some(store) = &store {
        args.extend(["--store-dir", store.as_str()]);
    }
    let service = LocalService::up_with_dynamic(&icheck_binary()?, &name, 6, &args, Some(&dynamic));
    let config = service.dir.join("bench.toml");
    let text = std::fs::read_to_string(service.config_path())?;
    std::fs::write(&config, format!("{text}redundancy = \"{policy}\"\n"))?;
    Ok(Case { policy: policy.to_string(), name, service, config })
}

/// Measures the rest of `case`'s row once its commits are `committed`:
/// protection, memory, restarts, and a lost node. The service goes with
/// the case.
fn finish_case(cli: &Cli, data: Dataset, case: Case, mut committed: Measured) -> Result<Row> {
    let Case { policy, name, service, config } = case;
    // The controller's record of each protection (versions 2 on: the first
    // warmed up).
    let now = service.status().apps.into_iter().find(|a| a.registration.name == APP).context("the application")?;
    committed.protect_secs = now.protection_secs.iter().filter(|(v, _)| *v >= 2).map(|(_, s)| *s).collect();
    // A version still being protected when the next one completes is
    // superseded (the newer one is protected instead): counted, not timed.
    let protected_count = committed.protect_secs.len();
    if policy != "none" && protected_count == 0 {
        bail!("{policy}: no version was protected: {:?}", now.protection_secs);
    }
    // The managers measure their stores every status interval (0.5 s here).
    std::thread::sleep(Duration::from_millis(1500));
    let report = service.status();
    let held: u64 = report.nodes.iter().map(|n| n.status.bytes_held).sum();
    let restarted = data.median_restart(cli, &config, APP)?;
    let restart = restarted.restart_secs;
    // A node holding a primary is lost: manager killed, store deleted.
    let app_report = report.apps.iter().find(|a| a.registration.name == APP).context("the application")?;
    let latest = app_report.latest.as_ref().map(|l| l.version);
    let node = app_report.agents[0].node.clone();
    let pid = service.pid_of(&format!("manager-{node}"));
    let lost_at = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(i32::try_from(pid)?), nix::sys::signal::Signal::SIGKILL)?;
    poll_until(Duration::from_secs(10), || !icheck_service::testkit::process_running(pid));
    std::fs::remove_dir_all(service.config.agent_store_dir.join(&node))?;
    let mut steps_after_loss = Vec::new();
    let (rebuild, restart_after_loss) = if policy == "none" {
        (None, None)
    } else {
        let rebuilt = poll_until(Duration::from_secs(300), || {
            service.status().apps.iter().any(|a| {
                a.registration.name == APP
                    && a.protected == latest
                    && !a.rebuilding
                    // Protected again, not still building its pieces anew
                    // (a restart then would share the rebuilt agent with
                    // that reading: measured apart, benches/results/JOURNAL.md).
                    && a.protecting.is_none()
                    && a.protection_problem.is_none()
                    && a.agents.iter().all(|agent| agent.node != node)
            })
        });
        if !rebuilt {
            let now = service.status().apps.into_iter().find(|a| a.registration.name == APP);
            let why = now.map(|a| {
                format!(
                    "protected {:?}, problem {:?}, agents {:?}",
                    a.protected,
                    a.protection_problem,
                    a.agents.iter().map(|g| g.node.clone()).collect::<Vec<_>>()
                )
            });
            bail!("{policy}: the version was not protected again after losing {node}: {why:?}");
        }
        let rebuild = lost_at.elapsed().as_secs_f64();
        let after_loss = data.median_restart(cli, &config, APP)?;
        steps_after_loss = after_loss.restart_steps;
        (Some(rebuild), Some(after_loss.restart_secs))
    };
    eprintln!("{} {policy}: commit {:?}, protect {:?}", data.label(), committed.commit_secs, committed.protect_secs);
    for (which, steps) in [("restart", &restarted.restart_steps), ("restart after the loss", &steps_after_loss)] {
        for step in steps {
            eprintln!("  {which}: {step}");
        }
    }
    if let Some(dir) = &cli.keep_logs {
        let into = dir.join(&name);
        std::fs::create_dir_all(&into)?;
        for entry in std::fs::read_dir(service.dir.join("logs"))?.flatten() {
            std::fs::copy(entry.path(), into.join(entry.file_name()))?;
        }
    }
    let commit_and_protect = (committed.commit_secs.len() == committed.protect_secs.len())
        .then(|| median(committed.commit_secs.iter().zip(&committed.protect_secs).map(|(c, p)| c + p).collect()));
    Ok(Row {
        policy,
        protected_count,
        commit_and_protect,
        commit: median(committed.commit_secs.clone()),
        commits: committed.commit_secs,
        protect: median(committed.protect_secs),
        memory: held as f64 / data.bytes(),
        restart,
        rebuild,
        restart_after_loss,
    })
}

fn memcpy_secs(bytes: usize) -> f64 {
    let mut src = AlignedBuffer::zeroed(bytes);
    fill_pattern(src.as_mut_slice(), 7);
    let mut dst = AlignedBuffer::zeroed(bytes);
    dst.as_mut_slice().fill(1);
    median(
        (0..3)
            .map(|_| {
                let start = Instant::now();
                dst.as_mut_slice().copy_from_slice(src.as_slice());
                start.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Before any rank starts: mpirun's ranks inherit it.
    std::env::set_var("ICHECK_INCREMENTAL", if cli.incremental { "1" } else { "0" });
    if !cli.mpi_rank.is_empty() {
        return mpi_rank(&cli, &cli.mpi_rank);
    }
    // Ctrl-C stops the services this run started.
    icheck_service::testkit::interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    if !cli.policies.iter().any(|p| p == "none") {
        bail!(
            "--policies {}: `none` is missing, and the other policies' commits are compared to it",
            cli.policies.join(",")
        );
    }
    if let Some(twice) = cli.policies.iter().enumerate().find(|(i, p)| cli.policies[..*i].contains(p)) {
        bail!(
            "--policies {}: `{}` is named twice; each policy is measured once, its commits taking turns with the others'",
            cli.policies.join(","),
            twice.1
        );
    }
    if !(1..=MAX_RUNS).contains(&cli.runs) {
        bail!(
            "--runs {}: from 1 to {MAX_RUNS} rounds (the controller's status keeps the newest {} protections' times, and the first round warms up)",
            cli.runs,
            MAX_RUNS + 1
        );
    }
    if !(cli.fti_l2.is_finite() && cli.fti_l2 > 0.0) {
        bail!("--fti-l2 {}: FTI L2's time must be a positive number of seconds", cli.fti_l2);
    }
    let mut datasets = Vec::new();
    if cli.rank_size.0 > 0 {
        datasets.push(Dataset { ranks: 4, per_rank: usize::try_from(cli.rank_size.0)? });
    }
    if cli.size.0 > 0 {
        datasets.push(Dataset { ranks: 1, per_rank: usize::try_from(cli.size.0)? });
    }
    let ms = |secs: f64| format!("{:.0}", secs * 1e3);
    let mut out = Vec::new();
    for data in datasets {
        let memcpy = memcpy_secs(data.ranks as usize * data.per_rank);
        let cases = cli.policies.iter().map(|policy| start_case(&cli, data, policy)).collect::<Result<Vec<_>>>()?;
        let configs: Vec<PathBuf> = cases.iter().map(|case| case.config.clone()).collect();
        eprintln!("{}: {} rounds of commits into {} services in turn", data.label(), cli.runs + 1, cases.len());
        let committed = data.run(&cli, &configs, APP, "commit")?;
        if committed.len() != cases.len() {
            bail!("the commit job measured {} services of {}", committed.len(), cases.len());
        }
        let mut rows = Vec::new();
        // One case at a time, each service going once its row is measured:
        // the next case's restarts then have its memory.
        for (case, measured) in cases.into_iter().zip(committed) {
            rows.push(finish_case(&cli, data, case, measured)?);
        }
        let none = rows.iter().find(|r| r.policy == "none").context("the `none` row")?;
        let none_commits = none.commits.clone();
        let baseline = format!(
            "\n÷ none, same round: the median over the {} rounds of each round's commit divided by that round's `none` commit (each commit followed by {} s of compute, longer if its protection takes longer). ÷ none, medians: the policy's median commit divided by `none`'s ({} ms).",
            none_commits.len(),
            COMPUTE_SECS,
            ms(none.commit)
        );
        out.push(format!(
            "\n**{}** ({} provider; memcpy of the same bytes: {} ms)\n",
            data.label(),
            cli.provider,
            ms(memcpy)
        ));
        let fti = cli.fti_l2;
        out.push(format!("| policy | commit (ms) | ÷ none, same round | ÷ none, medians | until protected (ms) | FTI L2 {fti:.2} s ÷ this | commit + until protected (ms) | FTI L2 ÷ that | memory held (× one version) | restart (ms) | rebuild after a lost node (ms) | restart after the loss (ms) | its speed ÷ no loss |"));
        out.push("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".into());
        for r in &rows {
            let label = r.policy.as_str();
            let paired: Vec<f64> = r.commits.iter().zip(&none_commits).map(|(c, n)| c / n).collect();
            if label != "none" {
                eprintln!("{} {label}: each round's commit ÷ none: {paired:.2?}", data.label());
            }
            let (protect, vs_fti) = match r.policy.as_str() {
                "none" => ("–".to_string(), "–".to_string()),
                _ if r.protected_count < cli.runs => (
                    format!(
                        "{} ({} of {} protected before the next commit)",
                        ms(r.protect),
                        r.protected_count,
                        cli.runs
                    ),
                    format!("{:.1}", fti / r.protect),
                ),
                _ => (ms(r.protect), format!("{:.1}", fti / r.protect)),
            };
            let (rebuild, after, speed) = match (r.rebuild, r.restart_after_loss) {
                (Some(b), Some(a)) => (ms(b), ms(a), format!("{:.2}", r.restart / a)),
                _ => ("lost".into(), "lost".into(), "–".into()),
            };
            let (whole, whole_vs_fti) = match r.commit_and_protect {
                Some(secs) if r.policy != "none" => (ms(secs), format!("{:.1}", fti / secs)),
                _ => ("–".to_string(), "–".to_string()),
            };
            out.push(format!(
                "| {label} | {} | {:.2} | {:.2} | {protect} | {vs_fti} | {whole} | {whole_vs_fti} | {:.2} | {} | {rebuild} | {after} | {speed} |",
                ms(r.commit),
                median(paired),
                r.commit / none.commit,
                r.memory,
                ms(r.restart),
            ));
        }
        out.push(baseline);
    }
    println!(
        "Redundancy across six local checkpoint nodes (a service per policy, up at once), median of {} commits and of {} restart jobs per case; one run.",
        cli.runs, cli.restarts
    );
    for line in out {
        println!("{line}");
    }
    Ok(())
}
