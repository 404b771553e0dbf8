//! Horizontal scaling and supervised relaunch, measured on a test-local
//! Slurm (Debian's munged, slurmctld and three slurmd on this host, as the
//! tests start it) in one run:
//!
//! * scale-out (Algorithm 8): an application fills its node's checkpoint
//!   memory; the time from the controller's request to Slurm until the new
//!   manager registers, and from there until a new application's first
//!   version is stored with an agent on the new node;
//! * release (Algorithm 9): a node holding part of an application's
//!   versions is drained in Slurm; the time until its versions have moved
//!   agent to agent and its manager job is cancelled, and the rate they
//!   moved at;
//! * `icheck run`: a job killed once, against the same job without a
//!   fault; the relaunch overhead is what the failure cost beyond the work
//!   redone since the newest version.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/scaling-bench --drain-mib 1024 --runs 3
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::config::StaticConfig;
use icheck_core::control::request_blocking;
use icheck_core::protocol::{ClientReply, ClientRequest, StatusReport};
use icheck_service::testkit::interrupt;
use icheck_service::testkit::poll_until;
use icheck_service::testkit::slurm::TestSlurm;

#[path = "siblings.rs"]
mod siblings;

#[derive(Parser)]
#[command(about = "Scale-out, release of a drained node and icheck run's relaunch overhead, on a test-local Slurm")]
struct Cli {
    /// MiB of versions (two ranks' newest version) the drained node's
    /// application holds in all; about half sits on the drained node.
    #[arg(long, default_value_t = 1024)]
    drain_mib: u64,
    /// Runs of the icheck run comparison (medians are printed).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// The programs this bench runs, beside it in the target directory.
struct Programs {
    icheck: PathBuf,
    example: PathBuf,
}

/// The service on the test Slurm, stopped on drop.
struct Service<'a> {
    slurm: &'a TestSlurm,
    dir: PathBuf,
    icheck: PathBuf,
    /// Stops the service if the run is interrupted (before the Slurm
    /// cluster it runs on: clean-ups run newest first).
    _on_interrupt: interrupt::Registered,
}

impl<'a> Service<'a> {
    fn up(slurm: &'a TestSlurm, icheck: &Path, nodes: &str, dynamic: &str) -> Result<Service<'a>> {
        let dir = std::env::temp_dir().join(format!("icheck-scaling-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("dynamic.toml"), dynamic)?;
        let _starting = interrupt::hold_off();
        let (down_with, state, conf) = (icheck.to_path_buf(), dir.clone(), slurm.conf.clone());
        let on_interrupt = interrupt::on_interrupt(format!("the service in {}", dir.display()), move || {
            stop_service(&down_with, &state, &conf);
        });
        let out = Command::new(icheck)
            .args(["up", "--detach", "--provider", "tcp", "--slurm", "--partition", &slurm.partition, "--nodes", nodes])
            .arg("--state-dir")
            .arg(&dir)
            .env("SLURM_CONF", &slurm.conf)
            .output()?;
        let service = Service { slurm, dir, icheck: icheck.to_path_buf(), _on_interrupt: on_interrupt };
        if !out.status.success() {
            bail!(
                "icheck up --slurm: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(service)
    }

    fn config(&self) -> PathBuf {
        self.dir.join("icheck.toml")
    }

    fn status(&self) -> Result<StatusReport> {
        let config = StaticConfig::load(&self.config())?;
        match request_blocking(&config, &ClientRequest::Status)? {
            ClientReply::Status(report) => Ok(report),
            other => bail!("status: {other:?}"),
        }
    }

    fn alive(&self) -> Vec<String> {
        self.status().map(|s| s.nodes.into_iter().filter(|n| n.alive).map(|n| n.node).collect()).unwrap_or_default()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("logs/controller.log")).unwrap_or_default()
    }
}

impl Drop for Service<'_> {
    fn drop(&mut self) {
        stop_service(&self.icheck, &self.dir, &self.slurm.conf);
    }
}

/// `icheck down` for the service in `dir` on the Slurm of `conf` (its
/// manager jobs cancelled), then its directory removed.
fn stop_service(icheck: &Path, dir: &Path, conf: &Path) {
    let _ = Command::new(icheck)
        .args(["down", "--state-dir"])
        .arg(dir)
        .env("SLURM_CONF", conf)
        .stdout(Stdio::null())
        .status();
    let _ = std::fs::remove_dir_all(dir);
}

/// `mpirun -np RANKS example ARGS` to its end; its stdout.
fn job(programs: &Programs, config: &Path, ranks: u32, args: &[&str]) -> Result<String> {
    let (mut command, shm) = icheck_service::testkit::mpirun("scaling-bench", ranks)?;
    let out = command.arg(&programs.example).args(args).env("ICHECK_CONFIG", config).output()?;
    let _ = std::fs::remove_dir_all(shm);
    if !out.status.success() {
        bail!("job {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The timestamp (seconds of the day) of a controller log line.
fn at(line: &str) -> Option<f64> {
    let time = line.split('T').nth(1)?.split('Z').next()?;
    let mut parts = time.split(':');
    let (h, m, s): (f64, f64, f64) =
        (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
    Some(h * 3600.0 + m * 60.0 + s)
}

fn field<'l>(line: &'l str, key: &str) -> Option<&'l str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Scale-out: (request → registered, registered → a new app's first version there).
fn scale_out(slurm: &TestSlurm, programs: &Programs) -> Result<(f64, f64)> {
    let dynamic = "readInterval = 1\nis_dynamic_hs = true\nmax_mem_node = 0.5\nlower_threshold = 0.3\n\
                   upper_threshold = 0.4\ndepletion_threshold = \"1MiB\"\nscaler_interval = 0.5\n\
                   init_agent_count = 2\nnode_selection = \"RR\"\n";
    let service = Service::up(slurm, &programs.icheck, "1..2", dynamic)?;
    let first = service.alive();
    eprintln!("scaling-bench: filling {first:?} ...");
    let filler = ["--app", "filler", "--steps", "8", "--every", "1", "--mib", "64", "--step-ms", "300", "--persist"];
    job(programs, &service.config(), 2, &filler)?;
    if !poll_until(Duration::from_secs(120), || service.alive().len() == 2) {
        bail!("no second node within 120 s; controller log:\n{}", service.log());
    }
    let added = service.alive().into_iter().find(|n| !first.contains(n)).context("the new node")?;
    let registered_seen = Instant::now();
    let log = service.log();
    let request =
        log.lines().find(|l| l.contains("scaler: asked for another checkpoint node")).context("no request logged")?;
    let registered = log
        .lines()
        .find(|l| l.contains("manager registered") && field(l, "node") == Some(added.as_str()))
        .context("no registration logged")?;
    let to_registered = at(registered).zip(at(request)).map(|(b, a)| b - a).context("timestamps")?;
    job(
        programs,
        &service.config(),
        2,
        &["--app", "newcomer", "--steps", "1", "--every", "1", "--mib", "1", "--persist"],
    )?;
    let to_version = registered_seen.elapsed().as_secs_f64();
    let status = service.status()?;
    let app = status.apps.iter().find(|a| a.registration.name == "newcomer").context("newcomer")?;
    if !app.agents.iter().any(|a| a.node == added) {
        bail!("the new application has no agent on {added}: {:?}", app.agents);
    }
    Ok((to_registered, to_version))
}

/// Release: (drain → released, the removal's own seconds, bytes moved).
fn release(slurm: &TestSlurm, programs: &Programs, drain_mib: u64) -> Result<(f64, f64, u64)> {
    let dynamic = "readInterval = 1\nscaler_interval = 0.5\ninit_agent_count = 2\nnode_selection = \"RR\"\n";
    let service = Service::up(slurm, &programs.icheck, "2", dynamic)?;
    let per_rank = (drain_mib / 2).to_string();
    job(
        programs,
        &service.config(),
        2,
        &["--app", "held", "--steps", "1", "--every", "1", "--mib", &per_rank, "--persist"],
    )?;
    let status = service.status()?;
    let app = status.apps.iter().find(|a| a.registration.name == "held").context("held")?;
    let leaving = app.agents.last().context("agents")?.node.clone();
    eprintln!("scaling-bench: draining {leaving} ...");
    let drained = Instant::now();
    let out = slurm
        .command("scontrol")
        .args(["update", &format!("NodeName={leaving}"), "State=DRAIN", "Reason=bench"])
        .output()?;
    if !out.status.success() {
        bail!("scontrol: {}", String::from_utf8_lossy(&out.stderr));
    }
    if !poll_until(Duration::from_secs(300), || service.log().contains("released checkpoint node")) {
        bail!("the node was not released; controller log:\n{}", service.log());
    }
    let wall = drained.elapsed().as_secs_f64();
    let log = service.log();
    let released = log.lines().find(|l| l.contains("released checkpoint node")).context("release line")?;
    let secs: f64 = field(released, "secs").and_then(|s| s.parse().ok()).context("secs")?;
    let moved: u64 = log
        .lines()
        .filter(|l| l.contains("agents changed"))
        .filter_map(|l| field(l, "moved_bytes")?.parse::<u64>().ok())
        .sum();
    Ok((wall, secs, moved))
}

/// icheck run: (fault-free seconds, with one kill, work lost, relaunch overhead), medians.
fn relaunch(slurm: &TestSlurm, programs: &Programs, runs: usize) -> Result<[f64; 4]> {
    let dynamic = "readInterval = 1\n";
    let service = Service::up(slurm, &programs.icheck, "1", dynamic)?;
    let (mut clean, mut faulty, mut lost, mut overhead) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for run in 0..runs {
        let app = |kind: &str| format!("relaunch-{kind}-{run}");
        let supervised = |name: &str, kill_after: Option<Duration>| -> Result<(f64, String)> {
            let (launcher, shm) = icheck_service::testkit::mpirun("scaling-bench", 2)?;
            let mut command = Command::new(&programs.icheck);
            command
                .args(["run", "--app", name, "--max-restarts", "2", "--state-dir"])
                .arg(&service.dir)
                .arg("--")
                .arg(launcher.get_program())
                .args(launcher.get_args())
                .envs(launcher.get_envs().filter_map(|(k, v)| Some((k, v?))))
                .arg(&programs.example)
                .args(["--app", name, "--steps", "60", "--every", "5", "--mib", "32", "--step-ms", "50"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            let started = Instant::now();
            let child = command.spawn()?;
            if let Some(after) = kill_after {
                std::thread::sleep(after);
                let ranks: Vec<u32> = std::fs::read_dir("/proc")?
                    .flatten()
                    .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
                    .filter(|pid| {
                        // A rank: the example program itself, running this job's application.
                        std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                            let text = String::from_utf8_lossy(&c);
                            let program = text.split('\0').next().unwrap_or("");
                            program.ends_with("mpi_checkpoint") && text.contains(name)
                        })
                    })
                    .collect();
                if let Some(rank) = ranks.last() {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(*rank as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            let out = child.wait_with_output()?;
            let _ = std::fs::remove_dir_all(shm);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            if !out.status.success() {
                bail!("icheck run {name}: {stderr}");
            }
            Ok((started.elapsed().as_secs_f64(), stderr))
        };
        let (t0, _) = supervised(&app("clean"), None)?;
        let (t1, summary) = supervised(&app("killed"), Some(Duration::from_secs_f64(t0 * 0.6)))?;
        let work: f64 = summary
            .split("work lost ")
            .nth(1)
            .and_then(|rest| rest.split('s').next())
            .and_then(|s| s.parse().ok())
            .context("no work lost in the summary")?;
        if !summary.contains("2 attempt(s), 1 failure(s)") {
            bail!("the kill did not cause one relaunch: {summary}");
        }
        clean.push(t0);
        faulty.push(t1);
        lost.push(work);
        overhead.push(t1 - t0 - work);
    }
    Ok([median(clean), median(faulty), median(lost), median(overhead)])
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Ctrl-C stops the test-local Slurm, its jobs and the service.
    icheck_service::testkit::interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    let programs =
        Programs { icheck: siblings::sibling_binary("icheck")?, example: siblings::sibling_binary("mpi_checkpoint")? };
    let slurm = TestSlurm::start("bench", "sb", 3);
    let (to_registered, to_version) = scale_out(&slurm, &programs)?;
    let (wall, removal, moved) = release(&slurm, &programs, cli.drain_mib)?;
    let [clean, faulty, lost, overhead] = relaunch(&slurm, &programs, cli.runs)?;
    println!("| measure | seconds |");
    println!("|---|---|");
    println!("| scale-out: request to Slurm → the new manager registered | {to_registered:.2} |");
    println!("| scale-out: registered → a new application's first version, with an agent on the new node | {to_version:.2} |");
    println!(
        "| release: drain in Slurm → versions moved and the manager job cancelled ({:.0} MiB moved agent to agent, {:.2} GB/s during the removal) | {wall:.2} (removal itself {removal:.2}) |",
        moved as f64 / (1 << 20) as f64,
        moved as f64 / removal.max(1e-9) / 1e9
    );
    println!(
        "| icheck run, 2 ranks × 32 MiB, median of {}: fault-free / killed once / work redone / relaunch overhead | {clean:.2} / {faulty:.2} / {lost:.2} / {overhead:.2} |",
        cli.runs
    );
    Ok(())
}
