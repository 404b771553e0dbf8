//! `icheck run` supervising real `mpirun` jobs of the Python heat1d
//! example against a real local service: ranks killed at random are
//! relaunched from the newest version to the fault-free result, a shrink
//! continues with fewer processes, and running out of relaunches ends with
//! the documented exit status.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::python::Venv;
use icheck_service::testkit::{icheck_in_target, kill_process_tree, process_tree, LocalService};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Arguments of a heat1d run long enough to be killed in (6 s or so).
fn heat1d(venv: &Venv, app: &str) -> Vec<String> {
    let script = common::install::repo().join("examples/python/heat1d.py");
    [
        venv.python().to_string_lossy().as_ref(),
        script.to_string_lossy().as_ref(),
        "--app",
        app,
        "--n",
        "4000",
        "--iters",
        "400",
        "--every",
        "20",
        "--step-ms",
        "15",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn mpirun(np: u32) -> Vec<String> {
    ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &np.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// `icheck run` in the foreground, its output collected line by line.
struct Supervisor {
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Supervisor {
    fn start(service: &LocalService, run_args: &[&str], job: &[String]) -> Supervisor {
        let shm = service.dir.join("mpi-shm");
        std::fs::create_dir_all(&shm).unwrap();
        let mut child = Command::new(&service.icheck)
            .arg("run")
            .arg("--state-dir")
            .arg(&service.dir)
            .args(run_args)
            .arg("--")
            .args(job)
            // The job finds the service through --state-dir alone.
            .env_remove("ICHECK_CONFIG")
            .env("OMPI_MCA_btl_vader_backing_directory", &shm)
            // And the session directories of the jobs it kills.
            .env("OMPI_MCA_orte_tmpdir_base", &shm)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("icheck run starts");
        let (stdout, stderr) = common::collect_output(&mut child);
        Supervisor { child, stdout, stderr }
    }

    fn lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Waits until `count` lines start with `prefix`.
    fn wait_for(&self, prefix: &str, count: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.lines().iter().filter(|l| l.starts_with(prefix)).count() < count {
            assert!(Instant::now() < deadline, "no {count} x {prefix:?} in {:?}\n{}", self.lines(), self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// SIGKILLs one of the job's Python ranks (a descendant of this
    /// supervisor, so a process the test started), chosen by `pick`.
    fn kill_a_rank(&self, pick: usize) {
        let ranks = process_tree(self.child.id())
            .into_iter()
            .skip(1)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains("heat1d.py"))
            })
            .collect::<Vec<_>>();
        assert!(!ranks.is_empty(), "no rank to kill under {}", self.child.id());
        let victim = ranks[pick % ranks.len()];
        kill(Pid::from_raw(victim as i32), Signal::SIGKILL).unwrap();
    }

    fn finish(mut self, timeout: Duration) -> (i32, Vec<String>, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(200)); // the readers drain
                return (status.code().unwrap_or(-1), self.lines(), self.stderr());
            }
            if Instant::now() > deadline {
                kill_process_tree(self.child.id());
                panic!("icheck run did not end: {:?}\n{}", self.lines(), self.stderr());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // The job too: `icheck run` starts it in a process group of its own,
        // so killing the supervisor alone (a failed test) would leave it
        // running against a stopped service. Only while it runs: once
        // reaped, its pid may be another process's.
        if matches!(self.child.try_wait(), Ok(None)) {
            kill_process_tree(self.child.id());
        }
        let _ = self.child.wait();
    }
}

fn checksum(lines: &[String]) -> Option<String> {
    lines.iter().find_map(|l| l.strip_prefix("CHECKSUM ").map(str::to_string))
}

/// A pseudo-random pause and pick from the clock: the kills land at
/// different points each run.
fn random_below(limit: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    u64::from(nanos) % limit
}

fn fault_free(venv: &Venv, service: &LocalService, np: u32) -> String {
    let mut job = mpirun(np);
    job.extend(heat1d(venv, &format!("clean-{np}")));
    let supervisor = Supervisor::start(service, &[], &job);
    let (code, lines, stderr) = supervisor.finish(Duration::from_secs(120));
    assert_eq!(code, 0, "{lines:?}\n{stderr}");
    checksum(&lines).unwrap_or_else(|| panic!("{lines:?}"))
}

#[test]
fn a_job_killed_twice_at_random_is_relaunched_to_the_fault_free_result() {
    let venv = Venv::with_icheck("run-same");
    let service = LocalService::up(&icheck_in_target(), "run-same", 2, &["--provider", "tcp"]);
    let expected = fault_free(&venv, &service, 4);
    let mut job = mpirun(4);
    job.extend(heat1d(&venv, "twice"));
    let supervisor = Supervisor::start(&service, &["--app", "twice", "--max-restarts", "3"], &job);
    for attempt in 1..=2 {
        // Killed somewhere after the attempt's first or second commit.
        supervisor.wait_for("COMMITTED", 2 * attempt, Duration::from_secs(120));
        std::thread::sleep(Duration::from_millis(random_below(1500)));
        supervisor.kill_a_rank(random_below(4) as usize);
        supervisor.wait_for("RESTARTED at iteration", attempt, Duration::from_secs(120));
    }
    let (code, lines, stderr) = supervisor.finish(Duration::from_secs(180));
    assert_eq!(code, 0, "{lines:?}\n{stderr}");
    assert_eq!(checksum(&lines), Some(expected), "{lines:?}");
    assert!(stderr.contains("the job succeeded after 3 attempt(s), 2 failure(s)"), "{stderr}");
    assert!(stderr.contains("restarts from version(s) "), "{stderr}");
}

#[test]
fn shrink_continues_with_one_process_fewer_after_a_rank_is_lost() {
    let venv = Venv::with_icheck("run-shrink");
    let service = LocalService::up(&icheck_in_target(), "run-shrink", 2, &["--provider", "tcp"]);
    // heat1d's result does not depend on the process count.
    let expected = fault_free(&venv, &service, 4);
    let mut job = mpirun(4);
    job.extend(heat1d(&venv, "shrunk"));
    let supervisor =
        Supervisor::start(&service, &["--app", "shrunk", "--policy", "shrink", "--max-restarts", "1"], &job);
    supervisor.wait_for("COMMITTED", 2, Duration::from_secs(120));
    supervisor.kill_a_rank(random_below(4) as usize);
    let (code, lines, stderr) = supervisor.finish(Duration::from_secs(180));
    assert_eq!(code, 0, "{lines:?}\n{stderr}");
    assert!(lines.iter().any(|l| l.starts_with("RESTARTED at iteration")), "{lines:?}");
    assert_eq!(checksum(&lines), Some(expected), "{lines:?}");
    assert!(stderr.contains("attempt 2: exit status 0") && stderr.contains("-np 3 "), "{stderr}");
}

#[test]
fn running_out_of_relaunches_ends_with_the_documented_status() {
    let venv = Venv::with_icheck("run-give-up");
    let service = LocalService::up(&icheck_in_target(), "run-give-up", 1, &["--provider", "tcp"]);
    let mut job = mpirun(2);
    job.extend(heat1d(&venv, "doomed"));
    let supervisor = Supervisor::start(&service, &["--app", "doomed", "--max-restarts", "1"], &job);
    supervisor.wait_for("COMMITTED", 1, Duration::from_secs(120));
    supervisor.kill_a_rank(0);
    supervisor.wait_for("RESTARTED at iteration", 1, Duration::from_secs(120));
    supervisor.kill_a_rank(1);
    let (code, lines, stderr) = supervisor.finish(Duration::from_secs(120));
    assert_eq!(code, 3, "icheck run gives up with status 3: {lines:?}\n{stderr}");
    assert!(stderr.contains("gave up: the job still fails after 2 attempt(s), 2 failure(s)"), "{stderr}");
    assert!(checksum(&lines).is_none(), "{lines:?}");
}

/// Slurm's time-limit warning (SIGUSR1 to the batch script, here to
/// `icheck run` directly): the newest version is copied to the PFS while
/// the job runs on, and a failure after it is not relaunched.
#[test]
fn the_time_limit_warning_flushes_the_newest_version_and_ends_the_relaunching() {
    let venv = Venv::with_icheck("run-warned");
    let service = LocalService::up(&icheck_in_target(), "run-warned", 1, &["--provider", "tcp"]);
    let mut job = mpirun(2);
    job.extend(heat1d(&venv, "warned"));
    let supervisor = Supervisor::start(&service, &["--app", "warned", "--max-restarts", "3"], &job);
    supervisor.wait_for("COMMITTED", 2, Duration::from_secs(120));
    kill(Pid::from_raw(supervisor.child.id() as i32), Signal::SIGUSR1).unwrap();
    let pfs = service.dir.join("pfs/warned");
    icheck_service::testkit::wait_for("a version of the warned job on the PFS", Duration::from_secs(60), || {
        std::fs::read_dir(&pfs).into_iter().flatten().flatten().any(|v| v.path().join("MANIFEST").exists())
    });
    assert!(!supervisor.lines().iter().any(|l| l.starts_with("CHECKSUM")), "the job runs on after the warning");
    supervisor.kill_a_rank(0);
    let (code, lines, stderr) = supervisor.finish(Duration::from_secs(120));
    assert_eq!(code, 3, "{lines:?}\n{stderr}");
    assert!(stderr.contains("the newest version is being copied to the PFS"), "{stderr}");
    assert!(stderr.contains("not relaunching after the time-limit warning"), "{stderr}");
}
