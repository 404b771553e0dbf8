//! The Rust API against a real local service, as a single (non-MPI)
//! process: wrong calls get clear errors and never damage a checkpoint;
//! corruption is detected; a restarted manager finds its checkpoints.

use std::path::Path;
use std::time::{Duration, Instant};

use icheck_lib::{Error, Icheck, InitStatus, ProbeHints, ProbeOutcome, Region, SingleProcess};
use icheck_service::testkit::{icheck_in_target, wait_for, ChildGuard, LocalService};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn service(name: &str) -> LocalService {
    LocalService::up(&icheck_in_target(), name, 1, &["--provider", "tcp"])
}

/// SIGKILLs the service's manager, waits until the controller has given
/// its agents up, and starts it again (stopped when the guard drops).
fn kill_and_restart_manager(service: &LocalService) -> ChildGuard {
    let old = service.pid_of("manager-local-1");
    kill(Pid::from_raw(old as i32), Signal::SIGKILL).unwrap();
    wait_for("the controller to notice", Duration::from_secs(10), || {
        service.status().apps.iter().all(|a| a.agents.is_empty())
    });
    let manager = service.start_manager("local-1");
    wait_for("the new manager", Duration::from_secs(10), || service.status().nodes.iter().any(|n| n.alive));
    manager
}

fn init(service: &LocalService, app: &str) -> (Icheck, InitStatus) {
    Icheck::init(Some(&service.config_path()), app, SingleProcess).expect("init")
}

#[test]
fn wrong_calls_get_clear_errors_and_leave_the_checkpoint_intact() {
    let service = service("api-errors");
    let (mut ic, status) = init(&service, "errors");
    assert_eq!(status, InitStatus::Fresh);
    let values = Region::from_vec((0..1000).map(|i| i as f64).collect::<Vec<f64>>());
    let ids = Region::from_vec(vec![7i32; 10]);

    assert!(matches!(ic.restart(), Err(Error::NoCheckpoint(_))));
    let err = ic.restore("values", &values).unwrap_err();
    assert!(matches!(err, Error::Order(_)), "{err}");
    assert!(matches!(ic.add("", &values), Err(Error::BadLabel(_))));

    ic.add("values", &values).unwrap();
    ic.add("ids", &ids).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    // Re-adding a label with a new size is allowed; the next commit uses it.
    ic.add("ids", &Region::from_vec(vec![9i32; 20])).unwrap();
    assert_eq!(ic.commit().unwrap(), 2);
    ic.finalize(true).unwrap();
    assert!(matches!(ic.finalize(true), Err(Error::Order(_))), "double finalize is an error");
    assert!(matches!(ic.commit(), Err(Error::Order(_))), "commit after finalize is an error");

    let (mut ic, status) = init(&service, "errors");
    assert_eq!(status, InitStatus::Restart { version: 2 });
    assert_eq!(ic.restart().unwrap(), 2);
    let err = ic.restore("nope", &values).unwrap_err();
    assert!(matches!(&err, Error::UnknownLabel { label, .. } if label == "nope"), "{err}");
    let err = ic.restore("ids", &ids).unwrap_err().to_string();
    assert!(err.contains("\"ids\"") && err.contains("80 bytes") && err.contains("40 bytes"), "{err}");
    let err = ic.restore("values", &Region::<i64>::zeroed(1000)).unwrap_err();
    assert!(matches!(err, Error::KindMismatch { .. }), "{err}");
    // The failed calls changed nothing: the real restore is still exact.
    let restored = Region::<i32>::zeroed(20);
    ic.restore("ids", &restored).unwrap();
    assert_eq!(*restored.read(), vec![9; 20]);
    let values_back = Region::<f64>::zeroed(1000);
    ic.restore("values", &values_back).unwrap();
    assert_eq!(*values_back.read(), *values.read());
    assert_eq!(ic.probe_agents(ProbeHints::default()).unwrap(), ProbeOutcome::Unchanged);
    ic.finalize(false).unwrap();

    // Without IC_PERSIST the checkpoints are gone for the next run.
    let (mut ic, status) = init(&service, "errors");
    assert_eq!(status, InitStatus::Fresh);
    ic.finalize(false).unwrap();
}

#[test]
fn unreachable_controller_fails_within_the_connect_timeout() {
    let dir = std::env::temp_dir().join(format!("icheck-api-unreachable-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A port nobody listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = dir.join("icheck.toml");
    let text = format!("ControllerPort = {port}\n[fabric]\nprovider = \"tcp\"\n[client]\nconnect_timeout = 2.0\n");
    std::fs::write(&config, text).unwrap();
    let started = Instant::now();
    let err = Icheck::init(Some(&config), "lonely", SingleProcess).err().expect("init must fail");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
    let err = Icheck::init(Some(Path::new("/nonexistent/icheck.toml")), "x", SingleProcess).err().unwrap();
    assert!(err.to_string().contains("/nonexistent/icheck.toml"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn corrupted_agent_memory_is_detected_on_restart() {
    let service = service("api-corrupt");
    let (mut ic, _) = init(&service, "corrupt");
    let data = Region::from_vec((0..(3u32 << 20)).map(|i| i as u8).collect::<Vec<u8>>());
    ic.add("first", &Region::from_vec(vec![1i64; 4])).unwrap();
    ic.add("data", &data).unwrap();
    ic.commit().unwrap();
    ic.finalize(true).unwrap();

    let file = service.config.agent_store_dir.join("local-1/corrupt/rank0/v1.data");
    let mut bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    bytes[32 + 2_000_000] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let (mut ic, _) = init(&service, "corrupt");
    ic.restart().unwrap();
    // The damaged label is refused, naming itself and the damaged range...
    let back = Region::<u8>::zeroed(3 << 20);
    let err = ic.restore("data", &back).unwrap_err();
    assert!(matches!(&err, Error::Corrupt { version: 1, labels, .. } if labels.contains("\"data\"")), "{err}");
    // ...while an intact label still restores.
    let first = Region::<i64>::zeroed(4);
    ic.restore("first", &first).unwrap();
    assert_eq!(*first.read(), vec![1; 4]);
    ic.finalize(false).unwrap();
}

#[test]
fn a_restarted_manager_finds_its_checkpoints() {
    let service = service("api-manager-restart");
    let (mut ic, _) = init(&service, "survivor");
    let data = Region::from_vec((0..100_000).map(|i| (i * 3) as i64).collect::<Vec<i64>>());
    ic.add("data", &data).unwrap();
    ic.commit().unwrap();
    drop(ic); // the application dies without finalize

    let _manager = kill_and_restart_manager(&service);

    let (mut ic, status) = init(&service, "survivor");
    assert_eq!(status, InitStatus::Restart { version: 1 });
    ic.restart().unwrap();
    let back = Region::<i64>::zeroed(100_000);
    ic.restore("data", &back).unwrap();
    assert_eq!(*back.read(), *data.read());
    ic.finalize(false).unwrap();
}

#[test]
fn probe_moves_to_new_agents_when_a_manager_dies() {
    // A manager that stays dead: the controller does not start it again.
    let args = ["--provider", "tcp", "--manager-relaunches", "0"];
    let service = LocalService::up(&icheck_in_target(), "api-probe", 2, &args);
    let (mut ic, _) = init(&service, "mover");
    let data = Region::from_vec((0..50_000).map(|i| i as f32).collect::<Vec<f32>>());
    ic.add("data", &data).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    let home = service.status().apps[0].agents[0].node.clone();

    let pid = service.pid_of(&format!("manager-{home}"));
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    wait_for("the controller to drop the lost agent", Duration::from_secs(10), || {
        service.status().apps.iter().all(|a| a.agents.is_empty())
    });
    let outcome = ic.probe_agents(ProbeHints::default());
    assert!(
        matches!(outcome, Ok(ProbeOutcome::Reconnected { agents: 1 })),
        "{outcome:?}\ncontroller log:\n{}",
        service.log("controller.log")
    );
    let status = service.status();
    assert_ne!(status.apps[0].agents[0].node, home, "the new agent runs on the surviving node");
    // The next commit goes to the new agent, and a new run restores it.
    data.write()[7] = -1.0;
    assert_eq!(ic.commit().unwrap(), 2);
    ic.finalize(true).unwrap();
    let (mut ic, status) = init(&service, "mover");
    assert_eq!(status, InitStatus::Restart { version: 2 });
    ic.restart().unwrap();
    let back = Region::<f32>::zeroed(50_000);
    ic.restore("data", &back).unwrap();
    assert_eq!(*back.read(), *data.read());
    ic.finalize(false).unwrap();
}

/// The service's configuration with `keys` added to its `[client]`
/// section, as a file `name` beside it (an environment variable would
/// reach every test of this binary).
fn client_config(service: &LocalService, name: &str, keys: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(service.config_path()).unwrap();
    let key = format!("[client]\n{keys}\n");
    let text = match text.find("[client]") {
        Some(at) => format!("{}{key}{}", &text[..at], &text[at + "[client]".len()..]),
        None => format!("{text}\n{key}"),
    };
    let path = service.config_path().with_file_name(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The service's client configuration with `incremental = on`.
fn incremental_setting(service: &LocalService, on: bool) -> std::path::PathBuf {
    client_config(service, &format!("incremental-{on}.toml"), &format!("incremental = {on}"))
}

fn incremental_config(service: &LocalService) -> std::path::PathBuf {
    incremental_setting(service, true)
}

/// The service's client configuration with incremental commits and page
/// tracking on.
fn tracking_config(service: &LocalService) -> std::path::PathBuf {
    client_config(service, "tracking.toml", "incremental = true\npage_tracking = true")
}

/// A new run of `app` restarts from `version` and restores `labels`
/// (name, bytes): their bytes, in order.
fn restored_labels(config: &Path, app: &str, version: u64, labels: &[(&str, usize)]) -> Vec<Vec<u8>> {
    let (mut ic, _) = Icheck::init(Some(config), app, SingleProcess).expect("init");
    assert_eq!(ic.restart().unwrap(), version);
    let bytes = labels
        .iter()
        .map(|(label, len)| {
            let region = Region::<u8>::zeroed(*len);
            ic.restore(label, &region).unwrap();
            let bytes = region.read().clone();
            bytes
        })
        .collect();
    ic.finalize(false).unwrap();
    bytes
}

/// With `incremental = false` every commit sends every byte and the agent
/// stores each version whole.
#[test]
fn commits_without_incremental_send_every_byte() {
    let service = service("api-plain");
    let config = incremental_setting(&service, false);
    let (mut ic, _) = Icheck::init(Some(&config), "plain", SingleProcess).expect("init");
    let data = Region::from_vec((0..(3usize << 20)).map(|i| (i % 241) as u8).collect::<Vec<u8>>());
    ic.add("data", &data).unwrap();
    ic.commit().unwrap();
    data.write()[5] ^= 1;
    assert_eq!(ic.commit().unwrap(), 2);
    let rank_dir = service.config.agent_store_dir.join("local-1/plain/rank0");
    assert_eq!(std::fs::metadata(rank_dir.join("v2.data")).unwrap().len(), 3 << 20);
    assert!(!rank_dir.join("v2.map").exists());
    ic.finalize(true).unwrap();
    let (mut ic, _) = Icheck::init(Some(&config), "plain", SingleProcess).expect("init");
    assert_eq!(ic.restart().unwrap(), 2);
    let back = Region::<u8>::zeroed(3 << 20);
    ic.restore("data", &back).unwrap();
    assert!(*back.read() == *data.read());
    ic.finalize(false).unwrap();
}

/// Incremental commits: a version sends only the 1 MiB blocks that changed
/// (the agent's file of version 2 holds them and nothing else), shares the
/// rest with the versions before it, frees what no version uses, and
/// restores bit-exact, also after its manager was killed and restarted
/// (which verifies every composed version before announcing it).
#[test]
fn incremental_commits_move_only_changed_blocks_and_restore_bit_exact() {
    const MIB: usize = 1 << 20;
    let service = service("api-incremental");
    let config = incremental_config(&service);
    let (mut ic, _) = Icheck::init(Some(&config), "delta", SingleProcess).expect("init");
    // A small first label puts the big one off the 1 MiB block grid.
    let head = Region::from_vec(vec![7u8; 100]);
    let data = Region::from_vec((0..24 * MIB).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    ic.add("head", &head).unwrap();
    ic.add("data", &data).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    let rank_dir = service.config.agent_store_dir.join("local-1/delta/rank0");
    let len = |name: &str| std::fs::metadata(rank_dir.join(name)).map(|m| m.len()).ok();
    assert_eq!(len("v1.data"), Some(24 * MIB as u64 + 100), "the first version is whole");
    // Nothing is known yet about how much a commit changes: the second
    // version is sent whole too (checksummed while it moves).
    data.write()[0] ^= 1;
    assert_eq!(ic.commit().unwrap(), 2);
    assert!(!rank_dir.join("v2.map").exists(), "whole");

    // Version 3: 300 KiB changed across a block boundary (two blocks).
    data.write()[5 * MIB - 150_000..5 * MIB + 150_000].fill(1);
    assert_eq!(ic.commit().unwrap(), 3);
    assert_eq!(len("v3.data"), Some(2 * MIB as u64), "only the two changed blocks were sent");
    assert!(rank_dir.join("v3.map").exists());
    // Version 4: one other block; version 3's two blocks stay shared.
    data.write()[20 * MIB] = 9;
    assert_eq!(ic.commit().unwrap(), 4);
    assert_eq!(len("v4.data"), Some(MIB as u64));
    // Version 5: nothing changed, nothing sent.
    assert_eq!(ic.commit().unwrap(), 5);
    assert_eq!(len("v5.data"), Some(4096), "an empty file (one page)");
    // Dropped versions whose blocks are still used are kept as shared
    // blocks, with the blocks nobody uses punched out.
    use std::os::unix::fs::MetadataExt;
    let shared = std::fs::metadata(rank_dir.join("b2.data")).expect("version 2's blocks are shared");
    let allocated = shared.blocks() * 512;
    assert!(allocated + 3 * MIB as u64 <= shared.len().next_multiple_of(4096), "{allocated} bytes allocated");
    assert!(rank_dir.join("b3.data").exists() && !rank_dir.join("v2.meta").exists());
    assert!(!rank_dir.join("b1.data").exists(), "version 1's blocks are used by no version");

    // Every byte rewritten: sent as blocks, since nothing predicted it; the
    // commit after such a change sends the whole version (checksummed
    // while it moves), and a small change after that goes back to blocks.
    let rewrite = || data.write().iter_mut().for_each(|b| *b = b.wrapping_add(1));
    rewrite();
    assert_eq!(ic.commit().unwrap(), 6);
    assert!(rank_dir.join("v6.map").exists());
    rewrite();
    assert_eq!(ic.commit().unwrap(), 7);
    assert!(!rank_dir.join("v7.map").exists(), "whole: the last commit changed every block");
    data.write()[7] ^= 1;
    assert_eq!(ic.commit().unwrap(), 8);
    assert!(!rank_dir.join("v8.map").exists(), "whole: the last commit changed every block");
    data.write()[7] ^= 1;
    assert_eq!(ic.commit().unwrap(), 9);
    assert_eq!(len("v9.data"), Some(MIB as u64), "one block again");
    ic.finalize(true).unwrap();

    let restore = |config: &Path| {
        let (mut ic, status) = Icheck::init(Some(config), "delta", SingleProcess).expect("init");
        assert_eq!(status, InitStatus::Restart { version: 9 });
        assert_eq!(ic.restart().unwrap(), 9);
        let (head_back, data_back) = (Region::<u8>::zeroed(100), Region::<u8>::zeroed(24 * MIB));
        ic.restore("head", &head_back).unwrap();
        ic.restore("data", &data_back).unwrap();
        assert!(*head_back.read() == *head.read() && *data_back.read() == *data.read(), "not bit-exact");
        ic.finalize(true).unwrap();
    };
    restore(&config);
    // Version 9's blocks lie in four files (versions 2, 3, 4 and 9): the
    // agent on this host handed them all over, and the library read them.
    wait_for("the composed version handed over", Duration::from_secs(30), || {
        service.status().nodes.iter().map(|n| n.status.files_handed_over).sum::<u64>() == 1
    });
    // The same version over the fabric.
    let pulled = config.with_file_name("pull.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("restore = \"auto\""), "{text}");
    std::fs::write(&pulled, text.replace("restore = \"auto\"", "restore = \"pull\"")).unwrap();
    restore(&pulled);

    let _manager = kill_and_restart_manager(&service);
    restore(&config);
}

/// Async commits are incremental too: the background thread compares the
/// staged copy with the previous version and sends the changed blocks.
#[test]
fn async_incremental_commits_send_the_changed_blocks_of_the_staged_copy() {
    const MIB: usize = 1 << 20;
    let service = service("api-async-incremental");
    let config = incremental_config(&service);
    let (mut ic, _) = Icheck::init(Some(&config), "async-delta", SingleProcess).expect("init");
    let data = Region::from_vec((0..8 * MIB).map(|i| (i % 249) as u8).collect::<Vec<u8>>());
    ic.add("data", &data).unwrap();
    ic.set_async(true);
    for version in 1..=2 {
        assert_eq!(ic.commit().unwrap(), version);
        ic.wait().unwrap();
    }
    data.write()[3 * MIB + 10] ^= 0xff;
    assert_eq!(ic.commit().unwrap(), 3);
    // Changed after staging: not part of version 3.
    data.write()[6 * MIB] ^= 0xff;
    ic.wait().unwrap();
    let rank_dir = service.config.agent_store_dir.join("local-1/async-delta/rank0");
    assert_eq!(std::fs::metadata(rank_dir.join("v3.data")).unwrap().len(), MIB as u64, "one block sent");
    ic.finalize(true).unwrap();
    data.write()[6 * MIB] ^= 0xff;

    let (mut ic, _) = Icheck::init(Some(&config), "async-delta", SingleProcess).expect("init");
    assert_eq!(ic.restart().unwrap(), 3);
    let back = Region::<u8>::zeroed(8 * MIB);
    ic.restore("data", &back).unwrap();
    assert!(*back.read() == *data.read(), "version 3 is the staged bytes, bit-exact");
    ic.finalize(false).unwrap();
}

/// Page tracking (opt-in): after the first commit, a commit checksums only
/// the chunks whose pages the process wrote, whichever way it wrote them
/// (its own stores, other threads, the kernel's `read(2)`), and every
/// version restores bit-exact. A restore, or a label whose memory moved,
/// makes the next commit compare every byte again.
#[test]
fn page_tracking_checksums_only_written_pages_and_restores_bit_exact() {
    const MIB: usize = 1 << 20;
    let service = service("api-tracking");
    let config = tracking_config(&service);
    let (mut ic, _) = Icheck::init(Some(&config), "tracked", SingleProcess).expect("init");
    let head = Region::from_vec(vec![1u8; 100]);
    let data = Region::from_vec((0..64 * MIB).map(|i| (i % 253) as u8).collect::<Vec<u8>>());
    ic.add("head", &head).unwrap();
    ic.add("data", &data).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    let first = ic.last_commit().unwrap();
    assert!(!first.page_tracking && first.checksummed_bytes == first.total_bytes, "{first:?}");

    let mut seed = 0x853c_49e6_748f_ea9bu64;
    let mut next = move |below: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % below as u64) as usize
    };
    let mut file = {
        let path = service.config_path().with_file_name("tracking-input");
        std::fs::write(&path, vec![0xA5u8; 2 * MIB]).unwrap();
        std::fs::File::open(path).unwrap()
    };
    for version in 2..=12u64 {
        match version % 4 {
            // A few scattered bytes and runs, from this thread.
            0 | 1 => {
                let mut bytes = data.write();
                for _ in 0..1 + next(3) {
                    let at = next(64 * MIB - 4096);
                    bytes[at..at + 1 + next(4096)].iter_mut().for_each(|b| *b = b.wrapping_add(1));
                }
            }
            // From another thread.
            2 => std::thread::scope(|s| {
                s.spawn(|| data.write()[next(64 * MIB)] ^= 0x5a);
            }),
            // By the kernel: read(2) straight into the region.
            _ => {
                use std::io::{Read, Seek};
                file.rewind().unwrap();
                let at = next(62 * MIB);
                file.read_exact(&mut data.write()[at..at + MIB + 17]).unwrap();
            }
        }
        head.write()[next(100)] ^= 1;
        assert_eq!(ic.commit().unwrap(), version);
        let stats = ic.last_commit().unwrap();
        assert!(stats.page_tracking, "version {version}: {stats:?}");
        // At most three runs and the head: at most seven 4 MiB chunks
        // read, and eight 1 MiB blocks sent, of 64 MiB.
        assert!(stats.checksummed_bytes <= 7 * 4 * MIB as u64 + 100, "version {version}: {stats:?}");
        assert!(stats.moved_bytes <= 8 * MIB as u64, "version {version}: {stats:?}");
    }
    // A restore may arrive by DMA: the next commit compares every byte.
    let expected = (head.read().clone(), data.read().clone());
    assert_eq!(ic.restart().unwrap(), 12);
    ic.restore_all().unwrap();
    assert!(*head.read() == expected.0 && *data.read() == expected.1, "version 12 is not bit-exact");
    data.write()[5] ^= 1;
    assert_eq!(ic.commit().unwrap(), 13);
    assert!(!ic.last_commit().unwrap().page_tracking, "after a restore");
    data.write()[7 * MIB] ^= 1;
    assert_eq!(ic.commit().unwrap(), 14);
    assert!(ic.last_commit().unwrap().page_tracking);
    // The label's memory moves (a resize reallocates): tracking starts
    // again on the new pages, and that commit compares every byte.
    data.write().extend_from_slice(&[9u8; 3 * MIB]);
    assert_eq!(ic.commit().unwrap(), 15);
    assert!(!ic.last_commit().unwrap().page_tracking);
    data.write()[66 * MIB] ^= 1;
    assert_eq!(ic.commit().unwrap(), 16);
    assert!(ic.last_commit().unwrap().page_tracking);
    ic.finalize(true).unwrap();

    let back = restored_labels(&config, "tracked", 16, &[("head", 100), ("data", 67 * MIB)]);
    assert!(back[0] == *head.read() && back[1] == *data.read(), "version 16 is not bit-exact");
}

/// With page tracking, two labels that swap their memory (a stencil code
/// re-adding `u` and `u_new` after each step) change no page, but every
/// byte of the version: the commit after the swap compares every byte,
/// and the restore gives each label its own data.
#[test]
fn page_tracking_sees_labels_that_swap_their_memory() {
    const MIB: usize = 1 << 20;
    let service = service("api-swap");
    let config = tracking_config(&service);
    let (mut ic, _) = Icheck::init(Some(&config), "swap", SingleProcess).expect("init");
    let (one, two) = (Region::from_vec(vec![1u8; 4 * MIB]), Region::from_vec(vec![2u8; 4 * MIB]));
    ic.add("u", &one).unwrap();
    ic.add("u_new", &two).unwrap();
    for version in 1..=3 {
        one.write()[version] ^= 1;
        assert_eq!(ic.commit().unwrap(), version as u64);
    }
    assert!(ic.last_commit().unwrap().page_tracking);
    ic.add("u", &two).unwrap();
    ic.add("u_new", &one).unwrap();
    assert_eq!(ic.commit().unwrap(), 4);
    assert!(!ic.last_commit().unwrap().page_tracking, "the labels moved: every byte is compared");
    ic.finalize(true).unwrap();

    let back = restored_labels(&config, "swap", 4, &[("u", 4 * MIB), ("u_new", 4 * MIB)]);
    assert!(back[0] == *two.read() && back[1] == *one.read(), "a label holds the other's data");
}

/// Before the first commit, adding labels tells the agent the version's
/// size: it backs a file of that size while the application computes, and
/// the first version is written into it.
#[test]
fn the_agent_prepares_the_first_versions_file_while_the_application_computes() {
    let service = service("api-prepare");
    let (mut ic, _) = init(&service, "prepare");
    let data = Region::from_vec(vec![3u8; 8 << 20]);
    ic.add("data", &data).unwrap();
    let prepared = service.config.agent_store_dir.join("local-1/prepare/rank0/prepared.data");
    let backed = || std::fs::metadata(&prepared).is_ok_and(|m| m.len() == 8 << 20 && m.blocks() * 512 >= 8 << 20);
    use std::os::unix::fs::MetadataExt;
    wait_for("the prepared file", Duration::from_secs(10), backed);
    let inode = std::fs::metadata(&prepared).unwrap().ino();
    assert_eq!(ic.commit().unwrap(), 1);
    // (After version 1 completes, the agent may prepare the next version's
    // file under the same name: compare the files, not the names.)
    let first = std::fs::metadata(prepared.with_file_name("v1.data")).unwrap();
    assert_eq!(first.ino(), inode, "the first version took the prepared file");
    ic.finalize(false).unwrap();
}

/// A restarted application restores into memory it has just allocated:
/// with `prefault` (the default) a helper populates the destination ahead
/// of the transfer. Every way a restore moves data (pulled, pushed, the
/// agent's files on this host) lands bit-exact in fresh memory whose end is
/// not page-aligned, with prefault on and off.
#[test]
fn restores_into_fresh_memory_are_bit_exact_with_and_without_prefault() {
    let service = service("api-prefault");
    let len = (48 << 20) + 4093;
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8 ^ (i >> 20) as u8).collect();
    let (mut ic, _) = init(&service, "prefault");
    let region = Region::from_vec(data.clone());
    ic.add("field", &region).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    ic.finalize(true).unwrap();
    for restore in ["pull", "push", "auto"] {
        for prefault in [true, false] {
            let config = client_config(
                &service,
                &format!("prefault-{restore}-{prefault}.toml"),
                &format!("prefault = {prefault}"),
            );
            // The service's file already names a restore direction.
            let text = std::fs::read_to_string(&config).unwrap();
            let text = text.replacen("restore = \"auto\"", &format!("restore = \"{restore}\""), 1);
            assert!(text.contains(&format!("restore = \"{restore}\"")), "{text}");
            std::fs::write(&config, text).unwrap();
            let (mut ic, _) = Icheck::init(Some(&config), "prefault", SingleProcess).expect("init");
            assert_eq!(ic.restart().unwrap(), 1);
            let fresh = Region::<u8>::zeroed(len);
            ic.restore("field", &fresh).unwrap();
            assert!(*fresh.read() == data, "restore = {restore}, prefault = {prefault}: not bit-exact");
            ic.finalize(true).unwrap();
        }
    }
}

/// The agent opens the endpoint a restarting rank reads through (its
/// lane) while the job still runs, once the rank's first version is
/// complete: not inside the restart that follows the job's end.
#[test]
fn a_ranks_lane_is_opened_while_its_job_still_runs() {
    let debug = [("ICHECK_LOG", "info,icheck_service::agent=debug")];
    let service = LocalService::up_with_env(&icheck_in_target(), "api-lanes", 1, &["--provider", "tcp"], None, &debug);
    let (mut ic, _) = init(&service, "lanes");
    let data: Vec<u8> = (0..(4 << 20)).map(|i: u32| (i % 251) as u8).collect();
    let region = Region::from_vec(data.clone());
    ic.add("data", &region).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    // The session is still open: nothing has ended that would open it.
    wait_for("a lane opened ahead of the restart", Duration::from_secs(20), || {
        service.log("manager-local-1.log").contains("lane opened ahead of a restart")
    });
    ic.finalize(true).unwrap();
    let (mut ic, _) = init(&service, "lanes");
    assert_eq!(ic.restart().unwrap(), 1);
    let restored = Region::<u8>::zeroed(data.len());
    ic.restore("data", &restored).unwrap();
    assert!(*restored.read() == data, "not bit-exact");
    ic.finalize(false).unwrap();
}

/// A lane that takes long to open ahead (here 6 s, by a failpoint) keeps
/// no restart waiting: the restarting rank's request for a lane opens one
/// of its own rather than wait for the lock a lane is opened under.
#[test]
fn a_slow_lane_opened_ahead_keeps_no_restart_waiting() {
    let slow = Some("agent.before_lane_ahead=sleep(6000)");
    let service =
        LocalService::up_with_failpoints(&icheck_in_target(), "api-slow-lane", 1, &["--provider", "tcp"], None, slow);
    let (mut ic, _) = init(&service, "slow-lane");
    let data: Vec<u8> = (0..(4 << 20)).map(|i: u32| (i % 241) as u8).collect();
    let region = Region::from_vec(data.clone());
    ic.add("data", &region).unwrap();
    assert_eq!(ic.commit().unwrap(), 1);
    ic.finalize(true).unwrap();
    let started = Instant::now();
    let (mut ic, _) = init(&service, "slow-lane");
    assert_eq!(ic.restart().unwrap(), 1);
    let restored = Region::<u8>::zeroed(data.len());
    ic.restore("data", &restored).unwrap();
    let took = started.elapsed();
    assert!(*restored.read() == data, "not bit-exact");
    assert!(took < Duration::from_secs(4), "the restart waited {took:?} for the lane being opened ahead");
    ic.finalize(false).unwrap();
}

/// `/proc/self/smaps`' `field` (in KiB) for the mapping that starts at
/// `addr`.
fn smaps_field_kib(addr: usize, field: &str) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let start = format!("{addr:x}-");
    let mut entry = smaps.split_inclusive('\n').skip_while(|l| !l.starts_with(&start)).skip(1);
    // Every entry lists the same fields: the first after the header is its.
    let value = entry
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} for the mapping at {addr:#x}"));
    value.trim().trim_end_matches("kB").trim().parse().unwrap()
}

/// How much of version 1's file of `app` (rank 0) on the service's only
/// node this process maps with 2 MiB pages, in KiB, after reading all of
/// it through a shared mapping; and the file's bytes.
fn version_file_pmd_mapped_kib(service: &LocalService, app: &str) -> (u64, Vec<u8>) {
    let path = service.config.agent_store_dir.join(format!("local-1/{app}/rank0/v1.data"));
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // SAFETY: the agent wrote the file before the commit returned and
    // nothing writes a complete version's file again; the mapping is only
    // read while the test holds it.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let bytes = map.to_vec();
    (smaps_field_kib(map.as_ptr() as usize, "ShmemPmdMapped"), bytes)
}

/// `icheck up --huge-pages on` mounts the default store as a tmpfs with
/// huge pages: the status says so, a version's file is backed by 2 MiB
/// pages (a mapping of it is PMD-mapped), the version restores bit-exact,
/// and `icheck down` leaves no mount behind. The default store keeps
/// 4 KiB pages. As a user who may not mount, the option fails clearly.
#[test]
fn huge_pages_on_backs_versions_with_2_mib_pages_and_down_unmounts() {
    let data: Vec<u8> = (0..(16usize << 20)).map(|i| (i as u8).wrapping_mul(31) ^ (i >> 16) as u8).collect();
    let commit_and_restore = |service: &LocalService, app: &str| {
        let (mut ic, _) = init(service, app);
        ic.add("field", &Region::from_vec(data.clone())).unwrap();
        assert_eq!(ic.commit().unwrap(), 1);
        ic.finalize(true).unwrap();
        let (mut ic, _) = init(service, app);
        assert_eq!(ic.restart().unwrap(), 1);
        let fresh = Region::<u8>::zeroed(data.len());
        ic.restore("field", &fresh).unwrap();
        assert!(*fresh.read() == data, "{app}: restore not bit-exact");
        ic.finalize(true).unwrap();
    };
    if !nix::unistd::geteuid().is_root() {
        let dir = std::env::temp_dir().join(format!("icheck-test-huge-user-{}", std::process::id()));
        let out = std::process::Command::new(icheck_in_target())
            .args(["up", "--detach", "--managers", "1", "--huge-pages", "on", "--state-dir"])
            .arg(&dir)
            .output()
            .unwrap();
        let _ = std::process::Command::new(icheck_in_target()).args(["down", "--state-dir"]).arg(&dir).output();
        let _ = std::fs::remove_dir_all(&dir);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("needs root"), "{stderr}");
        return;
    }
    let store = {
        let service =
            LocalService::up(&icheck_in_target(), "api-huge", 1, &["--provider", "tcp", "--huge-pages", "on"]);
        let store = service.config.agent_store_dir.clone();
        let pages = service.status().nodes[0].status.store_pages.clone();
        assert!(pages.starts_with("2 MiB huge pages"), "status: {pages}");
        commit_and_restore(&service, "huge");
        let (pmd_kib, bytes) = version_file_pmd_mapped_kib(&service, "huge");
        assert!(bytes.starts_with(&data), "the version's file holds the data");
        assert!(pmd_kib >= 8 << 10, "only {pmd_kib} KiB of the 16 MiB version are in 2 MiB pages");
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(mountinfo.contains(&format!(" {} ", store.display())), "{} is not a mount", store.display());
        store
    };
    // Dropping the service ran `icheck down`.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains(&format!(" {} ", store.display())), "{} is still mounted", store.display());
    assert!(!store.exists(), "{} is still there", store.display());

    let service = service("api-small-pages");
    let pages = service.status().nodes[0].status.store_pages.clone();
    commit_and_restore(&service, "small");
    let (pmd_kib, _) = version_file_pmd_mapped_kib(&service, "small");
    if pages.starts_with("4 KiB") {
        assert_eq!(pmd_kib, 0, "status says {pages}");
    }
}
