//! `icheck run`: a supervised job. Starts the command (`mpirun ...` or
//! `srun ...`), watches it, and when it fails relaunches it so that it
//! restarts from its newest complete version, with the process count the
//! policy gives, until it succeeds or the relaunches are used up (what
//! SCR's `scr_srun` loop and VeloC's relaunch scripts do by hand).
//!
//! The decisions (which command the next attempt runs, what the summary
//! says) are pure functions tested below; the loop around them only
//! starts processes, waits and forwards signals.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// Exit status of `icheck run` when the job still failed after the last
/// relaunch (the job's own status is in the summary).
pub const EXIT_GAVE_UP: i32 = 3;
/// Exit status when `icheck run` was interrupted (SIGINT, SIGTERM) and
/// stopped the job without relaunching it.
pub const EXIT_INTERRUPTED: i32 = 130;

/// How a failed job is relaunched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// The same command again.
    Same,
    /// One process fewer per failure: the lost rank's data is spread over
    /// the others (the application adds it with icheck_add_adapt*).
    Shrink,
    /// The first attempt's process count every time: a replacement process
    /// takes the lost rank's place and receives its data.
    Rebuild,
}

/// Where a command names its process count: the index of the value and
/// how it is written (`-np 4`, `--ntasks=4`).
#[derive(Debug, PartialEq, Eq)]
struct CountArgument {
    index: usize,
    /// `Some(prefix)` when the value shares the argument (`--ntasks=`).
    joined: Option<&'static str>,
    value: u32,
}

/// Options launchers take the process count from: mpirun (`-np`, `-n`,
/// `--np`, `-c`) and srun (`-n`, `--ntasks`); the first among the
/// launcher's options counts.
const SEPARATE: [&str; 5] = ["-np", "-n", "--np", "-c", "--ntasks"];
const JOINED: [&str; 3] = ["--ntasks=", "--np=", "-n="];

/// Launchers whose options name the process count.
const LAUNCHERS: [&str; 6] = ["mpirun", "mpiexec", "orterun", "prterun", "oshrun", "srun"];

fn count_argument(command: &[String]) -> Option<CountArgument> {
    let launcher = std::path::Path::new(command.first()?).file_name()?.to_str()?;
    if !LAUNCHERS.contains(&launcher) {
        return None;
    }
    for (i, arg) in command.iter().enumerate().skip(1) {
        if SEPARATE.contains(&arg.as_str()) {
            let value = command.get(i + 1)?.parse().ok()?;
            return Some(CountArgument { index: i + 1, joined: None, value });
        }
        for prefix in JOINED {
            if let Some(value) = arg.strip_prefix(prefix).and_then(|v| v.parse().ok()) {
                return Some(CountArgument { index: i, joined: Some(prefix), value });
            }
        }
        // A word that neither is an option nor follows one is the
        // program: what comes after it belongs to the application.
        if !arg.starts_with('-') && (i == 1 || !command[i - 1].starts_with('-')) {
            break;
        }
    }
    None
}

/// The command attempt `failures + 1` runs, after `failures` failed ones.
pub fn relaunch_command(command: &[String], policy: Policy, failures: u32) -> Result<Vec<String>, String> {
    if policy != Policy::Shrink {
        return Ok(command.to_vec());
    }
    let Some(count) = count_argument(command) else {
        return Err(format!(
            "--policy shrink changes the process count, and `{}` names none (give -np N, -n N or --ntasks N)",
            command.join(" ")
        ));
    };
    let Some(value) = count.value.checked_sub(failures).filter(|v| *v >= 1) else {
        return Err(format!("--policy shrink: no process left after {failures} failures of {}", count.value));
    };
    let mut next = command.to_vec();
    next[count.index] = match count.joined {
        Some(prefix) => format!("{prefix}{value}"),
        None => value.to_string(),
    };
    Ok(next)
}

/// How one attempt ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    /// The command it ran.
    pub command: Vec<String>,
    /// Exit code, or the signal that ended the launcher.
    pub outcome: Outcome,
    /// Its wall time.
    pub seconds: f64,
    /// The newest complete version when it started (what it restarted
    /// from), if the controller said.
    pub restarted_from: Option<u64>,
    /// Seconds from the newest version's completion to the end of a
    /// failed attempt: the work the next attempt does again.
    pub work_lost_secs: Option<f64>,
}

/// How a launcher process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It exited with this code.
    Exited(i32),
    /// A signal ended it.
    Signalled(i32),
}

impl Outcome {
    fn succeeded(self) -> bool {
        self == Outcome::Exited(0)
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Exited(code) => write!(f, "exit status {code}"),
            Outcome::Signalled(signal) => write!(f, "signal {signal}"),
        }
    }
}

/// The closing summary: attempts, versions restored, time lost.
pub fn summary(attempts: &[Attempt], gave_up: bool) -> String {
    let failures = attempts.iter().filter(|a| !a.outcome.succeeded()).count();
    let mut text = String::new();
    let verdict = match (attempts.last(), gave_up) {
        (Some(last), false) if last.outcome.succeeded() => "the job succeeded",
        (_, true) => "gave up: the job still fails",
        _ => "stopped",
    };
    let _ = write!(text, "icheck run: {verdict} after {} attempt(s), {failures} failure(s)", attempts.len());
    let restored: Vec<String> =
        attempts.iter().skip(1).map(|a| a.restarted_from.map_or("?".to_string(), |v| v.to_string())).collect();
    if !restored.is_empty() {
        let _ = write!(text, "; restarts from version(s) {}", restored.join(", "));
    }
    let lost: f64 = attempts.iter().filter_map(|a| a.work_lost_secs).sum();
    let _ = write!(text, "; work lost {lost:.1}s");
    let total: f64 = attempts.iter().map(|a| a.seconds).sum();
    let _ = write!(text, "; wall time {total:.1}s");
    for (i, a) in attempts.iter().enumerate() {
        let from = a.restarted_from.map_or(String::new(), |v| format!(", started with version {v} complete"));
        let lost = a.work_lost_secs.map_or(String::new(), |s| format!(", {s:.1}s of work after the newest version"));
        let _ = write!(
            text,
            "\n  attempt {}: {} after {:.1}s{from}{lost}: {}",
            i + 1,
            a.outcome,
            a.seconds,
            a.command.join(" ")
        );
    }
    text
}

/// What `icheck run` needs besides the command.
pub struct RunOptions {
    /// Relaunches after the first attempt.
    pub max_restarts: u32,
    /// How the command changes from one attempt to the next.
    pub policy: Policy,
    /// Asks the controller for the application's newest complete version
    /// (None: no application named, or no service to ask).
    pub newest_version: Option<Box<dyn Fn() -> Option<u64> + Send + Sync>>,
    /// The service's client configuration, given to the job as
    /// ICHECK_CONFIG (None: the job's environment decides).
    pub config: Option<std::path::PathBuf>,
    /// Copies the application's newest version to the PFS (at the
    /// time-limit warning; None: no application named).
    pub flush: Option<Box<dyn Fn() -> Result<(), String> + Send + Sync>>,
    /// Pass SIGUSR1 on to the job too (for applications that commit on it).
    pub signal_job: bool,
}

/// Runs `command` under supervision; returns the attempts and whether the
/// relaunches ran out (or `Err` when interrupted or unable to start).
pub fn supervise(command: &[String], options: RunOptions) -> Result<(Vec<Attempt>, bool)> {
    if command.is_empty() {
        bail!("no command to run: give it after `--`, e.g. icheck run -- mpirun -np 4 ./app");
    }
    if options.policy == Policy::Shrink {
        relaunch_command(command, options.policy, 0).map_err(anyhow::Error::msg)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(supervise_async(command, options))
}

async fn supervise_async(command: &[String], options: RunOptions) -> Result<(Vec<Attempt>, bool)> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    // Slurm's time-limit warning (`sbatch --signal=USR1@120`) and other
    // signals meant for the application: passed on to the job.
    let mut user1 = signal(SignalKind::user_defined1())?;
    let mut user2 = signal(SignalKind::user_defined2())?;
    let newest = options.newest_version.map(std::sync::Arc::from);
    let flush: Option<std::sync::Arc<dyn Fn() -> Result<(), String> + Send + Sync>> =
        options.flush.map(std::sync::Arc::from);
    let ask = |newest: &Option<std::sync::Arc<dyn Fn() -> Option<u64> + Send + Sync>>| {
        let newest = newest.clone();
        async move {
            match newest {
                Some(f) => tokio::task::spawn_blocking(move || f()).await.ok().flatten(),
                None => None,
            }
        }
    };
    let mut attempts = Vec::new();
    let mut warned = false;
    loop {
        let failures = attempts.len() as u32;
        let next = relaunch_command(command, options.policy, failures).map_err(anyhow::Error::msg)?;
        let restarted_from = ask(&newest).await;
        if failures > 0 {
            eprintln!(
                "icheck run: relaunching (attempt {} of at most {}){}: {}",
                failures + 1,
                options.max_restarts + 1,
                restarted_from.map_or(String::new(), |v| format!(" from version {v}")),
                next.join(" ")
            );
        }
        let started = Instant::now();
        let mut launch = tokio::process::Command::new(&next[0]);
        launch.args(&next[1..]).process_group(0).kill_on_drop(false);
        if let Some(config) = &options.config {
            launch.env("ICHECK_CONFIG", config);
        }
        let mut child = launch.spawn().with_context(|| format!("cannot start `{}`", next[0]))?;
        let group = Pid::from_raw(child.id().context("the job has no process id")? as i32);
        // The newest version and when it was first seen complete: the
        // work after it is what a failure costs.
        let mut newest_seen: Option<(u64, Instant)> = restarted_from.map(|v| (v, started));
        let mut poll = tokio::time::interval(Duration::from_millis(500));
        let status = loop {
            tokio::select! {
                status = child.wait() => break status?,
                _ = poll.tick(), if newest.is_some() => {
                    if let Some(v) = ask(&newest).await {
                        if newest_seen.is_none_or(|(seen, _)| v > seen) {
                            newest_seen = Some((v, Instant::now()));
                        }
                    }
                }
                _ = interrupt.recv() => {
                    stop(&mut child, group, Signal::SIGINT).await;
                    eprintln!("icheck run: interrupted; stopped the job, no relaunch");
                    std::process::exit(EXIT_INTERRUPTED);
                }
                _ = terminate.recv() => {
                    stop(&mut child, group, Signal::SIGTERM).await;
                    eprintln!("icheck run: terminated; stopped the job, no relaunch");
                    std::process::exit(EXIT_INTERRUPTED);
                }
                _ = user1.recv() => {
                    warned = true;
                    eprintln!("icheck run: SIGUSR1 (the time-limit warning?): the job will not be relaunched");
                    if options.signal_job {
                        let _ = killpg(group, Signal::SIGUSR1);
                    }
                    if let Some(flush) = flush.clone() {
                        match tokio::task::spawn_blocking(move || flush()).await {
                            Ok(Ok(())) => eprintln!("icheck run: the newest version is being copied to the PFS"),
                            Ok(Err(why)) => eprintln!("icheck run: cannot copy the newest version to the PFS: {why}"),
                            Err(err) => eprintln!("icheck run: cannot copy the newest version to the PFS: {err}"),
                        }
                    }
                }
                _ = user2.recv() => {
                    let _ = killpg(group, Signal::SIGUSR2);
                }
            }
        };
        // Whatever of the job outlived its launcher goes with it.
        let _ = killpg(group, Signal::SIGKILL);
        let outcome = {
            use std::os::unix::process::ExitStatusExt;
            match (status.code(), status.signal()) {
                (Some(code), _) => Outcome::Exited(code),
                (None, Some(signal)) => Outcome::Signalled(signal),
                (None, None) => Outcome::Exited(-1),
            }
        };
        let ended = Instant::now();
        let work_lost_secs = (!outcome.succeeded()).then(|| {
            let since = newest_seen.map_or(started, |(_, at)| at);
            ended.duration_since(since).as_secs_f64()
        });
        attempts.push(Attempt {
            command: next,
            outcome,
            seconds: ended.duration_since(started).as_secs_f64(),
            restarted_from: if failures > 0 { restarted_from } else { None },
            work_lost_secs,
        });
        if outcome.succeeded() {
            return Ok((attempts, false));
        }
        eprintln!("icheck run: attempt {} failed ({outcome})", failures + 1);
        if warned {
            eprintln!("icheck run: not relaunching after the time-limit warning");
            return Ok((attempts, true));
        }
        if failures >= options.max_restarts {
            return Ok((attempts, true));
        }
    }
}

/// Passes `signal` to the job, then kills what is left of it.
async fn stop(child: &mut tokio::process::Child, group: Pid, signal: Signal) {
    let _ = killpg(group, signal);
    if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn shrink_lowers_the_count_wherever_the_launcher_takes_it() {
        let cases = [
            ("mpirun -np 4 ./app --n 4", 1, "mpirun -np 3 ./app --n 4"),
            ("mpirun --oversubscribe -n 4 python3 heat.py -n 9", 2, "mpirun --oversubscribe -n 2 python3 heat.py -n 9"),
            ("srun --ntasks=8 ./app", 3, "srun --ntasks=5 ./app"),
            ("srun --ntasks 8 ./app", 1, "srun --ntasks 7 ./app"),
            ("mpirun --np=6 ./app", 1, "mpirun --np=5 ./app"),
        ];
        for (command, failures, expected) in cases {
            assert_eq!(relaunch_command(&words(command), Policy::Shrink, failures), Ok(words(expected)), "{command}");
        }
    }

    #[test]
    fn same_and_rebuild_keep_the_command_and_shrink_explains_what_it_cannot_do() {
        let command = words("mpirun -np 4 ./app");
        assert_eq!(relaunch_command(&command, Policy::Same, 2), Ok(command.clone()));
        assert_eq!(relaunch_command(&command, Policy::Rebuild, 2), Ok(command.clone()));
        let err = relaunch_command(&words("./app -np 4"), Policy::Shrink, 1).unwrap_err();
        assert!(err.contains("names none") && err.contains("./app -np 4"), "{err}");
        let err = relaunch_command(&command, Policy::Shrink, 4).unwrap_err();
        assert!(err.contains("no process left after 4 failures of 4"), "{err}");
        let count = |command: &str| count_argument(&words(command)).map(|c| c.value);
        assert_eq!(count("srun -n 12 ./x"), Some(12));
        assert_eq!(count("mpirun --oversubscribe --bind-to none -np 4 ./x"), Some(4));
        assert_eq!(count("mpirun ./x -np 3"), None, "the application's own -np is not the launcher's");
        assert_eq!(count("./x -np 3"), None, "no launcher");
    }

    #[test]
    fn the_summary_counts_attempts_restored_versions_and_lost_work() {
        let attempt = |outcome, from, lost| Attempt {
            command: words("mpirun -np 4 ./app"),
            outcome,
            seconds: 10.0,
            restarted_from: from,
            work_lost_secs: lost,
        };
        let text = summary(
            &[
                attempt(Outcome::Signalled(9), None, Some(2.5)),
                attempt(Outcome::Exited(1), Some(3), Some(1.0)),
                attempt(Outcome::Exited(0), Some(5), None),
            ],
            false,
        );
        assert!(text.starts_with("icheck run: the job succeeded after 3 attempt(s), 2 failure(s)"), "{text}");
        assert!(text.contains("restarts from version(s) 3, 5") && text.contains("work lost 3.5s"), "{text}");
        assert!(text.contains("attempt 1: signal 9 after 10.0s"), "{text}");
        let gave_up = summary(&[attempt(Outcome::Exited(1), None, Some(1.0))], true);
        assert!(gave_up.starts_with("icheck run: gave up: the job still fails after 1 attempt(s)"), "{gave_up}");
    }
}
