//! A malleable MPI application: it checkpoints distributed arrays (BLOCK,
//! CYCLIC, PREDEFINED 2-D grid, MANUAL) of several element types and
//! replicated values (CONSTANT, SIZE, RANK, DEFAULT, VOLATILE), and a later
//! run with *another* process count restores them, each process receiving
//! exactly its part under the distribution for the new count. Every element
//! holds a value derived from its global index, so the check is exact.
//!
//! ```text
//! mpirun -np 4 malleable --app m --write        # commit with 4 ranks
//! mpirun -np 6 malleable --app m --check        # restore with 6, verify, commit again
//! ```
//!
//! Output lines the tests read (rank 0): `COMMITTED version=V ranks=P
//! epoch=E`, `VERIFIED version=V from=P ranks=Q`, with `--probe`
//! `PROBE unchanged` or `PROBE agents=N`, with `--hang` `HANG` (and every
//! rank's `PID rank=R pid=P`); any rank: `ERROR ...`.

use std::process::ExitCode;

use clap::Parser;
use icheck_lib::{Element, Global, Icheck, InitStatus, MpiComm, ProcessorMapping, Region, Replicated};
use mpi::traits::*;

#[derive(Parser)]
#[command(about = "Checkpoints distributed and replicated data, restores it with another process count, verifies it")]
struct Args {
    /// Application name (runs with any process count share it).
    #[arg(long)]
    app: String,
    /// Elements of each 1-D distributed array.
    #[arg(long, default_value_t = 100_003)]
    global: u64,
    /// Commit a fresh version (otherwise: restart, verify, commit).
    #[arg(long)]
    write: bool,
    /// After verifying, finish with IC_PERSIST and commit nothing more.
    #[arg(long)]
    no_commit: bool,
    /// Bad input on purpose: rank 1 declares one element more globally.
    #[arg(long)]
    mismatch_global: bool,
    /// After the commit, probe: agents follow a resize (MA-RA / MA-MA).
    #[arg(long)]
    probe: bool,
    /// After writing, print every rank's PID and wait to be killed (a rank
    /// failure for the SHRINK / REBUILD restarts).
    #[arg(long)]
    hang: bool,
    /// MiB per rank of an extra BLOCK array whose global size follows the
    /// process count (weak scaling: the checkpoint grows with the job).
    #[arg(long, default_value_t = 0)]
    payload_mib: u64,
    /// Commits per run (the probe, if asked, follows the first).
    #[arg(long, default_value_t = 1)]
    commits: u32,
}

/// The weak-scaling payload's value at a global index.
fn payload_value(i: u64) -> f64 {
    i as f64 * 0.125
}

/// Payload elements per rank.
fn payload_per_rank(args: &Args) -> u64 {
    args.payload_mib * (1 << 20) / 8
}

/// The 2-D grid (PREDEFINED): 40 × 40 elements over the supported counts.
const GRID: (u64, u64) = (40, 40);
const GRIDS: [(u32, [u32; 2]); 7] =
    [(1, [1, 1]), (2, [1, 2]), (3, [3, 1]), (4, [2, 2]), (6, [2, 3]), (8, [2, 4]), (16, [4, 4])];

fn mapping() -> ProcessorMapping {
    let mut mapping = ProcessorMapping::new(GRID.0, GRID.1);
    for (procs, dims) in GRIDS {
        mapping.add(procs, dims, GRID.0 * GRID.1).expect("valid mapping");
    }
    mapping
}

/// Global index → value, per array, so every element can be checked.
fn block_value(i: u64) -> f64 {
    i as f64 * 0.5 + 1.0
}
fn cyclic_value(i: u64) -> i64 {
    (i as i64) * 7 - 3
}
fn cyclic1_value(i: u64) -> u8 {
    (i % 251) as u8
}
fn grid_value(i: u64) -> f32 {
    i as f32 + 0.25
}
fn manual_value(i: u64) -> i32 {
    (i as i32) * 3 + 5
}

/// MANUAL: 1000 elements cut unevenly (rank r's share grows with r).
const MANUAL_LEN: u64 = 1000;
fn manual_part(size: u32, rank: u32) -> std::ops::Range<u64> {
    let tri = |r: u64| r * (r + 1) / 2;
    let total = tri(u64::from(size));
    MANUAL_LEN * tri(u64::from(rank)) / total..MANUAL_LEN * tri(u64::from(rank) + 1) / total
}

fn part<T: Element>(layout: &Global, global: u64, size: u32, rank: u32, value: impl Fn(u64) -> T) -> Vec<T> {
    let distribution = layout.for_procs(size).expect("covered").expect("structured");
    distribution.ranges(global, size, rank).into_iter().flatten().map(value).collect()
}

fn first_bad<T: PartialEq + Copy>(got: &[T], want: &[T]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(a, b)| a != b)
}

fn main() -> ExitCode {
    icheck_examples::log_to_stderr(Some("warn"));
    let args = Args::parse();
    let universe = mpi::initialize().expect("MPI initialises");
    let world = universe.world();
    let (rank, size) = (world.rank() as u32, world.size() as u32);
    let result = run(&args, &world, rank, size);
    if let Err(message) = &result {
        println!("ERROR rank={rank} {message}");
    }
    world.barrier();
    if result.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(args: &Args, world: &mpi::topology::SimpleCommunicator, rank: u32, size: u32) -> Result<(), String> {
    let (mut ic, status) = Icheck::init(None, &args.app, MpiComm::new(world)).map_err(|e| e.to_string())?;
    let g = args.global;
    let cyclic3 = Global::Cyclic { width: 3 };
    let cyclic1 = Global::Cyclic { width: 1 };
    let grid = Global::Predefined(mapping());
    let grid_len = GRID.0 * GRID.1;
    if args.write {
        if status != InitStatus::Fresh {
            return Err(format!("--write expects a fresh application, found {status:?}"));
        }
        let declared = if args.mismatch_global && rank == 1 { g + 1 } else { g };
        let block = Region::from_vec(part(&Global::Block, g, size, rank, block_value));
        ic.add_adapt_global("block", &block, declared, Global::Block).map_err(|e| e.to_string())?;
        let cyclic = Region::from_vec(part(&cyclic3, g, size, rank, cyclic_value));
        ic.add_adapt_global("cyclic3", &cyclic, g, cyclic3.clone()).map_err(|e| e.to_string())?;
        let cyc1 = Region::from_vec(part(&cyclic1, g, size, rank, cyclic1_value));
        ic.add_adapt_global("cyclic1", &cyc1, g, cyclic1.clone()).map_err(|e| e.to_string())?;
        let grid_part = Region::from_vec(part(&grid, grid_len, size, rank, grid_value));
        ic.add_adapt_global("grid", &grid_part, grid_len, grid.clone()).map_err(|e| e.to_string())?;
        let manual = Region::from_vec(manual_part(size, rank).map(manual_value).collect());
        ic.add_adapt_global("manual", &manual, MANUAL_LEN, Global::Manual { root: 0 }).map_err(|e| e.to_string())?;
        add_replicated(&mut ic, rank, size, true)?;
        let payload_global = payload_per_rank(args) * u64::from(size);
        let payload = Region::from_vec(part(&Global::Block, payload_global, size, rank, payload_value));
        if args.payload_mib > 0 {
            ic.add_adapt_global("payload", &payload, payload_global, Global::Block).map_err(|e| e.to_string())?;
        }
        commit_and_probe(&mut ic, args, rank, size)?;
        if args.hang {
            println!("PID rank={rank} pid={}", std::process::id());
            world.barrier();
            if rank == 0 {
                println!("HANG");
            }
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        ic.finalize(true).map_err(|e| e.to_string())?;
        return Ok(());
    }
    let InitStatus::Restart { .. } = status else { return Err("--check expects a checkpoint".into()) };
    let version = ic.restart().map_err(|e| e.to_string())?;
    // Restores are per process: agree on the outcome before the next
    // collective call, so one rank's error cannot leave the others waiting.
    let verified = restore_and_verify(&mut ic, args, rank, size);
    let mut all_ok = 0i32;
    world.all_reduce_into(&i32::from(verified.is_err()), &mut all_ok, mpi::collective::SystemOperation::sum());
    let old_size = verified?;
    if all_ok != 0 {
        return Err(format!("{all_ok} other ranks failed their restore"));
    }
    if rank == 0 {
        println!("VERIFIED version={version} from={old_size} ranks={size}");
    }
    // The weak-scaling payload: restore the old one, then the job's data
    // grows (or shrinks) with its process count.
    let payload = Region::<f64>::zeroed(0);
    if args.payload_mib > 0 {
        let restored = restore_payload(&mut ic, args, rank, size, old_size, &payload);
        let mut failed = 0i32;
        world.all_reduce_into(&i32::from(restored.is_err()), &mut failed, mpi::collective::SystemOperation::sum());
        restored?;
        if failed != 0 {
            return Err(format!("{failed} other ranks failed to restore the payload"));
        }
    }
    if !args.no_commit {
        commit_and_probe(&mut ic, args, rank, size)?;
    }
    ic.finalize(true).map_err(|e| e.to_string())
}

/// Restores the payload written by `old_size` processes, checks it, and
/// puts the payload for this process count in its place.
fn restore_payload(
    ic: &mut Icheck,
    args: &Args,
    rank: u32,
    size: u32,
    old_size: u32,
    payload: &Region<f64>,
) -> Result<(), String> {
    let old_global = payload_per_rank(args) * u64::from(old_size);
    let restored = Region::<f64>::zeroed(ic.local_count("payload").map_err(|e| e.to_string())? as usize);
    ic.add_adapt_global("payload", &restored, old_global, Global::Block).map_err(|e| e.to_string())?;
    let started = std::time::Instant::now();
    ic.restore("payload", &restored).map_err(|e| e.to_string())?;
    if rank == 0 {
        println!("RESTORED_PAYLOAD seconds={:.4}", started.elapsed().as_secs_f64());
    }
    if let Some(at) = first_bad(&restored.read(), &part(&Global::Block, old_global, size, rank, payload_value)) {
        return Err(format!("label payload: element {at} is wrong"));
    }
    let global = payload_per_rank(args) * u64::from(size);
    *payload.write() = part(&Global::Block, global, size, rank, payload_value);
    ic.add_adapt_global("payload", payload, global, Global::Block).map_err(|e| e.to_string())
}

/// `--commits` commits, with a probe after the first if asked; rank 0
/// prints each version and its seconds.
fn commit_and_probe(ic: &mut Icheck, args: &Args, rank: u32, size: u32) -> Result<(), String> {
    for n in 0..args.commits.max(1) {
        let started = std::time::Instant::now();
        let version = ic.commit().map_err(|e| e.to_string())?;
        if rank == 0 {
            println!("COMMITTED version={version} ranks={size} epoch={}", ic.epoch());
            println!("COMMIT_SECONDS version={version} seconds={:.4}", started.elapsed().as_secs_f64());
        }
        if n == 0 && args.probe {
            let started = std::time::Instant::now();
            let outcome = ic.probe_agents(icheck_lib::ProbeHints::default()).map_err(|e| e.to_string())?;
            let secs = started.elapsed().as_secs_f64();
            if rank == 0 {
                match outcome {
                    icheck_lib::ProbeOutcome::Unchanged => println!("PROBE unchanged"),
                    icheck_lib::ProbeOutcome::Reconnected { agents } => println!("PROBE agents={agents}"),
                }
                println!("PROBE_SECONDS seconds={secs:.4}");
            }
        }
    }
    Ok(())
}

/// Sizes every label by `local_count`, restores it and checks every element
/// against its global index; returns the old process count.
fn restore_and_verify(ic: &mut Icheck, args: &Args, rank: u32, size: u32) -> Result<u32, String> {
    let g = args.global;
    let cyclic3 = Global::Cyclic { width: 3 };
    let cyclic1 = Global::Cyclic { width: 1 };
    let grid = Global::Predefined(mapping());
    let grid_len = GRID.0 * GRID.1;
    // How many elements will I get? (before allocating)
    let count = |label: &str| ic.local_count(label).map(|c| c as usize).map_err(|e| e.to_string());
    let block = Region::<f64>::zeroed(count("block")?);
    let cyclic = Region::<i64>::zeroed(count("cyclic3")?);
    let cyc1 = Region::<u8>::zeroed(count("cyclic1")?);
    let grid_part = Region::<f32>::zeroed(count("grid")?);
    let manual = Region::<i32>::zeroed(count("manual")?);
    ic.add_adapt_global("block", &block, g, Global::Block).map_err(|e| e.to_string())?;
    ic.add_adapt_global("cyclic3", &cyclic, g, cyclic3.clone()).map_err(|e| e.to_string())?;
    ic.add_adapt_global("cyclic1", &cyc1, g, cyclic1.clone()).map_err(|e| e.to_string())?;
    ic.add_adapt_global("grid", &grid_part, grid_len, grid.clone()).map_err(|e| e.to_string())?;
    // The root gets the whole MANUAL array and keeps it that way.
    ic.add_adapt_global("manual", &manual, MANUAL_LEN, Global::Manual { root: 0 }).map_err(|e| e.to_string())?;
    let (constant, size_v, rank_v, default, volatile) = add_replicated(ic, rank, size, false)?;
    ic.restore("block", &block).map_err(|e| e.to_string())?;
    ic.restore("cyclic3", &cyclic).map_err(|e| e.to_string())?;
    ic.restore("cyclic1", &cyc1).map_err(|e| e.to_string())?;
    ic.restore("grid", &grid_part).map_err(|e| e.to_string())?;
    ic.restore("manual", &manual).map_err(|e| e.to_string())?;
    ic.restore("size", &size_v).map_err(|e| e.to_string())?;
    ic.restore("rank", &rank_v).map_err(|e| e.to_string())?;
    ic.restore("constant", &constant).map_err(|e| e.to_string())?;
    ic.restore("default", &default).map_err(|e| e.to_string())?;
    ic.restore("volatile", &volatile).map_err(|e| e.to_string())?;
    let check = |what: &str, bad: Option<usize>| match bad {
        Some(at) => Err(format!("label {what}: element {at} is wrong")),
        None => Ok(()),
    };
    check("block", first_bad(&block.read(), &part(&Global::Block, g, size, rank, block_value)))?;
    check("cyclic3", first_bad(&cyclic.read(), &part(&cyclic3, g, size, rank, cyclic_value)))?;
    check("cyclic1", first_bad(&cyc1.read(), &part(&cyclic1, g, size, rank, cyclic1_value)))?;
    check("grid", first_bad(&grid_part.read(), &part(&grid, grid_len, size, rank, grid_value)))?;
    let old_size = ic.restarted_from().ok_or("restart() gave no process count")?;
    // MANUAL: rank 0 holds every old part, in old rank order: the whole array.
    if rank == 0 {
        let want: Vec<i32> = (0..MANUAL_LEN).map(manual_value).collect();
        check("manual", first_bad(&manual.read(), &want))?;
    } else if !manual.read().is_empty() {
        return Err("label manual: a non-root rank received data".into());
    }
    check("size", first_bad(&size_v.read(), &[size as i32]))?;
    check("rank", first_bad(&rank_v.read(), &[rank as i64]))?;
    check("constant", first_bad(&constant.read(), &[42, 43, 44]))?;
    // Existing ranks keep their value, joining ranks get the default.
    let want_default = if rank < old_size { 10.0 * f64::from(rank) } else { 2.5 };
    check("default", first_bad(&default.read(), &[want_default]))?;
    check("volatile", first_bad(&volatile.read(), &[i64::from(size) * 1000 + i64::from(rank)]))?;
    // A joining rank now holds the default; every rank goes on with its own
    // value, which the next version stores.
    default.write()[0] = 10.0 * f64::from(rank);
    Ok(old_size)
}

/// Replicated labels: CONSTANT [42, 43, 44], SIZE, RANK, DEFAULT 2.5 for
/// joining ranks (existing ones keep 10 × rank), VOLATILE recalculated as
/// size * 1000 + rank. A restarting run (`write` false) adds them holding
/// wrong values, which the restore must overwrite.
#[allow(clippy::type_complexity)]
fn add_replicated(
    ic: &mut Icheck,
    rank: u32,
    size: u32,
    write: bool,
) -> Result<(Region<i64>, Region<i32>, Region<i64>, Region<f64>, Region<i64>), String> {
    let (constant, size_v, rank_v, default) = if write {
        (vec![42i64, 43, 44], size as i32, i64::from(rank), 10.0 * f64::from(rank))
    } else {
        (vec![0; 3], -1, -1, -7.0)
    };
    let constant = Region::from_vec(constant);
    let size_v = Region::from_vec(vec![size_v]);
    let rank_v = Region::from_vec(vec![rank_v]);
    let default = Region::from_vec(vec![default]);
    let volatile = Region::from_vec(vec![-1i64]);
    let e = |e: icheck_lib::Error| e.to_string();
    ic.add_adapt("constant", &constant, Replicated::Constant).map_err(e)?;
    ic.add_adapt("size", &size_v, Replicated::Size).map_err(e)?;
    ic.add_adapt("rank", &rank_v, Replicated::Rank).map_err(e)?;
    ic.add_adapt("default", &default, Replicated::Default { value: 2.5, joining_only: true }).map_err(e)?;
    let recalc = Replicated::Volatile(Box::new(|v: &mut [i64], r: icheck_lib::Resize| {
        v.fill(i64::from(r.size) * 1000 + i64::from(r.rank));
    }));
    ic.add_adapt("volatile", &volatile, recalc).map_err(e)?;
    Ok((constant, size_v, rank_v, default, volatile))
}
