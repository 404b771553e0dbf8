//! Where a version's bytes go on this node: the file a `Begin` gets (a
//! pruned version's spare, a file prepared ahead, a new file, or a spill
//! to the PFS when the node's checkpoint memory is full), the files made
//! ahead of the next version on low-priority threads, and the pruning that
//! turns an older version's file into the next one's spare.
//!
//! Architecture invariant: whether a version fits the node's memory budget
//! and the making of its file are decided under one lock per manager
//! ([`NODE_STORE_SPACE`]), so that two ranks beginning at once never
//! overrun the budget together; a file made ahead is a bet on the next
//! commit and is made only while twice its size is free, so it never
//! pushes another version out.

use std::thread::JoinHandle;
use std::time::Instant;

use icheck_core::fabric::{
    Access, AlignedBuffer, ProgressMode, ProgressThread, RegisteredBuffer, RemoteRegion, StableBuffer,
};
use icheck_core::protocol::AgentReply;
use icheck_core::redundancy::PieceId;

use super::session::{admit, BeginChecked, SessionCore};
use super::{Destination, Session, Shared, Writing};
use crate::store::{MappedFile, Pruned, Store, StoreError};

/// Bytes of the registered buffer a spilling session pulls through.
const SPILL_STAGING: u64 = 16 << 20;

/// Exposes `file` to the rank for the checked version it is about to
/// write (pushing ranks get a progress thread that spins for them) and
/// returns where the rank writes or the agent reads into.
fn start_writing(
    shared: &Shared,
    session: &mut Session,
    file: RegisteredBuffer<MappedFile>,
    checked: BeginChecked,
    push: bool,
) -> Result<RemoteRegion, String> {
    let remote = file.remote();
    let progress = if push {
        Some(ProgressThread::spawn(&shared.endpoint, ProgressMode::Spin).map_err(|e| e.to_string())?)
    } else {
        None
    };
    session.writing = Some(Writing { destination: Destination::Memory(file), _progress: progress });
    session.core.begun(checked, true, Instant::now());
    Ok(remote)
}

/// Gives a checked Begin its destination: an incremental version's own
/// file for its changed blocks, a whole version's file (a spare or a
/// prepared one when there is one), or a spill to the PFS when the node's
/// checkpoint memory is full.
pub(super) fn begin_version(
    shared: &Shared,
    session: &mut Session,
    checked: BeginChecked,
    push: bool,
    begun: Instant,
) -> Result<AgentReply, String> {
    prune_protected(shared, session)?;
    let store = &shared.settings.store;
    let version = checked.version;
    let (app, rank, total_len) = (session.core.app(), session.core.rank(), checked.total_len);
    // Claimed before the file is made, so that an older session of this
    // rank and version (an agent stopped late on this node) no longer
    // discards or seals it.
    let key = (app.to_string(), rank, version);
    let (ticket, ()) = store.writers().claim(key.clone(), || ());
    session.writer = Some((ticket, key));
    if checked.delta.is_some() {
        return begin_incremental(shared, session, checked, push, begun);
    }
    // A file prepared in the background since the last version is
    // used when no spare is; one made useless by a spare goes.
    let prepared = session.prepared.take().and_then(|thread| thread.join().ok().flatten());
    let fits = |file: &MappedFile| file.len() as u64 == total_len.max(4096);
    let reusable = match (session.spare.take().filter(fits), prepared.filter(fits)) {
        (Some(spare), unneeded) => {
            if unneeded.is_some() {
                drop(unneeded);
                store.discard_prepared(app, rank).map_err(|e| e.to_string())?;
            }
            Some((spare, Reuse::Spare))
        }
        (None, Some(prepared)) => Some((prepared, Reuse::Prepared)),
        (None, None) => None,
    };
    let needed = if reusable.is_some() { 0 } else { total_len };
    // Whether the version fits, and creating its file, are decided
    // under one lock per manager (a node's agents all run in it):
    // two ranks beginning at once would otherwise both see room for
    // one and overrun the budget together.
    let space = NODE_STORE_SPACE.lock().unwrap_or_else(|p| p.into_inner());
    let held = if shared.mem_budget > 0 && needed > 0 { store.bytes_held() } else { 0 };
    let file = match (admit(shared.mem_budget, held, needed), reusable) {
        (Err(full), _) => Err(format!("version {version} of rank {rank}: {full}")),
        (Ok(()), Some((spare, reuse)))
            if match reuse {
                Reuse::Spare => store.reuse_spare(app, rank, version, total_len),
                Reuse::Prepared => store.reuse_prepared(app, rank, version, total_len),
            }
            .map_err(|e| e.to_string())? =>
        {
            // Registered again for this version only.
            shared.endpoint.register(spare, Access::REMOTE_READ_WRITE).map_err(|e| e.to_string())
        }
        (Ok(()), _) => match store.create(app, rank, version, total_len) {
            // Registered for both directions so the mapping can be
            // reused whichever way the next version arrives.
            Ok(file) => shared.endpoint.register(file, Access::REMOTE_READ_WRITE).map_err(|e| e.to_string()),
            // Another tenant of the store's file system took the room.
            Err(full @ StoreError::NoSpace { .. }) => Err(full.to_string()),
            Err(err) => return Err(err.to_string()),
        },
    };
    // The file has its size (and pages): later budget checks count it.
    drop(space);
    let file = match file {
        Ok(file) => file,
        Err(full) => {
            let destination = spill_destination(shared, &session.core, version, total_len, &full)?;
            tracing::warn!(
                version,
                rank,
                bytes = total_len,
                held,
                budget = shared.mem_budget,
                reason = %full,
                "the node's checkpoint memory is full: spilling this version to the PFS"
            );
            session.writing = Some(Writing { destination, _progress: None });
            session.core.begun(checked, false, Instant::now());
            // The agent spills only what it reads itself: a rank that meant
            // to push is told to send this version with Pull instead.
            if push {
                return Ok(AgentReply::SpillByPull);
            }
            // The rank pulls into nothing of ours: any region will do.
            return Ok(AgentReply::Target(RemoteRegion { addr: 0, len: 0, key: 0 }));
        }
    };
    let prepare_ms = begun.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(version, rank, bytes = total_len, push, prepare_ms, "version begun");
    Ok(AgentReply::Target(start_writing(shared, session, file, checked, push)?))
}

/// [`begin_version`] for an incremental version: a file of its changed
/// blocks only, admitted under the node's budget like any version's. A
/// version that does not fit is taken whole, as a spill.
fn begin_incremental(
    shared: &Shared,
    session: &mut Session,
    mut checked: BeginChecked,
    push: bool,
    begun: Instant,
) -> Result<AgentReply, String> {
    let store = &shared.settings.store;
    // The store may hand the spare's or the prepared file's pages to this
    // version (cut to its length): no mapping of them may outlive that.
    session.spare = None;
    let (app, rank, version, written) =
        (session.core.app(), session.core.rank(), checked.version, checked.written_len());
    // The file prepared after the last version: its mapping is taken as it
    // is when it has this version's size (a run committing the same small
    // change again), else its pages are. One still being made is left to
    // finish: waiting for it cost a small commit several milliseconds, and
    // the next Begin takes it.
    let still_preparing = session.prepared.as_ref().is_some_and(|thread| !thread.is_finished());
    let prepared = match still_preparing {
        true => None,
        false => session.prepared.take().and_then(|thread| thread.join().ok().flatten()),
    }
    .filter(|file| file.len() as u64 == written.max(4096));
    let space = NODE_STORE_SPACE.lock().unwrap_or_else(|p| p.into_inner());
    let file = match prepared {
        Some(file) if store.reuse_prepared(app, rank, version, written).map_err(|e| e.to_string())? => Ok(file),
        _ => {
            let held = if shared.mem_budget > 0 { store.bytes_held() } else { 0 };
            admit(shared.mem_budget, held, written).and_then(|()| {
                match still_preparing {
                    true => store.create_new(app, rank, version, written),
                    false => store.create(app, rank, version, written),
                }
                .map_err(|e| e.to_string())
            })
        }
    };
    drop(space);
    let file = match file {
        Ok(file) => file,
        Err(reason) => {
            tracing::info!(version, rank, %reason, "no room for the changed blocks: taking the version whole");
            checked.delta = None;
            return begin_version(shared, session, checked, push, begun);
        }
    };
    let file = shared.endpoint.register(file, Access::REMOTE_READ_WRITE).map_err(|e| e.to_string())?;
    let prepare_ms = begun.elapsed().as_secs_f64() * 1e3;
    tracing::debug!(version, rank, bytes = checked.total_len, written, push, prepare_ms, "incremental version begun");
    Ok(AgentReply::DeltaTarget(start_writing(shared, session, file, checked, push)?))
}

/// Versions a rank holds back from pruning besides its newest.
pub(super) type Held = std::collections::BTreeSet<u64>;

/// [`Shared::held_back`] given the newest protected version and the one
/// being protected (0: none).
pub(super) fn held_back(protected: u64, protecting: u64, newest: u64) -> Held {
    let protecting = Some(protecting).filter(|v| *v > protected);
    [Some(protected), protecting].into_iter().flatten().filter(|v| *v > 0 && *v < newest).collect()
}

/// Prunes the session's rank below `keep_from` but for `held` (see
/// [`Store::prune`]): one pruned version's file becomes the spare for the
/// next version, with its mapping; versions a PFS copy reads stay.
pub(super) fn prune_older(
    shared: &Shared,
    session: &mut Session,
    keep_from: u64,
    held: &Held,
) -> Result<Pruned, String> {
    let rank = session.core.rank();
    let stale = |v: u64| v < keep_from && !held.contains(&v);
    // Pruned: its file may become the spare and be cut.
    shared.kept.forget_if(rank, stale);
    let mut pinned = shared.pinned_versions();
    pinned.extend(held.iter().copied());
    let pruned =
        shared.settings.store.prune(session.core.app(), rank, keep_from, &pinned).map_err(|e| e.to_string())?;
    // Versions a PFS copy pins stay on the store (unmapped here: the copy
    // maps them itself); the held one stays mapped, for the Begin that
    // prunes it to take its file as the spare.
    let (old, kept): (Vec<_>, Vec<_>) = session.sealed.drain(..).partition(|(v, _)| stale(*v));
    session.sealed = kept;
    // (A reader still holding it leaves the next version to map it.)
    if let Some(spare) = old.into_iter().find(|(v, _)| Some(*v) == pruned.spare).and_then(|(_, f)| f.into_inner()) {
        session.spare = Some(spare);
    }
    Ok(pruned)
}

/// Before a Begin: a version held back at the last Complete until a newer
/// one was protected goes now if that happened, its file the new
/// version's.
fn prune_protected(shared: &Shared, session: &mut Session) -> Result<(), String> {
    let Some(newest) = shared.complete(session.core.rank()) else { return Ok(()) };
    let held = shared.held_back(newest);
    if session.sealed.iter().any(|(v, _)| *v < newest && !held.contains(v)) {
        let pruning = Instant::now();
        let pruned = prune_older(shared, session, newest, &held)?;
        tracing::debug!(
            rank = session.core.rank(),
            newest,
            ?held,
            removed = pruned.removed,
            prune_ms = pruning.elapsed().as_secs_f64() * 1e3,
            "protected: older versions pruned"
        );
    }
    Ok(())
}

/// Which kind of reusable file a `Begin` takes.
enum Reuse {
    /// A pruned version's file ([`Store::prune`]).
    Spare,
    /// A file made ahead of time ([`prepare_next_file`]).
    Prepared,
}

/// Starts making the file of `rank`'s next version (`len` bytes, the size
/// of its newest) on a background thread of low priority: the first two
/// versions of a run each mapped fresh memory inside the commit, where
/// tmpfs allocates and zeroes every page (the first two commits took 3× a
/// later one). The file is reserved against the node's memory budget
/// under the same lock as `Begin`'s, and only while twice its size is
/// free, so it does not push a version out; without that room it is not
/// made, and the next version does what it did before. `None` if the
/// thread cannot start.
pub(super) fn prepare_next_file(shared: &Shared, rank: u32, len: u64) -> Option<JoinHandle<Option<MappedFile>>> {
    let (store, app, budget) = (shared.settings.store.clone(), shared.app.clone(), shared.mem_budget);
    let spawned = std::thread::Builder::new().name("icheck-prepare".into()).spawn(move || {
        let warm = {
            let _space = NODE_STORE_SPACE.lock().unwrap_or_else(|p| p.into_inner());
            // Only with room for the prepared file and another version
            // besides: it is a bet on the next commit, never worth making
            // another application's version spill.
            if node_room(&store, budget) < len.saturating_mul(2) {
                return None;
            }
            match store.reserve_prepared(&app, rank, len) {
                Ok(warm) => warm,
                Err(err) => {
                    tracing::warn!(rank, %err, "cannot prepare the next version's file");
                    return None;
                }
            }
        };
        // Zeroing fresh pages is long work that must not take the cores
        // from a commit; a warm file only needs its mapping, which a
        // back-to-back Begin waits for: that keeps normal priority.
        if !warm {
            crate::manager::lower_thread_priority();
        }
        let started = Instant::now();
        match store.map_prepared(&app, rank, len) {
            Ok(file) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(rank, bytes = len, ms, warm, "next version's file prepared");
                Some(file)
            }
            Err(err) => {
                tracing::warn!(rank, %err, "cannot prepare the next version's file");
                let _ = store.discard_prepared(&app, rank);
                None
            }
        }
    });
    spawned.map_err(|err| tracing::warn!(%err, "cannot start preparing the next version's file")).ok()
}

/// Bytes this node's store can still take: the agent's memory budget less
/// what the store holds, or (no budget) what its file system has free.
fn node_room(store: &Store, budget: u64) -> u64 {
    match budget {
        0 => store.capacity().map_or(0, |c| c.available),
        _ => budget.saturating_sub(store.bytes_held()),
    }
}

/// After version `version`'s `piece` (`len` bytes) was sealed here from
/// `file`: hands the file's mapping to the store, for the piece's next use
/// as a spare ([`Store::keep_piece_mapping`]), and gives the piece a spare
/// for the next version when it has none ([`prepare_piece_spare`]).
pub(super) fn piece_sealed(shared: &Shared, version: u64, piece: PieceId, file: MappedFile, len: u64) {
    shared.settings.store.keep_piece_mapping(&shared.app, version, piece, file);
    prepare_piece_spare(shared, version, piece, len);
}

/// Gives version `version`'s sealed `piece` (`len` bytes) a spare for the
/// next version on a background thread of low
/// priority, when it has none and twice `len` is free (the bet on the next
/// protection never pushes a version out): until an older version's piece
/// was dropped, every protection allocated fresh files
/// ([`Store::prepare_piece_spare`]). At steady state a piece has its
/// protected version and a spare, so this holds no more than that.
fn prepare_piece_spare(shared: &Shared, version: u64, piece: PieceId, len: u64) {
    let (store, app, budget) = (shared.settings.store.clone(), shared.app.clone(), shared.mem_budget);
    let spawned = std::thread::Builder::new().name("icheck-spare".into()).spawn(move || {
        crate::manager::lower_thread_priority();
        // Most protections have an older piece to drop: decided without
        // the node's store lock, which `Begin` takes, or a walk of the
        // store for its size.
        if !store.needs_piece_spare(&app, version, piece).unwrap_or(false) {
            return;
        }
        {
            let _space = NODE_STORE_SPACE.lock().unwrap_or_else(|p| p.into_inner());
            if node_room(&store, budget) < len.saturating_mul(2) {
                return;
            }
        }
        let started = Instant::now();
        match store.prepare_piece_spare(&app, version, piece) {
            Ok(made) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(version, %piece, bytes = len, made, ms, "spare for the next version's piece");
            }
            Err(err) => tracing::debug!(version, %piece, %err, "no spare for the next version's piece"),
        }
    });
    if let Err(err) = spawned {
        tracing::warn!(%err, "cannot start preparing a spare piece");
    }
}

/// Serialises the budget check and file creation of `Begin` over every agent
/// of this manager (one manager per node, one store per node).
static NODE_STORE_SPACE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Where a version goes when the node's memory budget cannot hold it: the
/// rank's file on the PFS, filled through a bounded registered buffer.
/// Only pulled bytes can spill (a pushing rank would write straight into
/// agent memory), so a rank that asked to push is answered
/// [`AgentReply::SpillByPull`] and pulls this version.
fn spill_destination(
    shared: &Shared,
    session: &SessionCore,
    version: u64,
    total_len: u64,
    full: &str,
) -> Result<Destination, String> {
    let pfs = shared.pfs().map_err(|why| format!("{full}, and it cannot spill: {why}"))?;
    let file = pfs.create_spill(session.app(), version, session.rank(), total_len).map_err(|e| e.to_string())?;
    let staging = AlignedBuffer::zeroed(SPILL_STAGING.min(total_len) as usize);
    let staging = shared.endpoint.register(staging, Access::LOCAL).map_err(|e| e.to_string())?;
    Ok(Destination::Spill { staging, file })
}
