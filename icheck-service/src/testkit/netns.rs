//! Several checkpoint nodes on one machine for multi-host tests: each node
//! is a network namespace joined by a veth pair to a bridge in the test's
//! own namespace, where the controller and the application run. Agents and
//! ranks talk over the tcp provider across the veths, whose host ends can
//! be rate-limited with `tc tbf` (a node's link), so that placing agents on
//! more nodes really buys bandwidth.
//!
//! Needs root (CI runs as root) and iproute2. Everything a cluster creates
//! carries its own names (`icb<N>`, `ich<N>-<i>`, `icheck-<pid>-<N>-n<i>`)
//! and is removed on drop, processes by PID, even when the test fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use icheck_core::protocol::StatusReport;

use super::{wait_for, ChildGuard};

/// Clusters started by this process (names and subnets differ per cluster).
static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// A controller in this namespace and one manager per node namespace.
pub struct NetCluster {
    icheck: PathBuf,
    /// Directory of configuration files, logs and the PFS.
    pub dir: PathBuf,
    /// Configuration the application and `icheck status` use.
    pub client_config: PathBuf,
    bridge: String,
    namespaces: Vec<String>,
    /// Host ends of the veth pairs.
    links: Vec<String>,
    store: PathBuf,
    /// Controller first, then the managers.
    daemons: Vec<ChildGuard>,
}

/// Runs `ip`/`tc` with `args`; panics with its stderr on failure.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (install iproute2): {e}"));
    assert!(
        out.status.success(),
        "`{program} {}` failed (multi-host tests need root and network namespaces): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `ip args` to delete something of ours that may not exist (a
/// leftover before setup, or already gone at teardown); failures are fine.
fn remove(args: &[&str]) {
    let _ = Command::new("ip").args(args).stdin(Stdio::null()).stderr(Stdio::null()).status();
}

impl NetCluster {
    /// Starts `nodes` namespaced nodes named `n1`..`nN`. `rate` (a tc rate
    /// such as "100mbit") limits the traffic towards each node; `dynamic`
    /// is the dynamic configuration.
    pub fn start(icheck: &Path, name: &str, nodes: u32, rate: Option<&str>, dynamic: &str) -> NetCluster {
        let pid = std::process::id();
        let serial = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        // Third octet of the cluster's subnet and the number in its names.
        let net = (pid.wrapping_mul(7).wrapping_add(serial) % 250) + 1;
        let dir = std::env::temp_dir().join(format!("icheck-net-{name}-{pid}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("logs")).expect("create the cluster directory");
        let mut cluster = NetCluster {
            icheck: icheck.to_path_buf(),
            client_config: dir.join("client.toml"),
            bridge: format!("icb{net}"),
            namespaces: Vec::new(),
            links: Vec::new(),
            store: PathBuf::from(format!("/dev/shm/icheck-net-{pid}-{serial}")),
            daemons: Vec::new(),
            dir,
        };
        cluster.network(net, nodes, rate);
        std::fs::write(cluster.dir.join("dynamic.toml"), dynamic).expect("write dynamic.toml");
        let gateway = format!("10.213.{net}.1");
        let base = |port: u16, metrics: u16| {
            format!(
                "ControllerAddress = \"{gateway}\"\nControllerPort = {port}\nMetricsPort = {metrics}\n\
                 Token = \"net-{pid}-{serial}\"\nHeartBeatInterval = 0.5\nStatusMessageInterval = 0.5\n\
                 DynamicConfig = \"dynamic.toml\"\nPfsDir = \"{}\"\nAgentStoreDir = \"{}\"\n",
                cluster.dir.join("pfs").display(),
                cluster.store.display()
            )
        };
        // The controller picks its ports; the others learn them from its files.
        let controller = cluster.dir.join("controller.toml");
        std::fs::write(&controller, format!("{}[fabric]\nprovider = \"tcp\"\n", base(0, 0))).unwrap();
        let log = std::fs::File::create(cluster.dir.join("logs/controller")).unwrap();
        let child = Command::new(icheck)
            .args(["controller", "--config"])
            .arg(&controller)
            .arg("--state-dir")
            .arg(&cluster.dir)
            .env("ICHECK_LOG", "info")
            .stderr(log)
            .spawn()
            .expect("start the controller");
        cluster.daemons.push(ChildGuard(child));
        let port_of = |file: &str| -> u16 {
            let path = cluster.dir.join(file);
            wait_for(file, Duration::from_secs(10), || path.exists());
            let address = std::fs::read_to_string(&path).unwrap();
            address.trim().rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("host:port")
        };
        let (port, metrics) = (port_of("controller.addr"), port_of("metrics.addr"));
        let client = format!("{}[fabric]\nprovider = \"tcp\"\ndomain = \"{}\"\n", base(port, metrics), cluster.bridge);
        std::fs::write(&cluster.client_config, client).unwrap();
        for i in 1..=nodes {
            let config = cluster.dir.join(format!("n{i}.toml"));
            let text = format!(
                "{}AgentAddress = \"10.213.{net}.{}\"\n[fabric]\nprovider = \"tcp\"\ndomain = \"icnet0\"\n",
                base(port, metrics),
                10 + i
            );
            std::fs::write(&config, text).unwrap();
            let log = std::fs::File::create(cluster.dir.join(format!("logs/n{i}"))).unwrap();
            let child = Command::new("ip")
                .args(["netns", "exec", &cluster.namespaces[i as usize - 1]])
                .arg(icheck)
                .args(["manager", "--node", &format!("n{i}"), "--config"])
                .arg(&config)
                .env("ICHECK_LOG", "info")
                .stderr(log)
                .spawn()
                .expect("start a manager in its namespace");
            cluster.daemons.push(ChildGuard(child));
        }
        wait_for("every manager to register", Duration::from_secs(20), || {
            cluster.try_status().is_some_and(|s| s.nodes.iter().filter(|n| n.alive).count() == nodes as usize)
        });
        cluster
    }

    /// The bridge, one namespace per node with a veth to it, and the rate
    /// limits.
    fn network(&mut self, net: u32, nodes: u32, rate: Option<&str>) {
        let bridge = self.bridge.clone();
        // Leftovers of a killed run with the same number are ours to remove.
        remove(&["link", "del", &bridge]);
        run("ip", &["link", "add", &bridge, "type", "bridge"]);
        run("ip", &["addr", "add", &format!("10.213.{net}.1/24"), "dev", &bridge]);
        run("ip", &["link", "set", &bridge, "up"]);
        for i in 1..=nodes {
            let ns = format!("icheck-{}-{net}-n{i}", std::process::id());
            remove(&["netns", "del", &ns]);
            run("ip", &["netns", "add", &ns]);
            self.namespaces.push(ns.clone());
            let (host, peer) = (format!("ich{net}-{i}"), format!("icp{net}-{i}"));
            remove(&["link", "del", &host]);
            run("ip", &["link", "add", &host, "type", "veth", "peer", "name", &peer]);
            self.links.push(host.clone());
            run("ip", &["link", "set", &peer, "netns", &ns]);
            run("ip", &["link", "set", &host, "master", &bridge]);
            run("ip", &["link", "set", &host, "up"]);
            let inside = |args: &[&str]| {
                let mut all = vec!["netns", "exec", &ns, "ip"];
                all.extend_from_slice(args);
                run("ip", &all);
            };
            inside(&["link", "set", &peer, "name", "icnet0"]);
            inside(&["addr", "add", &format!("10.213.{net}.{}/24", 10 + i), "dev", "icnet0"]);
            inside(&["link", "set", "icnet0", "up"]);
            inside(&["link", "set", "lo", "up"]);
            inside(&["route", "add", "default", "via", &format!("10.213.{net}.1")]);
            if let Some(rate) = rate {
                run(
                    "tc",
                    &["qdisc", "add", "dev", &host, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "100ms"],
                );
            }
        }
    }

    fn try_status(&self) -> Option<StatusReport> {
        let out = Command::new(&self.icheck)
            .args(["status", "--json", "--config"])
            .arg(&self.client_config)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `icheck status --json`.
    pub fn status(&self) -> StatusReport {
        self.try_status().expect("icheck status answers")
    }

    /// The body of the controller's `GET /metrics`.
    pub fn metrics(&self) -> String {
        let address = std::fs::read_to_string(self.dir.join("metrics.addr")).expect("metrics.addr");
        super::scrape_metrics(address.trim())
    }

    /// Replaces the dynamic configuration (the controller re-reads it).
    pub fn set_dynamic(&self, text: &str) {
        let tmp = self.dir.join("dynamic.toml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.dir.join("dynamic.toml")).unwrap();
    }

    /// Environment for the application's processes: the tcp provider is
    /// pinned to the bridge. On a host with several interfaces the provider
    /// (`tcp;ofi_rxm` in libfabric 1.17) may otherwise advertise another
    /// interface's address than the configured domain's; concurrent
    /// clusters would then route through each other's bridges.
    pub fn app_env(&self) -> [(&str, &str); 1] {
        [("FI_TCP_IFACE", self.bridge.as_str())]
    }

    /// A daemon's log ("controller", "n1", ...).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("logs").join(name)).unwrap_or_default()
    }
}

impl Drop for NetCluster {
    fn drop(&mut self) {
        // Daemons first (by PID), then their network and files.
        self.daemons.clear();
        // A deleted namespace lingers while sockets in it wind down (and its
        // veth with it): delete the links themselves.
        for link in &self.links {
            remove(&["link", "del", link]);
        }
        for ns in &self.namespaces {
            remove(&["netns", "del", ns]);
        }
        remove(&["link", "del", &self.bridge]);
        let _ = std::fs::remove_dir_all(&self.store);
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
