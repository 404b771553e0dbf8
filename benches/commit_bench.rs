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
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::fabric::{Access, AlignedBuffer, Domain, Endpoint, FabricConfig, RmaOp, TransferOptions};
use icheck_core::units::ByteSize;
use icheck_lib::{Communicator, Icheck, InitStatus, MpiComm, Region, SingleProcess};
use icheck_service::selftest::{fill_pattern, Target, TargetProcess};
use icheck_service::testkit::LocalService;
use serde::{Deserialize, Serialize};

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
    /// Internal: serve as the raw-fabric target for one provider.
    #[arg(long, hide = true)]
    serve_target: Option<String>,
    /// Internal: run as one rank of the MPI case with this config.
    #[arg(long, hide = true)]
    mpi_rank: Option<PathBuf>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

/// What one mode measured, in seconds per operation.
#[derive(Debug, Default, Serialize, Deserialize)]
struct ModeTimes {
    commit: f64,
    unchanged: f64,
    async_blocked: f64,
    async_total: f64,
    restart: f64,
}

/// Changes one byte in every page of `data` (differently each run), so a
/// commit has new data to move.
fn change_every_page(data: &Region<u8>, run: usize) {
    let mut bytes = data.write();
    let len = bytes.len();
    for i in (0..len).step_by(4096) {
        bytes[i] = bytes[i].wrapping_add(run as u8 + 1);
    }
}

fn set_mode(transfer: &str) {
    std::env::set_var("ICHECK_TRANSFER", transfer);
    std::env::set_var("ICHECK_ZERO_COPY", "1");
}

/// Commits `data` `runs` times (blocking, then unchanged, then async) and
/// restarts it, through app `app`. Collective over `comm`.
fn measure<C: Communicator + 'static>(
    config: &Path,
    app: &str,
    comm_factory: impl Fn() -> C,
    data: &Region<u8>,
    runs: usize,
    transfer: &str,
) -> Result<ModeTimes> {
    set_mode(transfer);
    let (mut ic, _) = Icheck::init(Some(config), app, comm_factory())?;
    ic.add("data", data)?;
    ic.commit()?; // warm-up: agent files exist, pages touched
    let timed = |ic: &mut Icheck, change: bool| -> Result<f64> {
        let mut times = Vec::new();
        for run in 0..runs {
            if change {
                change_every_page(data, run);
            }
            let start = Instant::now();
            ic.commit()?;
            times.push(start.elapsed().as_secs_f64());
        }
        Ok(median(times))
    };
    let commit = timed(&mut ic, true)?;
    let unchanged = timed(&mut ic, false)?;
    ic.set_async(true);
    let (mut blocked, mut total) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let start = Instant::now();
        ic.commit()?;
        blocked.push(start.elapsed().as_secs_f64());
        ic.wait()?;
        total.push(start.elapsed().as_secs_f64());
    }
    ic.finalize(true)?;
    let mut restarts = Vec::new();
    for _ in 0..runs {
        let (mut ic, status) = Icheck::init(Some(config), app, comm_factory())?;
        if !matches!(status, InitStatus::Restart { .. }) {
            bail!("no checkpoint to restart from");
        }
        ic.add("data", data)?;
        let start = Instant::now();
        ic.restart()?;
        ic.restore_all()?;
        restarts.push(start.elapsed().as_secs_f64());
        ic.finalize(true)?;
    }
    let (mut ic, _) = Icheck::init(Some(config), app, comm_factory())?;
    ic.finalize(false)?;
    Ok(ModeTimes {
        commit,
        unchanged,
        async_blocked: median(blocked),
        async_total: median(total),
        restart: median(restarts),
    })
}

/// Raw fabric rates: fi_read and fi_write into/from touched memory, and
/// fi_read into freshly allocated memory (what a restart must do: its
/// destination has never been touched, so every page faults once).
fn raw_fabric(provider: &str, size: usize, runs: usize) -> Result<(f64, f64, f64)> {
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["--serve-target", provider, "--size", &size.to_string()]);
    let target = TargetProcess::spawn(command).context("starting the raw-fabric target")?;
    let domain = Domain::open(&FabricConfig::provider(provider))?;
    let endpoint = Endpoint::new(&domain)?;
    let peer = endpoint.insert_peer(&target.announcement().address)?;
    let mut local = endpoint.register(AlignedBuffer::zeroed(size), Access::LOCAL)?;
    fill_pattern(local.as_mut_slice(), 3);
    let whole = [RmaOp { local_offset: 0, remote: target.announcement().region, remote_offset: 0, len: size }];
    let options = TransferOptions::default();
    endpoint.read(&peer, local.target(), &whole, &options)?;
    let read = median(
        (0..runs)
            .map(|_| endpoint.read(&peer, local.target(), &whole, &options).map(|s| s.gb_per_s()))
            .collect::<Result<_, _>>()?,
    );
    endpoint.write(&peer, local.source(), &whole, &options)?;
    let write = median(
        (0..runs)
            .map(|_| endpoint.write(&peer, local.source(), &whole, &options).map(|s| s.gb_per_s()))
            .collect::<Result<_, _>>()?,
    );
    let fresh = median(
        (0..runs)
            .map(|_| -> Result<f64> {
                let mut fresh = endpoint.register(AlignedBuffer::zeroed(size), Access::LOCAL)?;
                let start = Instant::now();
                endpoint.read(&peer, fresh.target(), &whole, &options)?;
                Ok(size as f64 / start.elapsed().as_secs_f64() / 1e9)
            })
            .collect::<Result<_, _>>()?,
    );
    target.quit()?;
    Ok((read, write, fresh))
}

fn memcpy_secs(size: usize, runs: usize) -> f64 {
    let mut src = AlignedBuffer::zeroed(size);
    fill_pattern(src.as_mut_slice(), 7);
    let mut dst = AlignedBuffer::zeroed(size);
    dst.as_mut_slice().fill(1);
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
    let path = std::env::current_exe()?.with_file_name("icheck");
    if !path.exists() {
        bail!("{} is missing: build the workspace first (cargo build --release --workspace)", path.display());
    }
    Ok(path)
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
    vec![
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
            "restart + restore",
            format!("{:.2} GB/s", gb(pull.restart)),
            format!("fi_read {:.2} GB/s", raw.0),
            gb(pull.restart) / raw.0,
        ),
        line(
            "restart + restore vs fi_read into fresh memory",
            format!("{:.2} GB/s", gb(pull.restart)),
            format!("fi_read {:.2} GB/s", raw.2),
            gb(pull.restart) / raw.2,
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
            "commit, pull, no data change",
            format!("{:.2} GB/s", gb(pull.unchanged)),
            format!("changed {:.2} GB/s", gb(pull.commit)),
            pull.commit / pull.unchanged,
        ),
    ]
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

fn mpi_rank(config: &Path, rank_size: usize, runs: usize) -> Result<()> {
    let universe = mpi::initialize().context("MPI init")?;
    let world = universe.world();
    let data = Region::<u8>::zeroed(rank_size);
    fill_pattern(&mut data.write(), 5);
    let mut results = Vec::new();
    for transfer in ["pull", "push"] {
        let app = format!("bench-mpi-{transfer}");
        results.push(measure(config, &app, || MpiComm::new(&world), &data, runs, transfer)?);
    }
    use mpi::traits::Communicator as _;
    if world.rank() == 0 {
        println!("RESULT {}", serde_json::to_string(&results)?);
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
    let runs = cli.runs.max(1);
    if let Some(config) = &cli.mpi_rank {
        return mpi_rank(config, usize::try_from(cli.rank_size.0)?, runs);
    }
    let size = usize::try_from(cli.size.0)?;
    let rank_size = usize::try_from(cli.rank_size.0)?;
    let memcpy = memcpy_secs(size, runs);
    let memcpy_rank = memcpy_secs(rank_size.max(4096), runs);
    eprintln!("memcpy {}: {:.1} ms ({:.2} GB/s)", cli.size, memcpy * 1e3, size as f64 / memcpy / 1e9);
    let mut lines = Vec::new();
    for provider in &cli.providers {
        let raw = raw_fabric(provider, size, runs)?;
        eprintln!(
            "{provider}: raw fi_read {:.2} GB/s, fi_write {:.2} GB/s, fi_read into fresh memory {:.2} GB/s",
            raw.0, raw.1, raw.2
        );
        let svc = service(&format!("bench-{provider}"), provider, 1, 1)?;
        let data = Region::<u8>::zeroed(size);
        fill_pattern(&mut data.write(), 5);
        let pull = measure(&svc.config_path(), "bench-pull", || SingleProcess, &data, runs, "pull")?;
        let push = measure(&svc.config_path(), "bench-push", || SingleProcess, &data, runs, "push")?;
        drop(data);
        eprintln!("{provider}: 1 rank: pull {pull:?}, push {push:?}");
        lines.extend(rows_for(
            &format!("1 rank, 1 agent, {}", cli.size),
            provider,
            size as f64,
            &pull,
            &push,
            raw,
            memcpy,
        ));
        drop(svc);
        if rank_size > 0 {
            let svc = service(&format!("bench-mpi-{provider}"), provider, 2, 2)?;
            let out = Command::new("mpirun")
                .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"])
                .arg(std::env::current_exe()?)
                .args(["--rank-size", &rank_size.to_string(), "--runs", &runs.to_string(), "--mpi-rank"])
                .arg(svc.config_path())
                .output()
                .context("running mpirun")?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            let Some(json) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
                bail!("the MPI case printed no result:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
            };
            let results: Vec<ModeTimes> = serde_json::from_str(json)?;
            eprintln!("{provider}: 4 ranks: {results:?}");
            let case = format!("4 ranks, 2 agents, {} per rank", cli.rank_size);
            lines.extend(rows_for(&case, provider, 4.0 * rank_size as f64, &results[0], &results[1], raw, memcpy_rank));
        }
    }
    let pfs_size = usize::try_from(cli.pfs_size.0)?;
    if let (Some(provider), true) = (cli.providers.first(), pfs_size > 0) {
        let pfs = pfs_level(provider, pfs_size, runs)?;
        eprintln!("{provider}: PFS level done");
        lines.extend(pfs);
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
