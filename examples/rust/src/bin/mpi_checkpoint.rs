//! An MPI application that checkpoints several labels of different types and
//! sizes through icheck, and on restart checks every restored byte.
//!
//! ```text
//! mpirun -np 4 mpi_checkpoint --app demo --steps 10 --every 2 --mib 96
//! ```
//!
//! Output lines the tests read (one per event, rank 0 only):
//! `FRESH`, `RESTORED version=V step=S verified`, `COMMIT_START version=V`,
//! `COMMITTED version=V step=S seconds=T`, `HANG`, `DONE`; with
//! `--probe-every`: `PROBE unchanged seconds=T` or
//! `PROBE agents=N seconds=T` then `VERIFIED version=V agents=N` once the
//! newest version was restored bit-exact through the new agents.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use icheck_examples::{fill_bytes, first_mismatch};
use icheck_lib::{Icheck, InitStatus, MpiComm, ProbeHints, ProbeOutcome, Region};
use mpi::traits::*;

#[derive(Parser)]
#[command(about = "Checkpoints labelled MPI data through icheck; restarts and verifies it bit-exact")]
struct Args {
    /// Application name (a restart uses the same name).
    #[arg(long)]
    app: String,
    /// Client configuration (default: $ICHECK_CONFIG).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Last step to compute.
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// Commit every this many steps.
    #[arg(long, default_value_t = 2)]
    every: u64,
    /// MiB of the largest label per rank (make it larger than the staging buffer).
    #[arg(long, default_value_t = 8)]
    mib: usize,
    /// Asynchronous commits.
    #[arg(long = "async")]
    asynchronous: bool,
    /// After this many commits, print HANG and wait to be killed.
    #[arg(long)]
    hang_after: Option<u64>,
    /// Keep the checkpoints in agent memory after finishing (IC_PERSIST).
    #[arg(long)]
    persist: bool,
    /// Milliseconds of "computation" per step.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// Probe for new agents after every this many commits (0: never); after
    /// a change, restore the newest version through the new agents and check it.
    #[arg(long, default_value_t = 0)]
    probe_every: u64,
    /// Tell probes how many commits remain (eq. 6.12); off: unknown.
    #[arg(long)]
    hint_remaining: bool,
    /// Once MPI has started, print WAITING and wait until this file exists
    /// before `init`: a test starts the job ahead and lets it register at a
    /// moment of its choosing, however long `mpirun` takes to start.
    #[arg(long)]
    start_when: Option<PathBuf>,
}

/// The labels: different element types and sizes, different per rank.
struct State {
    step: Region<i64>,
    field: Region<f64>,
    counts: Region<i32>,
    weights: Region<f32>,
    big: Region<u8>,
}

impl State {
    fn new(rank: u32, mib: usize) -> State {
        State {
            step: Region::zeroed(1),
            field: Region::zeroed(65_536 + rank as usize),
            counts: Region::zeroed(1000 + 3 * rank as usize),
            weights: Region::zeroed(3),
            big: Region::zeroed((mib << 20) + rank as usize * 4096 + 17),
        }
    }

    fn fill(&self, rank: u32, step: u64) {
        self.step.write()[0] = step as i64;
        for (i, x) in self.field.write().iter_mut().enumerate() {
            *x = (rank as f64) * 1e6 + (step as f64) + (i as f64) * 0.5;
        }
        for (i, x) in self.counts.write().iter_mut().enumerate() {
            *x = (rank as i32) * 100_000 + (step as i32) * 1000 + i as i32;
        }
        *self.weights.write() = vec![step as f32 * 0.25, -(rank as f32), f32::MIN_POSITIVE];
        fill_bytes(&mut self.big.write(), rank, step);
    }

    /// Names the first label that differs from what `fill(rank, step)` wrote.
    fn check(&self, rank: u32, step: u64) -> Result<(), String> {
        let expected = State::new(rank, 0);
        expected.big.write().clear();
        let field = self.field.read();
        if field
            .iter()
            .enumerate()
            .any(|(i, x)| x.to_bits() != ((rank as f64) * 1e6 + step as f64 + i as f64 * 0.5).to_bits())
        {
            return Err("field".into());
        }
        let counts = self.counts.read();
        if counts.iter().enumerate().any(|(i, x)| *x != (rank as i32) * 100_000 + (step as i32) * 1000 + i as i32) {
            return Err("counts".into());
        }
        let weights: Vec<u32> = self.weights.read().iter().map(|x| x.to_bits()).collect();
        let want: Vec<u32> =
            [step as f32 * 0.25, -(rank as f32), f32::MIN_POSITIVE].iter().map(|x| x.to_bits()).collect();
        if weights != want {
            return Err("weights".into());
        }
        if let Some(at) = first_mismatch(&self.big.read(), rank, step) {
            return Err(format!("big (byte {at})"));
        }
        Ok(())
    }
}

/// Writes one error line to stderr in a single write, so that the lines of
/// ranks failing at once do not interleave mid-line in the job's output
/// (`eprintln!` writes each piece of its format separately).
fn complain(line: String) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn say(rank: u32, line: &str) {
    if rank == 0 {
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
}

/// Probes for new agents; after a change, scrambles the live data, restores
/// the newest version through the new agents and checks every byte.
fn probe(ic: &mut Icheck, state: &State, rank: u32, step: u64, version: u64, remaining: Option<u32>) {
    let started = Instant::now();
    let hints = ProbeHints { remaining_commits: remaining.unwrap_or(0) };
    let outcome = ic.probe_agents(hints).unwrap_or_else(|e| {
        complain(format!("rank {rank}: probe failed: {e}"));
        std::process::exit(6);
    });
    let seconds = started.elapsed().as_secs_f64();
    let agents = match outcome {
        ProbeOutcome::Unchanged => return say(rank, &format!("PROBE unchanged seconds={seconds:.3}")),
        ProbeOutcome::Reconnected { agents } => agents,
    };
    say(rank, &format!("PROBE agents={agents} seconds={seconds:.3}"));
    state.fill(rank, step + 1_000_000);
    let restored = ic.restart().and_then(|v| ic.restore_all().map(|_| v)).unwrap_or_else(|e| {
        complain(format!("rank {rank}: restore through the new agents failed: {e}"));
        std::process::exit(7);
    });
    let checked = match restored == version {
        true => state.check(rank, step),
        false => Err(format!("version (restored {restored})")),
    };
    if let Err(label) = checked {
        complain(format!("rank {rank}: after the agent change, label {label} differs from step {step}"));
        std::process::exit(8);
    }
    say(rank, &format!("VERIFIED version={version} agents={agents}"));
}

fn main() {
    let args = Args::parse();
    icheck_examples::log_to_stderr(Some("warn"));
    let universe = mpi::initialize().expect("MPI initialises");
    let world = universe.world();
    let rank = world.rank() as u32;
    if let Some(go) = &args.start_when {
        say(rank, "WAITING");
        while rank == 0 && !go.exists() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        world.barrier();
    }
    let comm = MpiComm::new(&world);
    let (mut ic, status) = Icheck::init(args.config.as_deref(), &args.app, comm).unwrap_or_else(|e| {
        complain(format!("rank {rank}: icheck init failed: {e}"));
        std::process::exit(2);
    });
    ic.set_async(args.asynchronous);
    let state = State::new(rank, args.mib);
    ic.add("step", &state.step).unwrap();
    ic.add("field", &state.field).unwrap();
    ic.add("counts", &state.counts).unwrap();
    ic.add("weights", &state.weights).unwrap();
    ic.add("big", &state.big).unwrap();

    let mut first_step = 0;
    match status {
        InitStatus::Fresh => say(rank, "FRESH"),
        InitStatus::Restart { .. } => {
            let version = ic.restart().unwrap_or_else(|e| {
                complain(format!("rank {rank}: restart failed: {e}"));
                std::process::exit(3);
            });
            ic.restore_all().unwrap_or_else(|e| {
                complain(format!("rank {rank}: restore failed: {e}"));
                std::process::exit(3);
            });
            let step = state.step.read()[0] as u64;
            if let Err(label) = state.check(rank, step) {
                complain(format!("rank {rank}: restored label {label} differs from step {step}"));
                std::process::exit(4);
            }
            world.barrier();
            say(rank, &format!("RESTORED version={version} step={step} verified"));
            first_step = step + 1;
        }
    }
    let mut commits = 0;
    for step in first_step..=args.steps {
        std::thread::sleep(std::time::Duration::from_millis(args.step_ms));
        state.fill(rank, step);
        if step % args.every == 0 {
            let next = ic.latest_version().map_or(1, |v| v + 1);
            say(rank, &format!("COMMIT_START version={next}"));
            let started = Instant::now();
            let version = ic.commit().unwrap_or_else(|e| {
                complain(format!("rank {rank}: commit failed: {e}"));
                std::process::exit(5);
            });
            if args.asynchronous {
                ic.wait().unwrap();
            }
            let seconds = started.elapsed().as_secs_f64();
            say(rank, &format!("COMMITTED version={version} step={step} seconds={seconds:.3}"));
            commits += 1;
            if args.probe_every > 0 && commits % args.probe_every == 0 {
                let remaining = (args.steps - step) / args.every;
                probe(&mut ic, &state, rank, step, version, args.hint_remaining.then_some(remaining as u32));
            }
            if args.hang_after == Some(commits) {
                say(rank, "HANG");
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(60));
                }
            }
        }
    }
    ic.finalize(args.persist).unwrap();
    say(rank, "DONE");
}
