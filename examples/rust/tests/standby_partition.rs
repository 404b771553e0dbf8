//! A partition between the primary controller and everyone else: both
//! controllers and the checkpoint nodes are network namespaces (see
//! `icheck_service::testkit::netns`). In a test binary of its own, so it
//! never runs beside other namespaced clusters. Needs root, as CI has.

mod common;

use std::time::Duration;

use common::{assert_restarts_from, committed, primaries, records, wait_for_more_commits, Job};
use icheck_core::config::StaticConfig;
use icheck_service::testkit::netns::NetCluster;
use icheck_service::testkit::{icheck_in_target, poll_until};

/// `TakeoverAfter` of `NetCluster::start_with_standby`.
const TAKEOVER_AFTER: Duration = Duration::from_secs(3);

/// A partition: the controllers and the checkpoint nodes are network
/// namespaces; the primary's link goes down while a job commits. The
/// standby takes over, the job goes on, and when the link comes back the
/// old primary has recorded nothing, steps down and follows the new one.
#[test]
fn a_partitioned_primary_is_replaced_and_steps_down_when_its_link_returns() {
    let cluster = NetCluster::start_with_standby(&icheck_in_target(), "partition", 2, "");
    let config = StaticConfig::load(&cluster.client_config).expect("the cluster's client configuration");
    let args = ["--app", "cutp", "--steps", "100000", "--every", "1", "--mib", "2", "--step-ms", "20"];
    let mut job = Job::start(4, &cluster.client_config, &args, &cluster.app_env());
    job.wait_line("COMMITTED version=5", Duration::from_secs(120));
    cluster.cut("c1");
    let cut = committed(&job.lines()).last().copied().unwrap_or(5);
    let took_over = poll_until(TAKEOVER_AFTER * 5, || {
        primaries(&config).iter().any(|(peer, epoch)| *peer == cluster.controllers[1] && *epoch == 2)
    });
    assert!(took_over, "the standby did not take over; its log:\n{}", cluster.log("c2"));
    // Counted once the standby took over: the cut-off primary's lease ran
    // out before that (it may record what reached it before the cut).
    let recorded_before = records(&cluster.log("c1"));
    let during = wait_for_more_commits(&job, cut, 3, Duration::from_secs(90));

    cluster.mend("c1");
    let stepped_down = poll_until(TAKEOVER_AFTER * 5, || cluster.log("c1").contains("stepping down to standby"));
    assert!(stepped_down, "the reconnected primary did not step down:\n{}", cluster.log("c1"));
    assert!(poll_until(TAKEOVER_AFTER * 5, || cluster.status().controller.is_some_and(|c| c.standby.is_some())));
    wait_for_more_commits(&job, during, 3, Duration::from_secs(60));
    assert_eq!(records(&cluster.log("c1")), recorded_before, "{}", cluster.log("c1"));
    let answering = primaries(&config);
    assert_eq!(
        answering.iter().map(|(peer, epoch)| (peer.as_str(), *epoch)).collect::<Vec<_>>(),
        [(cluster.controllers[1].as_str(), 2)]
    );

    job.kill();
    let told = committed(&job.lines()).last().copied().expect("COMMITTED lines");
    // An agent pulling from a killed rank waits out the stall bound before
    // it is replaced; a restart within it would be handed that agent.
    std::thread::sleep(icheck_core::fabric::TransferOptions::default().timeout + Duration::from_secs(2));
    assert_restarts_from(told, 4, &cluster.client_config, &cluster.app_env(), "cutp", "2");
}
