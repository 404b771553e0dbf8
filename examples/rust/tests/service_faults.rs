//! Faults that used to take a checkpoint node or a version out of service,
//! each reproduced against real daemons (`icheck up`) and real MPI jobs.
//! Every test is bounded in count and time and stays on loopback.

mod common;

use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use common::Job;
use icheck_core::testkit::{icheck_in_target, poll_until, LocalService};

fn service(name: &str, managers: u32) -> LocalService {
    LocalService::up(&icheck_in_target(), name, managers, &["--provider", "tcp"])
}

/// Open descriptors and threads of a process, from /proc.
fn descriptors_and_threads(pid: u32) -> (usize, usize) {
    let count = |what: &str| std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join(what)).unwrap().count();
    (count("fd"), count("task"))
}

/// Connects and closes at once with a reset, as a port scanner does (and
/// leaving no TIME_WAIT behind on this side, so 20,000 of them do not use up
/// the loopback's ephemeral ports).
fn connect_and_reset(address: &str) {
    use nix::sys::socket::{setsockopt, sockopt::Linger};
    let stream = TcpStream::connect(address).unwrap();
    setsockopt(&stream, Linger, &nix::libc::linger { l_onoff: 1, l_linger: 0 }).unwrap();
}

/// Item 1 of the faults issue: an agent's command port kept a descriptor per
/// connection forever and a thread per idle socket for 600 s.
#[test]
fn agent_port_floods_leave_no_descriptors_or_threads_behind() {
    let service = service("faults-flood", 1);
    let config = service.config_path();
    let args = ["--app", "flood", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let agent = service.status().apps[0].agents[0].control.clone();
    let manager = service.pid_of("manager-local-1");
    let (fds_before, threads_before) = descriptors_and_threads(manager);

    for _ in 0..20_000 {
        connect_and_reset(&agent);
    }
    let idle: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(&agent).unwrap()).collect();
    std::thread::sleep(Duration::from_secs(1));
    let (_, threads_idle) = descriptors_and_threads(manager);
    assert!(
        threads_idle <= threads_before + 4,
        "1,000 idle sockets hold {} threads of the manager",
        threads_idle - threads_before
    );
    // The agent closes sockets that never say Hello, while their peers still hold them.
    let settled = poll_until(Duration::from_secs(20), || descriptors_and_threads(manager).0 <= fds_before + 4);
    let (fds_idle, _) = descriptors_and_threads(manager);
    assert!(settled, "the manager holds {fds_idle} descriptors with idle peers connected, {fds_before} before");
    drop(idle);
    let (fds_after, threads_after) = descriptors_and_threads(manager);
    assert!(
        fds_after <= fds_before + 4 && threads_after <= threads_before + 4,
        "descriptors {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}"
    );
    let log = service.log("manager-local-1.log");
    assert!(log.contains("too many connections without a Hello"), "{log}");

    // The node still serves its application: restart, then commit again.
    let args = ["--app", "flood", "--steps", "6", "--every", "2", "--mib", "2"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=4 step=6")), "{lines:?}");
}
