//! Commit and restart benchmark: checkpoints through a real local service
//! (`icheck up`) and prints GB/s next to raw fabric fi_read/fi_write and
//! memcpy measured in the same run.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/commit-bench --size 1GiB --rank-size 256MiB
//! ```
//!
//! Cases: one rank with one agent (in this process), and four ranks with two
//! agents (this binary again, under `mpirun -np 4`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::config::RestoreDirection;
use icheck_core::fabric::{Access, AlignedBuffer, Domain, Endpoint, FabricConfig, RmaOp, TransferOptions};
use icheck_core::units::ByteSize;
use icheck_lib::{Communicator, Icheck, InitStatus, MpiComm, Region, SingleProcess, TransferReport};
use icheck_service::selftest::{fill_pattern, Target, TargetProcess};
use icheck_service::testkit::LocalService;
use serde::{Deserialize, Serialize};

#[path = "plots.rs"]
mod plots;
#[path = "siblings.rs"]
mod siblings;
#[path = "thread_cpu.rs"]
mod thread_cpu;

#[derive(Parser)]
#[command(about = "Commit/restart throughput through a local icheck service, against raw fabric RMA and memcpy")]
struct Cli {
    /// Bytes checkpointed by the single rank.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Bytes per rank in the four-rank case (0 skips it).
    #[arg(long, default_value = "256MiB")]
    rank_size: ByteSize,
    /// Providers, comma-separated.
    #[arg(long, default_value = "shm,tcp", value_delimiter = ',')]
    providers: Vec<String>,
    /// Bytes of the PFS-level cases (copies, compression, fallback writes),
    /// run on the first provider; 0 skips them.
    #[arg(long, default_value = "256MiB")]
    pfs_size: ByteSize,
    /// Timed repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds over which the CPU time of an idle service (an application
    /// registered, between commits) is measured, on the first provider; 0
    /// skips it.
    #[arg(long, default_value_t = 30)]
    idle_seconds: u64,
    /// Bytes of the one rank in the incremental-commit sweep (one
    /// contiguous range changed: 100, 50, 10, 1 and 0% of it), on the first
    /// provider; 0 skips it.
    #[arg(long, default_value = "512MiB")]
    incremental_size: ByteSize,
    /// Run only the incremental-commit sweep.
    #[arg(long)]
    incremental_only: bool,
    /// Run only the new-application cases (one rank with computation
    /// between commits; four ranks back to back, with and without a warm
    /// pool), on the first provider.
    #[arg(long)]
    new_app_only: bool,
    /// Directory of the four-rank case's MPI-IO baseline (each rank's bytes
    /// with MPI_File_write_at_all, then MPI_File_sync); a disk, as a PFS
    /// would be. Empty skips it.
    #[arg(long, default_value = "/var/tmp",
          value_parser = clap::builder::TypedValueParser::map(clap::builder::OsStringValueParser::new(), PathBuf::from))]
    mpiio_dir: PathBuf,
    /// Also write the plots (commit and restart rates, and the incremental
    /// sweep) as SVG into this directory (the README's: benches/results).
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Internal: serve as the raw-fabric target for one provider.
    #[arg(long, hide = true)]
    serve_target: Option<String>,
    /// Internal: run as one rank of the MPI case with this config.
    #[arg(long, hide = true)]
    mpi_rank: Option<PathBuf>,
    /// Internal: restart application `--restore-app` under this config,
    /// restore its `--size` bytes into fresh memory, print the seconds.
    #[arg(long, hide = true)]
    restore_config: Option<PathBuf>,
    /// Internal: the application `--restore-config` restarts.
    #[arg(long, hide = true)]
    restore_app: Option<String>,
    /// Internal: read the whole region of the raw target announced by
    /// this JSON line (over the first of `--providers`) into fresh memory,
    /// in this new process, and print the seconds.
    #[arg(long, hide = true)]
    cold_read_peer: Option<String>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// Prints `line` to stderr in one write: the ranks of the MPI case share
/// it, and `eprintln!` writes a line in pieces that interleave.
fn stderr_line(mut line: String) {
    use std::io::Write as _;
    line.push('\n');
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// What one mode measured, in seconds per operation.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ModeTimes {
    commit: f64,
    unchanged: f64,
    async_blocked: f64,
    async_total: f64,
    /// The first async commit's blocked time, made [`ASYNC_FIRST_PAUSE`]
    /// after choosing async commits (its staging buffer is new).
    #[serde(default)]
    async_first: f64,
    restart: f64,
    /// Restarts with `restore = "push"` (the agent writes), interleaved
    /// with the pulled ones.
    restart_pushed: f64,
    /// Restarts with `restore = "auto"` (the default) on the agents' host:
    /// the rank reads the version's file the agent handed over, interleaved
    /// with the others.
    #[serde(default)]
    restart_same_host: f64,
    /// Pulled restarts into freshly allocated memory in a new process each
    /// (what a restarted application does); not measured in the four-rank
    /// case.
    #[serde(default)]
    restart_fresh: Option<FreshRestarts>,
    /// The blocking commits, each with a raw fi_read (pull) or fi_write
    /// (push) of the rank's bytes made just before it ([`RawFabric`]).
    #[serde(default)]
    commit_pairs: Pairs,
    /// The pulled restores, each with a raw fi_read made just before it.
    #[serde(default)]
    restart_pairs: Pairs,
}

/// Median seconds of a restart into fresh memory in a new process.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct FreshRestarts {
    /// Pulled, its pages populated ahead of the transfer (`prefault`, the
    /// default).
    prefaulted: f64,
    /// Pulled with `prefault = false`: the transfer faults every page.
    unprefaulted: f64,
    /// The defaults (`restore = auto`, prefault): on the agent's host the
    /// rank reads the version's handed-over files, as a job restarted on
    /// one host does.
    #[serde(default)]
    from_files: f64,
    /// The first restart the agent serves: pulled (prefault) by a new
    /// process [`JOB_GAP`] after the committing job's sessions ended, as a
    /// job relaunched after a failure restarts (one run, not a median).
    #[serde(default)]
    first: f64,
    /// Its baseline: a raw `fi_read` of the same bytes by a new process
    /// into memory as cold, [`COLD_GAP`] after the first restart's process
    /// ended (one run; 0 when not measured).
    #[serde(default)]
    cold_read: f64,
}

/// How long after a job ends the benchmark's first restart starts: less
/// than `mpirun` takes to relaunch a job.
const JOB_GAP: Duration = Duration::from_secs(1);

/// How long after the first restart's process ends its raw baseline reads
/// in a new process, so that the memory that process freed can go cold
/// again. On this project's virtual machines memory that has been free a
/// while comes back from the host page by page when a new process first
/// touches it (256 MiB: 744 ms, against 70 ms for memory freed just
/// before), and the first restart after a job gets such memory: against
/// `fi_read` into memory the kernel recycles at once, that row mostly
/// measured the host. How cold either one's memory is varies from run to
/// run (the cold read of 256 MiB over tcp took 0.22-1.05 s in three runs
/// with this gap, 0.43 s in one with 20 s, and 0.21-0.26 s in two with
/// 3 s), so the row is one run of each, as the first restart is.
const COLD_GAP: Duration = Duration::from_secs(10);

/// Changes one byte in every page of `data` (differently each run), so a
/// commit has new data to move.
fn change_every_page(data: &Region<u8>, run: usize) {
    let mut bytes = data.write();
    let len = bytes.len();
    for i in (0..len).step_by(4096) {
        bytes[i] = bytes[i].wrapping_add(run as u8 + 1);
    }
}

/// Seconds of each of `runs` commits of `ic`, with `before(run)` done
/// untimed before each.
fn time_commits(ic: &mut Icheck, runs: usize, mut before: impl FnMut(usize)) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(runs);
    for run in 0..runs {
        before(run);
        let start = Instant::now();
        ic.commit()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(times)
}

fn set_mode(transfer: &str) {
    std::env::set_var("ICHECK_TRANSFER", transfer);
    std::env::set_var("ICHECK_ZERO_COPY", "1");
}

/// How long a measured application computes between the paired commits
/// (`measure`).
const COMPUTING: Duration = Duration::from_secs(1);

/// How long a measured application computes between `set_async(true)` and
/// its first async commit.
const ASYNC_FIRST_PAUSE: Duration = Duration::from_millis(500);

/// Commits `data` `runs` times (blocking, then unchanged, then async) and
/// restarts it, through app `app`. Collective over `comm`.
fn measure<C: Communicator + 'static>(
    config: &Path,
    app: &str,
    comm_factory: impl Fn() -> C,
    (data, paired): (&Region<u8>, &mut RawFabric),
    runs: usize,
    transfer: &str,
    fresh_in_new_processes: bool,
) -> Result<ModeTimes> {
    set_mode(transfer);
    let push = transfer == "push";
    let (mut ic, _) = Icheck::init(Some(config), app, comm_factory())?;
    ic.add("data", data)?;
    ic.commit()?; // warm-up: agent files exist, pages touched
    let commit = median(time_commits(&mut ic, runs, |run| change_every_page(data, run))?);
    // Paired: each commit right after a raw operation of the same bytes
    // (the agent reads a pulled commit's, the rank writes a pushed one's).
    // The application computes between them, as between checkpoints: back
    // to back, the raw operation would share the cores with the agents'
    // work after the last commit (the next version's file being backed).
    let timing = comm_factory();
    let mut commit_pairs = Pairs::default();
    for run in 0..runs {
        std::thread::sleep(COMPUTING);
        change_every_page(data, runs + run);
        let raw = paired.time(&timing, if push { RawOp::Write } else { RawOp::Read })?;
        let start = Instant::now();
        ic.commit()?;
        let secs = start.elapsed().as_secs_f64();
        stderr_line(format!("{app}: commit {:.1} ms, the raw operation just before {:.1} ms", secs * 1e3, raw * 1e3));
        commit_pairs.0.push((raw, secs));
    }
    let unchanged = median(time_commits(&mut ic, runs, |_| {})?);
    ic.set_async(true);
    // The application computes between choosing async commits and its
    // first one (the library backs the staging buffer meanwhile).
    std::thread::sleep(ASYNC_FIRST_PAUSE);
    let (mut blocked, mut total) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let start = Instant::now();
        ic.commit()?;
        blocked.push(start.elapsed().as_secs_f64());
        ic.wait()?;
        total.push(start.elapsed().as_secs_f64());
    }
    ic.finalize(true)?;
    // The job ended: the first restart comes from a new process.
    let first_restart = fresh_in_new_processes
        .then(|| -> Result<(f64, f64)> {
            std::thread::sleep(JOB_GAP);
            let first = restore_in_new_process(config, app, data.len(), "pull", true)?;
            std::thread::sleep(COLD_GAP);
            let cold_read = paired.cold_read_in_new_process()?;
            stderr_line(format!(
                "{app}: the first restart {:.1} ms; fi_read into cold memory in a new process {:.1} ms",
                first * 1e3,
                cold_read * 1e3
            ));
            Ok((first, cold_read))
        })
        .transpose()?;
    let (mut restarts, mut restarts_pushed, mut restarts_same_host) = (Vec::new(), Vec::new(), Vec::new());
    let mut restart_pairs = Pairs::default();
    for restore in ["pull", "push", "auto"].into_iter().cycle().take(3 * runs) {
        // A pulled restore against the rank's raw read made just before it.
        let raw = if restore == "pull" { Some(paired.time(&timing, RawOp::Read)?) } else { None };
        std::env::set_var("ICHECK_RESTORE", restore);
        let (mut ic, status) = Icheck::init(Some(config), app, comm_factory())?;
        if !matches!(status, InitStatus::Restart { .. }) {
            bail!("no checkpoint to restart from");
        }
        ic.add("data", data)?;
        // Timed until every rank has restored (restore_all is local).
        timing.barrier();
        let start = Instant::now();
        ic.restart()?;
        let restarted = start.elapsed().as_secs_f64();
        ic.restore_all()?;
        timing.barrier();
        let secs = start.elapsed().as_secs_f64();
        let raw_before = raw.map(|raw| format!(" (fi_read just before: {:.1} ms)", raw * 1e3)).unwrap_or_default();
        stderr_line(format!(
            "{app}: restore = {restore}: restart {:.1} ms, + restore {:.1} ms{raw_before}",
            restarted * 1e3,
            secs * 1e3
        ));
        match restore {
            "push" => restarts_pushed.push(secs),
            "auto" => restarts_same_host.push(secs),
            _ => restarts.push(secs),
        }
        if let Some(raw) = raw {
            restart_pairs.0.push((raw, secs));
        }
        ic.finalize(true)?;
    }
    let restart_fresh = first_restart.map(|first| fresh_restarts(config, app, data.len(), runs, first)).transpose()?;
    std::env::remove_var("ICHECK_RESTORE");
    let (mut ic, _) = Icheck::init(Some(config), app, comm_factory())?;
    ic.finalize(false)?;
    Ok(ModeTimes {
        commit,
        unchanged,
        async_first: blocked.first().copied().unwrap_or_default(),
        async_blocked: median(blocked),
        async_total: median(total),
        restart: median(restarts),
        restart_pushed: median(restarts_pushed),
        restart_same_host: median(restarts_same_host),
        restart_fresh,
        commit_pairs,
        restart_pairs,
    })
}

/// A restarted application restores into memory it has just allocated, in
/// a process of its own: `runs` restores of `app` that way pulled with
/// prefault, pulled without, and with the defaults (the agent's files),
/// one new process each, the order rotating from run to run; with
/// `(first, cold_read)`, the seconds of the first restart and of its raw
/// baseline, measured before them.
fn fresh_restarts(
    config: &Path,
    app: &str,
    len: usize,
    runs: usize,
    (first, cold_read): (f64, f64),
) -> Result<FreshRestarts> {
    let settings = [("pull", true), ("pull", false), ("auto", true)];
    let mut secs: [Vec<f64>; 3] = Default::default();
    for run in 0..runs {
        for at in 0..settings.len() {
            let which = (run + at) % settings.len();
            let (restore, prefault) = settings[which];
            let took = restore_in_new_process(config, app, len, restore, prefault)?;
            eprintln!(
                "{app}: restore = {restore} into fresh memory in a new process, prefault = {prefault}: {:.1} ms",
                took * 1e3
            );
            secs[which].push(took);
        }
    }
    let [prefaulted, unprefaulted, from_files] = secs.map(median);
    Ok(FreshRestarts { prefaulted, unprefaulted, from_files, first, cold_read })
}

/// Seconds a new process takes to restart `app` and restore its `len`
/// bytes with `restore` (`ICHECK_RESTORE`) into memory it has just
/// allocated, with `prefault` on or off (the child is this binary with
/// `--restore-config`).
fn restore_in_new_process(config: &Path, app: &str, len: usize, restore: &str, prefault: bool) -> Result<f64> {
    let out = Command::new(std::env::current_exe()?)
        .arg("--restore-config")
        .arg(config)
        .args(["--restore-app", app, "--size", &len.to_string()])
        .env("ICHECK_RESTORE", restore)
        .env("ICHECK_PREFAULT", if prefault { "1" } else { "0" })
        .output()
        .context("starting a restoring process")?;
    seconds_printed(&out, "RESTORED ", "the restoring process")
}

/// The seconds a child of this binary printed on the stdout line that
/// starts with `prefix`; an error quoting its output if it failed or
/// printed none.
fn seconds_printed(out: &std::process::Output, prefix: &str, child: &str) -> Result<f64> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().find_map(|l| l.strip_prefix(prefix)) {
        Some(secs) if out.status.success() => Ok(secs.trim().parse()?),
        _ => bail!("{child} failed ({}):\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr)),
    }
}

/// The child of [`restore_in_new_process`]: restart and restore (each
/// chunk checked against the rank's checksums by the library), timed from
/// before `restart` to the end of `restore_all`; keeps the checkpoint.
fn restore_child(config: &Path, app: &str, len: usize) -> Result<()> {
    let (mut ic, status) = Icheck::init(Some(config), app, SingleProcess)?;
    if !matches!(status, InitStatus::Restart { .. }) {
        bail!("{app}: no checkpoint to restart from");
    }
    // Untouched pages: a large zeroed allocation is mapped, not written.
    let fresh = Region::<u8>::zeroed(len);
    ic.add("data", &fresh)?;
    let start = Instant::now();
    ic.restart()?;
    ic.restore_all()?;
    let secs = start.elapsed().as_secs_f64();
    ic.finalize(true)?;
    println!("RESTORED {secs}");
    Ok(())
}

/// The child of [`RawFabric::cold_read_in_new_process`]: one `fi_read` of
/// the whole region `announcement` names, over `provider`, into memory
/// allocated just before (mapped, never written), timed with the
/// connection it makes; prints the seconds.
fn cold_read_child(provider: &str, announcement: &str) -> Result<()> {
    let announcement: icheck_service::selftest::TargetAnnouncement =
        serde_json::from_str(announcement).context("--cold-read-peer is not a target announcement")?;
    let len = usize::try_from(announcement.region.len)?;
    let domain = Domain::open(&FabricConfig::provider(provider))?;
    let endpoint = Endpoint::new(&domain)?;
    let peer = endpoint.insert_peer(&announcement.address)?;
    let mut fresh = endpoint.register(AlignedBuffer::zeroed(len), Access::LOCAL)?;
    let whole = [RmaOp { local_offset: 0, remote: announcement.region, remote_offset: 0, len }];
    let start = Instant::now();
    endpoint.read(&peer, fresh.target(), &whole, &TransferOptions::default())?;
    let secs = start.elapsed().as_secs_f64();
    println!("COLD_READ {secs}");
    Ok(())
}

/// A blocking commit with `transfer = "auto"` once its measurement is
/// over, and what it chose.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct AutoTimes {
    /// Median seconds of the commits after the choice.
    commit: f64,
    /// The choice and the rates it rests on.
    chose: TransferReport,
}

/// Commits `data` with `transfer = "auto"` (every page changed each time,
/// as in [`measure`]) until the library has chosen a direction, then
/// `runs` more: their median. Collective over `comm`.
fn measure_auto<C: Communicator + 'static>(
    config: &Path,
    app: &str,
    comm_factory: impl Fn() -> C,
    data: &Region<u8>,
    runs: usize,
) -> Result<AutoTimes> {
    set_mode("auto");
    let (mut ic, _) = Icheck::init(Some(config), app, comm_factory())?;
    ic.add("data", data)?;
    let mut trial = 0;
    while !ic.transfer().auto.is_some_and(|a| a.decided) {
        if trial == 12 {
            bail!("transfer = auto chose nothing in {trial} commits: {:?}", ic.transfer());
        }
        change_every_page(data, trial);
        ic.commit()?;
        trial += 1;
    }
    let commit = median(time_commits(&mut ic, runs, |run| change_every_page(data, run))?);
    let chose = ic.transfer();
    ic.finalize(false)?;
    Ok(AutoTimes { commit, chose })
}

/// The table row of an `auto` commit against the faster fixed direction.
fn auto_line(case: &str, provider: &str, auto: &AutoTimes, pull: &ModeTimes, push: &ModeTimes) -> Line {
    let best = pull.commit.min(push.commit);
    let faster = if push.commit < pull.commit { "push" } else { "pull" };
    Line::new(
        case,
        provider,
        &format!("commit, auto: {}", auto.chose),
        format!("{:.1} ms", auto.commit * 1e3),
        format!("faster fixed ({faster}) {:.1} ms", best * 1e3),
        auto.commit / best,
    )
}

/// A resized restart: four MPI ranks of the `malleable` example write a
/// BLOCK array of `rank_size` bytes each on two agents, then one process
/// restores the whole array, reading all four old ranks. The median of
/// `runs` restores, in seconds (the example's own timing of `restore`).
fn resized_restore(provider: &str, rank_size: usize, runs: usize) -> Result<f64> {
    let mib = (rank_size >> 20).max(1).to_string();
    let svc = service(&format!("bench-resize-{provider}"), provider, 2, 2)?;
    let malleable = std::env::current_exe()?.with_file_name("malleable");
    let job = |np: &str, extra: &str| -> Result<String> {
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", np])
            .arg(&malleable)
            .args(["--app", "bench-resize", "--global", "1000", "--payload-mib", &mib, extra])
            .env("ICHECK_CONFIG", svc.config_path())
            .output()
            .with_context(|| format!("running {} under mpirun", malleable.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() || stdout.contains("ERROR") {
            bail!("malleable -np {np} {extra} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(stdout)
    };
    job("4", "--write")?;
    let mut secs = Vec::new();
    for _ in 0..runs {
        let stdout = job("1", "--no-commit")?;
        let value = stdout
            .lines()
            .find_map(|l| l.strip_prefix("RESTORED_PAYLOAD seconds="))
            .context("the restoring process printed no RESTORED_PAYLOAD line")?;
        secs.push(value.trim().parse::<f64>()?);
    }
    Ok(median(secs))
}

/// Seconds of each commit (rank 0's, as the `mpi_checkpoint` example
/// times them) of a new four-rank application with `rank_size` bytes per
/// rank on two agents, committing back to back (no computation between),
/// on a fresh service whose managers keep `warm_pool` bytes of backed files
/// (0: none), once the pools are full; with `huge_pages` as `icheck up
/// --huge-pages` takes it. Also returns how the store backed its files, as
/// the managers report it.
fn new_app_back_to_back(
    provider: &str,
    rank_size: usize,
    warm_pool: ByteSize,
    huge_pages: &str,
    commits: usize,
) -> Result<(Vec<f64>, String)> {
    let name = format!("bench-new-{provider}-{}-{huge_pages}", warm_pool.0 >> 20);
    let dynamic = "init_agent_count = 2\nreadInterval = 5\n";
    let args = ["--provider", provider, "--warm-pool", &warm_pool.to_string(), "--huge-pages", huge_pages];
    let svc = LocalService::up_with_dynamic(&icheck_binary()?, &name, 2, &args, Some(dynamic));
    let pages = svc.status().nodes.first().map(|n| n.status.store_pages.clone()).unwrap_or_default();
    let started = Instant::now();
    while !svc.status().nodes.iter().all(|n| n.status.warm_bytes >= warm_pool.0) {
        if started.elapsed() > std::time::Duration::from_secs(120) {
            bail!("the managers' warm pools did not fill to {warm_pool} in 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let example = std::env::current_exe()?.with_file_name("mpi_checkpoint");
    let mib = (rank_size >> 20).max(1).to_string();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"])
        .arg(&example)
        .args(["--app", "bench-new", "--steps", &commits.to_string(), "--every", "1", "--mib", &mib])
        .env("ICHECK_CONFIG", svc.config_path())
        .env("ICHECK_INCREMENTAL", "0")
        .output()
        .with_context(|| format!("running {} under mpirun", example.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let secs: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("COMMITTED "))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("seconds="))?.parse().ok())
        .collect();
    if !out.status.success() || secs.len() < commits {
        bail!(
            "mpi_checkpoint failed or committed too few versions:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((secs, pages))
}

/// A single-rank application `app` pulling one label of `size` bytes
/// (pattern `seed`) under `config`: registered, nothing committed yet.
fn one_rank_app(config: &Path, app: &str, size: usize, seed: u64) -> Result<(Icheck, Region<u8>)> {
    set_mode("pull");
    let data = Region::<u8>::zeroed(size);
    fill_pattern(&mut data.write(), seed);
    let (mut ic, _) = Icheck::init(Some(config), app, SingleProcess)?;
    ic.add("data", &data)?;
    Ok((ic, data))
}

/// Changes one byte in every 512 of `data[start..start + len]` (every
/// block and page of the range), differently each run.
fn change_range(data: &Region<u8>, start: usize, len: usize, run: usize) {
    let mut bytes = data.write();
    for i in (start..start + len).step_by(512) {
        bytes[i] = bytes[i].wrapping_add(run as u8 + 1);
    }
}

/// What the incremental sweep measured for one changed fraction.
struct SweepPoint {
    fraction: f64,
    /// Median seconds of a commit.
    secs: f64,
    /// Bytes the node's agents received per commit (their counter).
    received: f64,
}

/// What [`incremental_sweep`] measured.
struct Sweep {
    /// Median seconds of a plain (not incremental) commit, every page changed.
    plain: f64,
    /// Incremental commits comparing checksums (the default).
    points: Vec<SweepPoint>,
    /// Incremental commits with page tracking.
    tracked: Vec<SweepPoint>,
    /// Median seconds the application took to change every page of its
    /// memory between commits: without page tracking, and with it (each
    /// page's first write after a commit takes a write-protect fault).
    writes: (f64, f64),
    /// Median seconds of the checksum pass alone over the rank's bytes.
    checksum_pass: f64,
}

/// One rank of `size` bytes, one contiguous `fraction` of it changed
/// before each commit: incremental commits per fraction, and (the
/// reference) a plain commit with every page changed.
fn incremental_sweep(provider: &str, size: usize, runs: usize) -> Result<Sweep> {
    // The reference first, on a service of its own: the counters below
    // then count the incremental application's commits only.
    let plain = {
        let svc = service("bench-plain", provider, 1, 1)?;
        std::env::set_var("ICHECK_INCREMENTAL", "0");
        let (mut ic, data) = one_rank_app(&svc.config_path(), "plain", size, 11)?;
        // Warm-up, as for every other case: the agent's files exist.
        ic.commit()?;
        change_every_page(&data, runs);
        ic.commit()?;
        let times = time_commits(&mut ic, runs, |run| change_every_page(&data, run))?;
        ic.finalize(false)?;
        median(times)
    };
    let svc = service("bench-incremental", provider, 1, 1)?;
    let config = svc.config_path();
    let node_counts = || -> (u64, u64) {
        let status = svc.status();
        status.nodes.iter().fold((0, 0), |(o, b), n| (o + n.status.checkpoint_ops, b + n.status.checkpoint_bytes))
    };
    // The manager reports its counters every status interval.
    let settled = |ops: u64| -> Result<u64> {
        let started = Instant::now();
        loop {
            let (now_ops, bytes) = node_counts();
            if now_ops >= ops {
                return Ok(bytes);
            }
            if started.elapsed().as_secs() > 30 {
                bail!("the node reported {now_ops} of {ops} checkpoint operations within 30 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    let mut ops = 0;
    std::env::set_var("ICHECK_INCREMENTAL", "1");
    // One application per mode, one after the other on the same service.
    let mut sweep = |app: &str, seed: u64, tracking: bool| -> Result<(Vec<SweepPoint>, f64, Region<u8>)> {
        std::env::set_var("ICHECK_PAGE_TRACKING", if tracking { "1" } else { "0" });
        let (mut ic, data) = one_rank_app(&config, app, size, seed)?;
        ic.commit()?;
        ops += 1;
        let mut points = Vec::new();
        let mut writes = Vec::new();
        for fraction in [1.0, 0.5, 0.1, 0.01, 0.0] {
            let len = (size as f64 * fraction) as usize;
            // One untimed commit of the same kind first: the library predicts
            // a commit's change from the one before it.
            change_range(&data, 0, len, runs);
            ic.commit()?;
            ops += 1;
            let before = settled(ops)?;
            // A different place each run, anywhere in the rank's bytes.
            let place = |run: usize| (run * 7 * size / 11) % (size - len + 1);
            let times = time_commits(&mut ic, runs, |run| {
                // The application computes between checkpoints (20 ms
                // here): the agent prepares the next file meanwhile, as
                // it would in a run. Back to back, a 1% commit with page
                // tracking could find that file still being made.
                std::thread::sleep(std::time::Duration::from_millis(20));
                let started = Instant::now();
                change_range(&data, place(run), len, run);
                if fraction == 1.0 {
                    writes.push(started.elapsed().as_secs_f64());
                }
            })?;
            ops += runs as u64;
            let received = (settled(ops)? - before) as f64 / runs as f64;
            if tracking && fraction < 0.5 {
                let stats = ic.last_commit().context("a blocking zero-copy commit reports its figures")?;
                if !stats.page_tracking {
                    bail!("page tracking was asked for but not used (this kernel cannot track pages?)");
                }
            }
            points.push(SweepPoint { fraction, secs: median(times), received });
        }
        ic.finalize(false)?;
        Ok((points, median(writes), data))
    };
    let (points, writes_compared, _) = sweep("delta", 12, false)?;
    let (tracked, writes_tracked, data) = sweep("tracked", 13, true)?;
    std::env::remove_var("ICHECK_PAGE_TRACKING");
    // The floor of a commit that compares checksums: one pass over the
    // rank's memory, on every core, as the library makes it.
    let mut passes = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        std::hint::black_box(icheck_core::delta::checksums(&[&data.read()]));
        passes.push(started.elapsed().as_secs_f64());
    }
    std::env::remove_var("ICHECK_INCREMENTAL");
    Ok(Sweep { plain, points, tracked, writes: (writes_compared, writes_tracked), checksum_pass: median(passes) })
}

/// Seconds of each of the first `count` commits (every page changed) of a
/// new application with one rank of `size` bytes, each after 300 ms of
/// "computation": the first versions of a run used to map fresh agent
/// memory inside the commit.
fn first_commits(provider: &str, size: usize, count: usize) -> Result<Vec<f64>> {
    let svc = service(&format!("bench-first-{provider}"), provider, 1, 1)?;
    let (mut ic, data) = one_rank_app(&svc.config_path(), "bench-first", size, 9)?;
    let times = time_commits(&mut ic, count, |run| {
        // Computation before every commit, the first too (an application
        // adds its labels, then computes before its first checkpoint).
        std::thread::sleep(std::time::Duration::from_millis(300));
        change_every_page(&data, run);
    })?;
    ic.finalize(false)?;
    Ok(times)
}

/// CPU time `pids` used between two [`thread_cpu`] snapshots; prints the
/// five busiest threads.
fn cpu_between(
    before: &std::collections::HashMap<String, u64>,
    after: &std::collections::HashMap<String, u64>,
) -> std::time::Duration {
    let used = thread_cpu::used_between(before, after);
    for (nanos, thread) in used.iter().take(5) {
        eprintln!("  {thread}: {:.1} ms", *nanos as f64 / 1e6);
    }
    std::time::Duration::from_nanos(used.iter().map(|(nanos, _)| nanos).sum())
}

/// The share of one core that a local service (controller and two
/// managers) uses while one application is registered with live agents and
/// computes between commits: what checkpointing costs when it is not
/// checkpointing.
fn idle_service_cpu(provider: &str, over: std::time::Duration) -> Result<f64> {
    let svc = service(&format!("bench-idle-{provider}"), provider, 2, 2)?;
    let pids: Vec<u32> = std::fs::read_to_string(svc.dir.join("pids"))?
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    let (mut ic, _data) = one_rank_app(&svc.config_path(), "bench-idle", 16 << 20, 7)?;
    ic.commit()?;
    ic.commit()?;
    // Let the commit's aftermath (pruning, status reports) pass first.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let before = thread_cpu::thread_cpu(&pids);
    let started = Instant::now();
    std::thread::sleep(over);
    let used = cpu_between(&before, &thread_cpu::thread_cpu(&pids));
    let share = used.as_secs_f64() / started.elapsed().as_secs_f64();
    ic.finalize(false)?;
    Ok(share)
}

/// The raw fabric operation a [`RawFabric`] times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RawOp {
    /// fi_read of the whole size into touched memory.
    Read,
    /// fi_write of the whole size from touched memory.
    Write,
    /// fi_read into memory registered just before, never touched (what a
    /// restart must do: every page faults once); its allocation untimed.
    FreshRead,
}

/// Raw fabric operations of a rank's size from this process to a target
/// process of its own: the baselines of every rate the benchmark prints.
///
/// Paired (`pause_between`), each is made just before one measured commit
/// or restore, under the same load (`measure`): on this host raw tcp
/// `fi_read` alone has measured 1.8-5.3 GB/s within minutes, so a ratio
/// against a baseline taken minutes apart mixes icheck's cost with the
/// host's drift, and the median of the pairs' ratios separates them. The
/// target's progress thread is paused between operations, so its spinning
/// takes no core from what is measured in between. With several ranks,
/// every rank reads at once from its own target (none waits for another's
/// reads, as ranks reading one `shm` endpoint would: the stricter baseline).
struct RawFabric {
    target: TargetProcess,
    provider: String,
    pause_between: bool,
    endpoint: Endpoint,
    peer: icheck_core::fabric::Peer,
    local: icheck_core::fabric::RegisteredBuffer,
    whole: [RmaOp; 1],
}

impl RawFabric {
    /// Collective over `comm`: every rank starts a target of `size` bytes
    /// and connects to it.
    fn start(comm: &impl Communicator, provider: &str, size: usize, pause_between: bool) -> Result<RawFabric> {
        let mut command = Command::new(std::env::current_exe()?);
        command.args(["--serve-target", provider, "--size", &size.to_string()]);
        let target = TargetProcess::spawn(command).context("starting the raw-fabric target")?;
        let domain = Domain::open(&FabricConfig::provider(provider))?;
        let endpoint = Endpoint::new(&domain)?;
        let peer = endpoint.insert_peer(&target.announcement().address)?;
        let mut local = endpoint.register(AlignedBuffer::zeroed(size), Access::LOCAL)?;
        fill_pattern(local.as_mut_slice(), 3);
        let whole = [RmaOp { local_offset: 0, remote: target.announcement().region, remote_offset: 0, len: size }];
        let mut raw = RawFabric { target, provider: provider.to_string(), pause_between, endpoint, peer, local, whole };
        // Warm-up: the connection is made and both sides' pages touched.
        raw.time(comm, RawOp::Read)?;
        raw.time(comm, RawOp::Write)?;
        Ok(raw)
    }

    /// Seconds until every rank has done `op`, timed between two barriers
    /// as the measured operations are.
    fn time(&mut self, comm: &impl Communicator, op: RawOp) -> Result<f64> {
        let options = TransferOptions::default();
        let mut fresh = (op == RawOp::FreshRead)
            .then(|| self.endpoint.register(AlignedBuffer::zeroed(self.whole[0].len), Access::LOCAL))
            .transpose()?;
        // Unpaused, the target has polled since it started.
        if self.pause_between {
            self.target.set_progress(true)?;
        }
        comm.barrier();
        let start = Instant::now();
        match (op, fresh.as_mut()) {
            (RawOp::Write, _) => self.endpoint.write(&self.peer, self.local.source(), &self.whole, &options)?,
            (_, Some(fresh)) => self.endpoint.read(&self.peer, fresh.target(), &self.whole, &options)?,
            (_, None) => self.endpoint.read(&self.peer, self.local.target(), &self.whole, &options)?,
        };
        comm.barrier();
        let secs = start.elapsed().as_secs_f64();
        if self.pause_between {
            self.target.set_progress(false)?;
        }
        Ok(secs)
    }

    /// Seconds a new process takes to read the target's whole region into
    /// memory it has just allocated ([`cold_read_child`]), its connection
    /// made by that read: a restarted process's first read, without icheck.
    fn cold_read_in_new_process(&mut self) -> Result<f64> {
        if self.pause_between {
            self.target.set_progress(true)?;
        }
        let out = Command::new(std::env::current_exe()?)
            .args(["--cold-read-peer", self.target.announcement_json(), "--providers", &self.provider])
            .output()
            .context("starting a cold-reading process");
        if self.pause_between {
            self.target.set_progress(false)?;
        }
        seconds_printed(&out?, "COLD_READ ", "the cold-reading process")
    }

    /// The median GB/s of `runs` operations `op` by this process alone.
    fn median_gb_per_s(&mut self, op: RawOp, runs: usize) -> Result<f64> {
        let secs = (0..runs).map(|_| self.time(&SingleProcess, op)).collect::<Result<Vec<_>>>()?;
        Ok(self.whole[0].len as f64 / median(secs) / 1e9)
    }
}

/// Pairs of (raw seconds, measured seconds), each raw operation made just
/// before its measured one ([`RawFabric`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Pairs(Vec<(f64, f64)>);

impl Pairs {
    /// The median raw and measured seconds, and the median of the pairs'
    /// ratios (raw ÷ measured: the measured rate as a fraction of raw).
    fn medians(&self) -> Option<(f64, f64, f64)> {
        if self.0.is_empty() {
            return None;
        }
        let raw = median(self.0.iter().map(|p| p.0).collect());
        let measured = median(self.0.iter().map(|p| p.1).collect());
        let ratio = median(self.0.iter().map(|p| p.0 / p.1).collect());
        Some((raw, measured, ratio))
    }
}

/// Raw fabric rates: fi_read and fi_write into/from touched memory, and
/// fi_read into freshly allocated memory (what a restart must do: its
/// destination has never been touched, so every page faults once).
fn raw_fabric(provider: &str, size: usize, runs: usize) -> Result<(f64, f64, f64)> {
    let mut raw = RawFabric::start(&SingleProcess, provider, size, false)?;
    let read = raw.median_gb_per_s(RawOp::Read, runs)?;
    let write = raw.median_gb_per_s(RawOp::Write, runs)?;
    let fresh = raw.median_gb_per_s(RawOp::FreshRead, runs)?;
    Ok((read, write, fresh))
}

/// A source of `size` patterned bytes and a touched destination of the
/// same size, for the memcpy baselines.
fn copy_buffers(size: usize) -> (AlignedBuffer, AlignedBuffer) {
    let mut src = AlignedBuffer::zeroed(size);
    fill_pattern(src.as_mut_slice(), 7);
    let mut dst = AlignedBuffer::zeroed(size);
    dst.as_mut_slice().fill(1);
    (src, dst)
}

fn memcpy_secs(size: usize, runs: usize) -> f64 {
    let (src, mut dst) = copy_buffers(size);
    median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                dst.as_mut_slice().copy_from_slice(src.as_slice());
                start.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn icheck_binary() -> Result<PathBuf> {
    siblings::sibling_binary("icheck")
}

/// A service whose dynamic config asks for `agents` agents per application.
fn service(name: &str, provider: &str, managers: u32, agents: u32) -> Result<LocalService> {
    let dynamic = format!("init_agent_count = {agents}\nreadInterval = 5\n");
    Ok(LocalService::up_with_dynamic(&icheck_binary()?, name, managers, &["--provider", provider], Some(&dynamic)))
}

struct Line {
    case: String,
    provider: String,
    what: String,
    value: String,
    baseline: String,
    ratio: f64,
}

impl Line {
    fn new(case: &str, provider: &str, what: &str, value: String, baseline: String, ratio: f64) -> Line {
        Line { case: case.into(), provider: provider.into(), what: what.into(), value, baseline, ratio }
    }
}

/// The paired rows ([`RawFabric`]): pulled and pushed blocking commits
/// ([`COMPUTING`] apart) and pulled restores, each against the raw
/// operation of the same bytes made just before it; the ratio is the
/// median of the pairs' ratios. With
/// `ranks` above one, every rank's raw operation ran at once.
fn paired_rows(
    case: &str,
    provider: &str,
    (bytes, ranks): (f64, u32),
    pull: &ModeTimes,
    push: &ModeTimes,
) -> Vec<Line> {
    let gb = |secs: f64| bytes / secs / 1e9;
    let at_once = if ranks > 1 { format!(", {ranks} ranks at once") } else { String::new() };
    let cases = [
        ("commit, pull, blocking, 1 s after the last", "fi_read", &pull.commit_pairs),
        ("commit, push, blocking, 1 s after the last", "fi_write", &push.commit_pairs),
        ("restart + restore, the rank pulls (restore = pull)", "fi_read", &pull.restart_pairs),
    ];
    cases
        .into_iter()
        .filter_map(|(what, raw_op, pairs)| {
            let (raw, measured, ratio) = pairs.medians()?;
            Some(Line::new(
                case,
                provider,
                &format!("{what}, paired: each against a {raw_op} just before it (median of {} ratios)", pairs.0.len()),
                format!("{:.2} GB/s", gb(measured)),
                format!("{raw_op}{at_once} {:.2} GB/s", gb(raw)),
                ratio,
            ))
        })
        .collect()
}

fn rows_for(
    case: &str,
    provider: &str,
    bytes: f64,
    pull: &ModeTimes,
    push: &ModeTimes,
    raw: (f64, f64, f64),
    memcpy: f64,
) -> Vec<Line> {
    let gb = |secs: f64| bytes / secs / 1e9;
    let line = |what: &str, value, baseline, ratio| Line::new(case, provider, what, value, baseline, ratio);
    let mut lines = vec![
        line(
            "commit, pull, blocking",
            format!("{:.2} GB/s", gb(pull.commit)),
            format!("fi_read {:.2} GB/s", raw.0),
            gb(pull.commit) / raw.0,
        ),
        line(
            "commit, push, blocking",
            format!("{:.2} GB/s", gb(push.commit)),
            format!("fi_write {:.2} GB/s", raw.1),
            gb(push.commit) / raw.1,
        ),
        line(
            "restart + restore, the rank pulls (restore = pull)",
            format!("{:.2} GB/s", gb(pull.restart)),
            format!("fi_read {:.2} GB/s", raw.0),
            gb(pull.restart) / raw.0,
        ),
        line(
            "restart + restore, the agent pushes (restore = push)",
            format!("{:.2} GB/s", gb(pull.restart_pushed)),
            format!("fi_read {:.2} GB/s", raw.0),
            gb(pull.restart_pushed) / raw.0,
        ),
        line(
            "restart + restore, the agent pushes, vs the rank pulling",
            format!("{:.1} ms", pull.restart_pushed * 1e3),
            format!("pull {:.1} ms", pull.restart * 1e3),
            pull.restart_pushed / pull.restart,
        ),
        line(
            "restart + restore, same host: the rank reads the agent's file (restore = auto)",
            format!("{:.2} GB/s", gb(pull.restart_same_host)),
            format!("fi_read {:.2} GB/s", raw.0),
            gb(pull.restart_same_host) / raw.0,
        ),
        line(
            "restart + restore, same host, vs memcpy",
            format!("{:.1} ms", pull.restart_same_host * 1e3),
            format!("memcpy {:.1} ms", memcpy * 1e3),
            pull.restart_same_host / memcpy,
        ),
        line(
            "commit, pull, async: blocked",
            format!("{:.1} ms", pull.async_blocked * 1e3),
            format!("memcpy {:.1} ms", memcpy * 1e3),
            pull.async_blocked / memcpy,
        ),
        line(
            "commit, push, async: blocked",
            format!("{:.1} ms", push.async_blocked * 1e3),
            format!("memcpy {:.1} ms", memcpy * 1e3),
            push.async_blocked / memcpy,
        ),
        line(
            "commit, pull, async: the first one blocked, 0.5 s after set_async",
            format!("{:.1} ms", pull.async_first * 1e3),
            format!("memcpy {:.1} ms", memcpy * 1e3),
            pull.async_first / memcpy,
        ),
        line(
            "commit, pull, no data change",
            format!("{:.2} GB/s", gb(pull.unchanged)),
            format!("changed {:.2} GB/s", gb(pull.commit)),
            pull.commit / pull.unchanged,
        ),
    ];
    if let Some(fresh) = pull.restart_fresh {
        lines.push(line(
            "restart + restore, a new process 1 s after the job ended: the first restart the agent serves (pulled, prefault; one run)",
            format!("{:.2} GB/s", gb(fresh.first)),
            format!("fi_read into fresh memory {:.2} GB/s", raw.2),
            gb(fresh.first) / raw.2,
        ));
        if fresh.cold_read > 0.0 {
            let what = format!(
                "restart + restore, the first restart the agent serves, vs fi_read by a new process into memory as cold ({} s after the restart's process ended; one run)",
                COLD_GAP.as_secs()
            );
            lines.push(line(
                &what,
                format!("{:.2} GB/s", gb(fresh.first)),
                format!("cold fi_read {:.2} GB/s", gb(fresh.cold_read)),
                gb(fresh.first) / gb(fresh.cold_read),
            ));
        }
        lines.push(line(
            "restart + restore into fresh memory in a new process, the rank pulls (prefault, the default)",
            format!("{:.2} GB/s", gb(fresh.prefaulted)),
            format!("fi_read into fresh memory {:.2} GB/s", raw.2),
            gb(fresh.prefaulted) / raw.2,
        ));
        lines.push(line(
            "restart + restore into fresh memory in a new process, prefault vs prefault = false",
            format!("{:.1} ms", fresh.prefaulted * 1e3),
            format!("prefault = false {:.1} ms", fresh.unprefaulted * 1e3),
            fresh.prefaulted / fresh.unprefaulted,
        ));
        lines.push(line(
            "restart + restore into fresh memory in a new process, the defaults (same host: the agent's files)",
            format!("{:.2} GB/s", gb(fresh.from_files)),
            format!("fi_read into fresh memory {:.2} GB/s", raw.2),
            gb(fresh.from_files) / raw.2,
        ));
    }
    lines
}

/// Median seconds of `runs` blocking commits of `data` (changed before each)
/// by a single-rank application `app` under `config`, with `env` set;
/// `after_each` runs untimed after every commit, with its version.
fn commit_secs(
    config: &Path,
    app: &str,
    data: &Region<u8>,
    runs: usize,
    env: &[(&str, &str)],
    mut after_each: impl FnMut(u64) -> Result<()>,
) -> Result<f64> {
    set_mode("pull");
    for (key, value) in env {
        std::env::set_var(key, value);
    }
    let (mut ic, _) = Icheck::init(Some(config), app, SingleProcess)?;
    ic.add("data", data)?;
    ic.commit()?;
    let mut times = Vec::new();
    for run in 0..runs {
        change_every_page(data, run);
        let start = Instant::now();
        let version = ic.commit()?;
        times.push(start.elapsed().as_secs_f64());
        after_each(version)?;
    }
    ic.finalize(false)?;
    for (key, _) in env {
        std::env::remove_var(key);
    }
    Ok(median(times))
}

/// Seconds to write and fsync `size` bytes into a new file in `dir` (and
/// delete the one before, as version replacement does): what the PFS
/// directory itself sustains, the baseline of the PFS-level cases.
fn posix_write_secs(dir: &Path, size: usize, runs: usize) -> Result<f64> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let mut data = vec![0u8; size];
    fill_pattern(&mut data, 9);
    let path = |run: usize| dir.join(format!("posix-baseline-{run}.tmp"));
    let mut times = Vec::new();
    for run in 0..runs {
        let start = Instant::now();
        let mut file = std::fs::File::create(path(run))?;
        file.write_all(&data)?;
        file.sync_all()?;
        if run > 0 {
            std::fs::remove_file(path(run - 1))?;
        }
        times.push(start.elapsed().as_secs_f64());
    }
    std::fs::remove_file(path(runs - 1))?;
    Ok(median(times))
}

/// The PFS level: a commit's time with and without the agents' background
/// copy (zstd) of every version, what the copy cost the agent, and the
/// library's fallback writes, against POSIX writes to the same directory
/// and the RDMA commit.
fn pfs_level(provider: &str, size: usize, runs: usize) -> Result<Vec<Line>> {
    let svc = service(&format!("bench-pfs-{provider}"), provider, 1, 1)?;
    let config = svc.config_path();
    let pfs_dir = svc.dir.join("pfs");
    let data = Region::<u8>::zeroed(size);
    fill_pattern(&mut data.write(), 5);
    let rdma = commit_secs(&config, "bench-nocopy", &data, runs, &[("ICHECK_PFS_INTERVAL", "0")], |_| Ok(()))?;
    let copies = [("ICHECK_PFS_INTERVAL", "1"), ("ICHECK_COMPRESSION", "zstd:1")];
    // Back to back: each commit overlaps the copy of the version before it.
    let back_to_back = commit_secs(&config, "bench-copy-b2b", &data, runs, &copies, |_| Ok(()))?;
    // With a compute phase long enough for the copy to finish in between.
    let mut copy = None;
    let spaced = commit_secs(&config, "bench-copy", &data, runs, &copies, |version| {
        let start = Instant::now();
        while start.elapsed().as_secs() < 300 {
            let status = svc.status();
            let app = status.apps.iter().find(|a| a.registration.name == "bench-copy");
            if let Some(stats) = app.and_then(|a| a.pfs_copy).filter(|c| c.version == version) {
                copy = Some(stats);
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        bail!("the PFS copy of version {version} did not complete within 300 s")
    })?;
    let copy = copy.context("no PFS copy completed")?;
    // The library's fallback: a controller nobody listens on, the same PFS.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let unreachable = svc.dir.join("no-controller.toml");
    std::fs::write(
        &unreachable,
        format!(
            "ControllerPort = {port}\nPfsDir = \"{}\"\n[fabric]\nprovider = \"{provider}\"\n[client]\nconnect_timeout = 0.5\n",
            pfs_dir.display()
        ),
    )?;
    // The disk's sustained rate drifts with what was written before: the
    // baseline runs right before the case it is compared with.
    let posix = posix_write_secs(&pfs_dir, size, runs)?;
    let fallback = commit_secs(&unreachable, "bench-fallback", &data, runs, &[], |_| Ok(()))?;
    let gb = |secs: f64| size as f64 / secs / 1e9;
    let case = format!("1 rank, 1 agent, {}", ByteSize(size as u64));
    let line = |what: &str, value, baseline, ratio| Line::new(&case, provider, what, value, baseline, ratio);
    let copy_secs = copy.compress_secs + copy.write_secs;
    Ok(vec![
        line(
            "commit, PFS copy (zstd:1) of every version done between commits",
            format!("{:.1} ms", spaced * 1e3),
            format!("no PFS copy {:.1} ms", rdma * 1e3),
            spaced / rdma,
        ),
        line(
            "commit back to back, overlapping the previous version's PFS copy",
            format!("{:.1} ms", back_to_back * 1e3),
            format!("no PFS copy {:.1} ms", rdma * 1e3),
            back_to_back / rdma,
        ),
        line(
            &format!("agent's PFS copy, in the background (compression ratio {:.2})", copy.ratio()),
            format!("{:.2} GB/s", gb(copy_secs)),
            format!("POSIX write+fsync {:.2} GB/s", gb(posix)),
            gb(copy_secs) / gb(posix),
        ),
        line(
            "fallback commit: the library writes the PFS",
            format!("{:.2} GB/s", gb(fallback)),
            format!("POSIX write+fsync {:.2} GB/s", gb(posix)),
            gb(fallback) / gb(posix),
        ),
        line(
            "fallback commit vs RDMA commit",
            format!("{:.2} GB/s", gb(fallback)),
            format!("RDMA commit {:.2} GB/s", gb(rdma)),
            gb(fallback) / gb(rdma),
        ),
    ])
}

/// What the four-rank case reports: the pull and push measurements, and
/// the baseline for its async rows.
#[derive(Debug, Serialize, Deserialize)]
struct MpiResult {
    modes: Vec<ModeTimes>,
    /// Seconds for every rank to memcpy its own bytes with all four copying
    /// at once: the median over runs of the slowest rank's copy, each run
    /// starting at a barrier, as an async commit's copies into the staging
    /// buffers start together at the commit and end at the ranks' agreement.
    memcpy_all: f64,
    /// The same copies timed on each rank's own clock after one barrier
    /// (the slowest rank's median), the baseline before 2026-12-04: ranks
    /// drift apart over the runs, so a copy shares the cores with fewer
    /// than three others and this is shorter. Reported beside it.
    memcpy_all_unaligned: f64,
    /// Median seconds of the MPI-IO baseline (every rank's bytes written
    /// with write_at_all and synced), when it ran.
    mpiio: Option<f64>,
    /// `transfer = "auto"` after its choice.
    auto: AutoTimes,
}

/// Median seconds for all ranks to write their `data` into one file in
/// `dir` with `MPI_File_write_at_all` and `MPI_File_sync` (collective),
/// the peers' PFS baseline.
fn mpiio_write_secs(world: &mpi::topology::SimpleCommunicator, dir: &Path, data: &[u8], runs: usize) -> Result<f64> {
    use mpi::ffi;
    use mpi::raw::AsRaw;
    use mpi::traits::{Communicator as _, CommunicatorCollectives as _};
    let path = dir.join("commit-bench.mpiio");
    let c_path = std::ffi::CString::new(path.to_string_lossy().as_bytes())?;
    let count = i32::try_from(data.len()).context("MPI-IO writes at most 2 GiB per rank here")?;
    let offset = i64::from(world.rank()) * i64::from(count);
    let mut times = Vec::new();
    for _ in 0..runs {
        world.barrier();
        let start = Instant::now();
        // SAFETY: plain MPI-IO calls on this process's communicator with a
        // NUL-terminated path; `data` outlives the blocking write, and the
        // status is MPI's own ignore value.
        let codes = unsafe {
            let mut file: ffi::MPI_File = std::mem::zeroed();
            let mode = (ffi::MPI_MODE_CREATE | ffi::MPI_MODE_WRONLY) as i32;
            let open = ffi::MPI_File_open(world.as_raw(), c_path.as_ptr(), mode, ffi::RSMPI_INFO_NULL, &mut file);
            if open != 0 {
                [open, 0, 0, 0]
            } else {
                let buf = data.as_ptr().cast();
                let write =
                    ffi::MPI_File_write_at_all(file, offset, buf, count, ffi::RSMPI_UINT8_T, ffi::RSMPI_STATUS_IGNORE);
                let sync = ffi::MPI_File_sync(file);
                [0, write, sync, ffi::MPI_File_close(&mut file)]
            }
        };
        if codes.iter().any(|c| *c != 0) {
            bail!("MPI-IO on {} failed (open, write, sync, close: {codes:?})", path.display());
        }
        world.barrier();
        times.push(start.elapsed().as_secs_f64());
    }
    if world.rank() == 0 {
        let _ = std::fs::remove_file(&path);
    }
    Ok(median(times))
}

/// Median over `runs` of the time until every rank of `world` has copied
/// `size` bytes, all starting at one barrier per run (each rank times its
/// own copy; the run's figure is the slowest).
fn memcpy_together_secs(world: &mpi::topology::SimpleCommunicator, size: usize, runs: usize) -> f64 {
    use mpi::collective::SystemOperation;
    use mpi::traits::CommunicatorCollectives as _;
    let (src, mut dst) = copy_buffers(size);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        world.barrier();
        let start = Instant::now();
        dst.as_mut_slice().copy_from_slice(src.as_slice());
        let mine = start.elapsed().as_secs_f64();
        let mut slowest = 0.0f64;
        world.all_reduce_into(&mine, &mut slowest, SystemOperation::max());
        times.push(slowest);
    }
    median(times)
}

fn mpi_rank(config: &Path, provider: &str, rank_size: usize, runs: usize, mpiio_dir: &Path) -> Result<()> {
    use mpi::collective::SystemOperation;
    use mpi::traits::{Communicator as _, CommunicatorCollectives as _};
    let universe = mpi::initialize().context("MPI init")?;
    let world = universe.world();
    world.barrier();
    let mine = memcpy_secs(rank_size.max(4096), runs);
    let mut memcpy_all_unaligned = 0.0f64;
    world.all_reduce_into(&mine, &mut memcpy_all_unaligned, SystemOperation::max());
    let memcpy_all = memcpy_together_secs(&world, rank_size.max(4096), runs);
    let data = Region::<u8>::zeroed(rank_size);
    fill_pattern(&mut data.write(), 5);
    let mut paired = RawFabric::start(&MpiComm::new(&world), provider, rank_size, true)?;
    let mut modes = Vec::new();
    for transfer in ["pull", "push"] {
        let app = format!("bench-mpi-{transfer}");
        modes.push(measure(config, &app, || MpiComm::new(&world), (&data, &mut paired), runs, transfer, false)?);
    }
    drop(paired);
    let auto = measure_auto(config, "bench-mpi-auto", || MpiComm::new(&world), &data, runs)?;
    let mpiio = if mpiio_dir.as_os_str().is_empty() {
        None
    } else {
        Some(mpiio_write_secs(&world, mpiio_dir, &data.read(), runs)?)
    };
    if world.rank() == 0 {
        let result = MpiResult { modes, memcpy_all, memcpy_all_unaligned, mpiio, auto };
        println!("RESULT {}", serde_json::to_string(&result)?);
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(provider) = &cli.serve_target {
        let size = usize::try_from(cli.size.0)?;
        let target = Target::start(&FabricConfig::provider(provider), size, 1)?;
        target.serve(std::io::stdin().lock(), std::io::stdout().lock())?;
        return Ok(());
    }
    if let Some(announcement) = &cli.cold_read_peer {
        let provider = cli.providers.first().context("--cold-read-peer needs --providers")?;
        return cold_read_child(provider, announcement);
    }
    if let (Some(config), Some(app)) = (&cli.restore_config, &cli.restore_app) {
        return restore_child(config, app, usize::try_from(cli.size.0)?);
    }
    let runs = cli.runs.max(1);
    // The library's own log (ICHECK_LOG, as the daemons'), on stderr: in
    // MPI ranks and in this process's one-rank cases.
    icheck_examples::log_to_stderr(None);
    if let Some(config) = &cli.mpi_rank {
        let provider = cli.providers.first().context("--mpi-rank needs --providers")?;
        return mpi_rank(config, provider, usize::try_from(cli.rank_size.0)?, runs, &cli.mpiio_dir);
    }
    // Ctrl-C stops the services this run started.
    icheck_service::testkit::interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    let size = usize::try_from(cli.size.0)?;
    let rank_size = usize::try_from(cli.rank_size.0)?;
    let memcpy = memcpy_secs(size, runs);
    let memcpy_rank = memcpy_secs(rank_size.max(4096), runs);
    eprintln!("memcpy {}: {:.1} ms ({:.2} GB/s)", cli.size, memcpy * 1e3, size as f64 / memcpy / 1e9);
    let mut lines = Vec::new();
    // Kinds of bars in the rates plot, in legend order.
    const KINDS: [&str; 8] = [
        "icheck commit, pull",
        "icheck commit, push",
        "icheck restart + restore, the rank pulls",
        "raw fi_read",
        "raw fi_write",
        "memcpy",
        "icheck restart + restore, the agent pushes",
        "icheck restart + restore, same host (the agent's file)",
    ];
    let mut bars =
        vec![plots::Bar { label: format!("memcpy, {}", cli.size), gb_per_s: size as f64 / memcpy / 1e9, kind: 5 }];
    let icheck_bars = |bars: &mut Vec<plots::Bar>, case: &str, bytes: f64, pull: &ModeTimes, push: &ModeTimes| {
        for (kind, what, secs) in [
            (0, "commit, pull", pull.commit),
            (1, "commit, push", push.commit),
            (2, "restart + restore, pulled", pull.restart),
            (6, "restart + restore, pushed", pull.restart_pushed),
            (7, "restart + restore, same host", pull.restart_same_host),
        ] {
            bars.push(plots::Bar { label: format!("{case}: {what}"), gb_per_s: bytes / secs / 1e9, kind });
        }
    };
    let incremental_size = usize::try_from(cli.incremental_size.0)?;
    if let (Some(provider), true) = (cli.providers.first(), incremental_size > 0 && !cli.new_app_only) {
        let Sweep { plain, points, tracked, writes, checksum_pass } =
            incremental_sweep(provider, incremental_size, runs)?;
        let all = points.first().map_or(plain, |p| p.secs);
        if let Some(dir) = &cli.plots {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let curve = |points: &[SweepPoint]| points.iter().map(|p| (p.fraction * 100.0, p.secs * 1e3)).collect();
            let curves = [
                ("incremental commit (checksums compared)", curve(&points)),
                ("incremental commit with page tracking", curve(&tracked)),
            ];
            let title = format!("Incremental commits: one rank of {} over {provider}", cli.incremental_size);
            plots::incremental(&dir.join("incremental.svg"), &title, &curves, plain * 1e3, checksum_pass * 1e3)?;
        }
        let case = format!("1 rank, 1 agent, {}, incremental", cli.incremental_size);
        for (mode, points) in [("", &points), (", page tracking", &tracked)] {
            for p in points {
                let changed = format!("{}% changed{mode}", p.fraction * 100.0);
                eprintln!(
                    "{provider}: incremental, {changed}: {:.1} ms, {:.1} MiB received",
                    p.secs * 1e3,
                    p.received / f64::from(1 << 20)
                );
                lines.push(Line::new(
                    &case,
                    provider,
                    &format!("commit, {changed}"),
                    format!("{:.1} ms", p.secs * 1e3),
                    format!("incremental, 100% changed {:.1} ms", all * 1e3),
                    p.secs / all,
                ));
                lines.push(Line::new(
                    &case,
                    provider,
                    &format!("bytes received, {changed}"),
                    format!("{:.1} MiB", p.received / f64::from(1 << 20)),
                    format!("the rank's {}", cli.incremental_size),
                    p.received / incremental_size as f64,
                ));
            }
        }
        lines.push(Line::new(
            &case,
            provider,
            "the application changing every page, with page tracking",
            format!("{:.1} ms", writes.1 * 1e3),
            format!("without {:.1} ms", writes.0 * 1e3),
            writes.1 / writes.0,
        ));
        lines.push(Line::new(
            &case,
            provider,
            "checksum pass alone (the floor of a compared commit)",
            format!("{:.1} ms", checksum_pass * 1e3),
            format!("incremental, 100% changed {:.1} ms", all * 1e3),
            checksum_pass / all,
        ));
        lines.push(Line::new(
            &case,
            provider,
            "commit, 100% changed, incremental",
            format!("{:.1} ms", all * 1e3),
            format!("plain commit {:.1} ms", plain * 1e3),
            all / plain,
        ));
    }
    let providers = if cli.incremental_only || cli.new_app_only { &[][..] } else { &cli.providers[..] };
    for provider in providers {
        // Measured before and after this provider's cases; the faster of
        // the two is the baseline (the stricter one): on this shared machine
        // raw tcp fi_read alone has measured 1.8-5.3 GB/s within minutes.
        let raw_before = raw_fabric(provider, size, runs)?;
        let svc = service(&format!("bench-{provider}"), provider, 1, 1)?;
        let data = Region::<u8>::zeroed(size);
        fill_pattern(&mut data.write(), 5);
        let mut paired = RawFabric::start(&SingleProcess, provider, size, true)?;
        let pull =
            measure(&svc.config_path(), "bench-pull", || SingleProcess, (&data, &mut paired), runs, "pull", true)?;
        let push =
            measure(&svc.config_path(), "bench-push", || SingleProcess, (&data, &mut paired), runs, "push", false)?;
        drop(paired);
        let auto = measure_auto(&svc.config_path(), "bench-auto", || SingleProcess, &data, runs)?;
        drop(data);
        eprintln!("{provider}: 1 rank: pull {pull:?}, push {push:?}, auto {auto:?}");
        drop(svc);
        let mpi = if rank_size > 0 {
            let svc = service(&format!("bench-mpi-{provider}"), provider, 2, 2)?;
            let out = Command::new("mpirun")
                .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"])
                .arg(std::env::current_exe()?)
                .args(["--rank-size", &rank_size.to_string(), "--runs", &runs.to_string(), "--providers", provider])
                .arg("--mpiio-dir")
                .arg(&cli.mpiio_dir)
                .arg("--mpi-rank")
                .arg(svc.config_path())
                .output()
                .context("running mpirun")?;
            drop(svc);
            // Each rank's restart and restore times, as the one-rank case
            // prints them; with ICHECK_LOG, the ranks' whole log.
            let logging = std::env::var_os("ICHECK_LOG").is_some();
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| logging || l.contains(": restore = ") || l.contains("the raw operation just before"))
                .for_each(|l| eprintln!("{l}"));
            let stdout = String::from_utf8_lossy(&out.stdout);
            let Some(json) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
                bail!("the MPI case printed no result:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            };
            Some(serde_json::from_str::<MpiResult>(json)?)
        } else {
            None
        };
        let resized = if rank_size > 0 { Some(resized_restore(provider, rank_size, runs)?) } else { None };
        let raw_after = raw_fabric(provider, size, runs)?;
        let raw = (raw_before.0.max(raw_after.0), raw_before.1.max(raw_after.1), raw_before.2.max(raw_after.2));
        bars.push(plots::Bar { label: format!("{provider}: fi_read, {}", cli.size), gb_per_s: raw.0, kind: 3 });
        bars.push(plots::Bar { label: format!("{provider}: fi_write, {}", cli.size), gb_per_s: raw.1, kind: 4 });
        eprintln!(
            "{provider}: raw fi_read {:.2} / {:.2} GB/s, fi_write {:.2} / {:.2} GB/s, fi_read into fresh memory {:.2} / \
             {:.2} GB/s (before / after)",
            raw_before.0, raw_after.0, raw_before.1, raw_after.1, raw_before.2, raw_after.2
        );
        icheck_bars(&mut bars, &format!("{provider}, 1 rank × {}", cli.size), size as f64, &pull, &push);
        let case = format!("1 rank, 1 agent, {}", cli.size);
        lines.extend(rows_for(&case, provider, size as f64, &pull, &push, raw, memcpy));
        lines.extend(paired_rows(&case, provider, (size as f64, 1), &pull, &push));
        lines.push(auto_line(&case, provider, &auto, &pull, &push));
        if let Some(result) = mpi {
            let results = &result.modes;
            eprintln!("{provider}: 4 ranks: {results:?}");
            let case = format!("4 ranks, 2 agents, {} per rank", cli.rank_size);
            let bar_case = format!("{provider}, 4 ranks × {}", cli.rank_size);
            icheck_bars(&mut bars, &bar_case, 4.0 * rank_size as f64, &results[0], &results[1]);
            lines.extend(rows_for(&case, provider, 4.0 * rank_size as f64, &results[0], &results[1], raw, memcpy_rank));
            let (bytes, ranks) = (4.0 * rank_size as f64, 4);
            lines.extend(paired_rows(&case, provider, (bytes, ranks), &results[0], &results[1]));
            lines.push(auto_line(&case, provider, &result.auto, &results[0], &results[1]));
            // The peers' PFS baseline on the same data, in the same run.
            if let Some(mpiio) = result.mpiio {
                lines.push(Line::new(
                    &case,
                    provider,
                    &format!("MPI-IO write_at_all + sync to {}", cli.mpiio_dir.display()),
                    format!("{:.1} ms", mpiio * 1e3),
                    format!("memcpy ×4 at once {:.1} ms", result.memcpy_all * 1e3),
                    mpiio / result.memcpy_all,
                ));
                for (mode, times) in [("pull", &results[0]), ("push", &results[1])] {
                    lines.push(Line::new(
                        &case,
                        provider,
                        &format!("commit, {mode}, blocking, vs MPI-IO"),
                        format!("{:.1} ms", times.commit * 1e3),
                        format!("MPI-IO {:.1} ms", mpiio * 1e3),
                        times.commit / mpiio,
                    ));
                }
            }
            if let Some(secs) = resized {
                let rate = 4.0 * rank_size as f64 / secs / 1e9;
                lines.push(Line::new(
                    &format!("4 ranks → 1 process (resized restart), 2 agents, {} per old rank", cli.rank_size),
                    provider,
                    "restore of the whole array into new memory",
                    format!("{rate:.2} GB/s"),
                    format!("fi_read into fresh memory {:.2} GB/s", raw.2),
                    rate / raw.2,
                ));
            }
            lines.push(Line::new(
                &case,
                provider,
                "memcpy ×4, each rank on its own clock after one barrier (the baseline before 2026-12-04)",
                format!("{:.1} ms", result.memcpy_all_unaligned * 1e3),
                format!("memcpy ×4 at once {:.1} ms", result.memcpy_all * 1e3),
                result.memcpy_all_unaligned / result.memcpy_all,
            ));
            // The issue's baseline for a four-rank commit (blocking: ≤ 4×
            // on one host) and an async one (blocked: ≤ 1.5×): each rank's
            // memcpy with all four copying at once.
            let blocking: fn(&ModeTimes) -> f64 = |t| t.commit;
            let blocked: fn(&ModeTimes) -> f64 = |t| t.async_blocked;
            for (how, secs) in [("blocking", blocking), ("async: blocked", blocked)] {
                for (mode, times) in [("pull", &results[0]), ("push", &results[1])] {
                    lines.push(Line::new(
                        &case,
                        provider,
                        &format!("commit, {mode}, {how}, vs 4 ranks copying at once"),
                        format!("{:.1} ms", secs(times) * 1e3),
                        format!("memcpy ×4 at once {:.1} ms", result.memcpy_all * 1e3),
                        secs(times) / result.memcpy_all,
                    ));
                }
            }
            lines.push(Line::new(
                &case,
                provider,
                "commit, pull, async: the first one blocked, 0.5 s after set_async, vs 4 ranks copying at once",
                format!("{:.1} ms", results[0].async_first * 1e3),
                format!("memcpy ×4 at once {:.1} ms", result.memcpy_all * 1e3),
                results[0].async_first / result.memcpy_all,
            ));
            // The issue's one-host restart target: no slower than the peers'
            // node-local restarts, 2.7× the same bytes' memcpy: restored the
            // default way (the agents' files, read on this host), and over
            // the fabric the way `auto` chooses where the agents are remote.
            let (direction, fabric) = match RestoreDirection::Auto.on(provider) {
                RestoreDirection::Push => ("push", results[0].restart_pushed),
                _ => ("pull", results[0].restart),
            };
            for (how, secs) in [
                ("restore = auto: the agents' files on this host".to_string(), results[0].restart_same_host),
                (format!("over the fabric, restore = {direction}"), fabric),
            ] {
                lines.push(Line::new(
                    &case,
                    provider,
                    &format!("restart + restore ({how}), vs 4 ranks copying at once"),
                    format!("{:.1} ms", secs * 1e3),
                    format!("memcpy ×4 at once {:.1} ms", result.memcpy_all * 1e3),
                    secs / result.memcpy_all,
                ));
            }
        }
    }
    if let (Some(provider), false) = (cli.providers.first(), cli.incremental_only) {
        let times = first_commits(provider, size, runs.max(5))?;
        eprintln!("{provider}: commits of a new application: {times:?}");
        let later = median(times[1..].to_vec());
        let slowest_later = times[1..].iter().copied().fold(0.0, f64::max);
        let case = format!("1 rank, 1 agent, {}, a new application", cli.size);
        lines.push(Line::new(
            &case,
            provider,
            "first commit",
            format!("{:.1} ms", times[0] * 1e3),
            format!("median of later {:.1} ms", later * 1e3),
            times[0] / later,
        ));
        lines.push(Line::new(
            &case,
            provider,
            "slowest commit after the first",
            format!("{:.1} ms", slowest_later * 1e3),
            format!("median of later {:.1} ms", later * 1e3),
            slowest_later / later,
        ));
    }
    if let (Some(provider), true) = (cli.providers.first(), rank_size > 0 && !cli.incremental_only) {
        // Each node holds two ranks' two first versions: the pool covers them.
        let pool = ByteSize((4 * rank_size) as u64);
        let case = format!("4 ranks, 2 agents, {} per rank, a new application committing back to back", cli.rank_size);
        // The store as `icheck up` backs it by default (4 KiB pages), with
        // `--huge-pages on` (root only), and with a warm pool.
        let mut variants = vec![(ByteSize(0), "off")];
        if nix::unistd::geteuid().is_root() {
            variants.push((ByteSize(0), "on"));
        }
        variants.push((pool, "off"));
        for (warm, huge_pages) in variants {
            let (times, pages) = new_app_back_to_back(provider, rank_size, warm, huge_pages, 6)?;
            eprintln!("{provider}: commits of a new four-rank application, warm pool {warm}, {pages}: {times:?}");
            let later = median(times[1..].to_vec());
            let slowest_later = times[1..].iter().copied().fold(0.0, f64::max);
            let page_size = if pages.starts_with("2 MiB") { "2 MiB pages" } else { "4 KiB pages" };
            let pool_name = match warm.0 {
                0 => format!("no warm pool, {page_size}"),
                _ => format!("warm pool {warm} per node, {page_size}"),
            };
            for (what, secs) in [("first commit", times[0]), ("slowest commit after the first", slowest_later)] {
                lines.push(Line::new(
                    &case,
                    provider,
                    &format!("{what}, {pool_name}"),
                    format!("{:.1} ms", secs * 1e3),
                    format!("median of later {:.1} ms", later * 1e3),
                    secs / later,
                ));
            }
        }
    }
    let others = !cli.incremental_only && !cli.new_app_only;
    if let (Some(provider), true) = (cli.providers.first(), cli.idle_seconds > 0 && others) {
        let share = idle_service_cpu(provider, std::time::Duration::from_secs(cli.idle_seconds))?;
        eprintln!("{provider}: idle service used {:.3}% of a core", share * 100.0);
        lines.push(Line::new(
            "idle: 2 managers, 1 application between commits",
            provider,
            &format!("service CPU over {} s", cli.idle_seconds),
            format!("{:.2}% of a core", share * 100.0),
            "target 0.5% of a core".into(),
            share / 0.005,
        ));
    }
    let pfs_size = usize::try_from(cli.pfs_size.0)?;
    if let (Some(provider), true) = (cli.providers.first(), pfs_size > 0 && others) {
        let pfs = pfs_level(provider, pfs_size, runs)?;
        eprintln!("{provider}: PFS level done");
        lines.extend(pfs);
    }
    if let (Some(dir), true) = (&cli.plots, others) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let title = "Commit and restart rates through a local service, beside raw RMA and memcpy (same run)";
        plots::rates(&dir.join("rates.svg"), title, &KINDS, &bars)?;
    }
    println!("Commit and restart through a local icheck service, median of {runs}; baselines measured in the same run");
    println!(
        "(raw fabric: one stream of {}, 1 MiB operations, 8 in flight; memcpy: the same bytes as one rank's data).",
        cli.size
    );
    println!();
    println!("| case | provider | operation | result | baseline | ratio |");
    println!("|---|---|---|---:|---:|---:|");
    for l in lines {
        println!("| {} | {} | {} | {} | {} | {:.2} |", l.case, l.provider, l.what, l.value, l.baseline, l.ratio);
    }
    Ok(())
}
