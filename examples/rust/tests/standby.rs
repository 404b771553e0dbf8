//! A standby controller takes over without losing a version or splitting
//! the brain: real daemons (`icheck up --standby`), real `mpirun` jobs (the
//! partition test, on namespaced controllers, is in `multi_host.rs`). The jobs use a client configuration without a PFS, so
//! whatever they restore came from agent memory.

mod common;

use std::time::{Duration, Instant};

use common::{committed, primaries, records, restored, wait_for_more_commits, Job};
use icheck_core::control::BlockingConnection;
use icheck_core::protocol::{ClientReply, ClientRequest};
use icheck_service::testkit::{icheck_in_target, poll_until, process_running, process_stopped, LocalService};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The takeover window the services below run with (`--takeover-after`).
const WINDOW: Duration = Duration::from_secs(3);

fn service(name: &str) -> LocalService {
    LocalService::up(&icheck_in_target(), name, 2, &["--provider", "tcp", "--standby", "--takeover-after", "3"])
}

fn signal(pid: u32, signal: Signal) {
    kill(Pid::from_raw(pid as i32), signal).unwrap_or_else(|e| panic!("{signal} to {pid}: {e}"));
}

/// The restart of a killed job restores bit-exact the newest version the
/// controller recorded when the job died (`recorded`, read from its status
/// after the kill), or the next one if a record was still on its way; never
/// one older than the job printed as complete (`told`: the job's output is
/// relayed by mpirun, which may lose its last lines when it is killed).
///
/// The job was killed in the middle of a transfer: an agent pulling from a
/// dead rank waits out the fabric's stall bound, then stops and is
/// replaced. A restart registered within that window is handed the doomed
/// agent (a limit of the library's init, not of the standby), so the
/// restart waits the bound out first.
fn restart_restores(config: &std::path::Path, app: &str, told: u64, recorded: u64) {
    let stall = icheck_core::fabric::TransferOptions::default().timeout;
    std::thread::sleep(stall + Duration::from_secs(2));
    let restart = ["--app", app, "--steps", "0", "--every", "1", "--mib", "4"];
    let lines = Job::start(4, config, &restart, &[]).finish(Duration::from_secs(120));
    let back = restored(&lines).unwrap_or_else(|| panic!("no restart after version {told}: {lines:?}"));
    assert!(back >= told, "told {told}, restored {back}: {lines:?}");
    assert!(back == recorded || back == recorded + 1, "recorded {recorded}, restored {back}: {lines:?}");
}

/// The newest complete version of `app` the primary has recorded.
fn recorded_latest(service: &LocalService, app: &str) -> u64 {
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == app).expect("the primary knows the app");
    app.latest.as_ref().map_or(0, |l| l.version)
}

/// The primary is SIGKILLed while a 4-rank job commits in a loop: the
/// standby takes over within the window (plus the time to find the primary
/// unreachable), the job goes on committing without a failed commit, the
/// status names the new primary at epoch 2, and a restart restores the
/// newest complete version bit-exact.
#[test]
fn the_primary_killed_mid_commits_the_standby_takes_over_and_the_job_goes_on() {
    let service = service("standby-kill");
    let config = service.config_without_pfs();
    let standby = service.config.controller_endpoints()[1].clone();
    let args = ["--app", "killp", "--steps", "100000", "--every", "1", "--mib", "4", "--step-ms", "20"];
    let mut job = Job::start(4, &config, &args, &[]);
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    let primary = service.pid_of("controller");
    signal(primary, Signal::SIGKILL);
    let killed = Instant::now();
    assert!(poll_until(Duration::from_secs(10), || !process_running(primary)));
    let before = committed(&job.lines()).last().copied().unwrap_or(5);

    let took_over = poll_until(WINDOW * 4, || {
        primaries(&service.config).iter().any(|(peer, epoch)| *peer == standby && *epoch == 2)
    });
    assert!(took_over, "the standby did not take over; its log:\n{}", service.log("standby.log"));
    let takeover = killed.elapsed();
    assert!(takeover < WINDOW * 3, "takeover took {takeover:?}");
    let last = wait_for_more_commits(&job, before, 5, Duration::from_secs(60));
    let output = job.output();
    assert!(!output.contains("commit failed"), "a commit failed across the takeover:\n{output}");

    let status = service.status();
    let controller = status.controller.expect("the controller reports itself");
    assert_eq!((controller.address.as_str(), controller.epoch, controller.takeovers), (standby.as_str(), 2, 1));
    assert!(controller.took_over_unix_ms.is_some() && controller.lease, "{controller:?}");
    let app = status.apps.iter().find(|a| a.registration.name == "killp").expect("the new primary knows the app");
    assert!(app.latest.as_ref().is_some_and(|l| l.version >= last), "{app:?}");

    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");
    restart_restores(&config, "killp", told, recorded_latest(&service, "killp"));
}

/// The primary is SIGSTOPped past the window while a job commits, then
/// continued: the standby took over meanwhile; the old primary, on waking,
/// records no version and accepts no registration (requests queued while
/// it was stopped included), steps down, and follows the new primary as
/// its standby. One primary answers; the job's data stays consistent.
#[test]
fn a_primary_paused_past_the_window_records_nothing_when_it_wakes_and_steps_down() {
    let service = service("standby-stop");
    let config = service.config_without_pfs();
    let args = ["--app", "stopp", "--steps", "100000", "--every", "1", "--mib", "4", "--step-ms", "20"];
    let mut job = Job::start(4, &config, &args, &[]);
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    // A client connected before the pause whose request (a version far
    // ahead of the job's) reaches the primary while it is stopped: it is
    // read only when the primary wakes, and must not be recorded.
    let (mut early, _) = BlockingConnection::connect_controller(
        &service.config.controller_endpoint(),
        &service.config.effective_token(),
        Duration::from_secs(5),
        0,
    )
    .expect("the primary answers");
    early.set_timeout(Duration::from_secs(120));
    let primary = service.pid_of("controller");
    signal(primary, Signal::SIGSTOP);
    assert!(poll_until(Duration::from_secs(5), || process_stopped(primary)), "SIGSTOP did not stop the primary");
    let recorded_before = records(&service.log("controller.log"));
    // The job's own capability: what is refused below is refused for the lease.
    let capability = icheck_service::testkit::kept_capability(&service.config, "stopp").expect("the job kept it");
    let queued = std::thread::spawn(move || {
        let ghost = ClientRequest::VersionComplete {
            name: "stopp".into(),
            version: 1_000_000,
            bytes: 1,
            commit_secs: 0.0,
            spilled: false,
            epoch: 0,
            agents: Vec::new(),
            capability,
            transfer: None,
        };
        early.call::<_, ClientReply>(&ghost)
    });
    let paused = committed(&job.lines()).last().copied().unwrap_or(5);

    // Commits go on through the new primary while the old one sleeps
    // (a commit whose request waits on the stopped primary moves over
    // once its bounded wait ends).
    let during = wait_for_more_commits(&job, paused, 3, Duration::from_secs(60));
    // A registration while the old primary is stopped goes to the new one.
    let other = ["--app", "stopq", "--steps", "2", "--every", "1", "--mib", "1", "--persist"];
    let lines = Job::start(2, &config, &other, &[]).finish(Duration::from_secs(60));
    assert!(lines.iter().any(|l| l == "DONE") && !committed(&lines).is_empty(), "{lines:?}");

    signal(primary, Signal::SIGCONT);
    match queued.join().expect("the queued request's thread") {
        Ok(ClientReply::NotPrimary(reason)) => assert!(reason.contains("epoch 1"), "{reason}"),
        Ok(other) => panic!("the woken primary answered a request queued while it was stopped: {other:?}"),
        Err(err) => panic!("no answer to the queued request: {err}"),
    }
    let stepped_down = poll_until(WINDOW * 4, || service.log("controller.log").contains("stepping down to standby"));
    assert!(stepped_down, "the woken primary did not step down:\n{}", service.log("controller.log"));
    let after = wait_for_more_commits(&job, during, 3, Duration::from_secs(60));
    assert!(after > during);
    // The woken primary recorded nothing, and it follows the new one.
    assert!(poll_until(WINDOW * 4, || service.status().controller.is_some_and(|c| c.standby.is_some())));
    assert_eq!(records(&service.log("controller.log")), recorded_before, "{}", service.log("controller.log"));
    let answering = primaries(&service.config);
    assert_eq!(answering.len(), 1, "{answering:?}");
    assert_eq!(answering[0].1, 2, "{answering:?}");
    let app = service.status().apps.into_iter().find(|a| a.registration.name == "stopp").expect("the app");
    assert!(app.latest.as_ref().is_some_and(|l| l.version < 1_000_000), "{app:?}");

    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");
    restart_restores(&config, "stopp", told, recorded_latest(&service, "stopp"));
}
