//! The controller's Prometheus endpoint (`GET /metrics`): the status report
//! in the text exposition format, so administrators graph the service with
//! the tools they already run.
//!
//! Architecture invariant: the endpoint renders the same [`StatusReport`]
//! that `icheck status` prints, so the two always agree; a metric that is
//! unavailable (no RAPL counters, one sample only) is left out, never 0.

#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use icheck_core::protocol::StatusReport;

/// Longest request head accepted.
const MAX_REQUEST: usize = 8192;
/// Connections served at once.
const MAX_CONNECTIONS: usize = 32;
/// Time a client has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// One metric family: name, help text, type, and its samples as
/// (labels, value).
struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    samples: Vec<(String, f64)>,
}

/// The report in Prometheus text format (version 0.0.4).
pub fn render(report: &StatusReport) -> String {
    let node = |n: &str| format!("node=\"{}\"", escape(n));
    let app = |a: &str| format!("app=\"{}\"", escape(a));
    let mut families = vec![
        Family {
            name: "icheck_build_info",
            help: "Constant 1; the labels say which icheck and which libfabric the controller runs",
            kind: "gauge",
            samples: vec![(build_labels(), 1.0)],
        },
        Family {
            name: "icheck_node_up",
            help: "1 while the node's manager sends heartbeats",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_fabric_info",
            help: "Constant 1; the provider label names the fabric provider the node's agents use",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_memory_available_bytes",
            help: "MemAvailable of the node",
            kind: "gauge",
            samples: vec![],
        },
        Family { name: "icheck_node_memory_total_bytes", help: "MemTotal of the node", kind: "gauge", samples: vec![] },
        Family {
            name: "icheck_node_memory_depletion_bytes_per_second",
            help: "Rate available memory shrinks (eq. 6.5)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_memory_forecast_min_bytes",
            help: "Lowest available memory expected at the forecast horizon",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_memory_forecast_max_bytes",
            help: "Highest available memory expected at the forecast horizon",
            kind: "gauge",
            samples: vec![],
        },
        Family { name: "icheck_node_agents", help: "Agents running on the node", kind: "gauge", samples: vec![] },
        Family {
            name: "icheck_node_agent_fill_rate",
            help: "Agents started per second (eq. 6.10)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_checkpoint_bytes_held",
            help: "Checkpoint bytes in the node's store",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_manager_anonymous_bytes",
            help: "The manager process's own resident memory that no file backs (heap, fabric buffers), beside the checkpoint bytes",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_warm_pool_bytes",
            help: "Backed files in the node's warm pool (WarmPool), ready for new version files",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_files_handed_over_total",
            help: "Version files handed to restarting ranks on the node's own host (read without the fabric)",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_node_checkpoint_received_bytes_total",
            help: "Checkpoint bytes received by the node's agents (incremental versions: changed blocks only)",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_node_checkpoint_operations_total",
            help: "Checkpoint operations served (ncops, eq. 6.6)",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_node_checkpoint_operations_per_minute",
            help: "Checkpoint operations over the last minute",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_checkpoint_interval_seconds",
            help: "Time between the last two checkpoint operations (eq. 6.7)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_bandwidth_bytes_per_second",
            help: "Bytes per second all agents moved over the last interval (eq. 6.9)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_agent_bandwidth_bytes_per_second",
            help: "Bytes per second of the agent's last transfer (eq. 6.8)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_power_watts",
            help: "Package power from RAPL, where the OS exposes it",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_draining",
            help: "1 while an operator drains the node",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_manager_relaunches",
            help: "Times the controller started the node's dead manager again (last ten minutes)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_node_given_up",
            help: "1 when the node's manager died more often than ManagerRelaunches allows",
            kind: "gauge",
            samples: vec![],
        },
        Family { name: "icheck_app_ranks", help: "Processes of the application", kind: "gauge", samples: vec![] },
        Family { name: "icheck_app_nodes", help: "Compute nodes of the application", kind: "gauge", samples: vec![] },
        Family { name: "icheck_app_agents", help: "Agents of the application", kind: "gauge", samples: vec![] },
        Family { name: "icheck_app_latest_version", help: "Newest complete version", kind: "gauge", samples: vec![] },
        Family {
            name: "icheck_app_version_bytes",
            help: "Bytes of the newest complete version",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_commit_seconds",
            help: "Commit time of the newest complete version",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_pfs_version",
            help: "Newest version copied to the PFS",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_pfs_compression_ratio",
            help: "Raw over stored bytes of the newest PFS copy",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_pfs_copies_failed_total",
            help: "Agent copies to the PFS that failed",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_app_pfs_copies_skipped_total",
            help: "Agent copies to the PFS skipped because the previous copy was still running",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_app_agent_changes_total",
            help: "Agent count changes made on the application's probes",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_app_versions_dropped_total",
            help: "Journaled versions no longer counted complete (a rank's data missing or damaged in the stores)",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_app_protected_version",
            help: "Newest version whose copies or parity shards on other checkpoint nodes are in place",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_rebuilding",
            help: "1 while the application's version is rebuilt after a lost checkpoint node",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_loss_probability",
            help: "Probability that the newest version is lost (data-loss model, node_failure_probability)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_app_transfer_push",
            help: "1 when the application's commits push (the library writes), 0 when its agents pull",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_controller_incarnation",
            help: "Controller processes that used the journal, this one included",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_journal_events",
            help: "Events in the controller journal",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_journal_damaged",
            help: "1 when the journal's tail was damaged at start (its valid prefix was used)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_controller_epoch",
            help: "Fencing epoch of the answering controller (raised by every takeover)",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_controller_primary",
            help: "1 while the answering controller holds its lease and acts as the primary",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_controller_takeovers_total",
            help: "Takeovers by a standby this journal has seen",
            kind: "counter",
            samples: vec![],
        },
        Family {
            name: "icheck_controller_last_takeover_timestamp_seconds",
            help: "Unix time of the last takeover",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_standby_attached",
            help: "1 while a standby follows the primary's journal",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_standby_lag_events",
            help: "Journal events sent to the standby and not yet acknowledged as durable",
            kind: "gauge",
            samples: vec![],
        },
        Family {
            name: "icheck_standby_last_ack_seconds",
            help: "Seconds since the standby acknowledged a heartbeat",
            kind: "gauge",
            samples: vec![],
        },
    ];
    let mut put = |name: &str, labels: String, value: Option<f64>| {
        if let (Some(family), Some(value)) = (families.iter_mut().find(|f| f.name == name), value) {
            family.samples.push((labels, value));
        }
    };
    for n in &report.nodes {
        let l = node(&n.node);
        let s = &n.status;
        put("icheck_node_up", l.clone(), Some(f64::from(u8::from(n.alive))));
        put("icheck_node_draining", l.clone(), Some(f64::from(u8::from(n.draining))));
        put("icheck_node_manager_relaunches", l.clone(), Some(f64::from(n.relaunches)));
        put("icheck_node_given_up", l.clone(), Some(f64::from(u8::from(n.given_up))));
        if !s.provider.is_empty() {
            put("icheck_node_fabric_info", format!("{l},provider=\"{}\"", escape(&s.provider)), Some(1.0));
        }
        put("icheck_node_memory_available_bytes", l.clone(), Some(s.mem_available as f64));
        put("icheck_node_memory_total_bytes", l.clone(), Some(s.mem_total as f64));
        put("icheck_node_memory_depletion_bytes_per_second", l.clone(), n.trend.mem_depletion_rate);
        put("icheck_node_memory_forecast_min_bytes", l.clone(), n.trend.mem_forecast.map(|f| f.0 as f64));
        put("icheck_node_memory_forecast_max_bytes", l.clone(), n.trend.mem_forecast.map(|f| f.1 as f64));
        put("icheck_node_agents", l.clone(), Some(f64::from(s.agents)));
        put("icheck_node_agent_fill_rate", l.clone(), n.trend.agent_fill_rate);
        put("icheck_node_checkpoint_bytes_held", l.clone(), Some(s.bytes_held as f64));
        put("icheck_node_manager_anonymous_bytes", l.clone(), Some(s.manager_anonymous_bytes as f64));
        put("icheck_node_warm_pool_bytes", l.clone(), Some(s.warm_bytes as f64));
        put("icheck_node_files_handed_over_total", l.clone(), Some(s.files_handed_over as f64));
        put("icheck_node_checkpoint_received_bytes_total", l.clone(), Some(s.checkpoint_bytes as f64));
        put("icheck_node_checkpoint_operations_total", l.clone(), Some(s.checkpoint_ops as f64));
        put("icheck_node_checkpoint_operations_per_minute", l.clone(), Some(s.cops_per_min));
        put("icheck_node_checkpoint_interval_seconds", l.clone(), s.last_cop_interval);
        put("icheck_node_bandwidth_bytes_per_second", l.clone(), Some(s.bandwidth));
        for (agent, bw) in &s.agent_bandwidth {
            put("icheck_agent_bandwidth_bytes_per_second", format!("{l},agent=\"{agent}\""), Some(*bw));
        }
        put("icheck_node_power_watts", l, s.power_watts);
    }
    for a in &report.apps {
        let l = app(&a.registration.name);
        put("icheck_app_ranks", l.clone(), Some(f64::from(a.registration.ranks)));
        put("icheck_app_nodes", l.clone(), Some(f64::from(a.registration.nodes)));
        put("icheck_app_agents", l.clone(), Some(a.agents.len() as f64));
        put("icheck_app_latest_version", l.clone(), a.latest.as_ref().map(|v| v.version as f64));
        put("icheck_app_version_bytes", l.clone(), a.latest.as_ref().map(|v| v.bytes as f64));
        put("icheck_app_commit_seconds", l.clone(), a.latest.as_ref().map(|v| v.commit_secs));
        put("icheck_app_pfs_version", l.clone(), a.pfs_version.map(|v| v as f64));
        put("icheck_app_pfs_compression_ratio", l.clone(), a.pfs_copy.map(|c| c.ratio()));
        put("icheck_app_pfs_copies_failed_total", l.clone(), Some(a.pfs_health.failed as f64));
        put("icheck_app_pfs_copies_skipped_total", l.clone(), Some(a.pfs_health.skipped as f64));
        put("icheck_app_agent_changes_total", l.clone(), Some(a.agent_changes.len() as f64));
        put("icheck_app_protected_version", l.clone(), a.protected.map(|v| v as f64));
        put("icheck_app_rebuilding", l.clone(), Some(f64::from(u8::from(a.rebuilding))));
        put("icheck_app_loss_probability", l.clone(), a.exposure);
        put("icheck_app_transfer_push", l.clone(), a.transfer.map(|t| f64::from(u8::from(t.push))));
        put("icheck_app_versions_dropped_total", l, Some(a.dropped.len() as f64));
    }
    if let Some(journal) = &report.journal {
        put("icheck_controller_incarnation", String::new(), Some(f64::from(journal.incarnation)));
        put("icheck_journal_events", String::new(), Some(journal.records as f64));
        put("icheck_journal_damaged", String::new(), Some(f64::from(u8::from(journal.damage.is_some()))));
    }
    if let Some(c) = &report.controller {
        let l = format!("address=\"{}\"", escape(&c.address));
        put("icheck_controller_epoch", l.clone(), Some(c.epoch as f64));
        put("icheck_controller_primary", l.clone(), Some(f64::from(u8::from(c.lease))));
        put("icheck_controller_takeovers_total", l.clone(), Some(c.takeovers as f64));
        put(
            "icheck_controller_last_takeover_timestamp_seconds",
            l.clone(),
            c.took_over_unix_ms.map(|ms| ms as f64 / 1e3),
        );
        put("icheck_standby_attached", l.clone(), Some(f64::from(u8::from(c.standby.is_some()))));
        put("icheck_standby_lag_events", l.clone(), c.standby.as_ref().map(|s| s.lag_events as f64));
        put("icheck_standby_last_ack_seconds", l, c.standby.as_ref().map(|s| s.last_ack_secs));
    }
    let mut text = String::new();
    for family in families.iter().filter(|f| !f.samples.is_empty()) {
        let _ = writeln!(text, "# HELP {} {}", family.name, family.help);
        let _ = writeln!(text, "# TYPE {} {}", family.name, family.kind);
        for (labels, value) in &family.samples {
            let _ = writeln!(text, "{}{{{labels}}} {value}", family.name);
        }
    }
    text
}

/// `version="0.1.0",libfabric="1.17"`: the controller's own build and the
/// libfabric it loaded, the usual `*_build_info` labels.
fn build_labels() -> String {
    let (major, minor) = icheck_core::fabric::libfabric_version().library;
    format!("version=\"{}\",libfabric=\"{major}.{minor}\"", env!("CARGO_PKG_VERSION"))
}

/// Label values escape backslash, quote and newline.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Serves `GET /metrics` (and `HEAD`, the same headers without the body)
/// on `listener` with whatever `report` returns at the time of each
/// request, to requests whose `Authorization: Bearer` secret is one of
/// `tokens` (the admin and the metrics token: the page names applications
/// and nodes); others get 401, other methods 405, other paths 404,
/// malformed requests 400.
///
/// Hand-written rather than hyper: one path, one response per connection
/// (`Connection: close`), and the limits a flood needs (connections at
/// once, head size, time to send it) in a page of code the flood test
/// exercises.
pub async fn serve(
    listener: TcpListener,
    tokens: Vec<String>,
    report: impl Fn() -> StatusReport + Send + Sync + Clone + 'static,
) {
    let tokens = std::sync::Arc::new(tokens);
    // Scrapers are few: a flood of connections holds at most this many
    // descriptors, each for REQUEST_TIMEOUT at most; more are closed at once.
    let mut listener = crate::accept::BoundedListener::new(listener, MAX_CONNECTIONS, "metrics", "a complete request");
    loop {
        let (stream, peer, permit) = listener.accept().await;
        let (report, tokens) = (report.clone(), tokens.clone());
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(err) = answer(stream, &tokens, report).await {
                tracing::debug!(%peer, %err, "metrics request failed");
            }
        });
    }
}

/// The bearer secret of a request head, if it carries one.
fn bearer(head: &str) -> Option<&str> {
    head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        let value = value.trim();
        let (scheme, secret) = value.split_once(' ')?;
        (name.trim().eq_ignore_ascii_case("authorization") && scheme.eq_ignore_ascii_case("bearer"))
            .then(|| secret.trim())
    })
}

async fn answer(mut stream: TcpStream, tokens: &[String], report: impl Fn() -> StatusReport) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    let read_head = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read_head).await.map_err(|_| std::io::ErrorKind::TimedOut)??;
    let head = String::from_utf8_lossy(&head);
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split_whitespace();
    let authorized =
        bearer(&head).is_some_and(|secret| tokens.iter().any(|t| icheck_core::credentials::secrets_equal(secret, t)));
    let method = parts.next();
    let head_only = method == Some("HEAD");
    let (status, content_type, body) = match (method, parts.next()) {
        (Some("GET" | "HEAD"), Some("/metrics")) if !authorized => (
            "401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"icheck\"",
            "text/plain",
            "send `Authorization: Bearer <MetricsToken or AdminToken>` (Prometheus: `authorization: {credentials_file: ...}`)\n"
                .to_string(),
        ),
        (Some("GET" | "HEAD"), Some("/metrics")) => ("200 OK", "text/plain; version=0.0.4", render(&report())),
        (Some(_), Some("/metrics")) => (
            "405 Method Not Allowed\r\nAllow: GET, HEAD",
            "text/plain",
            "/metrics answers GET and HEAD\n".to_string(),
        ),
        (Some(_), Some(_)) => ("404 Not Found", "text/plain", "only /metrics is served here\n".to_string()),
        _ => ("400 Bad Request", "text/plain", "malformed request\n".to_string()),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        response.push_str(&body);
    }
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use icheck_core::protocol::{NodeReport, NodeStatus};

    /// One request to a real endpoint on loopback; the whole response.
    async fn exchange(request: &str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, vec!["m3tr1cs".into()], StatusReport::default));
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        server.abort();
        response
    }

    #[tokio::test]
    async fn head_answers_the_get_headers_without_the_body_and_other_methods_get_405() {
        let auth = "Authorization: Bearer m3tr1cs\r\n\r\n";
        let get = exchange(&format!("GET /metrics HTTP/1.1\r\n{auth}")).await;
        let (get_head, get_body) = get.split_once("\r\n\r\n").unwrap();
        assert!(get_head.starts_with("HTTP/1.1 200 OK"), "{get}");
        assert!(get_body.contains("# TYPE icheck_build_info gauge\n"), "{get_body}");
        let head = exchange(&format!("HEAD /metrics HTTP/1.1\r\n{auth}")).await;
        let (head_head, head_body) = head.split_once("\r\n\r\n").unwrap();
        assert_eq!(head_body, "", "HEAD sends no body");
        assert!(head_head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head_head.contains(&format!("Content-Length: {}", get_body.len())), "{head}");
        let post = exchange(&format!("POST /metrics HTTP/1.1\r\n{auth}")).await;
        assert!(post.starts_with("HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\n"), "{post}");
        let unauthorized = exchange("HEAD /metrics HTTP/1.1\r\n\r\n").await;
        assert!(unauthorized.starts_with("HTTP/1.1 401"), "{unauthorized}");
    }

    #[test]
    fn build_info_names_the_version_and_the_libfabric() {
        let text = render(&StatusReport::default());
        let line = text.lines().find(|l| l.starts_with("icheck_build_info{")).unwrap_or_else(|| panic!("{text}"));
        let (major, minor) = icheck_core::fabric::libfabric_version().library;
        let labels = format!("version=\"{}\",libfabric=\"{major}.{minor}\"", env!("CARGO_PKG_VERSION"));
        assert_eq!(line, format!("icheck_build_info{{{labels}}} 1"));
        assert!(major >= 1, "{line}");
    }

    #[test]
    fn the_bearer_secret_is_read_from_the_head() {
        assert_eq!(bearer("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3 \r\n\r\n"), Some("s3"));
        assert_eq!(bearer("GET /metrics HTTP/1.1\r\nauthorization: bearer s3\r\n"), Some("s3"));
        assert_eq!(bearer("GET /metrics HTTP/1.1\r\nAuthorization: Basic czM=\r\n"), None);
        assert_eq!(bearer("GET /metrics HTTP/1.1\r\n\r\n"), None);
    }

    #[test]
    fn unavailable_metrics_are_left_out_and_labels_escaped() {
        let status =
            NodeStatus { mem_available: 1024, agents: 2, agent_bandwidth: vec![(7, 1.5e9)], ..NodeStatus::default() };
        let report = StatusReport {
            nodes: vec![NodeReport {
                node: "n\"1".into(),
                pid: 1,
                alive: true,
                last_heartbeat_secs: 0.1,
                status,
                trend: Default::default(),
                draining: false,
                relaunches: 0,
                given_up: false,
                start_failure: None,
            }],
            apps: vec![],
            init_agent_count: String::new(),
            journal: None,
            controller: Some(Box::new(icheck_core::protocol::ControllerReport {
                address: "h:1".into(),
                epoch: 3,
                lease: true,
                ..Default::default()
            })),
        };
        let text = render(&report);
        assert!(text.contains("icheck_node_up{node=\"n\\\"1\"} 1\n"), "{text}");
        assert!(text.contains("icheck_node_memory_available_bytes{node=\"n\\\"1\"} 1024\n"), "{text}");
        assert!(text.contains("icheck_agent_bandwidth_bytes_per_second{node=\"n\\\"1\",agent=\"7\"} 1500000000\n"));
        assert!(text.contains("# TYPE icheck_node_checkpoint_operations_total counter"));
        assert!(!text.contains("icheck_node_power_watts"), "no RAPL reading: no sample\n{text}");
        assert!(!text.contains("icheck_node_memory_depletion"), "one sample: no rate\n{text}");
        assert!(text.contains("icheck_controller_epoch{address=\"h:1\"} 3\n"), "{text}");
        assert!(text.contains("icheck_standby_attached{address=\"h:1\"} 0\n"), "{text}");
        assert!(!text.contains("icheck_standby_lag_events"), "no standby: no lag\n{text}");
    }
}
