//! Malleability (§7.2, §7.4) with real MPI jobs and a real local service:
//! versions committed by one process count restored by another through the
//! agents, every element checked against its global index by the
//! application (`malleable`); agents that follow a resize (MA-RA, MA-MA);
//! and the errors bad declarations get.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{files_handed_over, Job};
use icheck_service::testkit::{icheck_in_target, LocalService};

const MALLEABLE: &str = env!("CARGO_BIN_EXE_malleable");
const LONG: Duration = Duration::from_secs(180);

fn run(np: u32, config: &Path, args: &[&str]) -> Vec<String> {
    Job::start_program(MALLEABLE, np, config, args, &[]).finish(LONG)
}

fn has(lines: &[String], line: &str) -> bool {
    lines.iter().any(|l| l == line)
}

/// Writes version 1 of `app`'s arrays with four processes and checks it
/// completed.
fn write_with_four_ranks(config: &Path, app: &str) {
    let lines = run(4, config, &["--app", app, "--write"]);
    assert!(has(&lines, "COMMITTED version=1 ranks=4 epoch=0"), "{app}: {lines:?}");
}

/// Rank directories of `app` in the service's store, over all nodes.
fn stored_ranks(service: &LocalService, app: &str) -> Vec<String> {
    let mut ranks = Vec::new();
    for node in std::fs::read_dir(&service.config.agent_store_dir).into_iter().flatten().flatten() {
        for rank in std::fs::read_dir(node.path().join(app)).into_iter().flatten().flatten() {
            ranks.push(rank.file_name().to_string_lossy().into_owned());
        }
    }
    ranks.sort();
    ranks
}

#[test]
fn arrays_written_by_4_ranks_restore_on_1_3_4_and_6_ranks_element_by_element() {
    let service = LocalService::up(&icheck_in_target(), "malleable-counts", 2, &[]);
    let config = service.config_path();
    write_with_four_ranks(&config, "grow");
    // Each run restores version 1 (written by 4) without committing.
    for np in [1u32, 3, 4, 6] {
        let lines = run(np, &config, &["--app", "grow", "--no-commit"]);
        assert!(has(&lines, &format!("VERIFIED version=1 from=4 ranks={np}")), "{np} ranks: {lines:?}");
    }
    // A version written by 6 processes records its size and epoch, and the
    // old ranks' files nobody serves any more are gone (4 → 6 → 2).
    let lines = run(6, &config, &["--app", "grow"]);
    assert!(has(&lines, "COMMITTED version=2 ranks=6 epoch=1"), "{lines:?}");
    let lines = run(2, &config, &["--app", "grow"]);
    assert!(has(&lines, "VERIFIED version=2 from=6 ranks=2"), "{lines:?}");
    assert!(has(&lines, "COMMITTED version=3 ranks=2 epoch=2"), "{lines:?}");
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "grow").expect("registered");
    let latest = app.latest.clone().expect("a version");
    assert_eq!((latest.version, latest.ranks, latest.epoch), (3, 2, 2));
    let text = std::process::Command::new(&service.icheck)
        .args(["status", "--state-dir"])
        .arg(&service.dir)
        .output()
        .expect("icheck status runs");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("written by 2 processes, resize epoch 2"), "{text}");
    icheck_service::testkit::wait_for("the files of ranks 2-5 to be dropped", Duration::from_secs(10), || {
        stored_ranks(&service, "grow") == ["rank0", "rank1"]
    });
}

/// A distributed array of 9 MiB per rank (several 4 MiB checksum chunks
/// per old part) written by 4 ranks over 2 agents: restored on 1 rank (four
/// whole old parts read at once, straight into place), on 3 (parts cut
/// inside chunks: whole chunks in place, the partial ones through a buffer)
/// and on 6; the application checks every element.
#[test]
fn arrays_of_many_chunks_restore_bit_exact_on_1_3_and_6_ranks() {
    let service = LocalService::up(&icheck_in_target(), "malleable-chunks", 2, &[]);
    let config = service.config_path();
    let payload = ["--payload-mib", "9"];
    let lines = run(4, &config, &[&["--app", "chunks", "--write"][..], &payload].concat());
    assert!(has(&lines, "COMMITTED version=1 ranks=4 epoch=0"), "{lines:?}");
    for np in [1u32, 3, 6] {
        let lines = run(np, &config, &[&["--app", "chunks", "--no-commit"][..], &payload].concat());
        assert!(has(&lines, &format!("VERIFIED version=1 from=4 ranks={np}")), "{np} ranks: {lines:?}");
        assert!(lines.iter().any(|l| l.starts_with("RESTORED_PAYLOAD seconds=")), "{np} ranks: {lines:?}");
    }
}

#[test]
fn predefined_grids_go_from_2x4_to_4x4_processes() {
    let service = LocalService::up(&icheck_in_target(), "malleable-grid", 2, &[]);
    let config = service.config_path();
    let lines = run(8, &config, &["--app", "grid", "--write"]);
    assert!(has(&lines, "COMMITTED version=1 ranks=8 epoch=0"), "{lines:?}");
    let lines = run(16, &config, &["--app", "grid", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=8 ranks=16"), "{lines:?}");
}

#[test]
fn bad_declarations_get_errors_naming_the_label_and_the_numbers() {
    let service = LocalService::up(&icheck_in_target(), "malleable-bad", 1, &[]);
    let config = service.config_path();
    // Rank 1 declares 100004 elements where the others declare 100003: its
    // BLOCK part has the same length, so only the commit's check sees it.
    let job = Job::start_program(MALLEABLE, 4, &config, &["--app", "bad", "--write", "--mismatch-global"], &[]);
    let (ok, text) = job.finish_any(LONG);
    assert!(!ok, "{text}");
    assert!(
        text.lines().any(|l| l.contains("label \"block\": rank 1 declares 100004 elements")
            && l.contains("rank 0 declares 100003 elements")),
        "{text}"
    );
    // No process count that the PREDEFINED grid lacks can restore it.
    write_with_four_ranks(&config, "bad2");
    let (ok, text) = Job::start_program(MALLEABLE, 5, &config, &["--app", "bad2"], &[]).finish_any(LONG);
    assert!(!ok, "{text}");
    assert!(
        text.contains(
            "label \"grid\": no processor mapping covers 5 processes (mappings exist for [1, 2, 3, 4, 6, 8, 16])"
        ),
        "{text}"
    );
    // A plain label (the rigid example's) cannot be restored by another count.
    let rigid = common::EXAMPLE;
    let lines =
        Job::start_program(rigid, 2, &config, &["--app", "rigid", "--steps", "2", "--every", "2", "--persist"], &[])
            .finish(LONG);
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=1")), "{lines:?}");
    let (ok, text) = Job::start_program(rigid, 3, &config, &["--app", "rigid", "--steps", "4"], &[]).finish_any(LONG);
    assert!(!ok, "{text}");
    assert!(text.contains("which a run with another process count cannot restore"), "{text}");
}

/// The old ranks' data can also come from the PFS: every daemon is gone
/// (a fresh service, empty agent memory), the new agents load each old
/// rank's file from the PFS copy when a process of the new count asks.
#[test]
fn a_resized_restart_reads_the_old_ranks_back_from_the_pfs() {
    let mut service = LocalService::up(&icheck_in_target(), "malleable-pfs", 2, &[]);
    let config = service.config_path();
    let copies = [("ICHECK_PFS_INTERVAL", "1")];
    let lines = Job::start_program(MALLEABLE, 4, &config, &["--app", "frompfs", "--write"], &copies).finish(LONG);
    assert!(has(&lines, "COMMITTED version=1 ranks=4 epoch=0"), "{lines:?}");
    let manifest = service.dir.join("pfs/frompfs/v1/MANIFEST");
    icheck_service::testkit::wait_for("the PFS copy of version 1", Duration::from_secs(30), || manifest.exists());
    service.relaunch();
    let lines = run(3, &service.config_path(), &["--app", "frompfs", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=4 ranks=3"), "{lines:?}");
    // Without a controller the library reads the old ranks' PFS files itself.
    let lines = run(2, &common::without_a_controller(&service), &["--app", "frompfs", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=4 ranks=2"), "{lines:?}");
}

/// After a rank failure (paper 002's recovery modes, as restarts): SHRINK
/// goes on with one process fewer, the lost rank's data redistributed over
/// the others; REBUILD starts a replacement that receives the lost rank's
/// data.
#[test]
fn after_a_rank_fails_shrink_and_rebuild_restarts_recover_its_data() {
    let service = LocalService::up(&icheck_in_target(), "malleable-failure", 2, &[]);
    let config = service.config_path();
    let mut job = Job::start_program(MALLEABLE, 4, &config, &["--app", "fail", "--write", "--hang"], &[]);
    job.wait_line("HANG", LONG);
    let pid = job
        .output()
        .lines()
        .find_map(|l| l.strip_prefix("PID rank=2 pid=").map(|p| p.trim().parse::<i32>().expect("a pid")))
        .expect("rank 2 printed its pid");
    // Rank 2 dies; Open MPI then ends the whole job.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).expect("kill rank 2");
    let (ok, text) = job.finish_any(LONG);
    assert!(!ok, "the job survived the loss of a rank: {text}");
    // SHRINK: 3 processes; rank 2's BLOCK part now lies with ranks 1 and 2.
    let lines = run(3, &config, &["--app", "fail", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=4 ranks=3"), "{lines:?}");
    // REBUILD: 4 processes; the new rank 2 gets the lost rank's data.
    let lines = run(4, &config, &["--app", "fail", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=4 ranks=4"), "{lines:?}");
}

/// Agents after resizes 4 → 8 → 2 processes, starting with 2 agents.
fn agents_after_resizes(strategy: &str, name: &str) -> Vec<usize> {
    let dynamic = format!("init_agent_count = 2\nis_dynamic_as = false\nagent_change_strategy = \"{strategy}\"\n");
    let service = LocalService::up_with_dynamic(&icheck_in_target(), name, 2, &[], Some(&dynamic));
    let config = service.config_path();
    let agents = || {
        let status = service.status();
        status.apps.iter().find(|a| a.registration.name == "m").map_or(0, |a| a.agents.len())
    };
    let mut counts = Vec::new();
    write_with_four_ranks(&config, "m");
    counts.push(agents());
    for (np, version, from) in [(8u32, 1u64, 4u32), (2, 2, 8)] {
        // Each run restores through the agents the previous probe left.
        let lines = run(np, &config, &["--app", "m", "--probe"]);
        assert!(has(&lines, &format!("VERIFIED version={version} from={from} ranks={np}")), "{lines:?}");
        assert!(lines.iter().any(|l| l.starts_with("PROBE")), "{lines:?}");
        counts.push(agents());
    }
    let lines = run(3, &config, &["--app", "m", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=3 from=2 ranks=3"), "{lines:?}");
    counts
}

#[test]
fn ma_ma_agents_keep_the_ratio_and_ma_ra_agents_stay() {
    assert_eq!(agents_after_resizes("MA-MA", "malleable-mama"), [2, 4, 1]);
    assert_eq!(agents_after_resizes("MA-RA", "malleable-mara"), [2, 2, 2]);
}

/// A resized restart on the agents' own host (`restore = "auto"`) takes
/// every old rank's files and reads the pieces it needs from them; with
/// `restore = "pull"` it reads them over the fabric and takes no file.
/// The application checks every element either way.
#[test]
fn a_resized_restart_on_the_agents_host_reads_the_old_ranks_files() {
    let service = LocalService::up(&icheck_in_target(), "malleable-local", 2, &[]);
    let config = service.config_path();
    write_with_four_ranks(&config, "shrink");
    assert_eq!(files_handed_over(&service), 0);
    let pulled =
        Job::start_program(MALLEABLE, 3, &config, &["--app", "shrink", "--no-commit"], &[("ICHECK_RESTORE", "pull")])
            .finish(LONG);
    assert!(has(&pulled, "VERIFIED version=1 from=4 ranks=3"), "{pulled:?}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(files_handed_over(&service), 0, "pulled over the fabric");
    let lines = run(3, &config, &["--app", "shrink", "--no-commit"]);
    assert!(has(&lines, "VERIFIED version=1 from=4 ranks=3"), "{lines:?}");
    // Three new ranks read pieces of all four old ranks.
    icheck_service::testkit::wait_for("every old rank's files handed over", Duration::from_secs(30), || {
        files_handed_over(&service) >= 4
    });
}
