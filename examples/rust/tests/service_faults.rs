//! Faults that used to take a checkpoint node or a version out of service,
//! each reproduced against real daemons (`icheck up`) and real MPI jobs.
//! Every test is bounded in count and time and stays on loopback.

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::{
    anonymous_resident_bytes, connect_and_reset, descriptor_targets, descriptors_and_threads, wait_for_lanes, Job,
    AGENT_DEBUG_LOG,
};
use icheck_service::testkit::{icheck_in_target, metric_sample, poll_until, process_running, LocalService};

fn service(name: &str, managers: u32) -> LocalService {
    LocalService::up(&icheck_in_target(), name, managers, &["--provider", "tcp"])
}

/// Runs `app` (2 ranks, `mib` MiB per rank) to version 3 and keeps its
/// agents and versions (IC_PERSIST) for the test to work on.
fn commit_three_persisted_versions(service: &LocalService, app: &str, mib: &str) {
    let args = ["--app", app, "--steps", "4", "--every", "2", "--mib", mib, "--persist"];
    let lines = Job::start(2, &service.config_path(), &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{app}: {lines:?}");
}

/// Item 1 of the faults issue: an agent's command port kept a descriptor per
/// connection forever and a thread per idle socket for 600 s.
#[test]
fn agent_port_floods_leave_no_descriptors_or_threads_behind() {
    let service = LocalService::up_with_env(
        &icheck_in_target(),
        "faults-flood",
        1,
        &["--provider", "tcp"],
        None,
        &AGENT_DEBUG_LOG,
    );
    let config = service.config_path();
    commit_three_persisted_versions(&service, "flood", "2");
    let agent = service.status().apps[0].agents[0].control.clone();
    let manager = service.pid_of("manager-local-1");
    // Counted before the agent's lanes were open, their 7 sockets and an
    // epoll descriptor read as left behind by the flood (4 of 4 runs
    // beside three busy loops, once in a suite run).
    wait_for_lanes(&service, "local-1", "flood", 2);
    let (fds_before, threads_before) = descriptors_and_threads(manager);
    let targets_before = descriptor_targets(manager);

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
    assert!(
        settled,
        "the manager holds {fds_idle} descriptors with idle peers connected, {fds_before} before\n\
         now: {:?}\nbefore: {targets_before:?}",
        descriptor_targets(manager)
    );
    drop(idle);
    let (fds_after, threads_after) = descriptors_and_threads(manager);
    assert!(
        fds_after <= fds_before + 4 && threads_after <= threads_before + 4,
        "descriptors {fds_before} -> {fds_after}, threads {threads_before} -> {threads_after}\n\
         now: {:?}\nbefore: {targets_before:?}",
        descriptor_targets(manager)
    );
    let log = service.log("manager-local-1.log");
    assert!(log.contains("too many connections without a Hello"), "{log}");

    // The node still serves its application: restart, then commit again.
    let args = ["--app", "flood", "--steps", "6", "--every", "2", "--mib", "2"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=4 step=6")), "{lines:?}");
}

/// An agent over tcp keeps an endpoint and a lane per rank open between
/// jobs. With libfabric's defaults each endpoint held 64 MiB of ofi_rxm
/// receive buffers for messages icheck never sends: a manager held 224 MiB
/// of anonymous memory for one application of two ranks of 2 MiB. The
/// daemons now post 128 buffers per endpoint (`DAEMON_PROVIDER_DEFAULTS`):
/// about 75 MiB.
#[test]
fn an_agents_endpoints_over_tcp_hold_little_memory_beside_its_versions() {
    let service = LocalService::up_with_env(
        &icheck_in_target(),
        "faults-rxbuf",
        1,
        &["--provider", "tcp"],
        None,
        &AGENT_DEBUG_LOG,
    );
    commit_three_persisted_versions(&service, "small", "2");
    wait_for_lanes(&service, "local-1", "small", 2);
    let manager = service.pid_of("manager-local-1");
    let anonymous = anonymous_resident_bytes(manager);
    assert!(
        anonymous < 128 << 20,
        "the manager holds {} MiB of anonymous memory for one application of 2 x 2 MiB",
        anonymous >> 20
    );
    // The manager reports the figure, for administrators to see beside the
    // checkpoint bytes: in status, /metrics and `icheck status`.
    let near = |reported: u64| reported > 0 && reported.abs_diff(anonymous_resident_bytes(manager)) < 16 << 20;
    let reported = || service.status().nodes[0].status.manager_anonymous_bytes;
    let seen = poll_until(Duration::from_secs(10), || near(reported()));
    assert!(seen, "status reports {} bytes, /proc {}", reported(), anonymous_resident_bytes(manager));
    let metric = "icheck_node_manager_anonymous_bytes{node=\"local-1\"}";
    let exported = poll_until(Duration::from_secs(10), || {
        metric_sample(&service.metrics(), metric).is_some_and(|v| near(v as u64))
    });
    assert!(exported, "{}", service.metrics());
    let out =
        std::process::Command::new(&service.icheck).args(["status", "--state-dir"]).arg(&service.dir).output().unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains("local-1: the manager's own memory"), "{printed}");
}

/// A small deterministic generator (xorshift64*), so the kill points are
/// the same in every run and a failure can be replayed.
struct Seeded(u64);

impl Seeded {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % bound
    }
}

/// Item 2 of the faults issue: an application killed in the middle of a
/// commit could leave its agent with a closed endpoint, still handed out as
/// alive, so every later run failed until the managers were restarted.
#[test]
fn applications_killed_at_random_points_of_commits_always_restart() {
    let service = service("faults-killed", 2);
    let config = service.config_path();
    let mut rng = Seeded(0x1c4e_c0de_2026);
    for round in 0..20 {
        let expected = service.status().apps.iter().find_map(|a| a.latest.as_ref().map(|l| l.version));
        let transfer = if round % 2 == 0 { "pull" } else { "push" };
        let args = ["--app", "killed", "--steps", "100000", "--every", "1", "--mib", "8"];
        let mut job = Job::start(4, &config, &args, &[("ICHECK_TRANSFER", transfer)]);
        let first = job.wait_line_any(&["FRESH", "RESTORED"], Duration::from_secs(60));
        match expected {
            None => assert_eq!(first, "FRESH", "round {round}: {}", job.output()),
            Some(version) => assert!(
                first.starts_with(&format!("RESTORED version={version} ")) && first.ends_with(" verified"),
                "round {round}: the controller's newest version is {version}, the run says {first:?}\n{}",
                job.output()
            ),
        }
        // Somewhere in the next few commits: mid-transfer, mid-seal, between.
        std::thread::sleep(Duration::from_millis(rng.below(1500)));
        job.kill();
    }
    let args = ["--app", "killed", "--steps", "0", "--every", "1", "--mib", "8"];
    let (ok, output) = Job::start(4, &config, &args, &[]).finish_any(Duration::from_secs(120));
    assert!(ok && output.contains(" verified"), "{output}");
    for node in ["local-1", "local-2"] {
        let log = service.log(&format!("manager-{node}.log"));
        assert!(!log.contains("panicked"), "{log}");
    }
}

/// Item 2, made deterministic: a rank that asks its agent to pull and then
/// never drives progress (a hung or stopped process) makes the agent's
/// transfer time out, which closes the agent's endpoint. That agent used to
/// stay "alive" for the controller and fail every later request; now it
/// ends, the controller learns it is lost, and the application's next run
/// gets a new agent on the same node, which serves the stored versions.
#[test]
fn an_agent_whose_rank_stops_responding_mid_commit_is_replaced() {
    use icheck_core::fabric::{Access, AlignedBuffer, Domain, Endpoint};
    use icheck_core::protocol::{AgentReply, AgentRequest, DataKind, LabelLayout, ProtocolError, PullSegment};

    let service = service("faults-hung", 1);
    let config = service.config_path();
    commit_three_persisted_versions(&service, "hung", "2");
    let agent = service.status().apps[0].agents[0].clone();

    // Rank 0 of "hung" begins version 4 and asks to be pulled from memory
    // that nothing in this process ever progresses.
    let domain = Domain::open(&service.config.fabric).unwrap();
    let endpoint = Endpoint::new(&domain).unwrap();
    let len = 4 << 20;
    let memory = endpoint.register(AlignedBuffer::zeroed(len), Access::REMOTE_READ).unwrap();
    let mut conn = common::open_own_session(&service, "hung", &agent.control, &endpoint, Duration::from_secs(60));
    let mut call = |request: &AgentRequest| conn.call::<_, AgentReply>(request).unwrap();
    let label = LabelLayout { label: "x".into(), kind: DataKind::Binary, offset: 0, len: len as u64, adapt: None };
    let begin = AgentRequest::Begin { version: 4, ranks: 2, epoch: 0, labels: vec![label], push: false };
    assert!(matches!(call(&begin), AgentReply::Target(_)));
    let segment = PullSegment { source: memory.remote(), source_offset: 0, file_offset: 0, len: len as u64 };
    // The agent answers that the pull timed out, or, if it ended first
    // (it stops as soon as its endpoint is closed), the connection closes.
    let answer = conn.call::<_, AgentReply>(&AgentRequest::Pull(vec![segment]));
    let timed_out = matches!(&answer, Ok(AgentReply::Error(message)) if message.contains("timed out"));
    let closed = matches!(
        &answer,
        Err(icheck_core::control::ServiceError::Protocol(ProtocolError::Closed | ProtocolError::Io(_)))
    );
    assert!(timed_out || closed, "{answer:?}");
    drop(conn);

    icheck_service::testkit::wait_for("the controller to learn the agent is lost", Duration::from_secs(10), || {
        service.log("controller.log").contains("agent thread died")
    });
    // The abandoned version 4 left no file behind.
    let rank_dir = service.config.agent_store_dir.join(&agent.node).join("hung/rank0");
    icheck_service::testkit::wait_for("the abandoned version's file to go", Duration::from_secs(10), || {
        !rank_dir.join("v4.data").exists()
    });

    let args = ["--app", "hung", "--steps", "6", "--every", "2", "--mib", "2"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=4 step=6")), "{lines:?}");
}

/// A tmpfs mounted for one test (the tests run as root), unmounted on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(name: &str, size: &str) -> Tmpfs {
        let dir = std::env::temp_dir().join(format!("icheck-test-{name}-tmpfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(status.success(), "mounting a {size} tmpfs on {} needs root", dir.display());
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Item 3 of the faults issue: a store on a full tmpfs killed the manager
/// with SIGBUS (a write into a mapped file the file system could not back),
/// and the restarted manager died again on the restart.
#[test]
fn a_full_store_spills_to_the_pfs_and_no_daemon_dies() {
    // Declared first, so it is unmounted after the service is down.
    let tmpfs = Tmpfs::mount("faults-full", "100m");
    // Another tenant of the file system already holds 40 of its 100 MiB.
    std::fs::write(tmpfs.0.join("other-tenant"), vec![1u8; 40 << 20]).unwrap();
    let store = tmpfs.0.join("store");
    let service = LocalService::up(
        &icheck_in_target(),
        "faults-full",
        1,
        &["--provider", "tcp", "--store-dir", store.to_str().unwrap()],
    );
    let daemons = [service.pid_of("controller"), service.pid_of("manager-local-1")];
    let config = service.config_path();
    let args = ["--app", "full", "--steps", "2", "--every", "2", "--mib", "64", "--persist"];
    let (ok, output) = Job::start(4, &config, &args, &[]).finish_any(Duration::from_secs(300));
    assert!(daemons.iter().all(|pid| process_running(*pid)), "a daemon died\n{}", service.log("manager-local-1.log"));
    assert!(ok && output.contains("COMMITTED version=2 step=2"), "{output}");
    let log = service.log("manager-local-1.log");
    // The budget (the file system's 100 MiB) has room for one rank; the
    // file system, with the other tenant's 40 MiB, has not: the reservation
    // fails, names the store, and that rank spills too.
    assert!(log.contains("spilling this version to the PFS") && log.contains("has no room for"), "{log}");
    assert!(log.contains(store.to_str().unwrap()), "{log}");
    assert!(
        service.dir.join("pfs/full/v2/MANIFEST").exists() || {
            poll_until(Duration::from_secs(60), || service.dir.join("pfs/full/v2/MANIFEST").exists())
        }
    );

    // The restart reads version 2 back (from the PFS, through memory outside the full store).
    let args = ["--app", "full", "--steps", "2", "--every", "2", "--mib", "64"];
    let (ok, output) = Job::start(4, &config, &args, &[]).finish_any(Duration::from_secs(300));
    assert!(
        ok && output.contains("RESTORED version=2 step=2 verified"),
        "{output}\n{}",
        service.log("manager-local-1.log")
    );
    assert!(daemons.iter().all(|pid| process_running(*pid)), "a daemon died\n{}", service.log("manager-local-1.log"));
}

/// Item 4 of the faults issue: with a copy to the PFS after every commit and
/// commits faster than the copies, agents pruned versions whose copies had
/// not run yet ("version N of rank R is not stored at this agent"), so the
/// PFS fell behind silently, and a restart after losing the agents' memory
/// went back further than it had to.
#[test]
fn fast_commits_never_lose_a_pfs_copy_half_way() {
    // Copies start 0.4 s late, as on a loaded node (they run at nice 19),
    // while versions complete every few tens of milliseconds.
    let mut service = LocalService::up_with_failpoints(
        &icheck_in_target(),
        "faults-copies",
        1,
        &["--provider", "tcp"],
        None,
        Some("manager.before_pfs_copy=sleep(400)"),
    );
    let config = service.config_path();
    // A partial version an earlier, killed writer left behind.
    let stale = service.dir.join("pfs/copies/v1.partial");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("rank0.data.tmp"), b"half a file").unwrap();
    let copies = [("ICHECK_PFS_INTERVAL", "1"), ("ICHECK_COMPRESSION", "zstd:3")];
    let args = ["--app", "copies", "--steps", "30", "--every", "1", "--mib", "16", "--step-ms", "20", "--persist"];
    let lines = Job::start(4, &config, &args, &copies).finish(Duration::from_secs(180));
    let newest = lines.iter().rev().find(|l| l.starts_with("COMMITTED")).cloned().unwrap();
    assert!(newest.starts_with("COMMITTED version=31 step=30"), "{lines:?}");
    // Every copy that started completes; none fails.
    let settled = poll_until(Duration::from_secs(60), || {
        let status = service.status();
        let app = &status.apps[0];
        // The newest version waited for the copy before it, then went too.
        app.pfs_version == Some(31) && service.dir.join("pfs/copies/v31/MANIFEST").exists()
    });
    // The copy under way when the run ended (if any) has time to end too.
    std::thread::sleep(Duration::from_secs(3));
    let status = service.status();
    let log = service.log("manager-local-1.log");
    assert!(settled, "{:?}\n{log}\n{}", status.apps[0], service.log("controller.log"));
    let controller_log = service.log("controller.log");
    assert!(!controller_log.contains("PFS copy failed"), "{controller_log}");
    let health = &status.apps[0].pfs_health;
    assert_eq!(health.failed, 0, "{health:?}");
    // Skipped copies are counted where operators look.
    let text = service.metrics();
    let skipped = icheck_service::testkit::metric_sample(&text, "icheck_app_pfs_copies_skipped_total{app=\"copies\"}");
    assert_eq!(skipped, Some(health.skipped as f64), "{text}");
    assert_eq!(
        icheck_service::testkit::metric_sample(&text, "icheck_app_pfs_copies_failed_total{app=\"copies\"}"),
        Some(0.0)
    );

    assert!(!stale.exists(), "the abandoned partial version was removed");

    // Agent memory gone: the restart comes from the newest PFS copy, bit-exact.
    service.relaunch();
    let newest_on_pfs = icheck_core::pfs::PfsStore::new(service.dir.join("pfs")).latest("copies").unwrap().unwrap();
    let args = ["--app", "copies", "--steps", "0", "--every", "1", "--mib", "16"];
    let (ok, output) = Job::start(4, &service.config_path(), &args, &[]).finish_any(Duration::from_secs(120));
    assert!(ok && output.contains(&format!("RESTORED version={newest_on_pfs} ")), "{output}");
    assert!(output.contains(" verified"), "{output}");
}

/// Item 4: a truncated PFS MANIFEST made the application start FRESH with no
/// error. Now the previous complete version is used and the controller says
/// why; with no readable version the registration fails naming the file.
#[test]
fn a_damaged_pfs_manifest_is_never_a_fresh_start() {
    let mut service = service("faults-manifest", 1);
    let copies = [("ICHECK_PFS_INTERVAL", "1")];
    // Slow steps: each copy completes before the next version.
    let args = ["--app", "mf", "--steps", "4", "--every", "2", "--mib", "2", "--step-ms", "400"];
    let lines = Job::start(2, &service.config_path(), &args, &copies).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let app_dir = service.dir.join("pfs/mf");
    poll_until(Duration::from_secs(30), || {
        app_dir.join("v3/MANIFEST").exists() && app_dir.join("v2/MANIFEST").exists()
    });
    // A new service: agent memory is gone, only the PFS is left.
    service.relaunch();
    let truncate = |version: u64| {
        let path = app_dir.join(format!("v{version}/MANIFEST"));
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    };
    truncate(3);
    let args = ["--app", "mf", "--steps", "2", "--every", "2", "--mib", "2"];
    let (ok, output) = Job::start(2, &service.config_path(), &args, &[]).finish_any(Duration::from_secs(120));
    assert!(ok && output.contains("RESTORED version=2 step=2 verified"), "{output}");
    let log = service.log("controller.log");
    assert!(log.contains("newest PFS version unusable") && log.contains("v3/MANIFEST"), "{log}");

    truncate(2);
    service.relaunch();
    let (ok, output) = Job::start(2, &service.config_path(), &args, &[]).finish_any(Duration::from_secs(120));
    assert!(!ok && !output.contains("FRESH"), "{output}");
    assert!(output.contains("none is readable") && output.contains("MANIFEST"), "{output}");
}

/// Flips one byte in the middle of rank 1's stored version `version`.
fn damage_stored_rank(service: &LocalService, app: &str, version: u64) {
    let status = service.status();
    let node = &status.apps.iter().find(|a| a.registration.name == app).unwrap().agents[0].node;
    let file = service.config.agent_store_dir.join(node).join(app).join(format!("rank1/v{version}.data"));
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
}

/// Item 5 of the faults issue: damaged data in agent memory failed the
/// restart although the PFS held a good copy, and the rank that found the
/// damage left the others waiting forever.
#[test]
fn damaged_agent_memory_falls_back_to_the_pfs_or_fails_on_every_rank() {
    let service = service("faults-corrupt", 1);
    let config = service.config_path();
    // With a PFS copy of every version (slow steps: each copy completes).
    let copies = [("ICHECK_PFS_INTERVAL", "1")];
    let args = ["--app", "cor", "--steps", "4", "--every", "2", "--mib", "4", "--step-ms", "400", "--persist"];
    let lines = Job::start(2, &config, &args, &copies).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    assert!(poll_until(Duration::from_secs(30), || service.dir.join("pfs/cor/v3/MANIFEST").exists()));
    damage_stored_rank(&service, "cor", 3);
    let args = ["--app", "cor", "--steps", "4", "--every", "2", "--mib", "4", "--persist"];
    let (ok, output) = Job::start(2, &config, &args, &[]).finish_any(Duration::from_secs(60));
    assert!(ok && output.contains("RESTORED version=3 step=4 verified"), "{output}");
    let log = service.log("manager-local-1.log");
    assert!(log.contains("stored version is damaged; using its PFS copy") && log.contains("chunk"), "{log}");

    // Without any PFS copy: every rank returns an error, nobody hangs.
    commit_three_persisted_versions(&service, "bare", "4");
    damage_stored_rank(&service, "bare", 3);
    let args = ["--app", "bare", "--steps", "4", "--every", "2", "--mib", "4", "--persist"];
    let (ok, output) = Job::start(2, &config, &args, &[]).finish_any(Duration::from_secs(60));
    assert!(!ok, "{output}");
    for rank in 0..2 {
        assert!(output.contains(&format!("rank {rank}: restart failed")), "rank {rank} did not return:\n{output}");
    }
    assert!(output.contains("stored version 3 of rank 1 is damaged"), "{output}");
}

/// The architecture issue's failpoint between the controller recording a
/// version and the agents' Complete: the controller dies right after it
/// recorded version 3. The application gets an error on every rank (nobody
/// hangs), and the agents, never told that version 3 is complete, still
/// hold version 2 beside it: retention only ever follows a Complete.
#[test]
fn a_controller_dying_after_recording_a_version_leaves_the_agents_both_versions() {
    let failpoints = "controller.after_record_version=2*exit(86)";
    let service = LocalService::up_with_failpoints(
        &icheck_in_target(),
        "faults-record",
        1,
        &["--provider", "tcp"],
        None,
        Some(failpoints),
    );
    let controller = service.pid_of("controller");
    let args = ["--app", "rec", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let (ok, output) = Job::start(2, &service.config_path(), &args, &[]).finish_any(Duration::from_secs(60));
    assert!(!ok, "{output}");
    assert!(output.contains("COMMITTED version=2") && !output.contains("COMMITTED version=3"), "{output}");
    assert_eq!(output.matches(": commit failed: ").count(), 2, "a rank did not return:\n{output}");
    assert!(output.contains("could not record it at the controller"), "{output}");
    assert!(poll_until(Duration::from_secs(10), || !process_running(controller)), "the controller did not die");
    assert!(service.log("controller.log").contains("controller.after_record_version"));
    let rank_dir = |rank: u32| service.config.agent_store_dir.join("local-1").join("rec").join(format!("rank{rank}"));
    for rank in 0..2 {
        for version in [2, 3] {
            let meta = rank_dir(rank).join(format!("v{version}.meta"));
            assert!(meta.exists(), "{} is gone", meta.display());
        }
        assert!(!rank_dir(rank).join("v1.meta").exists(), "version 1 outlived the Complete of version 2");
    }
}
