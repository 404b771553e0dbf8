//! One application's checkpoints are closed to everyone else: another job
//! with the service's client token (the one a shared cluster hands every
//! user), a fake manager, a client of another Unix user holding a stolen
//! capability, and even the application's own sessions asking for made-up
//! versions. Real daemons (`icheck up`), real MPI jobs, and `intruder`, a
//! hostile client that tries every door and prints one line per attempt.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{
    committed, connect_and_reset, descriptors_and_threads, open_own_session, resident_bytes, wait_for_lanes, Job,
    AGENT_DEBUG_LOG,
};
use icheck_core::control::BlockingConnection;
use icheck_core::fabric::{Domain, Endpoint};
use icheck_core::protocol::{AgentReply, AgentRequest, DataKind, LabelLayout};
use icheck_service::testkit::{http_get_metrics, icheck_in_target, kept_capability, LocalService};

const INTRUDER: &str = env!("CARGO_BIN_EXE_intruder");

fn service(name: &str) -> LocalService {
    LocalService::up(&icheck_in_target(), name, 1, &["--provider", "tcp"])
}

/// A directory for the test, readable by every user (the other user's
/// client configuration and a copy of `intruder` live there); removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("icheck-scratch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The service's configuration as an ordinary user gets it: the client
/// token only (no admin or node token), readable by everyone.
fn client_only_config(service: &LocalService, dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(service.config_path()).unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.starts_with("AdminToken") && !l.starts_with("NodeToken"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.join("client.toml");
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path
}

/// The victim: two ranks commit versions 1 to 3 and finish with IC_PERSIST.
fn victim_commits(service: &LocalService) {
    let args = ["--app", "alpha", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &service.config_path(), &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
}

/// The victim restarts from version 3, bit-exact, and goes on.
fn victim_restarts_bit_exact(service: &LocalService) {
    let args = ["--app", "alpha", "--steps", "6", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &service.config_path(), &args, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=4 step=6")), "{lines:?}");
}

/// Every attempt of an intruder run was refused; returns its lines.
fn all_refused(output: std::process::Output) -> Vec<String> {
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(output.status.success(), "intruder failed: {text}\n{}", String::from_utf8_lossy(&output.stderr));
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    let allowed: Vec<&String> =
        lines.iter().filter(|l| !l.starts_with("REFUSED") && !l.starts_with("STATUS")).collect();
    assert!(allowed.is_empty(), "attempts that were not refused: {allowed:?}\n{text}");
    assert!(lines.iter().any(|l| l == "STATUS apps=0 nodes=0"), "a client's status names nothing: {text}");
    lines
}

/// The line of `attempt`.
fn line<'a>(lines: &'a [String], attempt: &str) -> &'a str {
    let prefix = format!("REFUSED {attempt}:");
    lines.iter().find(|l| l.starts_with(&prefix)).map_or_else(|| panic!("no {attempt} in {lines:?}"), |l| l.as_str())
}

#[test]
fn another_job_with_the_client_token_cannot_touch_an_applications_checkpoints() {
    let service = service("iso-token");
    let scratch = Scratch::new("iso-token");
    victim_commits(&service);
    let agent = service.status().apps[0].agents[0].control.clone();
    let config = client_only_config(&service, &scratch.0);

    // Another job (same Unix user, only the client token): every door.
    let output = Command::new(INTRUDER)
        .args(["--config"])
        .arg(&config)
        .args(["--app", "alpha", "--agent", &agent])
        .output()
        .unwrap();
    let lines = all_refused(output);
    assert!(line(&lines, "register-without-capability").contains("presented no capability"), "{lines:?}");
    assert!(line(&lines, "register-with-capability").contains("not this application's"), "{lines:?}");
    for attempt in ["probe", "record-version", "versions", "finish", "flush"] {
        assert!(line(&lines, attempt).contains("wrong or missing capability"), "{attempt}: {lines:?}");
    }
    for attempt in ["delete", "drain", "release"] {
        assert!(line(&lines, attempt).contains("admin token"), "{attempt}: {lines:?}");
    }
    assert!(line(&lines, "fake-manager").contains("node token"), "{lines:?}");
    assert!(line(&lines, "agent-open").contains("wrong or missing capability"), "{lines:?}");
    for attempt in ["agent-fetch-3", "agent-complete", "agent-begin", "agent-seal"] {
        assert!(line(&lines, attempt).contains("wrong or missing capability"), "{attempt}: {lines:?}");
    }
    // /metrics names applications and nodes: not without the admin (or metrics) token.
    let address = service.metrics_address();
    assert!(http_get_metrics(&address, None).starts_with("HTTP/1.1 401"));
    assert!(http_get_metrics(&address, Some(&service.config.effective_token())).starts_with("HTTP/1.1 401"));
    assert!(service.metrics().contains("icheck_app_latest_version{app=\"alpha\"} 3"));

    // The application's own session, asking for made-up versions: it may
    // neither retire its complete version nor write over it.
    let domain = Domain::open(&service.config.fabric).unwrap();
    let endpoint = Endpoint::new(&domain).unwrap();
    let mut conn = open_own_session(&service, "alpha", &agent, &endpoint, Duration::from_secs(20));
    let mut call = |request: &AgentRequest| conn.call::<_, AgentReply>(request).unwrap();
    match call(&AgentRequest::Complete { version: 1000 }) {
        AgentReply::Error(reason) => assert!(reason.contains("no such version was sealed"), "{reason}"),
        other => panic!("Complete of a made-up version was accepted: {other:?}"),
    }
    let label = LabelLayout { label: "x".into(), kind: DataKind::Binary, offset: 0, len: 8, adapt: None };
    match call(&AgentRequest::Begin { version: 3, ranks: 2, epoch: 0, labels: vec![label], push: false }) {
        AgentReply::Error(reason) => assert!(reason.contains("never overwritten"), "{reason}"),
        other => panic!("a Begin over the complete version was accepted: {other:?}"),
    }
    drop(conn);

    // Refusals are logged on the daemons' side, naming the application.
    let controller = service.log("controller.log");
    assert!(controller.contains("registration refused") && controller.contains("refused a peer"), "{controller}");
    let manager = service.log("manager-local-1.log");
    assert!(manager.contains("refused a session"), "{manager}");

    victim_restarts_bit_exact(&service);
}

/// A Unix user created for the test, deleted on drop.
struct TestUser {
    name: String,
    uid: u32,
}

impl TestUser {
    fn create() -> TestUser {
        let name = format!("ickiso{}", std::process::id());
        let status = Command::new("useradd")
            .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", &name])
            .status()
            .expect("useradd runs (the tests run as root)");
        assert!(status.success(), "useradd {name}");
        let id = Command::new("id").args(["-u", &name]).output().unwrap();
        let uid = String::from_utf8_lossy(&id.stdout).trim().parse().expect("a uid");
        TestUser { name, uid }
    }

    /// `program args` as this user, with its own home and capability directory.
    fn command(&self, program: &Path, home: &Path) -> Command {
        let mut command = Command::new("setpriv");
        command
            .args([
                &format!("--reuid={}", self.uid),
                &format!("--regid={}", self.uid),
                "--clear-groups",
                "--inh-caps=-all",
            ])
            .arg(program)
            .env("HOME", home)
            .env("ICHECK_CAPABILITY_DIR", home.join("capabilities"))
            .env_remove("ICHECK_ADMIN_TOKEN")
            .env_remove("ICHECK_NODE_TOKEN");
        command
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).status();
    }
}

#[test]
fn a_client_of_another_unix_user_cannot_read_a_root_applications_checkpoint() {
    assert!(nix::unistd::geteuid().is_root(), "this test creates a user: run it as root (CI does)");
    let service = service("iso-user");
    let scratch = Scratch::new("iso-user");
    victim_commits(&service);
    let agent = service.status().apps[0].agents[0].control.clone();
    let config = client_only_config(&service, &scratch.0);
    let user = TestUser::create();
    let home = scratch.0.join("home");
    std::fs::create_dir_all(&home).unwrap();
    nix::unistd::chown(&home, Some(user.uid.into()), Some(user.uid.into())).unwrap();
    // The binary where the other user may run it.
    let intruder = scratch.0.join("intruder");
    std::fs::copy(INTRUDER, &intruder).unwrap();
    std::fs::set_permissions(&intruder, std::fs::Permissions::from_mode(0o755)).unwrap();

    // The root application's capability file is its owner's alone.
    let capability_file = service.config.capability_store().path("alpha");
    let mode = std::fs::metadata(&capability_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{}", capability_file.display());
    let stolen = kept_capability(&service.config, "alpha").unwrap();

    // Even holding the stolen capability, and even claiming uid 0, the other
    // user is refused: the controller and the agent see who owns the socket.
    for claim in [None, Some("0")] {
        let mut command = user.command(&intruder, &home);
        command.arg("--config").arg(&config).args(["--app", "alpha", "--agent", &agent, "--capability", &stolen]);
        command.arg("--steal").arg(&capability_file);
        if let Some(uid) = claim {
            command.args(["--claim-uid", uid]);
        }
        let lines = all_refused(command.output().unwrap());
        let register = line(&lines, "register-with-capability");
        match claim {
            None => assert!(register.contains(&format!("not to uid {}", user.uid)), "{lines:?}"),
            Some(_) => assert!(register.contains(&format!("belongs to uid {}", user.uid)), "{lines:?}"),
        }
        for attempt in ["probe", "record-version", "versions", "finish"] {
            assert!(line(&lines, attempt).contains(&format!("this client to uid {}", user.uid)), "{lines:?}");
        }
        assert!(line(&lines, "agent-open").contains(&format!("this session to uid {}", user.uid)), "{lines:?}");
        assert!(line(&lines, "steal-capability-file").contains("Permission denied"), "{lines:?}");
    }
    victim_restarts_bit_exact(&service);
}

/// Bytes a hostile peer sends: frames announcing 4 GiB, frames of random
/// bytes, an HTTP request with a huge header, and nothing at all.
fn garbage(seed: &mut u64) -> Vec<u8> {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    match *seed % 4 {
        0 => u32::MAX.to_le_bytes().to_vec(),
        1 => (0..(*seed % 3000)).map(|i| (i as u8).wrapping_mul(*seed as u8)).collect(),
        2 => format!("GET /metrics HTTP/1.1\r\nX: {}\r\n", "a".repeat(20_000)).into_bytes(),
        _ => Vec::new(),
    }
}

#[test]
fn garbage_idle_and_half_open_connections_on_every_port_leave_the_daemons_as_they_were() {
    use std::io::Write;
    let service =
        LocalService::up_with_env(&icheck_in_target(), "iso-flood", 1, &["--provider", "tcp"], None, &AGENT_DEBUG_LOG);
    victim_commits(&service);
    let ports = [
        service.config.controller_endpoint(),
        service.metrics_address(),
        service.status().apps[0].agents[0].control.clone(),
    ];
    let daemons = [service.pid_of("controller"), service.pid_of("manager-local-1")];

    // An application commits through the whole flood (it runs until killed).
    // Each application's agent opens its lanes once a rank has completed a
    // version, at low priority (over tcp about 75 MiB each, of libfabric's
    // buffers): the counts are taken after both agents' lanes are open.
    // Counted before, they read as 123 MiB the flood kept (once in a suite run).
    let args = ["--app", "beta", "--steps", "1000000", "--every", "2", "--mib", "2", "--step-ms", "50"];
    let mut job = Job::start(2, &service.config_path(), &args, &[]);
    job.wait_line("COMMITTED version=1 ", Duration::from_secs(60));
    wait_for_lanes(&service, "local-1", "alpha", 2);
    wait_for_lanes(&service, "local-1", "beta", 2);
    let before: Vec<(usize, u64)> =
        daemons.iter().map(|pid| (descriptors_and_threads(*pid).0, resident_bytes(*pid))).collect();
    let newest = |job: &Job| committed(&job.lines()).last().copied().unwrap_or(0);
    let newest_before = newest(&job);

    let mut seed = 0x5eed_f100_d000_0001u64;
    let mut idle = Vec::new();
    for port in &ports {
        for _ in 0..3000 {
            connect_and_reset(port);
        }
        for _ in 0..300 {
            let Ok(mut stream) = std::net::TcpStream::connect(port) else { continue };
            let _ = stream.write_all(&garbage(&mut seed));
            // Some close at once (half-open from the daemon's side until it
            // reads the end), the rest stay connected and idle.
            if seed.is_multiple_of(2) {
                idle.push(stream);
            }
        }
    }
    // More silent peers at once than the controller lets wait (128): the
    // ones past its cap are closed at once, whatever the garbage above did.
    for _ in 0..200 {
        idle.extend(std::net::TcpStream::connect(&ports[0]).ok());
    }
    let newest_flooded = newest(&job);
    assert!(newest_flooded > newest_before, "no commit during the flood\n{}", job.output());
    // Every port closes what does not authenticate in time, while the
    // peers still hold their ends.
    for (pid, (fds_before, _)) in daemons.iter().zip(&before) {
        let settled = icheck_service::testkit::poll_until(Duration::from_secs(30), || {
            descriptors_and_threads(*pid).0 <= fds_before + 8
        });
        assert!(settled, "pid {pid} holds {} descriptors, {fds_before} before", descriptors_and_threads(*pid).0);
    }
    drop(idle);
    // The application goes on committing after the flood.
    let next = newest(&job) + 2;
    job.wait_line(&format!("COMMITTED version={next} "), Duration::from_secs(60));
    for (pid, (fds_before, rss_before)) in daemons.iter().zip(&before) {
        let (fds, rss) = (descriptors_and_threads(*pid).0, resident_bytes(*pid));
        assert!(fds <= fds_before + 8, "pid {pid}: descriptors {fds_before} -> {fds}");
        // The flood allocated nothing it kept (64 MiB of slack covers the
        // allocator's caches).
        assert!(rss <= rss_before + (64 << 20), "pid {pid}: resident memory {rss_before} -> {rss} bytes");
    }
    job.kill();
    let controller = service.log("controller.log");
    assert!(controller.contains("too many connections without a Hello"), "{controller}");
    victim_restarts_bit_exact(&service);
}

/// Encrypted PFS copies (`encryption = "aes-256-gcm"`): the key derives
/// from the application's capability, so the copies on the PFS are
/// ciphertext only its owner can read; a restart from them is bit-exact;
/// a wrong key and changed ciphertext (even with the MANIFEST's checksum
/// forged to match) are refused, naming why.
#[test]
fn encrypted_pfs_copies_restore_with_the_key_and_refuse_a_wrong_key_or_changed_ciphertext() {
    use icheck_core::cipher::PfsKey;
    use icheck_core::pfs::{PfsStore, MANIFEST};
    let mut service = service("iso-crypt");
    let encrypted = [("ICHECK_ENCRYPTION", "aes-256-gcm"), ("ICHECK_PFS_INTERVAL", "1")];
    let args = ["--app", "sec", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &service.config_path(), &args, &encrypted).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let root = service.config.pfs_dir.clone().expect("icheck up configures a PFS level");
    let plain = PfsStore::new(&root);
    icheck_service::testkit::wait_for("the encrypted copy of version 3", Duration::from_secs(30), || {
        plain.latest("sec").ok().flatten() == Some(3)
    });
    let manifest = plain.manifest("sec", 3).unwrap();
    assert!(manifest.entries.iter().all(|e| e.encryption.is_some()), "{manifest:?}");
    // Without the key, the copy is unreadable; with the capability's key it verifies.
    let err = plain.read_rank(&manifest, 0).unwrap_err().to_string();
    assert!(err.contains("no key was given"), "{err}");
    let capability = kept_capability(&service.config, "sec").expect("the job kept its capability");
    let capability = icheck_core::credentials::Capability::parse(&capability, "kept").unwrap();
    let key = PfsKey::new(capability.derive_key("pfs"));
    let keyed = PfsStore::new(&root).with_key(Some(key.clone()));
    assert!(keyed.read_rank(&manifest, 0).is_ok());
    assert!(!format!("{:?}", service.status()).contains(&hex(key.bytes())), "the key is nowhere in the status");

    // Every daemon and the agents' memory gone: the restart reads the
    // encrypted copy back through new agents (the ranks give them the key).
    service.relaunch();
    let restart = ["--app", "sec", "--steps", "6", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &service.config_path(), &restart, &encrypted).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");

    // A wrong key, straight from the PFS (no controller): refused, by name.
    let no_controller = common::without_a_controller(&service);
    let wrong = "11".repeat(32);
    let with_key = |key: &str| {
        let env = [("ICHECK_ENCRYPTION", "aes-256-gcm"), ("ICHECK_ENCRYPTION_KEY", key)];
        Job::start(2, &no_controller, &restart, &env).finish_any(Duration::from_secs(120))
    };
    let (ok, output) = with_key(&wrong);
    assert!(!ok && output.contains("another key"), "{output}");

    // Changed ciphertext in every kept version, each MANIFEST's checksum
    // forged to match: refused by the authentication tags.
    for version in plain.versions("sec").unwrap() {
        let dir = plain.version_dir("sec", version).unwrap();
        let mut forged = plain.manifest("sec", version).unwrap();
        for entry in &mut forged.entries {
            let file = dir.join(&entry.file);
            let mut bytes = std::fs::read(&file).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x01;
            std::fs::write(&file, &bytes).unwrap();
            entry.file_crc = crc32c::crc32c(&bytes);
        }
        std::fs::write(dir.join(MANIFEST), icheck_core::format::encode_stored(&forged).unwrap()).unwrap();
    }
    let (ok, output) = with_key(&hex(key.bytes()));
    assert!(!ok && output.contains("authentication tag"), "{output}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An agent exposes a version's memory to the fabric only while it is
/// written (Begin to Seal) or read (Fetch to FetchDone): the region a rank
/// wrote into is gone from the fabric once the version is sealed, so its
/// key opens nothing afterwards.
#[test]
fn a_sealed_versions_memory_is_no_longer_exposed_to_the_fabric() {
    use icheck_core::fabric::{Access, AlignedBuffer, RmaOp, TransferOptions};
    let service = service("iso-exposure");
    victim_commits(&service);
    let agent = service.status().apps[0].agents[0].clone();
    let domain = Domain::open(&service.config.fabric).unwrap();
    let endpoint = Endpoint::new(&domain).unwrap();
    let peer = endpoint.insert_peer(&agent.address).unwrap();
    let mut conn = open_own_session(&service, "alpha", &agent.control, &endpoint, Duration::from_secs(20));
    let mut call = |request: &AgentRequest| conn.call::<_, AgentReply>(request).unwrap();
    let len = 64 << 10;
    let label = LabelLayout { label: "x".into(), kind: DataKind::Binary, offset: 0, len: len as u64, adapt: None };
    let begin = AgentRequest::Begin { version: 4, ranks: 2, epoch: 0, labels: vec![label], push: true };
    let AgentReply::Target(region) = call(&begin) else { panic!("no target for the push") };
    // While the version is written, its region takes the rank's bytes.
    let mut data = endpoint.register(AlignedBuffer::zeroed(len), Access::LOCAL).unwrap();
    data.as_mut_slice().fill(0x5a);
    let op = [RmaOp { local_offset: 0, remote: region, remote_offset: 0, len }];
    endpoint.write(&peer, data.source(), &op, &TransferOptions::default()).expect("the open version takes writes");
    let crcs = icheck_core::format::label_crcs(&[data.as_slice()]);
    assert!(matches!(call(&AgentRequest::Seal { crcs }), AgentReply::Sealed(_)));
    // Sealed: the same region and key read nothing.
    let quick = TransferOptions { timeout: Duration::from_secs(3), ..TransferOptions::default() };
    let probe = Endpoint::new(&domain).unwrap();
    let probe_peer = probe.insert_peer(&agent.address).unwrap();
    let mut back = probe.register(AlignedBuffer::zeroed(len), Access::LOCAL).unwrap();
    let read = probe.read(&probe_peer, back.target(), &op, &quick);
    assert!(read.is_err(), "the sealed version's memory is still readable with its key");
    assert!(back.as_slice().iter().all(|b| *b == 0), "sealed bytes leaked to the reader");
    drop(conn);
    victim_restarts_bit_exact(&service);
}

/// Authenticated connections that go quiet are closed after
/// `ClientIdleTimeout` (3 s here) by the controller and by the agents, so a
/// holder of the client token cannot pile them up; and a job that computes
/// longer than that between commits opens new ones where it needs them:
/// every commit lands and the restart is bit-exact.
#[test]
fn idle_client_connections_are_closed_and_a_job_that_computes_longer_reconnects() {
    let service =
        LocalService::up(&icheck_in_target(), "iso-idle", 1, &["--provider", "tcp", "--client-idle-timeout", "3"]);
    victim_commits(&service);
    let token = service.config.effective_token();
    let controller = service.config.controller_endpoint();
    let controller_pid = service.pid_of("controller");
    let fds_before = descriptors_and_threads(controller_pid).0;
    let quiet: Vec<BlockingConnection> = (0..100)
        .map(|_| BlockingConnection::connect_controller(&controller, &token, Duration::from_secs(5), 0).unwrap().0)
        .collect();
    // Well within the 3 s: all of them are open.
    assert!(descriptors_and_threads(controller_pid).0 >= fds_before + 100, "the authenticated connections are open");
    let agent = service.status().apps[0].agents[0].clone();
    let domain = Domain::open(&service.config.fabric).unwrap();
    let endpoint = Endpoint::new(&domain).unwrap();
    let session = open_own_session(&service, "alpha", &agent.control, &endpoint, Duration::from_secs(5));
    let closed = icheck_service::testkit::poll_until(Duration::from_secs(20), || {
        quiet.iter().all(BlockingConnection::is_stale) && session.is_stale()
    });
    assert!(closed, "idle connections still open after 20 s with ClientIdleTimeout = 3");
    let settled = icheck_service::testkit::poll_until(Duration::from_secs(10), || {
        descriptors_and_threads(controller_pid).0 <= fds_before + 8
    });
    assert!(settled, "controller descriptors: {fds_before} before, {}", descriptors_and_threads(controller_pid).0);
    drop((quiet, session));
    assert!(service.log("manager-local-1.log").contains("closed an idle session"));

    // 4 s of computation between commits: every connection the job holds
    // was closed meanwhile.
    // The new connections are ordinary ones: no failure, no failover to
    // other agents or to the PFS, nothing to warn about.
    let args = ["--app", "gamma", "--steps", "3", "--every", "1", "--mib", "2", "--step-ms", "4000", "--persist"];
    let (lines, stderr) =
        Job::start(2, &service.config_path(), &args, &[]).finish_with_stderr(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=4 step=3")), "{lines:?}");
    assert!(!stderr.contains("WARN"), "the job noticed the closed connections:\n{stderr}");
    let args = ["--app", "gamma", "--steps", "5", "--every", "1", "--mib", "2", "--step-ms", "4000"];
    let (lines, stderr) =
        Job::start(2, &service.config_path(), &args, &[]).finish_with_stderr(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=4 step=3 verified"), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=6 step=5")), "{lines:?}");
    assert!(!stderr.contains("WARN"), "the job noticed the closed connections:\n{stderr}");
    victim_restarts_bit_exact(&service);
}
