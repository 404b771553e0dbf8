//! Several checkpoint nodes on one machine for multi-host tests: each node
//! is a network namespace joined by a veth pair to a bridge in the test's
//! own namespace, where the controller and the application run. Agents and
//! ranks talk over the tcp provider across the veths, whose host ends can
//! be rate-limited with `tc tbf` (a node's link), so that placing agents on
//! more nodes really buys bandwidth.
//!
//! Needs root (CI runs as root) and iproute2. Everything a cluster creates
//! carries its own names (`icb<N>`, `ich<N>-<i>`, `icheck-<pid>-<N>-n<i>`)
//! and is removed on drop, processes by PID, even when the test fails, and
//! when a benchmark that called [`interrupt::stop_on_interrupt`] is
//! interrupted.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use icheck_core::protocol::StatusReport;

use super::{interrupt, wait_for, ChildGuard};

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
    /// The namespaces, veth links and daemons made so far, shared with the
    /// clean-up that runs if the process is interrupted.
    created: Arc<Mutex<Created>>,
    store: PathBuf,
    /// The third octet of the cluster's subnet.
    net: u32,
    /// With [`start_with_standby`](Self::start_with_standby): the two
    /// controllers' addresses (primary first).
    pub controllers: Vec<String>,
    /// Removes what the cluster made if the process is interrupted.
    _on_interrupt: Option<interrupt::Registered>,
}

/// What a cluster has made that outlives its process unless removed.
#[derive(Default)]
struct Created {
    namespaces: Vec<String>,
    /// Host ends of the veth pairs.
    links: Vec<String>,
    /// Controller first, then the managers; killed by PID when dropped.
    daemons: Vec<ChildGuard>,
}

/// The port both namespaced controllers listen on (each in its own namespace).
const NAMESPACED_CONTROLLER_PORT: u16 = 7777;

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
        NetCluster::start_inner(icheck, name, nodes, rate, dynamic, false)
    }

    /// [`start`](Self::start) with two controllers, each in a namespace of
    /// its own (`c1`, `c2`) behind its own veth: `c1` starts as the primary,
    /// `c2` as its standby (`TakeoverAfter` 3 s). [`cut`](Self::cut) takes
    /// a controller's link down: a partition.
    pub fn start_with_standby(icheck: &Path, name: &str, nodes: u32, dynamic: &str) -> NetCluster {
        NetCluster::start_inner(icheck, name, nodes, None, dynamic, true)
    }

    fn start_inner(
        icheck: &Path,
        name: &str,
        nodes: u32,
        rate: Option<&str>,
        dynamic: &str,
        standby: bool,
    ) -> NetCluster {
        // An interrupt waits until the cluster is up and everything it made
        // is recorded.
        let _starting = interrupt::hold_off();
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
            created: Arc::default(),
            store: PathBuf::from(format!("/dev/shm/icheck-net-{pid}-{serial}")),
            dir,
            net,
            controllers: Vec::new(),
            _on_interrupt: None,
        };
        // Interrupted, the process does what a drop does.
        let (created, bridge, store, dir, client_config) = (
            cluster.created.clone(),
            cluster.bridge.clone(),
            cluster.store.clone(),
            cluster.dir.clone(),
            cluster.client_config.clone(),
        );
        cluster._on_interrupt =
            Some(interrupt::on_interrupt(format!("the cluster in {}", cluster.dir.display()), move || {
                let mut created = created.lock().unwrap_or_else(|p| p.into_inner());
                tear_down(&mut created, &bridge, &store, &dir, &client_config, true);
            }));
        cluster.network(net, nodes, rate);
        if standby {
            return cluster.start_with_controllers(icheck, nodes, dynamic, pid, serial);
        }
        std::fs::write(cluster.dir.join("dynamic.toml"), dynamic).expect("write dynamic.toml");
        let gateway = format!("10.213.{net}.1");
        let (pfs, store) = (cluster.dir.join("pfs"), cluster.store.clone());
        let base = |port: u16, metrics: u16| {
            format!(
                "ControllerAddress = \"{gateway}\"\nControllerPort = {port}\nMetricsPort = {metrics}\n\
                 Token = \"net-{pid}-{serial}\"\nAdminToken = \"admin-{pid}-{serial}\"\nNodeToken = \"node-{pid}-{serial}\"\nHeartBeatInterval = 0.5\nStatusMessageInterval = 0.5\n\
                 DynamicConfig = \"dynamic.toml\"\nPfsDir = \"{}\"\nAgentStoreDir = \"{}\"\n",
                pfs.display(),
                store.display()
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
        cluster.keep(child);
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
            cluster.start_manager(icheck, i, &config);
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
            let host = self.add_namespace(net, &format!("n{i}"), &format!("{i}"), 10 + i);
            if let Some(rate) = rate {
                run(
                    "tc",
                    &["qdisc", "add", "dev", &host, "root", "tbf", "rate", rate, "burst", "32kb", "latency", "100ms"],
                );
            }
        }
    }

    /// A namespace `label` joined to the bridge by a veth (host end
    /// `ich<net>-<link>`) with address `10.213.<net>.<octet>`; returns the
    /// host end.
    fn add_namespace(&mut self, net: u32, label: &str, link: &str, octet: u32) -> String {
        let ns = self.namespace(label);
        remove(&["netns", "del", &ns]);
        run("ip", &["netns", "add", &ns]);
        self.created().namespaces.push(ns.clone());
        let (host, peer) = (format!("ich{net}-{link}"), format!("icp{net}-{link}"));
        remove(&["link", "del", &host]);
        run("ip", &["link", "add", &host, "type", "veth", "peer", "name", &peer]);
        self.created().links.push(host.clone());
        run("ip", &["link", "set", &peer, "netns", &ns]);
        run("ip", &["link", "set", &host, "master", &self.bridge]);
        run("ip", &["link", "set", &host, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns, "ip"];
            all.extend_from_slice(args);
            run("ip", &all);
        };
        inside(&["link", "set", &peer, "name", "icnet0"]);
        inside(&["addr", "add", &format!("10.213.{net}.{octet}/24"), "dev", "icnet0"]);
        inside(&["link", "set", "icnet0", "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&["route", "add", "default", "via", &format!("10.213.{net}.1")]);
        host
    }

    /// The rest of [`start_with_standby`](Self::start_with_standby): the
    /// controllers' namespaces and processes, then the managers.
    fn start_with_controllers(mut self, icheck: &Path, nodes: u32, dynamic: &str, pid: u32, serial: u32) -> NetCluster {
        let net = self.net;
        let port = NAMESPACED_CONTROLLER_PORT;
        for (index, octet) in [(1, 2), (2, 3)] {
            let label = format!("c{index}");
            self.add_namespace(net, &label, &label, octet);
            self.controllers.push(format!("10.213.{net}.{octet}:{port}"));
        }
        std::fs::write(self.dir.join("dynamic.toml"), dynamic).expect("write dynamic.toml");
        let base = format!(
            "ControllerAddress = [\"{}\", \"{}\"]\nControllerPort = {port}\nMetricsPort = 0\nTakeoverAfter = 3\n\
             Token = \"net-{pid}-{serial}\"\nAdminToken = \"admin-{pid}-{serial}\"\nNodeToken = \"node-{pid}-{serial}\"\nHeartBeatInterval = 0.5\nStatusMessageInterval = 0.5\n\
             DynamicConfig = \"{}\"\nPfsDir = \"{}\"\nAgentStoreDir = \"{}\"\n",
            self.controllers[0],
            self.controllers[1],
            self.dir.join("dynamic.toml").display(),
            self.dir.join("pfs").display(),
            self.store.display()
        );
        let controller = self.dir.join("controller.toml");
        std::fs::write(&controller, format!("{base}[fabric]\nprovider = \"tcp\"\n")).unwrap();
        for (index, standby) in [(1, false), (2, true)] {
            let label = format!("c{index}");
            let state = self.dir.join(&label);
            let log = std::fs::File::create(self.dir.join("logs").join(&label)).unwrap();
            let mut command = Command::new("ip");
            command.args(["netns", "exec", &self.namespace(&label)]).arg(icheck);
            command.args(["controller", "--config"]).arg(&controller).arg("--state-dir").arg(&state);
            if standby {
                command.arg("--standby");
            }
            let child = command.env("ICHECK_LOG", "info").stderr(log).spawn().expect("start a controller");
            self.keep(child);
        }
        let client = format!("{base}[fabric]\nprovider = \"tcp\"\ndomain = \"{}\"\n", self.bridge);
        std::fs::write(&self.client_config, client).unwrap();
        for i in 1..=nodes {
            let config = self.dir.join(format!("n{i}.toml"));
            let text = format!(
                "{base}AgentAddress = \"10.213.{net}.{}\"\n[fabric]\nprovider = \"tcp\"\ndomain = \"icnet0\"\n",
                10 + i
            );
            std::fs::write(&config, text).unwrap();
            self.start_manager(icheck, i, &config);
        }
        wait_for("every manager to register and the standby to attach", Duration::from_secs(30), || {
            self.try_status().is_some_and(|s| {
                s.nodes.iter().filter(|n| n.alive).count() == nodes as usize
                    && s.controller.is_some_and(|c| c.standby_follows())
            })
        });
        self
    }

    /// The namespace named `label` ("n1", "c1").
    fn namespace(&self, label: &str) -> String {
        format!("icheck-{}-{}-{label}", std::process::id(), self.net)
    }

    /// Starts node `i`'s manager in its namespace.
    fn start_manager(&mut self, icheck: &Path, i: u32, config: &Path) {
        let log = std::fs::File::create(self.dir.join(format!("logs/n{i}"))).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.namespace(&format!("n{i}"))])
            .arg(icheck)
            .args(["manager", "--node", &format!("n{i}"), "--config"])
            .arg(config)
            .env("ICHECK_LOG", "info")
            .stderr(log)
            .spawn()
            .expect("start a manager in its namespace");
        self.keep(child);
    }

    /// Takes the link of controller `label` ("c1", "c2") or checkpoint node
    /// `label` ("n1", ...) down: it can reach nobody, and nobody it. Its
    /// processes run on, and their TCP connections stay open.
    pub fn cut(&self, label: &str) {
        run("ip", &["link", "set", &self.host_link(label), "down"]);
    }

    /// Brings the link of controller or node `label` back.
    pub fn mend(&self, label: &str) {
        run("ip", &["link", "set", &self.host_link(label), "up"]);
    }

    /// Cuts checkpoint node `label` ("n1", ...) off from this namespace,
    /// where jobs run, and from nothing else: a `prohibit` route in the
    /// node's namespace refuses everything it sends to this namespace's
    /// address. The controllers, each in a namespace of its own (only with
    /// [`start_with_standby`](Self::start_with_standby)), still hear its
    /// heartbeats, and other nodes still reach it: a partition only the
    /// jobs see.
    pub fn cut_from_jobs(&self, label: &str) {
        self.route_to_jobs(label, "add");
    }

    /// Undoes [`cut_from_jobs`](Self::cut_from_jobs).
    pub fn mend_from_jobs(&self, label: &str) {
        self.route_to_jobs(label, "del");
    }

    fn route_to_jobs(&self, label: &str, action: &str) {
        assert!(!self.controllers.is_empty(), "a cut only jobs see needs controllers in namespaces of their own");
        let jobs = format!("10.213.{}.1/32", self.net);
        run("ip", &["netns", "exec", &self.namespace(label), "ip", "route", action, "prohibit", &jobs]);
    }

    /// The host end of the veth of `label`: controllers' links carry their
    /// label ("ich<net>-c1"), nodes' links their number ("ich<net>-1").
    fn host_link(&self, label: &str) -> String {
        let link = match label.strip_prefix('n') {
            Some(number) if number.parse::<u32>().is_ok() => number,
            _ => label,
        };
        format!("ich{}-{link}", self.net)
    }

    /// The PID of controller `label` as started (`ip netns exec` execs it).
    pub fn controller_pid(&self, label: &str) -> u32 {
        let index: usize = label.trim_start_matches('c').parse().expect("c1 or c2");
        self.created().daemons[index - 1].0.id()
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
        let config = icheck_core::config::StaticConfig::load(&self.client_config).expect("client.toml");
        super::scrape_metrics(address.trim(), &config.admin_token().expect("AdminToken"))
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

    /// What the cluster has made so far.
    fn created(&self) -> std::sync::MutexGuard<'_, Created> {
        self.created.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a daemon the cluster started: killed by PID on drop or on an
    /// interrupt.
    fn keep(&mut self, daemon: std::process::Child) {
        self.created().daemons.push(ChildGuard(daemon));
    }

    /// A daemon's log ("controller", "n1", ...).
    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join("logs").join(name)).unwrap_or_default()
    }
}

impl Drop for NetCluster {
    fn drop(&mut self) {
        // A failing test keeps its logs to read.
        let remove_dir = !std::thread::panicking();
        tear_down(&mut self.created(), &self.bridge, &self.store, &self.dir, &self.client_config, remove_dir);
    }
}

/// Stops a cluster's daemons (by PID) and removes its network (`created`'s
/// links and namespaces, then `bridge`), its store, the capabilities its
/// jobs kept and, with `remove_dir`, its directory.
fn tear_down(created: &mut Created, bridge: &str, store: &Path, dir: &Path, client_config: &Path, remove_dir: bool) {
    // Daemons first, then their network and files.
    created.daemons.clear();
    if let Ok(config) = icheck_core::config::StaticConfig::load(client_config) {
        super::forget_capabilities(&config);
    }
    // A deleted namespace lingers while sockets in it wind down (and its
    // veth with it): delete the links themselves.
    for link in &created.links {
        remove(&["link", "del", link]);
    }
    for ns in &created.namespaces {
        remove(&["netns", "del", ns]);
    }
    remove(&["link", "del", bridge]);
    let _ = std::fs::remove_dir_all(store);
    if remove_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
}
