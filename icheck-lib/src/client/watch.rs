//! While a rank waits long for its agent's answer: is that agent still the
//! application's? The controller gives a silent node's agents up after
//! `HeartBeatInterval × MissedHeartbeats` (§6.5.2), and then records no
//! version on them. Before, a rank whose agent's node was cut off or hung
//! waited out `client.request_timeout` (30 s) before the commit moved to
//! new agents; now it asks the controller once that detection window has
//! passed and stops waiting as soon as the agent is given up.

use std::sync::Arc;
use std::time::Duration;

use icheck_core::config::StaticConfig;
use icheck_core::control::BlockingConnection;
use icheck_core::protocol::{ClientReply, ClientRequest};

/// The controller's id of an agent.
type AgentId = u64;

/// How long one question to the controller may take: the wait it
/// interrupts must not stall on a controller that is itself unreachable.
const ASK_WITHIN: Duration = Duration::from_secs(1);

/// How much later each question comes than the one before, at least: a
/// long legitimate transfer (gigabytes of one rank) is asked about a few
/// times, not every heartbeat for minutes.
const BACKOFF: f64 = 1.25;

/// Whom to ask and when, shared by all of a process's agent sessions.
#[derive(Debug)]
pub(super) struct AgentWatch {
    controllers: Vec<String>,
    /// The earliest a controller gives a silent node's agents up.
    first_question: Duration,
    /// The shortest pause between two questions.
    every: Duration,
}

/// What the controller's answer says of an agent.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Still the application's: its answer is worth waiting for.
    Listed,
    /// The controller knows the application, and not this agent any more.
    GivenUp,
    /// No answer, or no record of the application (a controller that
    /// restarted and has not heard of it yet): keep waiting.
    Unknown,
}

impl AgentWatch {
    /// From the static configuration the ranks read (the controller's own
    /// heartbeat settings); `None` when it names no controller.
    pub(super) fn from_config(config: &StaticConfig) -> Option<Arc<AgentWatch>> {
        let controllers = config.controller_endpoints();
        if controllers.is_empty() {
            return None;
        }
        let heartbeat = config.heartbeat().max(Duration::from_millis(100));
        // A heartbeat more: the controller's watch wakes once per heartbeat.
        let detection = heartbeat * (config.missed_heartbeats.max(1) + 1);
        // Up to a quarter later, by process: the ranks of a large job
        // waiting on one lost node do not all knock at once.
        let first_question = detection.mul_f64(1.0 + f64::from(std::process::id() % 64) / 256.0);
        Some(Arc::new(AgentWatch { controllers, first_question, every: heartbeat.max(Duration::from_millis(500)) }))
    }

    /// When to ask first, counted from the start of a wait.
    pub(super) fn first_question(&self) -> Duration {
        self.first_question
    }

    /// When to ask next, `waited` into a wait just after asking.
    pub(super) fn next_question(&self, waited: Duration) -> Duration {
        (waited + self.every).max(waited.mul_f64(BACKOFF))
    }

    /// Asks the primary controller about `agent` of `app` on `connection`
    /// (opened on the first question of a wait and kept for the next).
    pub(super) fn ask(
        &self,
        connection: &mut Option<BlockingConnection>,
        token: &str,
        app: &str,
        capability: &str,
        agent: AgentId,
    ) -> Verdict {
        if connection.as_ref().is_none_or(BlockingConnection::is_stale) {
            *connection = self.controllers.iter().find_map(|peer| {
                BlockingConnection::connect_controller(peer, token, ASK_WITHIN, 0).ok().map(|(c, _)| c)
            });
        }
        let Some(open) = connection.as_mut() else {
            return Verdict::Unknown;
        };
        open.set_timeout(ASK_WITHIN);
        let request = ClientRequest::AppStatus { name: app.to_string(), capability: capability.to_string() };
        match open.call(&request) {
            Ok(ClientReply::AppStatus(report)) => {
                let listed = report.map(|r| r.agents.iter().map(|a| a.id).collect::<Vec<_>>());
                verdict(listed.as_deref(), agent)
            }
            Ok(other) => {
                tracing::debug!(?other, "the controller's answer says nothing of the agent");
                Verdict::Unknown
            }
            Err(err) => {
                tracing::debug!(%err, "cannot ask the controller whether the agent is still the application's");
                *connection = None;
                Verdict::Unknown
            }
        }
    }
}

/// What the application's agents as the controller lists them (`None`: it
/// does not know the application) say of `agent`.
pub(super) fn verdict(listed: Option<&[AgentId]>, agent: AgentId) -> Verdict {
    match listed {
        None => Verdict::Unknown,
        Some(listed) if listed.contains(&agent) => Verdict::Listed,
        Some(_) => Verdict::GivenUp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn only_an_application_the_controller_knows_without_the_agent_gives_it_up() {
        assert_eq!(verdict(Some(&[3, 4]), 4), Verdict::Listed);
        assert_eq!(verdict(Some(&[5, 6]), 4), Verdict::GivenUp);
        assert_eq!(verdict(Some(&[]), 4), Verdict::GivenUp);
        assert_eq!(verdict(None, 4), Verdict::Unknown);
    }

    #[test]
    fn questions_start_after_the_detection_window_and_thin_out() {
        let config = StaticConfig { heartbeat_interval: 1.0, missed_heartbeats: 3, ..StaticConfig::default() };
        let watch = AgentWatch::from_config(&config).expect("a controller is configured");
        let first = watch.first_question();
        assert!(first >= Duration::from_secs(4) && first < Duration::from_secs(5), "{first:?}");
        assert_eq!(watch.next_question(Duration::from_secs(4)), Duration::from_secs(5));
        // Long waits: a quarter later each time, not every heartbeat.
        assert_eq!(watch.next_question(Duration::from_secs(40)), Duration::from_secs(50));
    }
}
