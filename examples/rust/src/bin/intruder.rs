//! A hostile client for the isolation tests: with only the client token
//! (and, when given, a stolen capability), it tries every way into another
//! application's checkpoints, through the controller and straight at the
//! application's agent, and prints one line per attempt:
//!
//! ```text
//! REFUSED <attempt>: <the service's reason>
//! ALLOWED <attempt>: <what it got>
//! ```
//!
//! The tests run it as root beside the victim, and as another Unix user;
//! every attempt must be refused.
//!
//! ```text
//! intruder --config client.toml --app victim --agent 127.0.0.1:40123 [--capability HEX] [--steal FILE]
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use icheck_core::config::StaticConfig;
use icheck_core::control::{request_blocking, BlockingConnection, ServiceError};
use icheck_core::fabric::{Domain, Endpoint};
use icheck_core::protocol::{
    AgentReply, AgentRequest, AppRegistration, ClientReply, ClientRequest, DataKind, Hello, HelloReply, LabelLayout,
    Role, TransferMode,
};

#[derive(Parser)]
#[command(about = "Tries to read, overwrite or delete another application's checkpoints (isolation tests)")]
struct Args {
    /// A client configuration (its Token only is used).
    #[arg(long)]
    config: PathBuf,
    /// The victim application.
    #[arg(long)]
    app: String,
    /// The victim's agent command channel (host:port).
    #[arg(long)]
    agent: Option<String>,
    /// A capability to present (a stolen one); default: a made-up one.
    #[arg(long)]
    capability: Option<String>,
    /// Uid to claim at registration (default: this process's).
    #[arg(long)]
    claim_uid: Option<u32>,
    /// A file to try to read (the victim's capability file).
    #[arg(long)]
    steal: Option<PathBuf>,
}

/// Prints the outcome of one attempt.
fn report(attempt: &str, outcome: Result<String, String>) {
    match outcome {
        Ok(got) => println!("ALLOWED {attempt}: {got}"),
        Err(reason) => println!("REFUSED {attempt}: {reason}"),
    }
}

/// A controller answer as an attempt's outcome: only a real answer counts
/// as allowed.
fn answered(reply: Result<ClientReply, ServiceError>) -> Result<String, String> {
    match reply {
        Ok(ClientReply::Error(reason)) => Err(reason),
        Ok(other) => Ok(format!("{other:?}").chars().take(200).collect()),
        Err(err) => Err(err.to_string()),
    }
}

fn main() {
    let args = Args::parse();
    let mut config = StaticConfig::load(&args.config).expect("the configuration loads");
    // Whatever the file holds, only the client token is used.
    config.admin_token = None;
    config.node_token = None;
    let token = config.effective_token();
    let made_up = "0123456789abcdef0123456789abcdef".to_string();
    let capability = args.capability.clone().unwrap_or(made_up);
    let uid = args.claim_uid.unwrap_or_else(icheck_core::credentials::current_uid);
    let registration = AppRegistration {
        name: args.app.clone(),
        ranks: 1,
        nodes: 1,
        ranks_per_node: 1,
        mode: TransferMode::Mr,
        pfs_interval: 0,
        compression: icheck_core::pfs::CompressionPolicy::Never,
        encrypted: false,
        redundancy: None,
    };

    // Through the controller.
    let register =
        |capability: Option<String>| ClientRequest::RegisterApp { registration: registration.clone(), capability, uid };
    report("register-without-capability", answered(request_blocking(&config, &register(None))));
    report("register-with-capability", answered(request_blocking(&config, &register(Some(capability.clone())))));
    let probe = ClientRequest::Probe {
        name: args.app.clone(),
        agents: Vec::new(),
        remaining_commits: 0,
        capability: capability.clone(),
        at_init: false,
        unreachable: Vec::new(),
    };
    report("probe", answered(request_blocking(&config, &probe)));
    let record = ClientRequest::VersionComplete {
        name: args.app.clone(),
        version: 1_000_000,
        bytes: 1,
        commit_secs: 0.0,
        spilled: false,
        epoch: 0,
        agents: Vec::new(),
        capability: capability.clone(),
        transfer: None,
    };
    report("record-version", answered(request_blocking(&config, &record)));
    let versions = ClientRequest::AppStatus { name: args.app.clone(), capability: capability.clone() };
    report("versions", answered(request_blocking(&config, &versions)));
    report("delete", answered(request_blocking(&config, &ClientRequest::DeleteApp { name: args.app.clone() })));
    report("drain", answered(request_blocking(&config, &ClientRequest::DrainNode { node: "x".into(), drain: true })));
    let flush = ClientRequest::FlushApp { name: args.app.clone(), capability: capability.clone() };
    report("flush", answered(request_blocking(&config, &flush)));
    let release = ClientRequest::ReleaseNodes { nodes: Vec::new(), count: 1 };
    report("release", answered(request_blocking(&config, &release)));
    let finish = ClientRequest::FinishApp { name: args.app.clone(), persist: false, capability: capability.clone() };
    report("finish", answered(request_blocking(&config, &finish)));
    // The status a client gets names no application and no node.
    match request_blocking(&config, &ClientRequest::Status) {
        Ok(ClientReply::Status(report)) => println!("STATUS apps={} nodes={}", report.apps.len(), report.nodes.len()),
        other => println!("STATUS unavailable: {other:?}"),
    }
    // A fake manager with the client token.
    let fake_manager = (|| {
        let controller = config.controller_endpoint();
        let mut stream = std::net::TcpStream::connect(&controller).map_err(|e| e.to_string())?;
        icheck_core::protocol::send_blocking(&mut stream, &Hello::new(&token, Role::Manager))
            .map_err(|e| e.to_string())?;
        match icheck_core::protocol::recv_blocking::<_, HelloReply>(&mut stream, Duration::from_secs(5)) {
            Ok(HelloReply::Refused(reason)) => Err(reason),
            Ok(other) => Ok(format!("{other:?}")),
            Err(err) => Err(err.to_string()),
        }
    })();
    report("fake-manager", fake_manager);

    // Straight at the victim's agent.
    if let Some(agent) = &args.agent {
        let domain = Domain::open(&config.fabric).expect("a fabric domain");
        let endpoint = Endpoint::new(&domain).expect("an endpoint");
        let attempt = |request: AgentRequest, open_first: bool| -> Result<String, String> {
            let mut conn =
                BlockingConnection::connect(agent, &token, Duration::from_secs(5)).map_err(|e| e.to_string())?;
            conn.set_timeout(Duration::from_secs(20));
            let mut call = |request: &AgentRequest| match conn.call::<_, AgentReply>(request) {
                Ok(AgentReply::Error(reason)) => Err(reason),
                Ok(reply) => Ok(format!("{reply:?}").chars().take(200).collect::<String>()),
                Err(err) => Err(err.to_string()),
            };
            if open_first {
                call(&AgentRequest::Open {
                    app: args.app.clone(),
                    rank: 0,
                    address: endpoint.address().clone(),
                    capability: capability.clone(),
                    pfs_key: None,
                })?;
            }
            call(&request)
        };
        let open = AgentRequest::Open {
            app: args.app.clone(),
            rank: 0,
            address: endpoint.address().clone(),
            capability: capability.clone(),
            pfs_key: None,
        };
        report("agent-open", attempt(open, false));
        for version in [1, 2, 3] {
            // As a process on the agent's host: a fetch it may not make must
            // not offer the version's file either.
            let reader = icheck_core::handoff::HostId::current();
            report(
                &format!("agent-fetch-{version}"),
                attempt(AgentRequest::Fetch { version, reader, reader_checks: false }, true),
            );
        }
        report("agent-complete", attempt(AgentRequest::Complete { version: 1000 }, true));
        let label = LabelLayout { label: "x".into(), kind: DataKind::Binary, offset: 0, len: 8, adapt: None };
        let begin = AgentRequest::Begin { version: 7, ranks: 1, epoch: 0, labels: vec![label], push: true };
        report("agent-begin", attempt(begin, true));
        report("agent-seal", attempt(AgentRequest::Seal { crcs: vec![vec![0]] }, true));
    }

    if let Some(path) = &args.steal {
        let stolen = std::fs::read_to_string(path).map(|text| format!("{} bytes", text.len()));
        report("steal-capability-file", stolen.map_err(|e| format!("{}: {e}", path.display())));
    }
}
