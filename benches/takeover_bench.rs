//! Standby controller benchmark, from one run:
//!
//! * the cost of a standby on commit latency: the same commits (one
//!   process, small versions, so the control plane dominates) against a
//!   service whose controller journals alone and against one whose every
//!   journaled event is also synced by a standby before the commit is
//!   acknowledged, as a ratio;
//! * takeover time: the primary SIGKILLed while this process commits in a
//!   loop, measured from the kill to the next completed commit (on the new
//!   primary), repeated `--takeovers` times (the dead controller is started
//!   again each time and becomes the standby), median and max.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/takeover-bench --commits 300 --takeovers 20
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_core::units::ByteSize;
use icheck_lib::{Icheck, Region, SingleProcess};
use icheck_service::launcher::is_icheck_process;
use icheck_service::testkit::LocalService;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

#[path = "siblings.rs"]
mod siblings;

#[derive(Parser)]
#[command(about = "Commit latency with and without a standby controller, and takeover time")]
struct Cli {
    /// Commits timed per service in the latency comparison.
    #[arg(long, default_value_t = 300)]
    commits: usize,
    /// Bytes of each version.
    #[arg(long, default_value = "1MiB")]
    size: ByteSize,
    /// Takeovers to time (0 skips them).
    #[arg(long, default_value_t = 20)]
    takeovers: usize,
    /// TakeoverAfter of the service with a standby, in seconds.
    #[arg(long, default_value_t = 3.0)]
    takeover_after: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn up(icheck: &std::path::Path, name: &str, standby: Option<f64>) -> LocalService {
    let after = standby.map(|s| s.to_string()).unwrap_or_default();
    let mut args = vec!["--provider", "tcp"];
    if standby.is_some() {
        args.extend(["--standby", "--takeover-after", &after]);
    }
    LocalService::up(icheck, name, 1, &args)
}

/// Seconds each of `commits` commits of `size` bytes took.
fn commit_times(service: &LocalService, app: &str, commits: usize, size: usize) -> Result<Vec<f64>> {
    let (mut ic, _) = Icheck::init(Some(&service.config_path()), app, SingleProcess)?;
    let data = Region::<u8>::zeroed(size);
    ic.add("data", &data)?;
    let mut times = Vec::with_capacity(commits);
    for i in 0..commits + 5 {
        data.write()[i % size] ^= 1;
        let started = Instant::now();
        ic.commit()?;
        // The first commits create and register the store files.
        if i >= 5 {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    ic.finalize(false)?;
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn takeover_times(service: &LocalService, takeovers: usize, size: usize) -> Result<(Vec<f64>, usize)> {
    let done = AtomicBool::new(false);
    let completed: Mutex<Vec<Instant>> = Mutex::default();
    let (mut ic, _) = Icheck::init(Some(&service.config_path()), "takeover", SingleProcess)?;
    let data = Region::<u8>::zeroed(size);
    ic.add("data", &data)?;
    std::thread::scope(|scope| {
        let injector = scope.spawn(|| {
            let result = inject(service, takeovers, &completed);
            done.store(true, Ordering::SeqCst);
            result
        });
        let mut failed = 0;
        let mut i = 0;
        while !done.load(Ordering::SeqCst) {
            i += 1;
            data.write()[i % size] ^= 1;
            match ic.commit() {
                Ok(_) => completed.lock().unwrap().push(Instant::now()),
                Err(err) => {
                    failed += 1;
                    eprintln!("commit failed: {err}");
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut times = injector.join().expect("the injector thread")?;
        times.sort_by(f64::total_cmp);
        Ok((times, failed))
    })
}

/// Kills the primary `takeovers` times while commits complete (their
/// times in `completed`); returns kill -> next completed commit, seconds.
fn inject(service: &LocalService, takeovers: usize, completed: &Mutex<Vec<Instant>>) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for round in 0..takeovers {
        // A few commits on the current primary first.
        let before = completed.lock().unwrap().len();
        while completed.lock().unwrap().len() < before + 5 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let name = service.primary_name().context("no primary answers")?;
        let pid = service.pid_of(name);
        let killed = Instant::now();
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL)?;
        let next = loop {
            if let Some(at) = completed.lock().unwrap().iter().find(|at| **at > killed) {
                break *at;
            }
            if killed.elapsed() > Duration::from_secs(120) {
                bail!("round {round}: no commit within 120 s of the takeover");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        times.push((next - killed).as_secs_f64());
        println!("takeover {}: {name} killed, next commit after {:.2} s", round + 1, times[round]);
        while is_icheck_process(pid) {
            std::thread::sleep(Duration::from_millis(10));
        }
        // The dead one comes back and follows the new primary.
        service.up_again();
        let attached = Instant::now();
        while !service.try_status().is_ok_and(|s| s.controller.is_some_and(|c| c.standby_follows())) {
            if attached.elapsed() > Duration::from_secs(60) {
                bail!("round {round}: the restarted controller did not follow the new primary");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(times)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Ctrl-C stops the services this run started.
    icheck_service::testkit::interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    let icheck = siblings::sibling_binary("icheck")?;
    let size = usize::try_from(cli.size.0)?;
    println!("commit latency: {} commits of {} per service, one process, tcp provider", cli.commits, cli.size);
    let alone = up(&icheck, "bench-alone", None);
    let single = commit_times(&alone, "alone", cli.commits, size)?;
    drop(alone);
    let paired = up(&icheck, "bench-paired", Some(cli.takeover_after));
    let with_standby = commit_times(&paired, "paired", cli.commits, size)?;
    println!();
    println!("| controller | commit median | p90 | ratio of medians |");
    println!("|---|---|---|---|");
    let median = percentile(&single, 0.5);
    for (what, times) in
        [("journal, no standby (baseline)", &single), ("journal + standby (synced before the ack)", &with_standby)]
    {
        println!(
            "| {what} | {:.2} ms | {:.2} ms | {:.2} |",
            percentile(times, 0.5) * 1e3,
            percentile(times, 0.9) * 1e3,
            percentile(times, 0.5) / median
        );
    }
    if cli.takeovers > 0 {
        let (times, failed) = takeover_times(&paired, cli.takeovers, size)?;
        println!();
        println!("| takeovers (TakeoverAfter {} s) | median | max | failed commits |", cli.takeover_after);
        println!("|---|---|---|---|");
        println!(
            "| {} x primary SIGKILLed -> next completed commit | {:.2} s | {:.2} s | {failed} |",
            times.len(),
            percentile(&times, 0.5),
            times.last().copied().unwrap_or(0.0)
        );
    }
    Ok(())
}
