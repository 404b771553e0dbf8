//! Checkpoint nodes on separate hosts: each manager runs in a network
//! namespace of its own, reached over veth links with the tcp provider (see
//! `icheck_service::testkit::netns`). Needs root, as CI has.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::Job;
use icheck_core::protocol::AppReport;
use icheck_service::testkit::netns::NetCluster;
use icheck_service::testkit::{icheck_in_target, metric_sample, wait_for};

fn app<'a>(status: &'a icheck_core::protocol::StatusReport, name: &str) -> &'a AppReport {
    status.apps.iter().find(|a| a.registration.name == name).unwrap_or_else(|| panic!("{name} in {status:?}"))
}

/// Each node's link carries 100 Mbit/s towards it, so agents on more nodes
/// pull a version faster, and more agents than nodes do not.
#[test]
fn agents_grow_while_commits_get_faster_then_settle_and_data_follows_them() {
    let dynamic = "readInterval = 0.5\ninit_agent_count = 1\nagent_selection = \"BW\"\nnode_selection = \"RR\"\ncandidate_count = 4\n";
    let cluster = NetCluster::start(&icheck_in_target(), "grow", 4, Some("100mbit"), dynamic);
    // 8 ranks x 1 MiB; a probe after every 4th commit (2 warm-up commits and 2 measured).
    let args = ["--app", "grow", "--steps", "23", "--every", "1", "--mib", "1", "--probe-every", "4", "--persist"];
    let lines = Job::start(8, &cluster.client_config, &args, &cluster.app_env()).finish(Duration::from_secs(300));
    let probes: Vec<&str> =
        lines.iter().filter(|l| l.starts_with("PROBE") || l.starts_with("VERIFIED")).map(|l| l.as_str()).collect();
    let changes: Vec<&str> = probes.iter().filter_map(|l| l.strip_prefix("PROBE agents=")?.split(' ').next()).collect();
    // 1 -> 2 -> 4 agents, each faster; 8 agents on 4 links are not, so back
    // to 4, and no more changes.
    assert_eq!(changes, ["2", "4", "8", "4"], "{}\n{}", lines.join("\n"), cluster.log("controller"));
    for (version, agents) in [(4, 2), (8, 4), (12, 8), (16, 4)] {
        assert!(probes.contains(&format!("VERIFIED version={version} agents={agents}").as_str()), "{probes:?}");
    }
    assert!(probes.last().is_some_and(|l| l.starts_with("PROBE unchanged")), "settled: {probes:?}");
    let status = cluster.status();
    let report = app(&status, "grow");
    let steps: Vec<(u32, u32)> = report.agent_changes.iter().map(|c| (c.from, c.to)).collect();
    assert_eq!(steps, [(1, 2), (2, 4), (4, 8), (8, 4)]);
    assert!(report.scaling_settled, "{report:?}");
    assert!(report.agent_changes.iter().all(|c| c.moved_bytes > 0), "ranks moved to other nodes: {report:?}");
    let nodes: BTreeSet<&str> = report.agents.iter().map(|a| a.node.as_str()).collect();
    assert_eq!(nodes.len(), 4, "four agents, one per node: {report:?}");
    assert_eq!(report.commits.last().map(|c| (c.version, c.agents)), Some((24, 4)), "{report:?}");
}

/// Strategies picked in the dynamic configuration while the service runs
/// place agents where they say, and `icheck status` and `/metrics` show
/// the managers' own counts.
#[test]
fn placement_follows_the_strategy_across_namespaced_nodes() {
    let stacked = "readInterval = 0.5\ninit_agent_count = 2\nmax_agents_node = 4\nagent_selection = \"BW\"\nnode_selection = \"FTC\"\ncandidate_count = 1\n";
    let cluster = NetCluster::start(&icheck_in_target(), "place", 3, None, stacked);
    let run = |name: &str| {
        let args = ["--app", name, "--steps", "6", "--every", "1", "--mib", "2", "--step-ms", "50", "--persist"];
        Job::start(2, &cluster.client_config, &args, &cluster.app_env()).finish(Duration::from_secs(120))
    };
    run("stacked");
    let status = cluster.status();
    let busy: BTreeSet<String> = app(&status, "stacked").agents.iter().map(|a| a.node.clone()).collect();
    assert_eq!(busy.len(), 1, "fill to completion stacks both agents on one node: {status:?}");
    let busy = busy.into_iter().next().unwrap();
    // Seven versions of two ranks: the busy node's manager counts 14 operations.
    wait_for("the busy node's report", Duration::from_secs(10), || {
        cluster.status().nodes.iter().any(|n| n.node == busy && n.status.checkpoint_ops == 14 && n.status.agents == 2)
    });
    // By bandwidth, round robin over two candidates: the two idle nodes.
    cluster.set_dynamic(&stacked.replace("FTC", "RR").replace("candidate_count = 1", "candidate_count = 2"));
    wait_for("the new dynamic configuration", Duration::from_secs(5), || {
        cluster.log("controller").contains("dynamic configuration changed")
    });
    run("spread");
    let status = cluster.status();
    let spread: Vec<String> = app(&status, "spread").agents.iter().map(|a| a.node.clone()).collect();
    assert_eq!(spread.len(), 2, "{status:?}");
    assert!(spread[0] != spread[1] && !spread.contains(&busy), "spread over the idle nodes, not {busy}: {spread:?}");
    // Each spread agent sealed 7 versions of one rank.
    wait_for("every node's report", Duration::from_secs(10), || {
        cluster.status().nodes.iter().all(|n| n.status.checkpoint_ops == if n.node == busy { 14 } else { 7 })
    });
    let (status, text) = (cluster.status(), cluster.metrics());
    for node in &status.nodes {
        let label = format!("{{node=\"{}\"}}", node.node);
        let metric = |name: &str| metric_sample(&text, &format!("{name}{label}"));
        assert_eq!(
            metric("icheck_node_checkpoint_operations_total"),
            Some(node.status.checkpoint_ops as f64),
            "{text}"
        );
        assert_eq!(metric("icheck_node_agents"), Some(f64::from(node.status.agents)), "{text}");
        assert_eq!(metric("icheck_node_up"), Some(1.0), "{text}");
    }
    for name in ["stacked", "spread"] {
        let label = format!("{{app=\"{name}\"}}");
        assert_eq!(metric_sample(&text, &format!("icheck_app_agents{label}")), Some(2.0), "{text}");
        assert_eq!(metric_sample(&text, &format!("icheck_app_latest_version{label}")), Some(7.0), "{text}");
    }
}
