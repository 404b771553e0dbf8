//! The fault campaign, short and seeded, as a test: real daemons and real
//! `mpirun` jobs, one fault per round; it must lose no version and never
//! hang. `fault-campaign --faults 200` is the long run (README).

use std::process::Command;

/// How long a short campaign may run (they take 40-75 s on two cores):
/// past it the campaign is taken as hung, and killed with its service and
/// job well before the test runner's own ten minutes (which would kill
/// this test alone and leave the service's daemons, in sessions of their
/// own, running).
const CAMPAIGN_BOUND: std::time::Duration = std::time::Duration::from_secs(480);

/// Runs `fault-campaign` with `args` and checks its invariants; returns its
/// output. Whatever of its service and job is still running when this
/// returns or fails is killed ([`Leftovers`]).
fn campaign(args: &[&str], rounds: u32) -> String {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_fault-campaign"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fault-campaign");
    let stdout = icheck_service::testkit::read_in_background(child.stdout.take().expect("piped"));
    let stderr = icheck_service::testkit::read_in_background(child.stderr.take().expect("piped"));
    let status = icheck_service::testkit::wait_or_kill(&mut child, CAMPAIGN_BOUND);
    // Its service's directory is named after its pid (`LocalService::up`);
    // a campaign killed at the bound left it with its configuration.
    let _leftovers =
        Leftovers::of(&std::env::temp_dir().join(format!("icheck-test-campaign-{}", child.id())), child.id());
    let (stdout, stderr) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
    let status =
        status.unwrap_or_else(|| panic!("still running after {CAMPAIGN_BOUND:?} (a hang):\n{stdout}\n{stderr}"));
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("| rounds (one fault each) | {rounds} |")), "{stdout}");
    assert!(stdout.contains("| versions lost (must be 0) | 0 |"), "{stdout}");
    assert!(stdout.contains("| hangs (must be 0) | 0 |"), "{stdout}");
    assert!(stdout.contains("| status not matching what runs, after healing (must be 0) | 0 |"), "{stdout}");
    assert!(stdout.contains("| newest versions left unprotected, after healing (must be 0) | 0 |"), "{stdout}");
    let verified: u32 = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("| versions verified bit-exact after a fault | ")?.strip_suffix(" |")?.parse().ok()
        })
        .expect("the table counts verified versions");
    assert!(verified >= rounds / 2, "too few restarts were checked:\n{stdout}");
    stdout
}

#[test]
fn a_short_seeded_fault_campaign_loses_no_version_and_never_hangs() {
    campaign(&["--faults", "10", "--seed", "11"], 10);
}

/// With a standby controller: takeovers (the primary killed, and stopped
/// past the window) mixed with kills of the controller process whatever
/// its role and of managers; seed 5 draws both kinds of takeover.
#[test]
fn a_short_campaign_with_takeovers_loses_no_version_and_never_hangs() {
    let kinds = "takeover: kill primary,takeover: stop primary,kill controller,kill manager";
    let stdout = campaign(&["--faults", "6", "--seed", "5", "--standby", "--kinds", kinds], 6);
    for kind in ["takeover: kill primary", "takeover: stop primary"] {
        let drawn = stdout.lines().any(|l| l.starts_with(&format!("| faults: {kind} | ")) && !l.contains("| 0 |"));
        assert!(drawn, "seed 5 no longer draws a {kind}:\n{stdout}");
    }
}

/// Under `rs:2+1` without PFS copies: lost nodes (a manager killed and its
/// store deleted) and killed managers (store intact). The version
/// protected at a loss, and every complete one after a manager kill, must
/// come back bit-exact from the other nodes' memory.
///
/// The controller protects one version at a time per application (a newer
/// one waits): before that, a debug build's protections piled up behind
/// the job and kept a manager busy after it, which failed the campaign's
/// busy-daemon check in CI.
#[test]
fn a_short_campaign_under_rs_2_1_loses_only_what_the_policy_allows() {
    let kinds = "lose node,kill manager";
    let stdout = campaign(&["--faults", "6", "--seed", "3", "--redundancy", "rs:2+1", "--kinds", kinds], 6);
    for kind in ["lose node", "kill manager"] {
        let drawn = stdout.lines().any(|l| l.starts_with(&format!("| faults: {kind} | ")) && !l.contains("| 0 |"));
        assert!(drawn, "seed 3 no longer draws a {kind}:\n{stdout}");
    }
}

/// The job on the other paths: asynchronous commits (a version counts once
/// `wait` returned for it), SHMR mode (one segment per node), and steps
/// that rewrite one 1 MiB block in four. Each restart checks every block
/// against the step that last wrote it. Whether these commits move only
/// part of each version is not checked here: the campaign measures that
/// for blocking commits (the test below), and in the SHMR node segment the
/// second rank's data does not start on a block boundary.
#[test]
fn a_short_campaign_of_async_shmr_partly_changed_commits_loses_no_version() {
    let stdout = campaign(
        &[
            "--faults",
            "8",
            "--seed",
            "1205",
            "--async",
            "--mode",
            "shmr",
            "--change-one-block-in",
            "4",
            "--size",
            "8MiB",
        ],
        8,
    );
    assert!(stdout.contains("mode shmr, async commits, one block in 4 rewritten per step"), "{stdout}");
}

/// Blocking commits that rewrite one 1 MiB block in four: the campaign's
/// table must show that they moved part of each version (incremental
/// commits), not whole ones. Until 2026-12-05 the job's data sat behind
/// an 8-byte label, every rewritten block straddled two of the version's,
/// and every such commit moved everything; nothing noticed.
#[test]
fn a_short_campaign_of_partly_changed_blocking_commits_moves_part_of_each_version() {
    let stdout = campaign(&["--faults", "6", "--seed", "1206", "--change-one-block-in", "4", "--size", "8MiB"], 6);
    let row = "| rank 0's blocking commits: share of its bytes moved, median; commits that moved everything | ";
    let median: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix(row)?.split('%').next()?.parse().ok())
        .unwrap_or_else(|| panic!("the table says what commits moved:\n{stdout}"));
    // One block in four, and the small step label: a quarter and a little.
    assert!(median < 40.0, "blocking commits moved {median}% of each version:\n{stdout}");
}

/// Ctrl-C during a campaign (SIGINT to the campaign alone: its daemons
/// left its session, as `icheck up --detach` starts them) stops the
/// service and the job it started and removes the service's directory,
/// and the campaign exits as a shell expects of an interrupted command
/// (130). Before, the campaign died at once and left its three daemons
/// running, their stores in memory.
#[test]
fn an_interrupted_campaign_stops_its_service_and_its_job() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let mut campaign = Command::new(env!("CARGO_BIN_EXE_fault-campaign"))
        .args(["--faults", "5", "--seed", "11"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fault-campaign");
    let dir = std::env::temp_dir().join(format!("icheck-test-campaign-{}", campaign.id()));
    // The first round's line comes once the service is up and a job runs.
    let (lines, seen) = std::sync::mpsc::channel();
    let stdout = campaign.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut printed = Vec::new();
    while !printed.iter().any(|l: &String| l.starts_with("round 0:")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match seen.recv_timeout(left) {
            Ok(line) => printed.push(line),
            Err(_) => {
                let _ = campaign.kill();
                panic!("no first round within 120 s:\n{}", printed.join("\n"));
            }
        }
    }
    let leftovers = Leftovers::of(&dir, campaign.id());
    let before = leftovers.running();
    assert!(before.len() >= 3, "the controller and two managers run, and the job: {before:?}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(campaign.id() as i32), nix::sys::signal::Signal::SIGINT)
        .expect("signal the campaign");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = campaign.try_wait().expect("wait for the campaign") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = campaign.kill();
            panic!("the campaign did not end within 60 s of SIGINT");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut campaign.stderr.take().expect("piped"), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopping the service in"), "{stderr}");
    // Each daemon stopped on `icheck down`'s SIGTERM, as it does when an
    // administrator stops the service, not by the SIGKILL after its grace.
    assert!(stderr.contains("icheck down: stopping manager-local-1"), "{stderr}");
    assert!(!stderr.contains("ignored SIGTERM"), "{stderr}");
    let left = leftovers.running();
    assert!(left.is_empty(), "still running after the interrupt: {left:?}\n{stderr}");
    assert!(!dir.exists(), "{} is left behind", dir.display());
    let store = leftovers.store.as_ref().expect("the configuration names the agents' store");
    assert!(!store.exists(), "the agents' store {} is left behind", store.display());
}

/// The processes and files of a campaign's service and job, found by its
/// state directory; whatever is still there when this drops (a failed
/// assertion) is killed by PID and removed.
struct Leftovers {
    dir: std::path::PathBuf,
    /// The service's store (`AgentStoreDir` of its configuration).
    store: Option<std::path::PathBuf>,
    /// Prefix of the jobs' Open MPI shm directories (`testkit::mpirun`).
    mpi_shm: String,
}

impl Leftovers {
    fn of(dir: &std::path::Path, campaign: u32) -> Leftovers {
        let config = std::fs::read_to_string(dir.join("icheck.toml")).unwrap_or_default();
        let store = config.lines().find_map(|l| {
            let value = l.strip_prefix("AgentStoreDir")?.trim_start().strip_prefix('=')?.trim();
            Some(std::path::PathBuf::from(value.trim_matches('"')))
        });
        Leftovers { dir: dir.to_path_buf(), store, mpi_shm: format!("icheck-campaign-mpi-{campaign}-") }
    }

    /// Live processes naming the state directory on their command line
    /// (daemons: `--config DIR/icheck.toml`; mpirun and the ranks:
    /// `--rank-of DIR/...`). A zombie has ended: its parent reaps it.
    fn running(&self) -> Vec<u32> {
        let needle = self.dir.to_string_lossy().into_owned();
        let procs = std::fs::read_dir("/proc").expect("read /proc");
        procs
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                icheck_service::testkit::process_running(*pid) && String::from_utf8_lossy(&cmdline).contains(&needle)
            })
            .collect()
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        for pid in self.running() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(store) = &self.store {
            let _ = std::fs::remove_dir_all(store);
        }
        for entry in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&self.mpi_shm) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}
