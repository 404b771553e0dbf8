//! The service on a real Slurm: a test-local cluster of Debian's munged,
//! slurmctld and three slurmd (`TestSlurm`), `icheck up --slurm` running
//! its managers as Slurm jobs, MPI jobs checkpointing to them, a manager
//! job cancelled and started again through Slurm, and `icheck down`
//! cancelling every job it submitted.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::Job;
use icheck_core::config::StaticConfig;
use icheck_core::control::request_blocking;
use icheck_core::protocol::{ClientReply, ClientRequest, StatusReport};
use icheck_service::testkit::slurm::TestSlurm;
use icheck_service::testkit::{icheck_in_target, poll_until, wait_for};

/// A Slurm-backed icheck service; `icheck down` on drop.
struct SlurmService<'a> {
    slurm: &'a TestSlurm,
    dir: PathBuf,
}

impl SlurmService<'_> {
    fn up<'a>(slurm: &'a TestSlurm, label: &str, nodes: &str) -> SlurmService<'a> {
        Self::up_with_dynamic(slurm, label, nodes, None)
    }

    /// With `dynamic` as the service's dynamic configuration.
    fn up_with_dynamic<'a>(slurm: &'a TestSlurm, label: &str, nodes: &str, dynamic: Option<&str>) -> SlurmService<'a> {
        Self::up_with(slurm, label, nodes, dynamic, &[])
    }

    /// With `dynamic` as the dynamic configuration and `extra` arguments to `icheck up`.
    fn up_with<'a>(
        slurm: &'a TestSlurm,
        label: &str,
        nodes: &str,
        dynamic: Option<&str>,
        extra: &[&str],
    ) -> SlurmService<'a> {
        let dir = std::env::temp_dir().join(format!("icheck-slurm-svc-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(text) = dynamic {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("dynamic.toml"), text).unwrap();
        }
        let out = Command::new(icheck_in_target())
            .args(["up", "--detach", "--provider", "tcp", "--slurm", "--partition", &slurm.partition, "--nodes", nodes])
            .args(extra)
            .arg("--state-dir")
            .arg(&dir)
            .env("SLURM_CONF", &slurm.conf)
            .output()
            .unwrap();
        let service = SlurmService { slurm, dir };
        assert!(
            out.status.success(),
            "icheck up --slurm failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        service
    }

    fn config_path(&self) -> PathBuf {
        self.dir.join("icheck.toml")
    }

    fn status(&self) -> StatusReport {
        let config = StaticConfig::load(&self.config_path()).unwrap();
        match request_blocking(&config, &ClientRequest::Status).unwrap() {
            ClientReply::Status(report) => report,
            other => panic!("{other:?}"),
        }
    }

    fn alive_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self.status().nodes.into_iter().filter(|n| n.alive).map(|n| n.node).collect();
        nodes.sort();
        nodes
    }

    fn down(&self) -> std::process::Output {
        Command::new(icheck_in_target())
            .args(["down", "--state-dir"])
            .arg(&self.dir)
            .env("SLURM_CONF", &self.slurm.conf)
            .output()
            .unwrap()
    }
}

impl Drop for SlurmService<'_> {
    fn drop(&mut self) {
        if self.dir.join("pids").exists() {
            let _ = self.down();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn manager_jobs(slurm: &TestSlurm) -> Vec<(u64, String, String)> {
    slurm.jobs().into_iter().filter(|(_, state, _)| state == "RUNNING").collect()
}

fn recorded_jobs(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("slurm-jobs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn managers_run_as_slurm_jobs_serve_mpi_jobs_are_restarted_through_slurm_and_are_released() {
    let slurm = TestSlurm::start("up", "ck", 3);
    let service = SlurmService::up(&slurm, "up", "2..3");
    // Two manager jobs run, on nodes Slurm chose; the service knows the
    // checkpoint nodes by Slurm's names for them.
    let running = manager_jobs(&slurm);
    assert_eq!(running.len(), 2, "{running:?}");
    let mut job_nodes: Vec<String> = running.iter().map(|(_, _, node)| node.clone()).collect();
    job_nodes.sort();
    assert_eq!(service.alive_nodes(), job_nodes);
    assert!(job_nodes.iter().all(|n| slurm.nodes.contains(n)), "{job_nodes:?} not among {:?}", slurm.nodes);
    let recorded = recorded_jobs(&service.dir);
    assert_eq!(recorded.len(), 2, "{recorded:?}");

    // An MPI job checkpoints to them, is killed, and restarts bit-exact.
    let config = service.config_path();
    let mut job = Job::start(
        2,
        &config,
        &["--app", "on-slurm", "--steps", "20", "--every", "2", "--mib", "8", "--hang-after", "3"],
        &[],
    );
    job.wait_line("HANG", Duration::from_secs(120));
    job.kill();
    let lines = Job::start(2, &config, &["--app", "on-slurm", "--steps", "8", "--every", "2", "--mib", "8"], &[])
        .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");

    // A manager's job ends (cancelled, as a node failure or an admin
    // would): the controller submits a new job for that node.
    let (victim, _, node) = running[0].clone();
    slurm.run("scancel", &[&victim.to_string()]);
    wait_for("the cancelled manager's node to be started again by Slurm", Duration::from_secs(90), || {
        manager_jobs(&slurm).iter().any(|(id, _, n)| *id != victim && *n == node)
            && service.alive_nodes().contains(&node)
    });
    assert_eq!(recorded_jobs(&service.dir).len(), 3, "the relaunch is recorded");

    // icheck down cancels every job it submitted.
    let down = service.down();
    let text = String::from_utf8_lossy(&down.stdout);
    assert!(down.status.success() && text.contains("cancelled the manager job(s)"), "{text}");
    assert!(slurm.jobs().is_empty(), "jobs left in Slurm: {:?}", slurm.jobs());
    assert!(!service.dir.join("slurm-jobs").exists());
}

#[test]
fn filling_checkpoint_memory_makes_the_controller_ask_slurm_for_a_node_and_new_versions_land_there() {
    let slurm = TestSlurm::start("scale", "cs", 2);
    // 50 MiB of checkpoint memory per node; a node half full and still
    // filling needs another (Algorithm 8 with low thresholds).
    let dynamic = "readInterval = 1\nis_dynamic_hs = true\nmax_mem_node = 0.049\nlower_threshold = 0.3\n\
                   upper_threshold = 0.4\ndepletion_threshold = \"1MiB\"\nscaler_interval = 0.5\n\
                   init_agent_count = 2\nnode_selection = \"RR\"\n";
    let service = SlurmService::up_with_dynamic(&slurm, "scale", "1..2", Some(dynamic));
    let first = service.alive_nodes();
    assert_eq!(first.len(), 1, "{first:?}");
    let config = service.config_path();
    // Two ranks x 12 MiB per version, a version every 0.3 s.
    let filler = Job::start(
        2,
        &config,
        &["--app", "filler", "--steps", "12", "--every", "1", "--mib", "12", "--step-ms", "300", "--persist"],
        &[],
    );
    wait_for("a second checkpoint node from Slurm", Duration::from_secs(90), || service.alive_nodes().len() == 2);
    let lines = filler.finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=12 ")), "{lines:?}");
    let log = std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap();
    let asked = log
        .lines()
        .find(|l| l.contains("scaler: asked for another checkpoint node"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(asked.contains("priority=High") && asked.contains("Slurm job"), "{asked}");
    assert_eq!(manager_jobs(&slurm).len(), 2, "{:?}", slurm.jobs());
    let added: Vec<String> = service.alive_nodes().into_iter().filter(|n| !first.contains(n)).collect();
    assert_eq!(added.len(), 1, "{added:?}");
    // The most nodes is 2: no third request, however full the nodes are.
    assert_eq!(log.matches("scaler: asked for another checkpoint node").count(), 1, "{log}");

    // A new application's agents are placed on both nodes: its versions
    // land on the new one too.
    let lines =
        Job::start(2, &config, &["--app", "newcomer", "--steps", "2", "--every", "1", "--mib", "1", "--persist"], &[])
            .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=2 ")), "{lines:?}");
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "newcomer").expect("newcomer registered");
    assert!(app.agents.iter().any(|a| a.node == added[0]), "agents {:?} not on {}", app.agents, added[0]);
    assert!(service.down().status.success());
    assert!(slurm.jobs().is_empty(), "{:?}", slurm.jobs());
}

#[test]
fn a_node_slurm_asks_back_is_emptied_first_then_released_and_restarts_stay_bit_exact() {
    let slurm = TestSlurm::start("shrink", "cr", 2);
    let dynamic = "readInterval = 1\nscaler_interval = 0.5\ninit_agent_count = 2\nnode_selection = \"RR\"\n";
    let service = SlurmService::up_with_dynamic(&slurm, "shrink", "2", Some(dynamic));
    assert_eq!(service.alive_nodes().len(), 2);
    let config = service.config_path();
    // Versions of an application whose agents sit on both nodes, kept
    // after it ends.
    let lines =
        Job::start(2, &config, &["--app", "keeper", "--steps", "4", "--every", "2", "--mib", "8", "--persist"], &[])
            .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "keeper").unwrap();
    let mut homes: Vec<String> = app.agents.iter().map(|a| a.node.clone()).collect();
    homes.sort();
    homes.dedup();
    assert_eq!(homes.len(), 2, "agents on both nodes: {:?}", app.agents);

    // Slurm wants one back: an administrator drains it.
    let leaving = homes[1].clone();
    slurm.run("scontrol", &["update", &format!("NodeName={leaving}"), "State=DRAIN", "Reason=icheck-test"]);
    wait_for("the drained node's manager job to end", Duration::from_secs(90), || {
        manager_jobs(&slurm).iter().all(|(_, _, node)| *node != leaving)
    });
    // Its versions moved away before its manager went.
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "keeper").unwrap();
    assert!(app.agents.iter().all(|a| a.node != leaving), "agents left on {leaving}: {:?}", app.agents);
    let log = std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap();
    assert!(log.contains("released checkpoint node"), "{log}");
    // Moved over the fabric, agent to agent (the PFS holds no copy of it).
    let moved = log.lines().find(|l| l.contains("agents changed")).unwrap_or_else(|| panic!("{log}"));
    assert!(moved.contains("moved_bytes=") && !moved.contains("moved_bytes=0 "), "{moved}");
    assert!(!service.dir.join("pfs/keeper/v3").exists(), "version 3 is on the PFS: the test would prove nothing");
    assert_eq!(manager_jobs(&slurm).len(), 1, "{:?}", slurm.jobs());
    // Not started again, though its manager is gone.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(manager_jobs(&slurm).len(), 1, "the released node got a manager again: {:?}", slurm.jobs());

    // The restart reads every rank from the remaining node, bit-exact.
    let lines = Job::start(2, &config, &["--app", "keeper", "--steps", "6", "--every", "2", "--mib", "8"], &[])
        .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
}

#[test]
fn manager_count_caps_horizontal_scaling() {
    let slurm = TestSlurm::start("capped", "cm", 2);
    let dynamic = "readInterval = 1\nis_dynamic_hs = true\nmanager_count = 1\nmax_mem_node = 0.049\n\
                   lower_threshold = 0.3\nupper_threshold = 0.4\ndepletion_threshold = \"1MiB\"\n\
                   scaler_interval = 0.5\n";
    let service = SlurmService::up_with_dynamic(&slurm, "capped", "1..2", Some(dynamic));
    let config = service.config_path();
    let lines = Job::start(
        2,
        &config,
        &["--app", "filler", "--steps", "10", "--every", "1", "--mib", "12", "--step-ms", "300", "--persist"],
        &[],
    )
    .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=10 ")), "{lines:?}");
    // The node filled past the thresholds, but manager_count = 1 is reached.
    std::thread::sleep(Duration::from_secs(2));
    let log = std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap();
    assert!(!log.contains("scaler: asked for another checkpoint node"), "{log}");
    assert_eq!(service.alive_nodes().len(), 1);
    assert_eq!(manager_jobs(&slurm).len(), 1, "{:?}", slurm.jobs());
}

/// A user's batch job in the form of `examples/slurm/job.sbatch`: `icheck
/// run` as the batch script, `srun` steps of the MPI application inside the
/// allocation. Slurm kills the first step (as a node or rank failure
/// would); icheck run starts a new step, which restarts from the newest
/// version, and the job completes.
#[test]
fn a_batch_job_under_icheck_run_relaunches_a_killed_srun_step_inside_its_allocation() {
    let slurm = TestSlurm::start("batch", "cb", 3);
    let service = SlurmService::up(&slurm, "batch", "1");
    let example = icheck_in_target().with_file_name("mpi_checkpoint");
    let output = slurm.path("job.out");
    let script = format!(
        "exec '{icheck}' run --state-dir '{dir}' --app batch --max-restarts 2 -- \
         srun --mpi=pmix -n 2 '{example}' --app batch --steps 30 --every 2 --mib 4 --step-ms 100 --persist",
        icheck = icheck_in_target().display(),
        dir = service.dir.display(),
        example = example.display(),
    );
    let job = slurm.sbatch(&[
        "--nodes=2",
        "--ntasks=2",
        &format!("--output={}", output.display()),
        &format!("--wrap={script}"),
    ]);
    let read = || std::fs::read_to_string(&output).unwrap_or_default();
    wait_for("the first step's third version", Duration::from_secs(90), || read().contains("COMMITTED version=3 "));
    // Slurm kills the step; the batch script (icheck run) lives on.
    slurm.kill_first_step_and_wait(job, &output, Duration::from_secs(180));
    let text = read();
    assert!(text.contains("icheck run: relaunching (attempt 2"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("RESTORED version=") && l.ends_with(" verified")), "{text}");
    assert!(text.contains("icheck run: the job succeeded after 2 attempt(s), 1 failure(s)"), "{text}");
    let state = slurm.job_state(job);
    assert!(state.contains("JobState=COMPLETED") && state.contains("ExitCode=0:0"), "{state}");
}

/// The README's `examples/slurm/job.sbatch` itself, submitted as a user
/// would, against an installed icheck and heat2d compiled with it: only the
/// allocation's size and the problem's size are overridden. Slurm kills the
/// first step; the script's `icheck run` relaunches heat2d inside the
/// allocation, which restarts from the checkpoint nodes' memory and ends
/// with the checksum of a fault-free run.
#[test]
fn the_readme_batch_script_relaunches_heat2d_to_the_fault_free_checksum() {
    let installed = common::install::install("slurm-job");
    let heat2d = installed.compile("mpicc", "examples/heat2d/heat2d.c", &["-std=c99", "-O2"]);
    let slurm = TestSlurm::start("script", "cs", 3);
    let service = SlurmService::up(&slurm, "script", "1");
    let config = service.config_path();
    let size = "--n 1024 --iters 6000 --every 500";

    let shm = service.dir.join("mpi-shm");
    let args: Vec<&str> = size.split(' ').chain(["--app", "fault-free"]).collect();
    let clean = common::install::mpirun_np(2, &config, &shm, &heat2d, &args, &[]);
    let expected = common::install::checksum(&clean);

    let output = slurm.path("heat2d.out");
    let path = format!("{}:{}", installed.prefix.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let job = slurm.sbatch(&[
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=10",
        &format!("--chdir={}", installed.prefix.display()),
        &format!("--output={}", output.display()),
        &format!("--export=ALL,PATH={path},ICHECK_CONFIG={},HEAT2D_ARGS={size}", config.display()),
        common::install::repo().join("examples/slurm/job.sbatch").to_str().unwrap(),
    ]);
    let read = || std::fs::read_to_string(&output).unwrap_or_default();
    wait_for("heat2d's second commit", Duration::from_secs(120), || read().contains("COMMITTED iteration 500 "));
    slurm.kill_first_step_and_wait(job, &output, Duration::from_secs(240));
    let text = read();
    assert!(text.contains("icheck run: relaunching (attempt 2"), "{text}");
    assert!(text.contains("RESTARTED at iteration "), "{text}");
    let got = text.lines().find_map(|l| l.strip_prefix("CHECKSUM ")).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(got.trim(), expected, "{text}");
    let state = slurm.job_state(job);
    assert!(state.contains("JobState=COMPLETED") && state.contains("ExitCode=0:0"), "{state}");
}

/// Algorithm 9 on request: `icheck release --count 1` picks a node, moves
/// its applications' agents away and releases it; releasing every node is
/// refused, as is releasing without a resource manager.
#[test]
fn icheck_release_gives_back_the_node_algorithm_9_picks_after_moving_its_versions() {
    let slurm = TestSlurm::start("release", "cl", 3);
    let dynamic = "readInterval = 1\nscaler_interval = 0.5\ninit_agent_count = 3\nnode_selection = \"RR\"\n";
    let service = SlurmService::up_with_dynamic(&slurm, "release", "3", Some(dynamic));
    let config = service.config_path();
    let lines =
        Job::start(3, &config, &["--app", "three", "--steps", "4", "--every", "2", "--mib", "4", "--persist"], &[])
            .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let icheck = |args: &[&str]| {
        Command::new(icheck_in_target())
            .args(args)
            .arg("--state-dir")
            .arg(&service.dir)
            .env("SLURM_CONF", &slurm.conf)
            .output()
            .unwrap()
    };
    let all = service.alive_nodes();
    let refused = icheck(&["release", &all[0], &all[1], &all[2]]);
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && text.contains("would leave no checkpoint node"), "{text}");

    let released = icheck(&["release", "--count", "1", "--wait", "120"]);
    let text = String::from_utf8_lossy(&released.stdout);
    assert!(released.status.success(), "{text}{}", String::from_utf8_lossy(&released.stderr));
    let node =
        text.lines().find_map(|l| l.strip_prefix("icheck release: released ")).unwrap_or_else(|| panic!("{text}"));
    assert!(all.contains(&node.to_string()), "{node} not among {all:?}");
    wait_for("the released node's job to end", Duration::from_secs(60), || {
        manager_jobs(&slurm).iter().all(|(_, _, n)| n != node)
    });
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "three").unwrap();
    assert!(app.agents.iter().all(|a| a.node != node), "{:?}", app.agents);
    let lines = Job::start(3, &config, &["--app", "three", "--steps", "6", "--every", "2", "--mib", "4"], &[])
        .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
}

/// A release while an application commits: the node drains, the
/// application's next probe moves its agents off it (while it commits
/// nothing), only then is the node released; no version is lost and the
/// restart afterwards is bit-exact.
#[test]
fn a_node_released_while_an_application_commits_loses_no_version() {
    let slurm = TestSlurm::start("live", "cv", 2);
    let dynamic = "readInterval = 1\nscaler_interval = 0.5\ninit_agent_count = 2\nnode_selection = \"RR\"\n";
    let service = SlurmService::up_with_dynamic(&slurm, "live", "2", Some(dynamic));
    let config = service.config_path();
    let mut job = Job::start(
        2,
        &config,
        &[
            "--app",
            "live",
            "--steps",
            "40",
            "--every",
            "2",
            "--mib",
            "4",
            "--step-ms",
            "150",
            "--probe-every",
            "2",
            "--persist",
        ],
        &[],
    );
    job.wait_line("COMMITTED version=4 ", Duration::from_secs(120));
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "live").unwrap();
    let leaving = app.agents.last().unwrap().node.clone();
    let out = Command::new(icheck_in_target())
        .args(["release", &leaving, "--wait", "120", "--state-dir"])
        .arg(&service.dir)
        .env("SLURM_CONF", &slurm.conf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}\ncontroller log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap_or_default()
    );
    let lines = job.finish(Duration::from_secs(180));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=21 step=40")), "{lines:?}");
    let status = service.status();
    let app = status.apps.iter().find(|a| a.registration.name == "live").unwrap();
    assert!(app.agents.iter().all(|a| a.node != leaving), "{:?}", app.agents);
    let lines = Job::start(2, &config, &["--app", "live", "--steps", "42", "--every", "2", "--mib", "4"], &[])
        .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=21 step=40 verified"), "{lines:?}");
}

/// A checkpoint node lost for good (Slurm has it down: its manager job
/// killed, its memory gone) while no other node is free: the rebuild gives
/// the node up and asks Slurm for another in its place, instead of doubling
/// up on a survivor, and the version is protected on three distinct nodes
/// again without a restart. The restart is bit-exact and reads no PFS.
#[test]
fn a_lost_node_is_replaced_through_slurm_and_the_version_rebuilt_on_the_new_one() {
    let slurm = TestSlurm::start("replace", "cx", 4);
    let service = SlurmService::up_with_dynamic(&slurm, "replace", "3..4", Some("readInterval = 1\n"));
    let before = service.alive_nodes();
    assert_eq!(before.len(), 3, "{before:?}");
    let config = service.config_path();
    let env = [("ICHECK_REDUNDANCY", "rs:2+1")];
    let args = ["--app", "rx", "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(4, &config, &args, &env).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
    let app = |service: &SlurmService| service.status().apps.into_iter().find(|a| a.registration.name == "rx").unwrap();
    wait_for("version 3 protected", Duration::from_secs(60), || {
        let report = app(&service);
        report.protected == Some(3) && report.protecting.is_none()
    });
    let lost = app(&service).agents[0].node.clone();

    // The machine fails: Slurm loses it, its manager dies with it, and
    // what the manager held in memory is gone.
    let manager = service.status().nodes.into_iter().find(|n| n.node == lost).unwrap().pid;
    slurm.fail_node(&lost);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(manager as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    std::fs::remove_dir_all(StaticConfig::load(&config).unwrap().agent_store_dir.join(&lost)).unwrap();

    let mut last = None;
    let rebuilt = poll_until(Duration::from_secs(180), || {
        let report = app(&service);
        let nodes: std::collections::BTreeSet<&str> = report.agents.iter().map(|a| a.node.as_str()).collect();
        let done = nodes.len() == 3
            && !nodes.contains(lost.as_str())
            && report.protected == Some(3)
            && report.protecting.is_none()
            && !report.rebuilding
            && report.protection_problem.is_none();
        last = Some(report);
        done
    });
    let log = std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap();
    assert!(
        rebuilt,
        "version 3 is not protected on three other nodes than {lost}: {last:?}\n{log}\n{:?}",
        slurm.jobs()
    );
    let report = last.unwrap();
    let added: Vec<&str> =
        report.agents.iter().map(|a| a.node.as_str()).filter(|n| !before.iter().any(|b| b == n)).collect();
    assert_eq!(added.len(), 1, "one agent on the node Slurm gave: {:?} (before {before:?})", report.agents);
    let asked = log
        .lines()
        .find(|l| l.contains("asked the resource manager for a node in place of a lost one"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(asked.contains(&lost) && asked.contains("Slurm job"), "{asked}");
    // Given up: no manager job waits for the down node, and the status
    // says it is gone.
    assert!(manager_jobs(&slurm).iter().all(|(_, _, node)| *node != lost), "{:?}", slurm.jobs());
    let gone = service.status().nodes.into_iter().find(|n| n.node == lost).unwrap();
    assert!(!gone.alive && gone.given_up, "{gone:?}");

    let args = ["--app", "rx", "--steps", "6", "--every", "2", "--mib", "2", "--persist"];
    let lines = Job::start(4, &config, &args, &env).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l == "RESTORED version=3 step=4 verified"), "{lines:?}");
    let pfs = icheck_core::pfs::PfsStore::new(StaticConfig::load(&config).unwrap().pfs_dir.expect("a PFS"));
    assert_eq!(pfs.versions("rx").unwrap_or_default(), Vec::<u64>::new(), "restored from the PFS: proves nothing");
    assert!(service.down().status.success());
    assert!(slurm.jobs().is_empty(), "{:?}", slurm.jobs());
}

/// A manager job whose manager stays silent while alive (SIGSTOPped for
/// good) is killed through Slurm (`scancel --full --signal=KILL`) after
/// `KillSilentManagerAfter`; the job ends, the controller submits a new
/// one for the same node, and the manager it starts brings back the
/// versions its store kept: the job killed meanwhile restarts bit-exact
/// from agent memory, not from the PFS.
#[test]
fn a_silent_manager_job_is_killed_through_slurm_and_its_versions_come_back() {
    let slurm = TestSlurm::start("silent", "cq", 2);
    let service = SlurmService::up_with(&slurm, "silent", "1", None, &["--kill-silent-after", "4"]);
    let config = service.config_path();
    let args = ["--app", "sq", "--steps", "20", "--every", "2", "--mib", "4", "--hang-after", "3"];
    let mut job = Job::start(2, &config, &args, &[]);
    job.wait_line("HANG", Duration::from_secs(120));
    let (victim, _, node) = manager_jobs(&slurm).first().cloned().expect("a manager job runs");
    let manager = service.status().nodes.into_iter().find(|n| n.node == node).expect("its node is known").pid;
    let stop = |signal| nix::sys::signal::kill(nix::unistd::Pid::from_raw(manager as i32), signal);
    stop(nix::sys::signal::Signal::SIGSTOP).unwrap();
    job.kill();

    let back = poll_until(Duration::from_secs(120), || {
        manager_jobs(&slurm).iter().any(|(id, _, n)| *id != victim && *n == node)
            && service.status().nodes.iter().any(|n| n.node == node && n.alive && n.pid != manager)
    });
    let log = std::fs::read_to_string(service.dir.join("logs/controller.log")).unwrap_or_default();
    if !back {
        let _ = stop(nix::sys::signal::Signal::SIGCONT);
    }
    assert!(back, "the silent manager of {node} was not killed and started again: {:?}\n{log}", slurm.jobs());
    assert!(log.contains(&format!("sent SIGKILL to Slurm job(s) {victim} on {node}")), "{log}");
    let lines = Job::start(2, &config, &["--app", "sq", "--steps", "8", "--every", "2", "--mib", "4"], &[])
        .finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("RESTORED version=3 ") && l.ends_with("verified")), "{lines:?}");
    let pfs = icheck_core::pfs::PfsStore::new(StaticConfig::load(&config).unwrap().pfs_dir.expect("a PFS"));
    assert_eq!(pfs.versions("sq").unwrap_or_default(), Vec::<u64>::new(), "restored from the PFS: proves nothing");
}
