//! A checkpoint node cut off from the network while a job commits to it:
//! the nodes are network namespaces (see `icheck_service::testkit::netns`)
//! and the node's link goes down, so its manager and agent run on with
//! their TCP connections open but reach nobody. Other fault tests stop or
//! kill the manager's process; here only the network fails. In a test
//! binary of its own, so it never runs beside other namespaced clusters.
//! Needs root, as CI has.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{assert_restarts_from, committed, kill_for_a_restart, restored, wait_for_more_commits, Job};
use icheck_core::protocol::StatusReport;
use icheck_service::testkit::icheck_in_target;
use icheck_service::testkit::netns::NetCluster;
use icheck_service::testkit::poll_until;

/// The nodes holding `app`'s agents.
fn agent_nodes(status: &StatusReport, app: &str) -> BTreeSet<String> {
    status
        .apps
        .iter()
        .filter(|a| a.registration.name == app)
        .flat_map(|a| a.agents.iter().map(|agent| agent.node.clone()))
        .collect()
}

/// The `seconds=S` of a job's `COMMITTED` line.
fn seconds(line: &str) -> Option<f64> {
    line.strip_prefix("COMMITTED ")?.split(' ').find_map(|field| field.strip_prefix("seconds=")?.parse().ok())
}

/// Waits until `job`, which wrote to the PFS while no node could be
/// reached, has tried the service again (every `t_wait`) and commits to
/// agents, which the controller lists for `app`.
fn back_on_agents(cluster: &NetCluster, job: &Job, app: &str) {
    let back = poll_until(Duration::from_secs(30), || job.output().contains("the service is reachable again"));
    assert!(back, "the job stayed on the PFS:\n{}\n{}", job.output(), cluster.log("controller"));
    let listed = agent_nodes(&cluster.status(), app);
    assert!(!listed.is_empty(), "no agents listed for {app}:\n{}", cluster.log("controller"));
}

/// The node of `app`'s one agent on a two-node cluster, and the other node.
fn the_agents_node_and_the_other(cluster: &NetCluster, app: &str) -> (String, &'static str) {
    let nodes = agent_nodes(&cluster.status(), app);
    assert_eq!(nodes.len(), 1, "one agent on one node: {nodes:?}");
    let node = nodes.into_iter().next().unwrap();
    let other = if node == "n1" { "n2" } else { "n1" };
    (node, other)
}

/// Whether the controller counts `node` alive.
fn alive(status: &StatusReport, node: &str) -> bool {
    status.nodes.iter().any(|n| n.node == node && n.alive)
}

/// A cluster of two nodes and a 4-rank job of `app` on it (2 MiB per rank,
/// a commit every 20 ms, asynchronous ones with `asynchronous`,
/// `init_agent_count` agents, `env` besides the cluster's), once the job
/// has committed version 5.
fn cluster_and_job(app: &str, init_agent_count: u32, env: &[(&str, &str)], asynchronous: bool) -> (NetCluster, Job) {
    let dynamic = format!("readInterval = 0.5\ninit_agent_count = {init_agent_count}\nmax_agents_node = 4\n");
    let cluster = NetCluster::start(&icheck_in_target(), app, 2, None, &dynamic);
    let env = [cluster.app_env().as_slice(), env].concat();
    let mut args = running(app).to_vec();
    if asynchronous {
        args.push("--async");
    }
    let mut job = Job::start(4, &cluster.client_config, &args, &env);
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    (cluster, job)
}

/// The arguments of a job of `app` that commits until it is killed.
fn running(app: &str) -> [&str; 10] {
    ["--app", app, "--steps", "100000", "--every", "1", "--mib", "2", "--step-ms", "20"]
}

/// Takes every node's link down, or brings them all back.
fn cut_all(cluster: &NetCluster, cut: bool) {
    for node in ["n1", "n2"] {
        if cut {
            cluster.cut(node);
        } else {
            cluster.mend(node);
        }
    }
}

/// Kills `job` and checks that a restart of `app` (with `env` besides the
/// cluster's) restores the last version it reported complete (or the one
/// it was completing), verified.
fn kill_and_restart_bit_exact(cluster: &NetCluster, job: Job, app: &str, env: &[(&str, &str)]) {
    let told = kill_for_a_restart(job);
    let env = [cluster.app_env().as_slice(), env].concat();
    assert_restarts_from(told, 4, &cluster.client_config, &env, app, "2");
}

/// One agent on one of two nodes; that node's link goes down mid-job. The
/// controller marks it down after its missed heartbeats; the ranks waiting
/// on the cut-off agent learn so from the controller (their own request
/// bound is 600 s here), get a new agent on the other node and go on
/// committing. When the link comes back the manager answers again, its
/// replaced agent is stopped, and a restart after the job is killed is
/// bit-exact.
#[test]
fn a_node_cut_off_mid_job_is_replaced_and_rejoins_when_its_link_returns() {
    cut_a_node_mid_job("cutn", &[("ICHECK_TRANSFER", "pull")], false);
}

/// The same with pushed commits: a rank's own writes to the cut-off agent
/// stall, and so does its wait for the agent's answer.
#[test]
fn a_node_cut_off_mid_job_under_pushed_commits_is_replaced_too() {
    cut_a_node_mid_job("cutp", &[("ICHECK_TRANSFER", "push")], false);
}

/// The same with asynchronous commits in SHMR mode: the node leader's
/// background transfer is what waits on the cut-off agent.
#[test]
fn a_node_cut_off_mid_job_under_async_shmr_commits_is_replaced_too() {
    cut_a_node_mid_job("cuts", &[("ICHECK_MODE", "shmr")], true);
}

/// Runs the scenario above for an application named `app`, with `env`
/// (how commits move) and `asynchronous` commits.
fn cut_a_node_mid_job(app: &str, env: &[(&str, &str)], asynchronous: bool) {
    // A request bound far beyond the test's: the ranks must not wait it out
    // on the cut-off agent, but learn from the controller that it was
    // given up.
    let job_env = [env, &[("ICHECK_REQUEST_TIMEOUT", "600")]].concat();
    let (cluster, job) = cluster_and_job(app, 1, &job_env, asynchronous);
    let (cut, other) = the_agents_node_and_the_other(&cluster, app);

    cluster.cut(&cut);
    let at_cut = committed(&job.lines()).last().copied().unwrap_or(5);
    let marked_down = poll_until(Duration::from_secs(20), || !alive(&cluster.status(), &cut));
    assert!(marked_down, "{cut} was not marked down:\n{}", cluster.log("controller"));
    // The ranks waiting on the cut-off agent ask the controller, learn that
    // it gave the agent up, and store the version on a new one.
    let during = wait_for_more_commits(&job, at_cut, 3, Duration::from_secs(60));
    let stalled = job.lines().iter().filter_map(|l| seconds(l)).fold(0.0, f64::max);
    assert!(stalled < 60.0, "a commit waited {stalled} s:\n{}", job.output());
    let moved = agent_nodes(&cluster.status(), app);
    assert_eq!(moved, BTreeSet::from([other.to_string()]), "{}", cluster.log("controller"));

    cluster.mend(&cut);
    let back = poll_until(Duration::from_secs(30), || alive(&cluster.status(), &cut));
    assert!(back, "{cut} did not answer again:\n{}\n{}", cluster.log("controller"), cluster.log(&cut));
    let stopped = poll_until(Duration::from_secs(30), || {
        cluster.log("controller").contains("stopping an agent that was replaced while its node was silent")
            && cluster.status().nodes.iter().any(|n| n.node == cut && n.status.agents == 0)
    });
    assert!(stopped, "the replaced agent on {cut} still runs:\n{}", cluster.log("controller"));
    wait_for_more_commits(&job, during, 3, Duration::from_secs(60));
    kill_and_restart_bit_exact(&cluster, job, app, env);
}

/// Both checkpoint nodes cut off at once: no agent can be reached and
/// none can be placed. The job's versions go straight to the PFS (the
/// library's fallback) until the links return; then commits go back to
/// the nodes' memory, and a restart after the job is killed is bit-exact.
#[test]
fn every_node_cut_off_at_once_sends_the_job_to_the_pfs_until_the_links_return() {
    let (cluster, job) =
        cluster_and_job("cutall", 2, &[("ICHECK_REQUEST_TIMEOUT", "600"), ("ICHECK_T_WAIT", "2")], false);
    cut_all(&cluster, true);
    let at_cut = committed(&job.lines()).last().copied().unwrap_or(5);
    let during = wait_for_more_commits(&job, at_cut, 5, Duration::from_secs(60));
    // Cut for a while longer: tries of the service every t_wait (2 s)
    // find no node, and the versions keep going to the PFS meanwhile.
    std::thread::sleep(Duration::from_secs(6));
    let during = wait_for_more_commits(&job, during, 5, Duration::from_secs(30));
    let pfs = job.output().matches("checkpoints go directly to the PFS").count();
    assert!(pfs > 0, "the job did not fall back to the PFS:\n{}", job.output());
    cut_all(&cluster, false);
    let back = poll_until(Duration::from_secs(30), || {
        let status = cluster.status();
        alive(&status, "n1") && alive(&status, "n2")
    });
    assert!(back, "the nodes did not answer again:\n{}", cluster.log("controller"));
    back_on_agents(&cluster, &job, "cutall");
    let on_agents = committed(&job.lines()).last().copied().unwrap_or(during);
    wait_for_more_commits(&job, on_agents, 3, Duration::from_secs(60));
    kill_and_restart_bit_exact(&cluster, job, "cutall", &[]);
}

/// A job killed while every checkpoint node is cut off, after its newest
/// versions went to the PFS, restarts from there while the nodes are
/// still unreachable (before 2026-12-05 its `init` failed: "no live
/// checkpoint node") and goes on writing to the PFS; once the links
/// return, its commits go back to the nodes' memory, and a restart after
/// it is killed again is bit-exact.
#[test]
fn a_job_killed_while_every_node_is_cut_off_restarts_from_its_pfs_versions() {
    let extra = [("ICHECK_REQUEST_TIMEOUT", "600"), ("ICHECK_T_WAIT", "2")];
    let (cluster, mut job) = cluster_and_job("cutkill", 2, &extra, false);
    cut_all(&cluster, true);
    let at_cut = committed(&job.lines()).last().copied().unwrap_or(5);
    wait_for_more_commits(&job, at_cut, 5, Duration::from_secs(60));
    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");

    let env = [cluster.app_env().as_slice(), &extra].concat();
    let mut job = Job::start(4, &cluster.client_config, &running("cutkill"), &env);
    job.wait_line("RESTORED", Duration::from_secs(60));
    let back = restored(&job.lines()).unwrap_or_else(|| panic!("no restart after version {told}: {}", job.output()));
    assert!(back == told || back == told + 1, "told {told}, restored {back}: {}", job.output());
    let going_on = wait_for_more_commits(&job, back, 5, Duration::from_secs(60));
    assert!(job.output().contains("checkpoints go directly to the PFS"), "{}", job.output());

    cut_all(&cluster, false);
    back_on_agents(&cluster, &job, "cutkill");
    let on_agents = committed(&job.lines()).last().copied().unwrap_or(going_on);
    wait_for_more_commits(&job, on_agents, 3, Duration::from_secs(60));
    kill_and_restart_bit_exact(&cluster, job, "cutkill", &[]);
}

/// A partition only the job sees: the node holding its agent still
/// heartbeats to the controllers (each in a namespace of its own) and
/// reaches the other node, but nothing it sends reaches the job's hosts.
/// The controller cannot tell, so the job tells it: the ranks' requests to
/// the agent time out (`client.request_timeout`, 5 s here), the next probe
/// names the agent, and the controller moves it to the other node, taking
/// the newest version over between the nodes. Before 2026-12-05 the
/// controller saw a live node and kept the agent, and the job wrote every
/// version to the PFS until the path came back.
///
/// Then the other way round, at restart: the job is killed, its new node
/// is cut off from the job's hosts, and a restart, handed the agent that
/// holds its files there, cannot reach it; `init` names it, and the
/// restart reads its version from an agent on the first node, bit-exact.
#[test]
fn a_node_only_the_job_cannot_reach_loses_the_jobs_agents_mid_run_and_at_restart() {
    cut_only_from_the_job("cutjob", "pull");
}

/// The same with pushed commits: a rank's writes to the agent may stall on
/// the cut as well as its wait for the agent's answer; either names the
/// agent.
#[test]
fn a_node_only_the_job_cannot_reach_under_pushed_commits_loses_the_jobs_agents_too() {
    cut_only_from_the_job("cutjobp", "push");
}

/// Runs the scenario above for an application named `app` whose commits
/// move their bytes by `transfer` ("pull" or "push").
fn cut_only_from_the_job(app: &str, transfer: &str) {
    let dynamic = "readInterval = 0.5\ninit_agent_count = 1\nmax_agents_node = 4\n";
    let cluster = NetCluster::start_with_standby(&icheck_in_target(), app, 2, dynamic);
    let env = [("ICHECK_TRANSFER", transfer), ("ICHECK_REQUEST_TIMEOUT", "5")];
    let job_env = [cluster.app_env().as_slice(), &env].concat();
    let mut job = Job::start(4, &cluster.client_config, &running(app), &job_env);
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    let (first, second) = the_agents_node_and_the_other(&cluster, app);

    cluster.cut_from_jobs(&first);
    let at_cut = committed(&job.lines()).last().copied().unwrap_or(5);
    let during = wait_for_more_commits(&job, at_cut, 3, Duration::from_secs(90));
    let status = cluster.status();
    let moved = agent_nodes(&status, app);
    assert_eq!(moved, BTreeSet::from([second.to_string()]), "{}", cluster.log("c1"));
    assert!(alive(&status, &first), "{first} should still heartbeat: the cut is only the job's");
    let report = status.apps.iter().find(|a| a.registration.name == app).expect("the application in the status");
    let unreached: Vec<&str> = report.unreached_nodes.iter().map(|(node, _)| node.as_str()).collect();
    assert_eq!(unreached, [first.as_str()], "the status names the node the job cannot reach");
    let job_said = job.output().contains("ranks could not reach these agents; telling the controller");
    assert!(job_said, "the job did not name the agent it could not reach:\n{}", job.output());
    assert!(
        !job.output().contains("checkpoints go directly to the PFS"),
        "the job fell back to the PFS instead of moving:\n{}\n{}",
        job.output(),
        cluster.log("c1")
    );
    // The stall is the request bound plus the move, not a PFS detour.
    let stalled = job.lines().iter().filter_map(|l| seconds(l)).fold(0.0, f64::max);
    assert!(stalled < 30.0, "a commit waited {stalled} s:\n{}", job.output());
    eprintln!("the longest commit across the cut took {stalled:.2} s");
    cluster.mend_from_jobs(&first);
    wait_for_more_commits(&job, during, 3, Duration::from_secs(60));

    // The restart's side: its agent's node cut off from the job's hosts.
    let told = kill_for_a_restart(job);
    cluster.cut_from_jobs(second);
    let restart = assert_restarts_from(told, 4, &cluster.client_config, &job_env, app, "2");
    assert!(
        restart.contains("an agent is unreachable at init"),
        "the restart did not meet the cut:\n{restart}\n{}",
        cluster.log("c1")
    );
    let placed = agent_nodes(&cluster.status(), app);
    assert!(!placed.contains(second), "the job's agents stayed behind the cut: {placed:?}");
    cluster.mend_from_jobs(second);
}
