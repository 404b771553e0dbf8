//! Adaptive agents on several checkpoint nodes (the shape of the thesis's
//! Fig. 9.7a and 9.7b), measured here: each node is a network namespace
//! behind a rate-limited veth link (`icheck_service::testkit::netns`), so that
//! more agents on more nodes really buy bandwidth. Needs root.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/adaptive-bench
//! ```
//!
//! 1. **Dynamic agents** (Fig. 9.7a): heat2d (C) with 8 ranks probes after
//!    every 4th commit; the controller grows its agents while commits get
//!    faster. Prints the commit time with each agent count, against the first
//!    count in the same run, and what a probe costs with and without a change.
//! 2. **Placement under contention** (Fig. 9.7b): one application commits
//!    while five others checkpoint continuously, with every agent stacked on
//!    one node (FTC) and placed by bandwidth (BW, round robin); prints its
//!    commit bandwidth over time under both, and their ratio.
//! 3. **Malleable application** (Fig. 9.11/9.12): `malleable` goes 1 → 4 → 2
//!    ranks (a restart with the new count each time, its data redistributed
//!    through the agents) with a checkpoint that grows with the ranks, under
//!    MA-RA (the one agent stays) and MA-MA (agents follow the ranks, 1:1);
//!    prints commit times per phase, the MA-MA / MA-RA ratio, and what the
//!    agent change and the redistribution cost.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use icheck_service::testkit::netns::NetCluster;

#[path = "siblings.rs"]
mod siblings;

#[derive(Parser)]
#[command(about = "Dynamic agents and placement under contention on namespaced checkpoint nodes (needs root)")]
struct Cli {
    /// Rate of each node's link (tc syntax).
    #[arg(long, default_value = "100mbit")]
    rate: String,
    /// Ranks of heat2d.
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Grid edge of heat2d (8 * n * n bytes in all).
    #[arg(long, default_value_t = 1024)]
    n: u32,
    /// Commits of heat2d.
    #[arg(long, default_value_t = 28)]
    commits: u32,
    /// Commits of the measured application under contention.
    #[arg(long, default_value_t = 10)]
    contended_commits: u32,
    /// Applications checkpointing meanwhile.
    #[arg(long, default_value_t = 5)]
    others: u32,
    /// MiB per rank of the malleable application's checkpoint (part 3).
    #[arg(long, default_value_t = 8)]
    payload_mib: u64,
    /// Commits per phase of the malleable application (part 3).
    #[arg(long, default_value_t = 4)]
    phase_commits: u32,
    /// Run only this part (1, 2 or 3).
    #[arg(long)]
    only: Option<u32>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The directory of this executable: `icheck` and `mpi_checkpoint` are built beside it.
fn out_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe.parent().context("executable has a directory")?.to_path_buf())
}

fn check(command: &mut Command) -> Result<std::process::Output> {
    let out = command.output().with_context(|| format!("{command:?}"))?;
    if !out.status.success() {
        bail!("{command:?} failed:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(out)
}

/// Installs the build beside this executable under `prefix` and compiles heat2d against it.
fn build_heat2d(prefix: &Path) -> Result<PathBuf> {
    let out = out_dir()?;
    check(
        Command::new("make")
            .current_dir(repo())
            .arg("install-files")
            .arg(format!("PREFIX={}", prefix.display()))
            .arg(format!("OUT={}", out.display())),
    )?;
    let flags = check(
        Command::new("pkg-config")
            .args(["--cflags", "--libs", "icheck"])
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")),
    )?;
    let exe = prefix.join("heat2d");
    check(
        Command::new("mpicc")
            .args(["-O2", "-std=c99"])
            .arg(repo().join("examples/heat2d/heat2d.c"))
            .arg("-o")
            .arg(&exe)
            .args(String::from_utf8(flags.stdout)?.split_whitespace()),
    )?;
    Ok(exe)
}

/// An `mpirun` job in its own process group, killed with it on drop.
struct Job {
    child: Child,
    shm: PathBuf,
}

impl Job {
    fn start(cluster: &NetCluster, np: u32, program: &Path, args: &[String], quiet: bool) -> Result<Job> {
        let (mut command, shm) = icheck_service::testkit::mpirun("bench", np)?;
        command
            .arg(program)
            .args(args)
            .env("ICHECK_CONFIG", &cluster.client_config)
            .envs(cluster.app_env())
            .stdout(if quiet { Stdio::null() } else { Stdio::piped() })
            .stderr(Stdio::inherit());
        Ok(Job { child: command.spawn().context("mpirun")?, shm })
    }

    /// Streams stdout lines to `each` until the job ends; fails if it failed.
    fn follow(mut self, mut each: impl FnMut(&str)) -> Result<()> {
        let out = self.child.stdout.take().context("stdout is piped")?;
        for line in BufReader::new(out).lines() {
            each(&line?);
        }
        let status = self.child.wait()?;
        if !status.success() {
            bail!("job failed with {status}");
        }
        Ok(())
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            // mpirun and its ranks (each in a process group of its own).
            icheck_service::testkit::kill_process_tree(self.child.id());
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.shm);
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Part 1: heat2d grows its agents while commits get faster.
fn dynamic_agents(cli: &Cli, icheck: &Path, heat2d: &Path) -> Result<()> {
    let dynamic = "readInterval = 0.5\ninit_agent_count = 1\nagent_selection = \"BW\"\nnode_selection = \"RR\"\ncandidate_count = 4\n";
    let cluster = NetCluster::start(icheck, "fig97a", 4, Some(&cli.rate), dynamic);
    let args: Vec<String> = ["--n", &cli.n.to_string(), "--iters", &(cli.commits - 1).to_string(), "--every", "1"]
        .into_iter()
        .chain(["--probe-every", "4", "--hint-remaining", "1", "--app", "heat"])
        .map(String::from)
        .collect();
    println!(
        "\n## Dynamic agents (like Fig. 9.7a): heat2d, {} ranks, {} MiB per version, 4 nodes at {}; a probe after every 4th commit\n",
        cli.ranks,
        (u64::from(cli.n) * u64::from(cli.n) * 8) >> 20,
        cli.rate
    );
    let started = Instant::now();
    let mut agents = 1u32;
    // (agents, commit seconds) per commit; probe seconds with and without a change.
    let (mut commits, mut changed, mut unchanged) = (Vec::new(), Vec::new(), Vec::new());
    let mut timeline = Vec::new();
    Job::start(&cluster, cli.ranks, heat2d, &args, false)?.follow(|line| {
        let seconds = line.rsplit_once("seconds=").and_then(|(_, s)| s.parse::<f64>().ok());
        if let (true, Some(s)) = (line.starts_with("COMMITTED"), seconds) {
            commits.push((agents, s));
            timeline.push(format!(
                "{:>6.1}s commit {:>2} with {agents} agent(s): {s:.3} s",
                started.elapsed().as_secs_f64(),
                commits.len()
            ));
        } else if let (Some(rest), Some(s)) = (line.strip_prefix("PROBE agents="), seconds) {
            agents = rest.split(' ').next().and_then(|a| a.parse().ok()).unwrap_or(agents);
            changed.push(s);
            timeline.push(format!("{:>6.1}s probe: agents -> {agents} ({s:.3} s)", started.elapsed().as_secs_f64()));
        } else if let (true, Some(s)) = (line.starts_with("PROBE unchanged"), seconds) {
            unchanged.push(s);
            timeline.push(format!("{:>6.1}s probe: unchanged ({s:.3} s)", started.elapsed().as_secs_f64()));
        }
    })?;
    println!("```");
    for line in &timeline {
        println!("{line}");
    }
    println!("```\n");
    // Phases in the order they ran; the first two commits after a change warm up.
    let mut phases: Vec<(u32, Vec<f64>)> = Vec::new();
    for (a, s) in &commits {
        match phases.last_mut() {
            Some((last, times)) if last == a => times.push(*s),
            _ => phases.push((*a, vec![*s])),
        }
    }
    let baseline = phases.first().map(|(_, t)| mean(t.get(2..).unwrap_or(t))).unwrap_or(f64::NAN);
    println!(
        "| agents (in order) | commits | mean commit s (after 2 warm-up) | vs {} agent(s) |",
        phases.first().map_or(0, |p| p.0)
    );
    println!("|---:|---:|---:|---:|");
    for (a, times) in &phases {
        let warm = mean(times.get(2..).filter(|t| !t.is_empty()).unwrap_or(times));
        println!("| {a} | {} | {warm:.3} | {:.2}x |", times.len(), warm / baseline);
    }
    let mean_commit = mean(&commits.iter().map(|c| c.1).collect::<Vec<_>>());
    println!("\n| probe | count | mean s | in mean commits |\n|---|---:|---:|---:|");
    for (what, times) in [("with an agent change", &changed), ("without a change", &unchanged)] {
        println!("| {what} | {} | {:.3} | {:.2} |", times.len(), mean(times), mean(times) / mean_commit);
    }
    Ok(())
}

/// Part 2: one application's commit bandwidth while `others` checkpoint,
/// under one placement; returns its MB/s per commit.
fn contended(cli: &Cli, icheck: &Path, strategy: &str, dynamic: &str) -> Result<Vec<f64>> {
    let example = out_dir()?.join("mpi_checkpoint");
    let cluster = NetCluster::start(icheck, &format!("fig97b-{strategy}"), 3, Some(&cli.rate), dynamic);
    let mut background = Vec::new();
    for i in 0..cli.others {
        let args: Vec<String> =
            ["--app", &format!("other{i}"), "--steps", "100000", "--every", "1", "--mib", "2", "--step-ms", "100"]
                .into_iter()
                .map(String::from)
                .collect();
        background.push(Job::start(&cluster, 1, &example, &args, true)?);
        // Let the managers report the new load before the next placement.
        std::thread::sleep(Duration::from_millis(1500));
    }
    let steps = (cli.contended_commits - 1).to_string();
    let args: Vec<String> =
        ["--app", "measured", "--steps", &steps, "--every", "1", "--mib", "2", "--step-ms", "100", "--persist"]
            .into_iter()
            .map(String::from)
            .collect();
    Job::start(&cluster, 2, &example, &args, false)?.follow(|_| ())?;
    drop(background);
    let report = cluster.status();
    let app = report.apps.iter().find(|a| a.registration.name == "measured").context("the measured application")?;
    let nodes: Vec<&str> = app.agents.iter().map(|a| a.node.as_str()).collect();
    let placed: Vec<String> = report.nodes.iter().map(|n| format!("{}: {} agents", n.node, n.status.agents)).collect();
    println!("{strategy}: measured app's agents on {nodes:?}; nodes {placed:?}");
    Ok(app.commits.iter().map(|c| c.bytes as f64 / c.commit_secs / 1e6).collect())
}

fn placement(cli: &Cli, icheck: &Path) -> Result<()> {
    println!(
        "\n## Placement under contention (like Fig. 9.7b): 2 ranks x 2 MiB per commit while {} single-rank applications checkpoint 2 MiB every 0.1 s; 3 nodes at {}\n",
        cli.others, cli.rate
    );
    let base = "readInterval = 0.5\ninit_agent_count = 2\nmax_agents_node = 16\n";
    let stacked = contended(
        cli,
        icheck,
        "stacked",
        &format!("{base}agent_selection = \"BW\"\nnode_selection = \"FTC\"\ncandidate_count = 1\n"),
    )?;
    let spread = contended(
        cli,
        icheck,
        "bandwidth",
        &format!("{base}agent_selection = \"BW\"\nnode_selection = \"RR\"\ncandidate_count = 2\n"),
    )?;
    println!("\n| commit | stacked (FTC): MB/s | by bandwidth (BW, RR): MB/s |\n|---:|---:|---:|");
    for i in 0..stacked.len().max(spread.len()) {
        let cell = |v: &Vec<f64>| v.get(i).map_or(String::new(), |bw| format!("{bw:.1}"));
        println!("| {} | {} | {} |", i + 1, cell(&stacked), cell(&spread));
    }
    let summary = |v: &Vec<f64>| {
        let mut bw: Vec<f64> = v.iter().skip(2).copied().collect();
        bw.sort_by(|a, b| a.total_cmp(b));
        (
            bw.first().copied().unwrap_or(0.0),
            bw.get(bw.len() / 2).copied().unwrap_or(0.0),
            bw.last().copied().unwrap_or(0.0),
        )
    };
    let (s, b) = (summary(&stacked), summary(&spread));
    println!("\n| placement (after 2 warm-up commits) | min MB/s | median MB/s | max MB/s |\n|---|---:|---:|---:|");
    println!("| stacked on one node (FTC) | {:.1} | {:.1} | {:.1} |", s.0, s.1, s.2);
    println!("| by bandwidth (BW, RR) | {:.1} | {:.1} | {:.1} |", b.0, b.1, b.2);
    println!("\nmedian ratio, by bandwidth / stacked: {:.2}x", b.1 / s.1);
    Ok(())
}

/// One phase of the malleable application as measured.
#[derive(Default, Debug)]
struct Phase {
    ranks: u32,
    agents: usize,
    /// Commits after the probe (the agents of this phase).
    commit_secs: Vec<f64>,
    /// The first commit after the resize (the previous phase's agents).
    first_commit: f64,
    probe_secs: f64,
    restore_secs: f64,
}

/// Part 3 under one strategy: phases of 1, 4 and 2 ranks.
fn malleable_run(cli: &Cli, icheck: &Path, strategy: &str) -> Result<Vec<Phase>> {
    let example = out_dir()?.join("malleable");
    let dynamic = format!(
        "readInterval = 0.5\ninit_agent_count = 1\nis_dynamic_as = false\nagent_change_strategy = \"{strategy}\"\nagent_selection = \"BW\"\nnode_selection = \"RR\"\ncandidate_count = 4\n"
    );
    let cluster =
        NetCluster::start(icheck, &format!("fig911-{}", strategy.to_lowercase()), 4, Some(&cli.rate), &dynamic);
    let mut phases = Vec::new();
    for (i, ranks) in [1u32, 4, 2].into_iter().enumerate() {
        let mut args: Vec<String> = ["--app", "malleable", "--global", "10007", "--probe"].map(String::from).into();
        args.extend([
            "--payload-mib".into(),
            cli.payload_mib.to_string(),
            "--commits".into(),
            cli.phase_commits.to_string(),
        ]);
        if i == 0 {
            args.push("--write".into());
        }
        let mut phase = Phase { ranks, ..Phase::default() };
        let mut probed = false;
        let value = |line: &str| line.rsplit('=').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
        Job::start(&cluster, ranks, &example, &args, false)?.follow(|line| {
            if line.starts_with("COMMIT_SECONDS") {
                if probed {
                    phase.commit_secs.push(value(line));
                } else {
                    phase.first_commit = value(line);
                }
            } else if line.starts_with("PROBE_SECONDS") {
                phase.probe_secs = value(line);
                probed = true;
            } else if line.starts_with("RESTORED_PAYLOAD") {
                phase.restore_secs = value(line);
            } else if line.starts_with("ERROR") {
                eprintln!("{line}");
            }
        })?;
        let report = cluster.status();
        phase.agents = report.apps.iter().find(|a| a.registration.name == "malleable").map_or(0, |a| a.agents.len());
        println!("{strategy}: {phase:?}");
        phases.push(phase);
    }
    Ok(phases)
}

fn malleable(cli: &Cli, icheck: &Path) -> Result<()> {
    println!(
        "\n## Malleable application (like Fig. 9.11/9.12): 1 -> 4 -> 2 ranks, {} MiB per rank, 4 nodes at {}\n",
        cli.payload_mib, cli.rate
    );
    let rigid = malleable_run(cli, icheck, "MA-RA")?;
    let flexible = malleable_run(cli, icheck, "MA-MA")?;
    println!(
        "\n| ranks | checkpoint MiB | MA-RA agents | MA-RA commit s | MA-MA agents | MA-MA commit s | MA-RA / MA-MA |\n|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (r, m) in rigid.iter().zip(&flexible) {
        let (a, b) = (mean(&r.commit_secs), mean(&m.commit_secs));
        println!(
            "| {} | {} | {} | {a:.3} | {} | {b:.3} | {:.2}x |",
            r.ranks,
            cli.payload_mib * u64::from(r.ranks),
            r.agents,
            m.agents,
            a / b
        );
    }
    println!(
        "\n| ranks | restore (redistribution) s, MA-RA / MA-MA | first commit after the resize s, MA-RA / MA-MA | probe s (agent change), MA-RA / MA-MA |\n|---:|---:|---:|---:|"
    );
    for (r, m) in rigid.iter().zip(&flexible).skip(1) {
        println!(
            "| {} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} / {:.3} |",
            r.ranks, r.restore_secs, m.restore_secs, r.first_commit, m.first_commit, r.probe_secs, m.probe_secs
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // Ctrl-C stops the clusters this run started and removes their networks.
    icheck_service::testkit::interrupt::stop_on_interrupt().context("cannot wait for interrupting signals")?;
    let icheck = siblings::sibling_binary("icheck")?;
    if cli.only.is_none_or(|p| p == 1) {
        let prefix = std::env::temp_dir().join(format!("icheck-bench-prefix-{}", std::process::id()));
        let heat2d = build_heat2d(&prefix)?;
        let result = dynamic_agents(&cli, &icheck, &heat2d);
        let _ = std::fs::remove_dir_all(&prefix);
        result?;
    }
    if cli.only.is_none_or(|p| p == 2) {
        placement(&cli, &icheck)?;
    }
    if cli.only.is_none_or(|p| p == 3) {
        malleable(&cli, &icheck)?;
    }
    Ok(())
}
