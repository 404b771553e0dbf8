//! Versions survive lost checkpoint nodes: real managers (four or more,
//! each with its own store), real MPI jobs asking for `partner` or
//! `rs:K+M`, a manager killed with its store deleted (a lost node), the
//! version rebuilt on the survivors without the PFS, protected again, and
//! a restart bit-exact; losses beyond the policy name the missing ranks.

mod common;

use std::time::Duration;

use common::Job;
use icheck_core::protocol::AppReport;
use icheck_service::testkit::{icheck_in_target, metric_sample, poll_until, LocalService};

fn service(name: &str, managers: u32) -> LocalService {
    LocalService::up(&icheck_in_target(), name, managers, &["--provider", "tcp", "--manager-relaunches", "0"])
}

fn app(service: &LocalService, name: &str) -> AppReport {
    service.status().apps.into_iter().find(|a| a.registration.name == name).expect("the application is known")
}

/// Waits until `name`'s `version` is protected again (not rebuilding).
fn wait_protected(service: &LocalService, name: &str, version: u64) -> AppReport {
    let mut last = None;
    let done = poll_until(Duration::from_secs(60), || {
        let report = app(service, name);
        let done = report.protected == Some(version) && !report.rebuilding && report.protection_problem.is_none();
        last = Some(report);
        done
    });
    let last = last.unwrap();
    assert!(done, "version {version} of {name} is not protected: {:?} {:?}", last.protected, last.protection_problem);
    last
}

/// Kills the manager of `node` and deletes its store: the node and
/// everything in its memory are gone.
fn lose_node(service: &LocalService, node: &str) {
    lose_nodes(service, &[node]);
}

/// [`lose_node`] for several nodes at once (all killed before any store goes).
fn lose_nodes(service: &LocalService, nodes: &[&str]) {
    let pids: Vec<u32> = nodes.iter().map(|node| service.pid_of(&format!("manager-{node}"))).collect();
    for pid in &pids {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    }
    for pid in pids {
        assert!(poll_until(Duration::from_secs(10), || !icheck_service::testkit::process_running(pid)));
    }
    for node in nodes {
        std::fs::remove_dir_all(service.config.agent_store_dir.join(node)).unwrap();
    }
}

/// The first job: four ranks commit versions 1 to 3 and finish with IC_PERSIST.
fn commit_three(service: &LocalService, name: &str, policy: &str) {
    let args = ["--app", name, "--steps", "4", "--every", "2", "--mib", "2", "--persist"];
    let env = [("ICHECK_REDUNDANCY", policy)];
    let lines = Job::start(4, &service.config_path(), &args, &env).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED version=3 step=4")), "{lines:?}");
}

/// A restart from version 3, bit-exact, that commits once more.
fn restart_bit_exact(service: &LocalService, name: &str, policy: &str, steps: u32) {
    let steps = steps.to_string();
    let args = ["--app", name, "--steps", &steps, "--every", "2", "--mib", "2", "--persist"];
    let env = [("ICHECK_REDUNDANCY", policy)];
    let lines = Job::start(4, &service.config_path(), &args, &env).finish(Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.starts_with("RESTORED version=") && l.ends_with("verified")), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("COMMITTED")), "{lines:?}");
}

/// Nothing of the application ever reached the PFS: what was restored came
/// from the checkpoint nodes' memory.
fn pfs_untouched(service: &LocalService, name: &str) {
    let pfs = icheck_core::pfs::PfsStore::new(service.config.pfs_dir.clone().expect("icheck up configures a PFS"));
    assert_eq!(pfs.versions(name).unwrap_or_default(), Vec::<u64>::new(), "{name} has versions on the PFS");
}

#[test]
fn partner_copies_rebuild_a_lost_node_and_survive_a_second_loss() {
    let service = service("red-partner", 4);
    commit_three(&service, "pa", "partner");
    let report = wait_protected(&service, "pa", 3);
    assert_eq!(report.redundancy.to_string(), "partner:2");
    assert!(report.exposure.unwrap() < 1e-3, "two copies: {:?}", report.exposure);
    let metrics = service.metrics();
    assert_eq!(metric_sample(&metrics, "icheck_app_protected_version{app=\"pa\"}"), Some(3.0), "{metrics}");
    let first = report.agents[0].node.clone();
    lose_node(&service, &first);
    let rebuilt = wait_protected(&service, "pa", 3);
    assert!(rebuilt.agents.iter().all(|a| a.node != first), "an agent is still on the lost node: {:?}", rebuilt.agents);
    // Protected again on the survivors: a second lost node is survived too.
    let second = rebuilt.agents.iter().map(|a| a.node.clone()).find(|n| *n != first).unwrap();
    lose_node(&service, &second);
    wait_protected(&service, "pa", 3);
    restart_bit_exact(&service, "pa", "partner", 6);
    pfs_untouched(&service, "pa");
    let controller = service.log("controller.log");
    assert!(controller.matches("rebuilt after a lost node").count() >= 2, "{controller}");
}

#[test]
fn reed_solomon_decodes_lost_ranks_and_names_them_when_too_many_are_lost() {
    let service = service("red-rs21", 4);
    commit_three(&service, "rs", "rs:2+1");
    let report = wait_protected(&service, "rs", 3);
    assert_eq!(report.agents.len(), 3, "rs:2+1 spreads the agents over three nodes: {:?}", report.agents);
    let first = report.agents[0].node.clone();
    lose_node(&service, &first);
    let rebuilt = wait_protected(&service, "rs", 3);
    restart_bit_exact(&service, "rs", "rs:2+1", 6);
    pfs_untouched(&service, "rs");
    // The restart committed version 4; once it is protected, two of its
    // three nodes go at once: more than one parity shard can make up for.
    wait_protected(&service, "rs", 4);
    let nodes: Vec<String> = app(&service, "rs").agents.iter().map(|a| a.node.clone()).collect();
    assert!(rebuilt.agents.iter().all(|a| a.node != first));
    lose_nodes(&service, &[&nodes[0], &nodes[1]]);
    let args = ["--app", "rs", "--steps", "10", "--every", "2", "--mib", "2"];
    let (ok, output) = Job::start(4, &service.config_path(), &args, &[("ICHECK_REDUNDANCY", "rs:2+1")])
        .finish_any(Duration::from_secs(300));
    assert!(!ok, "a restart after losing two of three nodes under rs:2+1 succeeded: {output}");
    assert!(output.contains("rebuilt") && output.contains("ranks ["), "the error names the missing ranks: {output}");
    assert!(output.contains(&nodes[0]) || output.contains(&nodes[1]), "the error names a lost node: {output}");
}

#[test]
fn a_damaged_parity_shard_is_refused_and_the_rank_decoded_from_the_others() {
    let service = service("red-rs22", 4);
    commit_three(&service, "rd", "rs:2+2");
    let report = wait_protected(&service, "rd", 3);
    assert_eq!(report.agents.len(), 4);
    // Flip a byte of every parity shard 0 on every node: each group still
    // has parity shard 1 and its surviving member.
    let store = &service.config.agent_store_dir;
    let mut damaged = 0;
    for agent in &report.agents {
        let pieces = store.join(&agent.node).join("rd").join("pieces");
        for entry in std::fs::read_dir(&pieces).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("v3.parity") && name.ends_with("-0.data") {
                let mut bytes = std::fs::read(entry.path()).unwrap();
                bytes[100] ^= 0x40;
                std::fs::write(entry.path(), bytes).unwrap();
                damaged += 1;
            }
        }
    }
    assert!(damaged > 0, "no parity shard 0 found under {}", store.display());
    lose_node(&service, &report.agents[0].node.clone());
    wait_protected(&service, "rd", 3);
    restart_bit_exact(&service, "rd", "rs:2+2", 6);
    pfs_untouched(&service, "rd");
    let managers: String = report.agents.iter().map(|a| service.log(&format!("manager-{}.log", a.node))).collect();
    assert!(managers.contains("is damaged at bytes"), "the damaged shard was not detected");
}

#[test]
fn rs_4_2_survives_two_lost_nodes_at_once() {
    let service = service("red-rs42", 6);
    commit_three(&service, "r42", "rs:4+2");
    let report = wait_protected(&service, "r42", 3);
    assert_eq!(report.agents.len(), 6, "rs:4+2 spreads the agents over six nodes: {:?}", report.agents);
    // The nodes of ranks 0 and 1: two members of one group, so both of its
    // parity shards are needed to decode them.
    let (a, b) = (report.agents[0].node.clone(), report.agents[1].node.clone());
    lose_nodes(&service, &[&a, &b]);
    let rebuilt = wait_protected(&service, "r42", 3);
    assert!(rebuilt.agents.iter().all(|agent| agent.node != a && agent.node != b), "{:?}", rebuilt.agents);
    restart_bit_exact(&service, "r42", "rs:4+2", 6);
    pfs_untouched(&service, "r42");
}
