//! The controller's durable state (journal) and its reconciliation with
//! the managers' stores, against real daemons (`icheck up`) and real
//! `mpirun` jobs. The jobs use a client configuration without a PFS, so a
//! restart restores from agent memory or not at all.

mod common;

use std::time::Duration;

use common::{
    assert_restarts_from, committed, kill_for_a_restart, lose_node, managers_run_what_is_listed, restored, Job,
};
use icheck_service::testkit::{icheck_in_target, poll_until, process_running, LocalService};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

fn service(name: &str, managers: u32) -> LocalService {
    LocalService::up(&icheck_in_target(), name, managers, &["--provider", "tcp"])
}

/// SIGKILLs the controller and waits until it is gone.
fn kill_controller(service: &LocalService) {
    let pid = service.pid_of("controller");
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).expect("SIGKILL the controller");
    assert!(poll_until(Duration::from_secs(10), || !process_running(pid)), "the controller did not die");
}

/// Between commits: a 4-rank job commits four versions and finishes with
/// IC_PERSIST; the controller is SIGKILLed and started again. Its journal
/// and the managers' announcements bring the application back with
/// version 4, and a restart restores it bit-exact from agent memory.
#[test]
fn a_controller_killed_between_commits_forgets_no_version_in_agent_memory() {
    let service = service("journal-between", 2);
    let config = service.config_without_pfs();
    let args = ["--app", "between", "--steps", "6", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(4, &config, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(committed(&lines).last().copied(), Some(4), "{lines:?}");

    kill_controller(&service);
    let said = service.up_again();
    assert!(said.contains("controller"), "{said}");

    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "between").expect("the journal remembers the app");
    assert_eq!(app.latest.as_ref().map(|l| l.version), Some(4), "{:?}", app);
    assert!(app.persisted && app.dropped.is_empty(), "{app:?}");
    let journal = status.journal.expect("icheck up gives the controller a journal");
    assert_eq!((journal.incarnation, journal.damage), (2, None));

    let restart = ["--app", "between", "--steps", "8", "--every", "2", "--mib", "2"];
    let lines = Job::start(4, &config, &restart, &[]).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(4), "{lines:?}");
    assert!(lines.iter().any(|l| l == "DONE"), "{lines:?}");
}

/// During commits: the controller is SIGKILLed while a 4-rank job commits
/// in a loop. The job fails (every rank names the controller), the
/// controller is started again, and the restart restores bit-exact the
/// newest version the job had been told was complete, or a newer one the
/// controller journaled before it died.
#[test]
fn a_controller_killed_during_commits_forgets_no_version_in_agent_memory() {
    let service = service("journal-during", 2);
    let config = service.config_without_pfs();
    let args = ["--app", "during", "--steps", "100000", "--every", "1", "--mib", "4", "--step-ms", "5"];
    let mut job = Job::start(4, &config, &args, &[]);
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    kill_controller(&service);
    let (ok, output) = job.finish_any(Duration::from_secs(60));
    assert!(!ok, "the job went on without its controller:\n{output}");
    let lines: Vec<String> = output.lines().map(str::to_string).collect();
    let told = committed(&lines).last().copied().expect("COMMITTED lines");
    assert!(output.contains("commit failed"), "{output}");

    service.up_again();
    assert_restarts_from(told, 4, &config, &[], "during", "4");
}

/// A journal whose tail is damaged (here: its last record cut short, as a
/// crash mid-write leaves it) is used up to the damage, and the status
/// says what was ignored.
#[test]
fn a_damaged_journal_tail_is_detected_and_its_valid_prefix_used() {
    let service = service("journal-damage", 1);
    let config = service.config_without_pfs();
    let args = ["--app", "cut", "--steps", "4", "--every", "2", "--mib", "1", "--persist"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(committed(&lines).last().copied(), Some(3), "{lines:?}");
    kill_controller(&service);

    // The last record is the finish with IC_PERSIST: cut three bytes of it.
    let path = service.dir.join(icheck_service::controller::journal::JOURNAL_FILE);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    service.up_again();

    let status = service.status();
    let damage = status.journal.and_then(|j| j.damage).expect("the damage is reported");
    assert!(damage.contains("is truncated") && damage.contains("controller.journal"), "{damage}");
    let app = status.apps.iter().find(|a| a.registration.name == "cut").expect("the valid prefix has the app");
    assert_eq!(app.latest.as_ref().map(|l| l.version), Some(3), "{app:?}");
    assert!(!app.persisted, "the cut record (IC_PERSIST) was applied: {app:?}");
    let text =
        std::process::Command::new(&service.icheck).args(["status", "--state-dir"]).arg(&service.dir).output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("journal DAMAGED at start"));

    let restart = ["--app", "cut", "--steps", "4", "--every", "2", "--mib", "1"];
    let lines = Job::start(2, &config, &restart, &[]).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(3), "{lines:?}");
}

/// Sends SIGCONT to a stopped daemon when dropped, so that a failing test
/// leaves nothing stopped behind for `icheck down`.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Stopped {
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).expect("SIGSTOP");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // Only while it is still the daemon: the controller may have killed
        // it, and its pid may belong to another process since.
        if icheck_service::launcher::is_icheck_process(self.0) {
            let _ = kill(Pid::from_raw(self.0 as i32), Signal::SIGCONT);
        }
    }
}

/// §6.5.2 with a silent node: a manager is SIGSTOPped while a job commits
/// in a loop (its connection stays open). Within the heartbeat window the
/// controller gives its agents up; the rank waiting on a frozen agent hits
/// its bound, the library asks the controller for new agents, and the
/// version completes there; later commits land on the live node. After
/// SIGCONT the node is back, its stale agents are stopped and the files
/// the newer versions made obsolete are dropped (no memory counted twice).
#[test]
fn a_silent_manager_loses_its_agents_and_commits_go_on_elsewhere() {
    silent_manager("silent-manager", &[], &[]);
}

/// The same with asynchronous commits in SHMR mode: the node leader
/// stores the version again on the new agent from the node segment.
#[test]
fn a_silent_manager_loses_its_agents_and_async_shmr_commits_go_on_elsewhere() {
    silent_manager("silent-manager-shmr", &["--async"], &[("ICHECK_MODE", "shmr")]);
}

fn silent_manager(name: &str, extra: &[&str], env: &[(&str, &str)]) {
    let service = service(name, 2);
    let config = service.config_without_pfs();
    let mut args = vec!["--app", "silent", "--steps", "100000", "--every", "1", "--mib", "4", "--step-ms", "20"];
    args.extend(extra);
    let mut env = env.to_vec();
    env.push(("ICHECK_REQUEST_TIMEOUT", "3"));
    let mut job = Job::start(2, &config, &args, &env);
    job.wait_line("COMMITTED version=3", Duration::from_secs(120));
    let app = |status: &icheck_core::protocol::StatusReport| {
        status.apps.iter().find(|a| a.registration.name == "silent").cloned().expect("the app is registered")
    };
    let silent = app(&service.status()).agents[0].node.clone();
    let manager = service.pid_of(&format!("manager-{silent}"));
    let stopped = Stopped::stop(manager);

    // The job goes on: the version under way completes (on new agents) or
    // fails cleanly; either way, later ones complete on the live node.
    let told_before = committed(&job.lines()).last().copied().unwrap_or(0);
    job.wait_line(&format!("COMMITTED version={}", told_before + 3), Duration::from_secs(60));
    let status = service.status();
    let node = |status: &icheck_core::protocol::StatusReport, name: &str| {
        status.nodes.iter().find(|n| n.node == name).cloned().expect("the node is known")
    };
    assert!(!node(&status, &silent).alive, "{:?}", node(&status, &silent));
    let agents = app(&status).agents;
    assert!(!agents.is_empty() && agents.iter().all(|a| a.node != silent), "{agents:?}");
    assert!(service.log("controller.log").contains("missed 3 heartbeats"));

    drop(stopped);
    // Back: its stale agents stop, and its files of this app go (the
    // report may say nothing is held a moment before the rank's directory
    // itself is removed, so both are polled).
    let app_dir = service.config.agent_store_dir.join(&silent).join("silent");
    let left = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&app_dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
    };
    let back = poll_until(Duration::from_secs(30), || {
        let n = node(&service.status(), &silent);
        n.alive && n.status.agents == 0 && n.status.bytes_held == 0 && left().is_empty()
    });
    assert!(
        back,
        "after SIGCONT: {:?}\nleft in {}: {:?}\n{}",
        node(&service.status(), &silent),
        app_dir.display(),
        left(),
        service.log("controller.log")
    );
    assert!(left().is_empty(), "files left on the node that came back: {:?}", left());

    let told = {
        job.kill();
        committed(&job.lines()).last().copied().expect("COMMITTED lines")
    };
    assert_restarts_from(told, 2, &config, &env, "silent", "4");
}

/// A version sealed on its agents whose node goes silent before rank 0
/// records it at the controller: the controller has given those agents
/// up (and placed no new ones yet), answers so, and every rank asks for
/// new agents, stores the version again there and the commit succeeds.
/// Before, it failed ("it was stored on agents the controller gave up")
/// and the job ended, though every byte was still in its memory: a
/// checkpoint node busy for three heartbeats failed a job. Rank 0 waits
/// 8 s before it records version 3 (failpoint
/// `client.before_version_complete`), time for the test to stop the node
/// once version 3 is sealed and for the controller to give it up (0.5 s
/// heartbeats).
#[test]
fn a_version_whose_agents_are_given_up_before_it_is_recorded_is_stored_again_on_new_ones() {
    given_up_before_recorded("given-up-unrecorded", &[], &[], &[0, 1]);
}

/// The same with asynchronous commits in SHMR mode: the node leader stores
/// the version again from the node segment, which still holds it (the
/// agent holds one "rank" per node).
#[test]
fn an_async_shmr_version_whose_agents_are_given_up_before_it_is_recorded_is_stored_again() {
    given_up_before_recorded("given-up-unrecorded-shmr", &["--async"], &[("ICHECK_MODE", "shmr")], &[0]);
}

/// `stored_ranks`: the ranks the agents hold files of.
fn given_up_before_recorded(name: &str, extra: &[&str], mode_env: &[(&str, &str)], stored_ranks: &[u32]) {
    let service = service(name, 2);
    let config = service.config_without_pfs();
    let mut args = vec!["--app", "unrecorded", "--steps", "4", "--every", "1", "--mib", "4", "--persist"];
    args.extend(extra);
    let mut env = mode_env.to_vec();
    env.push(("ICHECK_FAILPOINTS", "client.before_version_complete=2*sleep(8000) x1"));
    let mut job = Job::start(2, &config, &args, &env);
    job.wait_line("COMMIT_START version=3", Duration::from_secs(120));
    let status = service.status();
    let agents = status.apps.iter().find(|a| a.registration.name == "unrecorded").expect("registered").agents.clone();
    let sealed = |rank: u32| {
        status.nodes.iter().any(|n| {
            icheck_service::store::Store::new(service.config.agent_store_dir.join(&n.node))
                .manifest("unrecorded", rank, 3)
                .is_ok()
        })
    };
    assert!(
        poll_until(Duration::from_secs(60), || stored_ranks.iter().all(|&rank| sealed(rank))),
        "version 3 was not sealed on the agents\n{}",
        job.output()
    );
    let silent = agents[0].node.clone();
    let stopped = Stopped::stop(service.pid_of(&format!("manager-{silent}")));
    let alive = || service.status().nodes.iter().any(|n| n.node == silent && n.alive);
    assert!(poll_until(Duration::from_secs(6), || !alive()), "{silent} was not marked down");
    assert!(
        !job.has("COMMITTED version=3"),
        "version 3 was recorded before the controller gave its node up: the failpoint's sleep is too short here\n{}",
        job.output()
    );

    let lines = job.finish(Duration::from_secs(120));
    assert_eq!(committed(&lines), vec![1, 2, 3, 4, 5], "{lines:?}");
    let log = service.log("controller.log");
    assert!(log.contains("missed 3 heartbeats"), "{log}");
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "unrecorded").expect("persisted");
    assert_eq!(app.latest.as_ref().map(|l| l.version), Some(5), "{app:?}");

    drop(stopped);
    assert!(poll_until(Duration::from_secs(30), alive), "{silent} did not answer again after SIGCONT");
    // In the mode of the job that wrote it, without the failpoint.
    let mut restart = vec!["--app", "unrecorded", "--steps", "4", "--every", "1", "--mib", "4"];
    restart.extend(extra);
    let lines = Job::start(2, &config, &restart, mode_env).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(5), "{lines:?}");
}

/// A node silent for a few heartbeats in the middle of a commit, on a
/// service of one node: when it answers again, the controller stops its
/// agent and places the application's new agent on the same node, in the
/// same store. The old agent's sessions end late (when they next touch
/// their ranks' closed connections), and each one writing the version the
/// ranks then wrote through the new agent deleted the new session's file:
/// the job's commit failed ("cannot flush .../rank0/v3.data: No such
/// file", 3 runs of 3 without the fix); in a run on a loaded host the
/// job went on and printed version 3, and the controller held none of its
/// versions. Now only the newest session of a rank's version discards or
/// seals its file.
#[test]
fn an_agent_replaced_on_its_own_node_leaves_the_new_agents_files_alone() {
    let service = LocalService::up(&icheck_in_target(), "same-node", 1, &["--provider", "tcp", "--heartbeat", "0.5"]);
    let config = service.config_without_pfs();
    let args = ["--app", "renewed", "--steps", "100000", "--every", "1", "--mib", "48"];
    let env = [("ICHECK_REQUEST_TIMEOUT", "3")];
    let mut job = Job::start(4, &config, &args, &env);
    job.wait_line("COMMITTED version=2", Duration::from_secs(120));
    let manager = service.pid_of("manager-local-1");
    // Counted from here: on a loaded host the node may already have been
    // silent once (the job then waited for it to come back).
    let seen = |what: &str| service.log("controller.log").matches(what).count();
    let (down, replaced) = ("marked down", "stopping an agent that was replaced while its node was silent");
    let (down_before, replaced_before) = (seen(down), seen(replaced));
    // Not the status's `alive`, which turns false with the first late
    // heartbeat: the agents are given up when the node is marked down.
    let marked_down = || seen(down) > down_before;
    {
        let _stopped = Stopped::stop(manager);
        assert!(poll_until(Duration::from_secs(20), marked_down), "{}", service.log("controller.log"));
    }
    let replaced = poll_until(Duration::from_secs(30), || seen(replaced) > replaced_before);
    assert!(replaced, "{}", service.log("controller.log"));
    let told = committed(&job.lines()).last().copied().unwrap_or(0);
    job.wait_line(&format!("COMMITTED version={}", told + 3), Duration::from_secs(120));
    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");
    let latest = || {
        let status = service.status();
        status.apps.iter().find(|a| a.registration.name == "renewed").and_then(|a| a.latest.as_ref().map(|l| l.version))
    };
    assert!(
        latest().is_some_and(|v| v >= told),
        "told {told}, the controller has {:?}\n{}",
        latest(),
        service.log("manager-local-1.log")
    );
    assert_restarts_from(told, 4, &config, &env, "renewed", "48");
}

/// A job without a PFS whose only checkpoint node is silent long enough
/// to be marked down, and then comes back: the job's probe hears that no
/// node can take agents, asks again while the node is away, and goes on
/// with new agents once it is back. (A run in CI, where a loaded host held
/// a manager back for 1.9 s, failed the job's commit at the first "no
/// live checkpoint node" answer.)
#[test]
fn a_job_without_a_pfs_waits_for_its_only_node_to_come_back() {
    let service = LocalService::up(&icheck_in_target(), "only-node", 1, &["--provider", "tcp", "--heartbeat", "0.5"]);
    let config = service.config_without_pfs();
    let args = ["--app", "waits", "--steps", "100000", "--every", "1", "--mib", "8"];
    let env = [("ICHECK_REQUEST_TIMEOUT", "12")];
    let mut job = Job::start(2, &config, &args, &env);
    job.wait_line("COMMITTED version=2", Duration::from_secs(120));
    let asks_again = "no checkpoint node can take new agents now";
    {
        let _stopped = Stopped::stop(service.pid_of("manager-local-1"));
        let waiting = poll_until(Duration::from_secs(30), || job.output().contains(asks_again));
        assert!(waiting, "{}\n{}", job.output(), service.log("controller.log"));
        // Still away for a few of the job's questions.
        std::thread::sleep(Duration::from_secs(2));
    }
    let told = committed(&job.lines()).last().copied().unwrap_or(0);
    job.wait_line(&format!("COMMITTED version={}", told + 2), Duration::from_secs(60));
    assert!(job.output().contains("the controller replaced the application's agents"), "{}", job.output());
    let told = kill_for_a_restart(job);
    assert_restarts_from(told, 2, &config, &env, "waits", "8");
}

/// A SIGKILLed manager is started again by the controller's local
/// launcher; its store, which outlived it on tmpfs, is announced and
/// reconciled, so the application restarts from agent memory. Killed
/// again after its files were lost, it comes back without them, and the
/// controller drops the version and says why instead of promising it.
#[test]
fn a_killed_manager_is_relaunched_and_its_surviving_store_reconciled() {
    let service = service("relaunch", 1);
    let config = service.config_without_pfs();
    let args = ["--app", "again", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(committed(&lines).last().copied(), Some(3), "{lines:?}");

    let relaunched = |dead: u32| {
        let back = poll_until(Duration::from_secs(30), || {
            let pid = service.pid_of("manager-local-1");
            pid != dead && process_running(pid) && service.status().nodes.iter().all(|n| n.alive && n.pid == pid)
        });
        assert!(back, "manager {dead} was not started again:\n{}", service.log("controller.log"));
    };
    let first = service.pid_of("manager-local-1");
    kill(Pid::from_raw(first as i32), Signal::SIGKILL).unwrap();
    relaunched(first);
    assert!(service.log("controller.log").contains("manager was dead; started it again"));
    let status = service.status();
    assert_eq!(status.nodes[0].relaunches, 1, "{:?}", status.nodes[0]);
    let app = status.apps.iter().find(|a| a.registration.name == "again").unwrap();
    assert_eq!((app.latest.as_ref().map(|l| l.version), app.dropped.len()), (Some(3), 0), "{app:?}");
    let restart = ["--app", "again", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &config, &restart, &[]).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(3), "{lines:?}");

    // Killed again, and its files of the app lost before it is back.
    let second = service.pid_of("manager-local-1");
    kill(Pid::from_raw(second as i32), Signal::SIGKILL).unwrap();
    assert!(poll_until(Duration::from_secs(10), || !process_running(second)));
    std::fs::remove_dir_all(service.config.agent_store_dir.join("local-1").join("again")).unwrap();
    relaunched(second);
    let app = service.status().apps.into_iter().find(|a| a.registration.name == "again").unwrap();
    assert_eq!(app.latest, None, "{app:?}");
    assert!(app.dropped.iter().any(|d| d.contains("came back without the file of rank 0")), "{app:?}");
    let lines = Job::start(2, &config, &restart, &[]).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "FRESH"), "{lines:?}");
}

/// A 4-rank job of `app`, on a 2-manager service started with
/// `--kill-silent-after kill_after`, commits version 3 and hangs; the
/// manager of its first agent is SIGSTOPped, then the job is killed.
/// `up_args` go to `icheck up` besides the provider and `kill_after`.
/// Returns the service, its client configuration (no PFS), that node and
/// its stopped manager.
fn job_killed_beside_a_stopped_manager(
    service_name: &str,
    kill_after: &str,
    app: &str,
    up_args: &[&str],
) -> (LocalService, std::path::PathBuf, String, Stopped) {
    let (service, config, node, stopped, ()) =
        job_killed_beside_a_stopped_manager_after(service_name, kill_after, app, up_args, |_, _| ());
    (service, config, node, stopped)
}

/// [`job_killed_beside_a_stopped_manager`], calling `before_stop` with the
/// service and the client configuration once the job has committed
/// version 3, before its node's manager is stopped; returns what it returned.
fn job_killed_beside_a_stopped_manager_after<T>(
    service_name: &str,
    kill_after: &str,
    app: &str,
    up_args: &[&str],
    before_stop: impl FnOnce(&LocalService, &std::path::Path) -> T,
) -> (LocalService, std::path::PathBuf, String, Stopped, T) {
    let mut args = vec!["--provider", "tcp", "--kill-silent-after", kill_after];
    args.extend_from_slice(up_args);
    let service = LocalService::up(&icheck_in_target(), service_name, 2, &args);
    let config = service.config_without_pfs();
    let args = ["--app", app, "--steps", "20", "--every", "2", "--mib", "4", "--hang-after", "3"];
    let mut job = Job::start(4, &config, &args, &[]);
    job.wait_line("HANG", Duration::from_secs(120));
    let report = service.status().apps.into_iter().find(|a| a.registration.name == app).expect("registered");
    assert_eq!(report.latest.as_ref().map(|l| l.version), Some(3), "{report:?}");
    let node = report.agents[0].node.clone();
    let ahead = before_stop(&service, &config);
    let stopped = Stopped::stop(service.pid_of(&format!("manager-{node}")));
    job.kill();
    (service, config, node, stopped, ahead)
}

/// The restart that ended with `ok` and `output` was refused, naming
/// version 3, its ranks and the silent `node`, and not failing on a PFS
/// manifest; once `stopped` goes on, `app` restores version 3 bit-exact.
fn refused_naming_the_silent_node_then_restores(
    ok: bool,
    output: &str,
    (service, config, app): (&LocalService, &std::path::Path, &str),
    node: &str,
    stopped: Stopped,
) {
    assert!(!ok, "the restart went on without the silent node's ranks:\n{output}");
    assert!(
        output.contains("version 3 is held only by ranks")
            && output.contains(&format!("on node {node}"))
            && output.contains("is silent"),
        "{output}"
    );
    assert!(!output.contains("MANIFEST"), "{output}");
    drop(stopped);
    let back = poll_until(Duration::from_secs(30), || service.status().nodes.iter().all(|n| n.alive));
    assert!(back, "{node} did not answer again after SIGCONT");
    restores_version_3(service, config, app);
}

/// A restart of `app` (see [`job_killed_beside_a_stopped_manager`]) that
/// must restore version 3 bit-exact and finish.
fn restores_version_3(service: &LocalService, config: &std::path::Path, app: &str) {
    let restart = ["--app", app, "--steps", "8", "--every", "2", "--mib", "4"];
    let lines = Job::start(4, config, &restart, &[]).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(3), "{lines:?}\n{}", service.log("controller.log"));
    assert!(lines.iter().any(|l| l == "DONE"), "{lines:?}");
}

/// A restart while the only node holding ranks of the newest version is
/// silent (here with `KillSilentManagerAfter = 0`, so nobody kills it) is
/// refused with the version, the ranks and the node named, instead of
/// agents placed elsewhere failing to read a PFS copy that never existed;
/// nothing is lost: once the manager answers again, the restart is
/// bit-exact from its memory.
#[test]
fn a_restart_while_the_newest_versions_node_is_silent_names_it_and_loses_nothing() {
    let (service, config, node, stopped) = job_killed_beside_a_stopped_manager("wait-silent", "0", "asleep", &[]);
    let down =
        poll_until(Duration::from_secs(30), || service.status().nodes.iter().any(|n| n.node == node && !n.alive));
    assert!(down, "{node} is not marked down");

    let restart = ["--app", "asleep", "--steps", "8", "--every", "2", "--mib", "4"];
    let (ok, output) = Job::start(4, &config, &restart, &[]).finish_any(Duration::from_secs(120));
    refused_naming_the_silent_node_then_restores(ok, &output, (&service, &config, "asleep"), &node, stopped);
}

/// A restart that registers between a manager falling silent and its node
/// being marked down gets that node's agents back. Its `init` cannot reach
/// one and asks for new agents. The controller holds that probe until the
/// node is marked down (before, it answered "unchanged" at once, and the
/// init failed after 2.5 s of asking), and then places as for a
/// registration, so the refusal a registration meets holds here too: the
/// restart fails naming the silent node. (Before, the new agents were
/// placed as for a running job and every rank failed on a PFS manifest
/// that never existed.) Nothing is lost: after SIGCONT the restart is
/// bit-exact.
#[test]
fn a_restart_registered_before_its_silent_node_is_marked_down_names_it() {
    // Heartbeats 4 s apart: the node is marked down 12-16 s after it
    // stops, long after the restart registers and after `init`'s
    // connection to the stopped agent gives up (5 s). The restart's
    // processes start before the manager stops and wait for `go` before
    // `init`, so that a slow `mpirun` start (seconds on a loaded node, or
    // where name lookups time out) does not eat the window.
    let (service, config, node, stopped, (restart, go)) = job_killed_beside_a_stopped_manager_after(
        "init-silent",
        "0",
        "dozing",
        &["--heartbeat", "4"],
        |service, config| {
            let go = service.dir.join("go");
            let start_when = go.to_str().expect("a UTF-8 path");
            let args = ["--app", "dozing", "--steps", "8", "--every", "2", "--mib", "4", "--start-when", start_when];
            let mut job = Job::start(4, config, &args, &[]);
            job.wait_line("WAITING", Duration::from_secs(120));
            (job, go)
        },
    );
    std::fs::write(&go, b"").unwrap();
    let (ok, output) = restart.finish_any(Duration::from_secs(120));
    let log = service.log("controller.log");
    assert!(
        log.contains("application re-registered; returning its agents"),
        "the restart registered only after {node} was marked down, so it never probed from init:\n{log}"
    );
    refused_naming_the_silent_node_then_restores(ok, &output, (&service, &config, "dozing"), &node, stopped);
}

/// A manager that stays silent while alive (SIGSTOPped for good here; a
/// hang its watchdog does not catch looks the same) is killed by the
/// controller after `KillSilentManagerAfter` and started again, and the
/// versions in its store come back with it: the job killed meanwhile
/// restarts bit-exact from agent memory. Before, the node stayed down
/// for good, and with it the only copy of the ranks it held (this job has
/// no PFS), so the restart failed.
#[test]
fn a_manager_silent_for_good_is_killed_and_started_again_with_its_versions() {
    let (service, config, node, stopped) = job_killed_beside_a_stopped_manager("kill-silent", "4", "frozen", &[]);
    let frozen = stopped.0;
    let back = poll_until(Duration::from_secs(60), || {
        let pid = service.pid_of(&format!("manager-{node}"));
        pid != frozen
            && !process_running(frozen)
            && service.status().nodes.iter().any(|n| n.node == node && n.alive && n.pid == pid)
    });
    let log = service.log("controller.log");
    assert!(back, "the silent manager {frozen} of {node} was not killed and started again:\n{log}");
    assert!(log.contains("KillSilentManagerAfter") && log.contains(&format!("sent SIGKILL to pid {frozen}")), "{log}");
    restores_version_3(&service, &config, "frozen");
}

/// A restart that comes while the manager holding its files is being
/// started again waits for it (bounded) instead of placing its agents on
/// another node, where its newest version is not: with no PFS, that would
/// have been a fresh start.
#[test]
fn a_restart_right_after_its_manager_died_waits_for_the_relaunch() {
    let service = service("relaunch-wait", 2);
    let config = service.config_without_pfs();
    let args = ["--app", "soon", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(committed(&lines).last().copied(), Some(3), "{lines:?}");
    let status = service.status();
    let home = status.apps.iter().find(|a| a.registration.name == "soon").unwrap().agents[0].node.clone();
    let manager = service.pid_of(&format!("manager-{home}"));
    kill(Pid::from_raw(manager as i32), Signal::SIGKILL).unwrap();
    assert!(poll_until(Duration::from_secs(10), || !process_running(manager)));
    // Its connection closed with it: the controller marks the node down
    // and starts it again. (Before that it is merely silent, and a
    // restart is refused.)
    let down = || service.status().nodes.iter().any(|n| n.node == home && (!n.alive || n.pid != manager));
    assert!(poll_until(Duration::from_secs(10), down), "{}", service.log("controller.log"));
    // At once: the controller has not started it again yet.
    let lines = Job::start(2, &config, &args, &[]).finish(Duration::from_secs(120));
    assert_eq!(restored(&lines), Some(3), "{lines:?}\n{}", service.log("controller.log"));
}

/// An agent change whose new node dies while a rank is taken over there:
/// the node's manager will never answer, so the take-over fails at once,
/// the change is undone (the job keeps its agents), and the next probe
/// moves the agent to a live node. The controller used to wait out the
/// take-over's bound (five minutes), holding the job's probe, with the
/// change's new agents running unlisted; the fault campaign found it.
#[test]
fn an_agent_change_whose_new_node_dies_is_undone_at_once() {
    // The only change a probe can bring is the drain; every take-over
    // waits 6 s before it reads, and the node is lost meanwhile.
    let dynamic = "readInterval = 0.5\ninit_agent_count = 1\nis_dynamic_as = false\n";
    let args = ["--provider", "tcp", "--manager-relaunches", "0"];
    let failpoints = Some("agent.take_over_rank=sleep(6000)");
    let service =
        LocalService::up_with_failpoints(&icheck_in_target(), "change-lost", 3, &args, Some(dynamic), failpoints);
    let config = service.config_without_pfs();
    let job_args = [
        "--app",
        "chg",
        "--steps",
        "40",
        "--every",
        "1",
        "--mib",
        "2",
        "--probe-every",
        "2",
        "--step-ms",
        "200",
        "--persist",
    ];
    let mut job = Job::start(2, &config, &job_args, &[]);
    job.wait_line("COMMITTED version=2 ", Duration::from_secs(60));
    let home = service.status().apps[0].agents[0].node.clone();
    service.drain(&home);
    // The change's new agent: on a node other than the job's, which ran none.
    let mut target = None;
    let started = poll_until(Duration::from_secs(30), || {
        let status = service.status();
        target = (status.nodes.iter()).find(|n| n.node != home && n.status.agents > 0).map(|n| n.node.clone());
        target.is_some()
    });
    assert!(started, "no agent change after draining {home}: {:?}", service.status());
    let target = target.unwrap();
    let manager = service.pid_of(&format!("manager-{target}"));
    kill(Pid::from_raw(manager as i32), Signal::SIGKILL).expect("SIGKILL the manager");
    assert!(poll_until(Duration::from_secs(10), || !process_running(manager)), "the manager did not die");

    let lines = job.finish(Duration::from_secs(120));
    let log = service.log("controller.log");
    let undone = format!("node {target} was lost (its manager's connection closed) before its agent");
    assert!(log.contains(&undone) && log.contains("cannot move agents off draining nodes"), "{log}");
    // The next probe moved the agent to the third node, with the newest version.
    let moved = lines.iter().position(|l| l.starts_with("PROBE agents=1 ")).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(lines[moved + 1].starts_with("VERIFIED version="), "{lines:?}");
    assert_eq!(lines.iter().filter(|l| l.starts_with("PROBE agents=")).count(), 1, "{lines:?}");
    assert!(lines.iter().any(|l| l == "DONE"), "{lines:?}");
    let status = service.status();
    let agents = &status.apps[0].agents;
    assert!(agents.iter().all(|a| a.node != home && a.node != target), "{agents:?}");
    // No live node runs an agent that the application does not list.
    managers_run_what_is_listed(&service);
}

/// A node lost for good (its manager killed, its store deleted, and not
/// started again: `--manager-relaunches 0`) held the ranks of the newest
/// version, which no redundancy protected: the version is gone. The
/// restart says so, naming the version, the ranks, the node and how to
/// start afresh. Before, it placed a new agent for the ranks and failed
/// reading a PFS manifest that never existed, at every restart.
#[test]
fn a_version_lost_with_a_node_given_up_is_named_at_restart() {
    let args = ["--provider", "tcp", "--manager-relaunches", "0"];
    let service = LocalService::up(&icheck_in_target(), "lost-for-good", 2, &args);
    let config = service.config_without_pfs();
    let job_args = ["--app", "gone", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(2, &config, &job_args, &[]).finish(Duration::from_secs(120));
    assert_eq!(committed(&lines).last().copied(), Some(3), "{lines:?}");
    // One agent (`init_agent_count`) holds both ranks.
    let node = service.status().apps[0].agents[0].node.clone();
    lose_node(&service, &node);
    let given_up = poll_until(Duration::from_secs(30), || {
        service.status().nodes.iter().any(|n| n.node == node && n.given_up && !n.alive)
    });
    assert!(given_up, "{node} was not given up: {:?}", service.status().nodes);
    // `icheck status` lists it with the dropped versions.
    let dropped = service.status().apps[0].dropped.clone();
    assert!(dropped.iter().any(|d| d.starts_with("version 3 of \"gone\" is lost")), "{dropped:?}");
    let (ok, output) = Job::start(2, &config, &job_args, &[]).finish_any(Duration::from_secs(120));
    assert!(!ok, "a restart without version 3's ranks succeeded: {output}");
    let named = format!("version 3 of \"gone\" is lost: ranks [0, 1] on node {node} held it alone");
    assert!(output.contains(&named), "{output}");
    assert!(output.contains("icheck delete gone"), "{output}");
}
