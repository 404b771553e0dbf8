//! Agent threads: each serves one application, owns a fabric endpoint and
//! its registered memory, and drives its endpoint's progress.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::fabric::{Access, AlignedBuffer, Domain, Endpoint, FabricConfig, FabricError};
use crate::protocol::AgentInfo;
use crate::selftest::fill_pattern;

/// Bytes of the probe region every agent exposes for reachability checks.
pub const PROBE_LEN: usize = 4096;

/// The pattern seed of an agent's probe region: its id.
pub fn probe_seed(agent_id: u64) -> u64 {
    agent_id
}

/// A running agent thread.
pub struct Agent {
    info: AgentInfo,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Agent {
    /// Opens an endpoint, registers the probe region and starts the thread.
    pub fn start(fabric: &FabricConfig, node: &str, id: u64, app: &str) -> Result<Agent, FabricError> {
        let domain = Domain::open(fabric)?;
        let endpoint = Endpoint::new(&domain)?;
        let mut probe = AlignedBuffer::zeroed(PROBE_LEN);
        fill_pattern(probe.as_mut_slice(), probe_seed(id));
        let probe = endpoint.register(probe, Access::REMOTE_READ)?;
        let info = AgentInfo {
            id,
            node: node.to_string(),
            address: endpoint.address().clone(),
            provider: endpoint.provider().to_string(),
            probe: probe.remote(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let app_name = app.to_string();
        let thread = std::thread::Builder::new()
            .name(format!("icheck-agent-{id}"))
            .spawn(move || {
                let _span = tracing::info_span!("agent", id, app = %app_name).entered();
                tracing::info!("agent running");
                // The agent owns its endpoint and memory; it polls so that
                // peers' RMA against its memory progresses.
                let _memory = probe;
                while !flag.load(Ordering::Relaxed) {
                    endpoint.progress();
                    std::thread::sleep(Duration::from_micros(200));
                }
                tracing::info!("agent stopped");
            })
            .map_err(|err| FabricError::Config(format!("cannot start agent thread: {err}")))?;
        Ok(Agent { info, stop, thread: Some(thread) })
    }

    /// What the application needs to reach this agent.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Whether the thread is still running.
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
