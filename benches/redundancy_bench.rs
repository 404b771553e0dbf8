//! Redundancy benchmark, from one run: for `none`, `partner`, `rs:2+1` and
//! `rs:4+2`, on the same data (4 ranks × 256 MiB under `mpirun`, and one
//! rank × 1 GiB), through a local service of six checkpoint nodes:
//!
//! * the commit time the application sees, as a ratio to `none`: to the
//!   median of every commit of the `none` cases, run first and again last
//!   so that a host drifting over the run moves the baseline too;
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
//! target/release/redundancy-bench --rank-size 256MiB --size 1GiB
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
    /// Commits timed per case; the median is reported.
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
    /// Policies to compare, in this order. The "÷ none" column divides by
    /// the median of every commit of the `none` cases: with `none` first and
    /// last (the default) the baseline brackets the run, since this host
    /// drifts over minutes (a last `none` took 1.18× the first).
    #[arg(long, value_delimiter = ',', default_value = "none,partner,rs:2+1,rs:4+2,none")]
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
    /// Internal: run as one rank of the four-rank case.
    #[arg(long, hide = true)]
    mpi_rank: Option<PathBuf>,
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

/// Seconds the ranks "compute" between commits, asleep: long enough for the
/// agents to protect the version before the next commit, and the ranks do
/// not spin in MPI meanwhile (on two cores that would starve the agents).
const COMPUTE_SECS: u64 = 6;

/// Commits `runs + 1` versions (the first warms up) with a computation
/// phase after each, then checks the last is protected and finishes with
/// IC_PERSIST. The time to protect each version is the controller's
/// record (from the version's record to its last piece).
fn commit_phase<C: Communicator + 'static>(
    config: &Path,
    app: &str,
    comm: C,
    size: usize,
    runs: usize,
) -> Result<Measured> {
    let rank = comm.rank();
    let (mut ic, _) = Icheck::init(Some(config), app, comm)?;
    let data = Region::<u8>::zeroed(size);
    data.write().copy_from_slice(&expected(rank, size, 0));
    ic.add("data", &data)?;
    let mut measured = Measured::default();
    let mut version = 0;
    for i in 0..=runs {
        data.write()[i * 4099 % size] ^= 0x5a;
        let started = Instant::now();
        version = ic.commit()?;
        let committed = started.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_secs(COMPUTE_SECS));
        if i > 0 {
            measured.commit_secs.push(committed);
        }
    }
    if ic.protection()?.policy != "none" {
        ic.wait_protected(version, Duration::from_secs(300))?;
    }
    ic.finalize(true)?;
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

/// Runs `phase` ("commit", else restart) as one rank of `comm`.
fn run_phase<C: Communicator + 'static>(
    phase: &str,
    config: &Path,
    app: &str,
    comm: C,
    size: usize,
    runs: usize,
) -> Result<Measured> {
    match phase {
        "commit" => commit_phase(config, app, comm, size, runs),
        _ => restart_phase(config, app, comm, size, runs),
    }
}

fn mpi_rank(cli: &Cli, config: &Path) -> Result<()> {
    // The library's own log (ICHECK_LOG, as the daemons'): kept with
    // `--keep-logs`.
    icheck_examples::log_to_stderr(None);
    let universe = mpi::initialize().context("MPI init")?;
    let world = universe.world();
    let size = usize::try_from(cli.rank_size.0)?;
    let comm = MpiComm::new(&world);
    let rank = comm.rank();
    let measured = run_phase(&cli.phase, config, &cli.app, comm, size, cli.runs);
    match measured {
        Ok(measured) => {
            for steps in &measured.restart_steps {
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
            runs.push(self.run(cli, config, app, "restart")?);
        }
        runs.sort_by(|a, b| a.restart_secs.total_cmp(&b.restart_secs));
        Ok(runs.swap_remove(runs.len() / 2))
    }

    /// Runs `phase` of the case: in this process (one rank) or under mpirun.
    fn run(&self, cli: &Cli, config: &Path, app: &str, phase: &str) -> Result<Measured> {
        if self.ranks == 1 {
            return run_phase(phase, config, app, SingleProcess, self.per_rank, cli.runs);
        }
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &self.ranks.to_string()])
            .arg(std::env::current_exe()?)
            .args(["--rank-size", &self.per_rank.to_string(), "--runs", &cli.runs.to_string()])
            .args(["--phase", phase, "--app", app, "--mpi-rank"])
            .arg(config)
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
        let mut measured: Measured = serde_json::from_str(json)?;
        // Every rank's steps, not only rank 0's, slowest first.
        measured.restart_steps = stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<RestartSteps>(l.strip_prefix("STEPS ")?).ok())
            .collect();
        measured.restart_steps.sort_by(|a, b| b.total().total_cmp(&a.total()));
        // `restart` agrees across ranks, `restore_all` does not: rank 0
        // often restored in a third of the slowest rank's time, and a
        // restart lasts until every rank has restored.
        if let Some(slowest) = measured.restart_steps.first().filter(|_| phase == "restart") {
            measured.restart_secs = slowest.total();
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
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the benchmark's directory")?;
    let icheck = dir.join("icheck");
    if !icheck.exists() {
        bail!("{} is missing: build the workspace first (cargo build --release --workspace)", icheck.display());
    }
    Ok(icheck)
}

fn case(cli: &Cli, data: Dataset, policy: &str) -> Result<Row> {
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
    let app = "bench";
    let mut committed = data.run(cli, &config, app, "commit")?;
    // The controller's record of each protection (versions 2 on: the first
    // warmed up).
    let now = service.status().apps.into_iter().find(|a| a.registration.name == app).context("the application")?;
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
    let restarted = data.median_restart(cli, &config, app)?;
    let restart = restarted.restart_secs;
    // A node holding a primary is lost: manager killed, store deleted.
    let app_report = report.apps.iter().find(|a| a.registration.name == app).context("the application")?;
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
                a.registration.name == app
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
            let now = service.status().apps.into_iter().find(|a| a.registration.name == app);
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
        let after_loss = data.median_restart(cli, &config, app)?;
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
        policy: policy.to_string(),
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
    if let Some(config) = &cli.mpi_rank {
        return mpi_rank(&cli, config);
    }
    if !cli.policies.iter().any(|p| p == "none") {
        bail!(
            "--policies {}: `none` is missing, and the other policies' commits are compared to it",
            cli.policies.join(",")
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
        let mut rows = Vec::new();
        for policy in &cli.policies {
            rows.push(case(&cli, data, policy)?);
        }
        // The baseline: every `none` commit of the run, first and last.
        let nones: Vec<&Row> = rows.iter().filter(|r| r.policy == "none").collect();
        let none = median(nones.iter().flat_map(|r| r.commits.iter().copied()).collect());
        let baseline = format!(
            "\n÷ none: to the median of the {} commits of the `none` case{} ({} ms; each case's median: {} ms).",
            nones.iter().map(|r| r.commits.len()).sum::<usize>(),
            if nones.len() > 1 { "s, run first and last" } else { "" },
            ms(none),
            nones.iter().map(|r| ms(r.commit)).collect::<Vec<_>>().join(", ")
        );
        out.push(format!(
            "\n**{}** ({} provider; memcpy of the same bytes: {} ms)\n",
            data.label(),
            cli.provider,
            ms(memcpy)
        ));
        let fti = cli.fti_l2;
        out.push(format!("| policy | commit (ms) | ÷ none | until protected (ms) | FTI L2 {fti:.2} s ÷ this | commit + until protected (ms) | FTI L2 ÷ that | memory held (× one version) | restart (ms) | rebuild after a lost node (ms) | restart after the loss (ms) | its speed ÷ no loss |"));
        out.push("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|".into());
        for (i, r) in rows.iter().enumerate() {
            let again = r.policy == "none" && rows[..i].iter().any(|earlier| earlier.policy == "none");
            let label = if again { "none, again" } else { r.policy.as_str() };
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
                "| {label} | {} | {:.2} | {protect} | {vs_fti} | {whole} | {whole_vs_fti} | {:.2} | {} | {rebuild} | {after} | {speed} |",
                ms(r.commit),
                r.commit / none,
                r.memory,
                ms(r.restart),
            ));
        }
        out.push(baseline);
    }
    println!(
        "Redundancy across six local checkpoint nodes, median of {} commits and of {} restart jobs per case; one run.",
        cli.runs, cli.restarts
    );
    for line in out {
        println!("{line}");
    }
    Ok(())
}
