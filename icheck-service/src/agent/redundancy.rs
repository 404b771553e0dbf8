//! The agent's side of redundancy across nodes: building a piece (a copy of
//! another node's rank, or a parity shard of a Reed-Solomon group) from the
//! ranks' primaries, and rebuilding a lost rank from copies or from the
//! survivors of its group. Everything moves agent to agent over the
//! fabric, on the manager's job threads, never on an application's path.
//!
//! Architecture invariant: every byte read from a peer is checked before it
//! counts: primaries and copies against the rank's own checksums (the peer
//! refuses to expose damaged ones), parity shards against their stripe
//! checksums, and every rebuilt rank against its manifest before it is
//! sealed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use icheck_core::control::BlockingConnection;
use icheck_core::fabric::{
    Access, AlignedBuffer, FabricError, Peer, PeerOp, RegisteredBuffer, RemoteRegion, RmaOp, StableBuffer,
    TransferOptions,
};
use icheck_core::format::InOrderCheck;
use icheck_core::protocol::data_shard_ranges;
use icheck_core::protocol::{
    check_fetched, AgentInfo, AgentReply, AgentRequest, FetchWanted, Fetched, Manifest, ParityMeta, PieceMeta,
    PieceTask, RebuildSource, STRIPE,
};
use icheck_core::redundancy::{self, PieceId};
use icheck_core::verified::{read_checked, CheckedRange};

use super::{Job, TAKE_OVER_CONNECT_TIMEOUT, TAKE_OVER_TIMEOUT};
use crate::store::{MappedFile, SharedMapping};

/// A session with another agent of the same application, admitted by the
/// node token (it presents no capability): what reading a peer's primary
/// or piece takes.
pub(super) struct PeerSession {
    conn: BlockingConnection,
    peer: Peer,
    from: AgentInfo,
    fetching: bool,
    /// Whether the peer was asked to serve this session's reads apart.
    apart: bool,
}

impl PeerSession {
    /// Opens a session with `from` bound to `rank`.
    pub(super) fn open(job: &Job<'_>, from: &AgentInfo, rank: u32) -> Result<PeerSession, String> {
        let fail = |what: String| format!("agent {} on {} ({}): {what}", from.id, from.node, from.control);
        let mut conn = BlockingConnection::connect(&from.control, &job.settings.node_token, TAKE_OVER_CONNECT_TIMEOUT)
            .map_err(|e| fail(e.to_string()))?;
        conn.set_timeout(TAKE_OVER_TIMEOUT);
        let peer = job.endpoint.insert_peer(&from.address).map_err(|e| fail(e.to_string()))?;
        let mut session = PeerSession { conn, peer, from: from.clone(), fetching: false, apart: false };
        let open = AgentRequest::Open {
            app: job.app.clone(),
            rank,
            address: job.endpoint.address().clone(),
            capability: String::new(),
            pfs_key: None,
        };
        session.call(&open)?;
        Ok(session)
    }

    fn fail(&self, what: impl std::fmt::Display) -> String {
        format!("agent {} on {} ({}): {what}", self.from.id, self.from.node, self.from.control)
    }

    /// Before the first read: asks the peer to serve this session from an
    /// endpoint of its own where the provider would otherwise make
    /// concurrent readers of the peer take turns (`ServeApart`), and
    /// reads from there.
    fn serve_apart(&mut self, job: &Job<'_>) -> Result<(), String> {
        if std::mem::replace(&mut self.apart, true) {
            return Ok(());
        }
        match self.call(&AgentRequest::ServeApart)? {
            AgentReply::Apart(address) => {
                self.peer = job.endpoint.insert_peer(&address).map_err(|e| self.fail(e))?;
                Ok(())
            }
            AgentReply::Ok => Ok(()),
            other => Err(self.fail(format!("unexpected answer to ServeApart: {other:?}"))),
        }
    }

    fn call(&mut self, request: &AgentRequest) -> Result<AgentReply, String> {
        match self.conn.call::<_, AgentReply>(request) {
            Ok(AgentReply::Error(message)) => Err(self.fail(message)),
            Ok(reply) => Ok(reply),
            Err(err) => Err(self.fail(err)),
        }
    }

    /// The rank's primary of `version`, exposed for reading. Without
    /// `reader_checks` the peer checks it first (and refuses to call a
    /// damaged one intact), as for a restarting rank; with it the peer
    /// exposes it unchecked, because this reader checks every chunk as it
    /// arrives.
    pub(super) fn fetch(
        &mut self,
        job: &Job<'_>,
        (rank, version): (u32, u64),
        reader_checks: bool,
    ) -> Result<(Manifest, RemoteRegion), String> {
        self.serve_apart(job)?;
        let reply = self.call(&AgentRequest::Fetch { version, reader: None, reader_checks })?;
        self.fetching = true;
        match check_fetched(reply, FetchWanted { app: &job.app, rank, version }) {
            Ok(Fetched { damaged: Some(damage), .. }) => Err(self.fail(format!("rank {rank} is damaged: {damage}"))),
            Ok(Fetched { manifest, region, damaged: None, .. }) => Ok((manifest, region)),
            Err(refused) => Err(self.fail(refused)),
        }
    }

    /// A piece the peer holds (verified by the peer before it is exposed),
    /// checked before any of its lengths is used.
    pub(super) fn fetch_piece(
        &mut self,
        job: &Job<'_>,
        version: u64,
        piece: PieceId,
    ) -> Result<(PieceMeta, RemoteRegion), String> {
        self.serve_apart(job)?;
        let reply = self.call(&AgentRequest::FetchPiece { version, piece })?;
        self.fetching = true;
        let AgentReply::Piece { meta, region } = reply else {
            return Err(self.fail(format!("unexpected answer to FetchPiece: {reply:?}")));
        };
        let len = meta.check(&job.app, version, piece).map_err(|e| self.fail(format!("the {piece} it sent: {e}")))?;
        if region.len < len {
            return Err(self.fail(format!("the {piece} exposes {} of its {len} bytes", region.len)));
        }
        Ok((meta, region))
    }

    /// Asks the peer to take its parity shard `piece` of `version` (`len`
    /// bytes): returns the memory to write it into.
    fn put_piece(&mut self, version: u64, piece: PieceId, len: u64) -> Result<RemoteRegion, String> {
        match self.call(&AgentRequest::PutPiece { version, piece, len })? {
            AgentReply::Target(region) if region.len >= len => Ok(region),
            AgentReply::Target(region) => Err(self.fail(format!("it offers {} of the {len} bytes", region.len))),
            other => Err(self.fail(format!("unexpected answer to PutPiece: {other:?}"))),
        }
    }

    /// Tells the peer its piece is written, as `meta` describes it.
    fn seal_piece(&mut self, meta: PieceMeta) -> Result<(), String> {
        match self.call(&AgentRequest::SealPiece { meta })? {
            AgentReply::Ok => Ok(()),
            other => Err(self.fail(format!("unexpected answer to SealPiece: {other:?}"))),
        }
    }

    /// Reads the version `manifest` describes from `region` into `into`,
    /// label by label, checking each chunk against the rank's checksums as
    /// it arrives ([`icheck_core::verified`]) instead of in a second pass
    /// over the whole version afterwards.
    pub(super) fn read_checked<B: icheck_core::fabric::StableBuffer>(
        &self,
        job: &Job<'_>,
        region: RemoteRegion,
        into: &mut RegisteredBuffer<B>,
        manifest: &Manifest,
    ) -> Result<(), String> {
        manifest.validate().map_err(|e| e.to_string())?;
        if manifest.chunk_size != icheck_core::format::CHUNK_SIZE {
            return Err(format!("chunks of {} bytes, not {}", manifest.chunk_size, icheck_core::format::CHUNK_SIZE));
        }
        for (label, crcs) in manifest.labels.iter().zip(&manifest.crcs) {
            let (Ok(offset), Ok(len)) = (usize::try_from(label.offset), usize::try_from(label.len)) else {
                return Err(format!("label {:?} does not fit this machine's memory", label.label));
            };
            let range = CheckedRange { remote: region, remote_offset: label.offset, local_offset: offset, len, crcs };
            match read_checked(&job.endpoint, &self.peer, into, range).map_err(|e| self.fail(e))? {
                None => {}
                Some(chunk) => {
                    return Err(format!("label {:?}: chunk {chunk} does not match the rank's checksum", label.label))
                }
            }
        }
        Ok(())
    }

    /// Reads `len` bytes of `region` from `offset` into the start of
    /// `into` in one batch, handing each `piece` bytes to `take` as they
    /// arrive ([`icheck_core::verified::read_in_pieces`]); `take` refuses a
    /// piece with the reason, which is returned.
    pub(super) fn read_in_pieces<B: icheck_core::fabric::StableBuffer>(
        &self,
        job: &Job<'_>,
        (region, offset, len): (RemoteRegion, u64, usize),
        into: &mut RegisteredBuffer<B>,
        piece: usize,
        mut take: impl FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut refusal = None;
        let accept = |bytes: &[u8]| take(bytes).map_err(|why| refusal = Some(why)).is_ok();
        let refused = icheck_core::verified::read_in_pieces(
            &job.endpoint,
            &self.peer,
            into,
            (region, offset, len),
            piece,
            accept,
        )
        .map_err(|e| self.fail(e))?;
        match (refused, refusal) {
            (None, _) => Ok(()),
            (Some(at), why) => Err(format!("bytes {at}..: {}", why.unwrap_or_default())),
        }
    }
}

impl PeerSession {
    /// Tells the peer its exposure is read (it stops driving progress for
    /// it), as soon as the bytes are here rather than after they are checked.
    pub(super) fn done_reading(&mut self) {
        if std::mem::take(&mut self.fetching) {
            let _ = self.conn.call::<_, AgentReply>(&AgentRequest::FetchDone);
        }
    }
}

impl Drop for PeerSession {
    fn drop(&mut self) {
        self.done_reading();
    }
}

/// How building one piece ended: the agent holding it, the piece, and the
/// bytes it holds or why it failed.
pub struct PieceOutcome {
    /// The agent holding the piece (this one, or one it wrote a shard to).
    pub agent: u64,
    /// The piece.
    pub piece: PieceId,
    /// Bytes held, or why the piece is not there.
    pub result: Result<u64, String>,
}

/// Builds `task`'s piece in this node's store, and for the encoder of a
/// group the other parity shards at their holders: how each piece ended.
pub(super) fn protect(job: &Job<'_>, task: &PieceTask) -> Vec<PieceOutcome> {
    let mine = |result| PieceOutcome { agent: job.id, piece: task.piece, result };
    match task.piece {
        PieceId::Copy { .. } => vec![mine(protect_copy(job, task))],
        PieceId::Slice { group, index } => vec![mine(protect_slice(job, task, group, index))],
        PieceId::Parity { group, index } => {
            let started = Instant::now();
            // An encoder answers for other holders' shards too: the
            // reason names the group, each outcome its own piece.
            let fail = |what: String| format!("encoding group {group} of version {}: {what}", task.version);
            match build_parity(job, task, group, index) {
                Ok(mut outcomes) => {
                    let bytes = outcomes.first().and_then(|o| o.result.as_ref().ok().copied()).unwrap_or(0);
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::info!(version = task.version, piece = %task.piece, bytes, ms, shards = outcomes.len(), "group encoded");
                    for outcome in &mut outcomes {
                        outcome.result = std::mem::replace(&mut outcome.result, Ok(0)).map_err(fail);
                    }
                    outcomes
                }
                // Nothing was built: every shard this agent answers for failed.
                Err(why) => PieceOutcome::all_failed(job.id, task, &fail(why)),
            }
        }
    }
}

impl PieceOutcome {
    /// Every piece `task` answers for (its own, and for an encoder the
    /// shards of `task.also`) failed, at `agent`, for `why`.
    pub fn all_failed(agent: u64, task: &PieceTask, why: &str) -> Vec<PieceOutcome> {
        let answers = task.answers(agent).into_iter();
        answers.map(|(agent, piece)| PieceOutcome { agent, piece, result: Err(why.to_string()) }).collect()
    }
}

/// Builds a copy of a rank. Returns the bytes it holds.
fn protect_copy(job: &Job<'_>, task: &PieceTask) -> Result<u64, String> {
    let started = Instant::now();
    let version = task.version;
    let fail = |what: String| format!("building the {} for version {version}: {what}", task.piece);
    let bytes = match task.piece {
        PieceId::Copy { rank } => {
            let Some(Some((member, from))) = task.members.first() else {
                return Err(fail("no primary to copy".into()));
            };
            if *member != rank {
                return Err(fail(format!("the task names rank {member}")));
            }
            let mut session = PeerSession::open(job, from, rank).map_err(fail)?;
            // `read_checked` checks every chunk it reads.
            let (manifest, region) = session.fetch(job, (rank, version), true).map_err(fail)?;
            let fetched = started.elapsed();
            let store = &job.settings.store;
            let file = store
                .create_piece(&job.app, version, task.piece, manifest.total_len)
                .map_err(|e| fail(e.to_string()))?;
            let mut file = job.endpoint.register(file, Access::LOCAL).map_err(|e| fail(e.to_string()))?;
            let created = started.elapsed();
            session.read_checked(job, region, &mut file, &manifest).map_err(fail)?;
            session.done_reading();
            let read = started.elapsed();
            store
                .seal_piece(&job.app, version, task.piece, &PieceMeta::Copy(manifest.clone()))
                .map_err(|e| fail(e.to_string()))?;
            super::piece_sealed(job, version, task.piece, file.into_inner(), manifest.total_len);
            tracing::debug!(
                version,
                rank,
                fetch_ms = fetched.as_secs_f64() * 1e3,
                create_ms = (created - fetched).as_secs_f64() * 1e3,
                read_and_check_ms = (read - created).as_secs_f64() * 1e3,
                "copy's steps"
            );
            manifest.total_len
        }
        PieceId::Parity { .. } | PieceId::Slice { .. } => return Err(fail("not a copy".into())),
    };
    tracing::info!(version, piece = %task.piece, bytes, ms = started.elapsed().as_secs_f64() * 1e3, "piece of redundancy built");
    Ok(bytes)
}

/// Builds slice `index` of the one member of sliced group `group` (the
/// task lists it once per slice): reads that range of the rank from its
/// primary, each chunk checked against the rank's checksums as it arrives.
/// Returns the bytes it holds.
fn protect_slice(job: &Job<'_>, task: &PieceTask, group: u32, index: u8) -> Result<u64, String> {
    let started = Instant::now();
    let version = task.version;
    let fail = |what: String| format!("building the {} for version {version}: {what}", task.piece);
    let Some(Some((rank, from))) = task.members.first() else {
        return Err(fail("no primary to slice".into()));
    };
    let slices = u8::try_from(task.members.len()).map_err(|_| fail("too many slices".into()))?;
    let mut session = PeerSession::open(job, from, *rank).map_err(fail)?;
    let (manifest, region) = session.fetch(job, (*rank, version), true).map_err(fail)?;
    let meta = icheck_core::protocol::SliceMeta { manifest, group, index, slices };
    let (start, end) = meta.bounds().map_err(fail)?;
    let len = end - start;
    let store = &job.settings.store;
    // A file of one byte at least: an empty slice (a rank of few chunks) is
    // still a piece, described as holding none of them.
    let file = store.create_piece(&job.app, version, task.piece, len.max(1)).map_err(|e| fail(e.to_string()))?;
    let mut file = job.endpoint.register(file, Access::LOCAL).map_err(|e| fail(e.to_string()))?;
    let mut check = InOrderCheck::over(&meta.manifest, (start, end)).map_err(|e| fail(e.to_string()))?;
    if len > 0 {
        let bytes = usize::try_from(len).map_err(|_| fail(format!("{len} bytes do not fit this machine's memory")))?;
        let take = |piece: &[u8]| check.feed(piece).map(drop).map_err(|e| e.to_string());
        session.read_in_pieces(job, (region, start, bytes), &mut file, STRIPE as usize, take).map_err(fail)?;
    }
    session.done_reading();
    if !check.complete() {
        return Err(fail("the rank's bytes ended early".into()));
    }
    store.seal_piece(&job.app, version, task.piece, &PieceMeta::Slice(meta)).map_err(|e| fail(e.to_string()))?;
    super::piece_sealed(job, version, task.piece, file.into_inner(), len.max(1));
    tracing::info!(version, piece = %task.piece, bytes = len, ms = started.elapsed().as_secs_f64() * 1e3, "piece of redundancy built");
    Ok(len)
}

/// A source of one shard of a group: a member's primary (shorter ones read
/// as zero-padded), a slice of one (the slices of a sliced group share
/// the session with its primary), a slice piece, a parity shard, or zeros.
struct ShardSource {
    /// Where its bytes are (`None`: zeros throughout).
    from: Option<ShardOrigin>,
    /// Where the shard's bytes start there (a slice's start in its rank).
    offset: u64,
    /// Bytes of real data (the rest of the shard is zeros).
    len: u64,
}

/// Where a shard's bytes are read from.
#[derive(Clone)]
enum ShardOrigin {
    /// A peer's exposed region, over the fabric.
    Peer(Arc<PeerSession>, RemoteRegion),
    /// This agent's own primary of the rank (a sliced group's encoder is
    /// its primary's agent): copied from its mapping.
    Local(SharedMapping),
}

impl ShardSource {
    /// The whole of `region`'s first `len` bytes, read through `session`.
    fn whole(session: PeerSession, region: RemoteRegion, len: u64) -> ShardSource {
        ShardSource { from: Some(ShardOrigin::Peer(Arc::new(session), region)), offset: 0, len }
    }

    /// The session its bytes are read through, if a peer holds them.
    fn session(&self) -> Option<&PeerSession> {
        match &self.from {
            Some(ShardOrigin::Peer(session, _)) => Some(session),
            _ => None,
        }
    }
}

/// The shards a coder reads a block at a time, all into one registered
/// buffer in one fabric batch: the fabric keeps every member's reads in
/// flight together instead of draining after each member's block.
///
/// The buffer is laid out stripe by stripe, each stripe as `slots` shard
/// slots of [`STRIPE`] bytes ([`slot_offset`]), the sources' in order: a
/// stripe's shards lie side by side, in cache together while they are
/// checked and coded where the fabric put them.
struct ShardBlocks {
    sources: Vec<ShardSource>,
    slots: usize,
    buffer: BlockBuffer,
}

impl ShardBlocks {
    /// `slots` (at least one per source) shard slots per stripe.
    fn new(job: &Job<'_>, sources: Vec<ShardSource>, slots: usize) -> Result<ShardBlocks, String> {
        let slots = slots.max(sources.len());
        let buffer = block_buffer(job, slots)?;
        Ok(ShardBlocks { sources, slots, buffer })
    }

    /// Another buffer of this layout, to read the next block into.
    fn spare_buffer(&self, job: &Job<'_>) -> Result<BlockBuffer, String> {
        block_buffer(job, self.slots)
    }

    /// Loads block `[offset, offset + n)` of every shard into the buffer.
    fn load(&mut self, job: &Job<'_>, offset: u64, n: usize) -> Result<(), String> {
        read_blocks(job, (&self.sources, self.slots), (offset, n), &mut self.buffer)
    }

    /// `n` bytes (within one stripe) of shard `shard`'s loaded block from `at`.
    fn bytes(&self, shard: usize, at: usize, n: usize) -> &[u8] {
        let start = slot_offset(self.slots, shard, at);
        &self.buffer.as_slice()[start..start + n]
    }
}

/// Where byte `at` of a block of shard slot `shard` lies in a buffer of
/// `slots` slots per stripe.
fn slot_offset(slots: usize, shard: usize, at: usize) -> usize {
    let stripe = STRIPE as usize;
    (at / stripe) * slots * stripe + shard * stripe + at % stripe
}

/// A registered buffer with room for one block of each of `shards` shards,
/// its memory another job's ([`SPARE_BLOCKS`]) where one of this length
/// was left.
fn block_buffer(job: &Job<'_>, shards: usize) -> Result<BlockBuffer, String> {
    let len = shards.max(1) * block_len(job) as usize;
    let spare = {
        let mut spares = SPARE_BLOCKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        spares.iter().position(|spare| spare.len() == len).map(|at| spares.swap_remove(at))
    };
    let memory = spare.unwrap_or_else(|| AlignedBuffer::zeroed(len));
    job.endpoint.register(memory, Access::LOCAL).map(|buffer| BlockBuffer(Some(buffer))).map_err(|e| e.to_string())
}

/// Block buffers that ended jobs (encoders, copies, rebuilds) left for the
/// next ones in this manager: the pages of a fresh buffer are faulted in,
/// and zeroed by the kernel, while the first block is read into it (80 MiB
/// of buffers per `rs:4+2` group over tcp, about a tenth of the encoder's
/// threads' time in `perf`). Their bytes are stale: every user writes or
/// zeroes all it uses (`read_blocks` and `zero_padding` for reads,
/// `encode_block` for the coded blocks sent to other holders).
static SPARE_BLOCKS: Mutex<Vec<AlignedBuffer>> = Mutex::new(Vec::new());

/// Most bytes [`SPARE_BLOCKS`] keeps: one `rs:4+2` encoder's buffers over
/// tcp (two 32 MiB read blocks, two 8 MiB coded ones) and a rebuild's.
const SPARE_BLOCK_BYTES: usize = 160 << 20;

/// A block buffer whose memory goes back to [`SPARE_BLOCKS`] (deregistered
/// first) when the job drops it, while the spares stay within
/// [`SPARE_BLOCK_BYTES`].
struct BlockBuffer(Option<RegisteredBuffer>);

impl std::ops::Deref for BlockBuffer {
    type Target = RegisteredBuffer;

    fn deref(&self) -> &RegisteredBuffer {
        self.0.as_ref().expect("a block buffer holds its memory until dropped")
    }
}

impl std::ops::DerefMut for BlockBuffer {
    fn deref_mut(&mut self) -> &mut RegisteredBuffer {
        self.0.as_mut().expect("a block buffer holds its memory until dropped")
    }
}

impl Drop for BlockBuffer {
    fn drop(&mut self) {
        let Some(registered) = self.0.take() else { return };
        let memory = registered.into_inner();
        let mut spares = SPARE_BLOCKS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if spares.iter().map(StableBuffer::len).sum::<usize>() + memory.len() <= SPARE_BLOCK_BYTES {
            spares.push(memory);
        }
    }
}

/// Reads block `(offset, n)` of every shard of `sources` into `into` (laid
/// out in `slots` slots per stripe, [`slot_offset`]) in one batch: each
/// shard's real bytes from its peer, zeros after them (and throughout
/// without a session).
fn read_blocks(
    job: &Job<'_>,
    (sources, slots): (&[ShardSource], usize),
    (offset, n): (u64, usize),
    into: &mut RegisteredBuffer,
) -> Result<(), String> {
    let ops = read_ops((sources, slots), (offset, n));
    if !ops.is_empty() {
        // A few operations per member keep every member's link busy.
        let options = TransferOptions { inflight: (4 * ops.len()).clamp(8, 32), ..TransferOptions::default() };
        job.endpoint.read_observed_from(into.target(), &ops, &options, &mut |_| {}).map_err(|e| {
            let from: Vec<String> =
                sources.iter().filter_map(ShardSource::session).map(|s| s.from.node.to_string()).collect();
            format!("reading bytes {offset}.. of the group's shards from {}: {e}", from.join(", "))
        })?;
    }
    copy_local((sources, slots), (offset, n), into);
    zero_padding((sources, slots), (offset, n), into);
    Ok(())
}

/// Copies the stripes of block `(offset, n)` that end in padding, of every
/// shard this agent holds itself ([`ShardOrigin::Local`]), into its slots
/// of `into`: whole stripes are coded where they lie ([`local_stripe`]),
/// without a copy.
fn copy_local((sources, slots): (&[ShardSource], usize), (offset, n): (u64, usize), into: &mut RegisteredBuffer) {
    for (shard, source) in sources.iter().enumerate() {
        let Some(ShardOrigin::Local(file)) = &source.from else { continue };
        let real = real_bytes(source, (offset, n));
        let first = (source.offset + offset) as usize;
        for (at, len) in stripes_of(n as u64).take_while(|(at, _)| *at < real) {
            if local_stripe(source, (offset + at as u64, len)).is_some() {
                continue;
            }
            let len = len.min(real - at);
            let to = slot_offset(slots, shard, at);
            into.as_mut_slice()[to..to + len].copy_from_slice(&file.as_slice()[first + at..first + at + len]);
        }
    }
}

/// The `n` bytes of `source` from `at` (a stripe), where this agent holds
/// them itself and no padding is among them.
fn local_stripe(source: &ShardSource, (at, n): (u64, usize)) -> Option<&[u8]> {
    let Some(ShardOrigin::Local(file)) = &source.from else { return None };
    let end = at.checked_add(n as u64).filter(|end| *end <= source.len)?;
    file.as_slice().get((source.offset + at) as usize..(source.offset + end) as usize)
}

/// Bytes of block `(offset, n)` of `source` that its peer holds.
fn real_bytes(source: &ShardSource, (offset, n): (u64, usize)) -> usize {
    match source.from {
        Some(_) => source.len.saturating_sub(offset).min(n as u64) as usize,
        None => 0,
    }
}

/// The reads of block `(offset, n)` of every shard: one per stripe of
/// shard i's real bytes, each into its slot.
fn read_ops((sources, slots): (&[ShardSource], usize), (offset, n): (u64, usize)) -> Vec<PeerOp<'_>> {
    let mut ops = Vec::new();
    for (shard, source) in sources.iter().enumerate() {
        let Some(ShardOrigin::Peer(session, region)) = &source.from else { continue };
        let real = real_bytes(source, (offset, n));
        for (at, len) in stripes_of(n as u64).take_while(|(at, _)| *at < real) {
            let len = len.min(real - at);
            let op = RmaOp {
                local_offset: slot_offset(slots, shard, at),
                remote: *region,
                remote_offset: source.offset + offset + at as u64,
                len,
            };
            ops.push(PeerOp { peer: &session.peer, op });
        }
    }
    ops
}

/// Zeros each shard's block `(offset, n)` in `into` after its real bytes.
fn zero_padding((sources, slots): (&[ShardSource], usize), (offset, n): (u64, usize), into: &mut RegisteredBuffer) {
    for (shard, source) in sources.iter().enumerate() {
        let real = real_bytes(source, (offset, n));
        for (at, len) in stripes_of(n as u64) {
            let start = slot_offset(slots, shard, at);
            into.as_mut_slice()[start + real.saturating_sub(at).min(len)..start + len].fill(0);
        }
    }
}

/// Runs `code(offset, block, shards)` on each block of `shards` from 0 to
/// `until`, cut as an encoder cuts shards of `shard_len` bytes, with the
/// next block read on a second thread (at low priority) while `code` works
/// on this one. Returns the time the reads took.
fn for_each_block(
    job: &Job<'_>,
    shards: &mut ShardBlocks,
    (until, shard_len): (u64, u64),
    mut code: impl FnMut(u64, u64, &ShardBlocks) -> Result<(), String>,
) -> Result<Duration, String> {
    let block_len = block_len(job);
    let block_at = |offset: u64| (shard_len - offset).min(block_len);
    let mut ahead = shards.spare_buffer(job)?;
    let mut reading = Duration::ZERO;
    if until > 0 {
        let started = Instant::now();
        shards.load(job, 0, block_at(0) as usize)?;
        reading += started.elapsed();
    }
    let mut offset = 0;
    while offset < until {
        let (block, next) = (block_at(offset), offset + block_at(offset));
        let sources = (shards.sources.as_slice(), shards.slots);
        let read_next = |ahead: &mut RegisteredBuffer| -> Result<Duration, String> {
            crate::manager::lower_thread_priority();
            let started = Instant::now();
            read_blocks(job, sources, (next, block_at(next) as usize), ahead)?;
            Ok(started.elapsed())
        };
        let (coded, read) = std::thread::scope(|scope| {
            let reader = (next < until).then(|| scope.spawn(|| read_next(&mut ahead)));
            let coded = code(offset, block, shards);
            let read = reader
                .map_or(Ok(Duration::ZERO), |r| r.join().unwrap_or_else(|_| Err("the reading thread panicked".into())));
            (coded, read)
        });
        coded?;
        reading += read?;
        std::mem::swap(&mut shards.buffer, &mut ahead);
        offset = next;
    }
    Ok(reading)
}

/// Bytes of each shard read at once (a whole number of stripes) over
/// `job`'s provider. Each block is one fabric batch, drained before the
/// next: over a network, 8 MiB per member keeps every link busy through a
/// batch, where a block per stripe would wait a round trip every megabyte.
/// Over shm the reader's CPU copies every byte itself (`process_vm_readv`)
/// and the coder reads it right after: 2 MiB blocks keep an encoder's
/// buffers (the block coded, the one read ahead and the coded shards, 20 MiB
/// for `rs:4+2`) within this machine's 32 MiB L3, so the coder's checks and
/// coding read from cache what the copy brought in (`rs:4+2` of 4 × 256 MiB
/// protected in 502-719 ms, median 581, over ten runs, against 610-655 ms
/// in three with 8 MiB; over tcp 2 MiB blocks were slower, 807 and 1000 ms
/// against 715 and 895).
fn block_len(job: &Job<'_>) -> u64 {
    if job.endpoint.provider() == "shm" {
        2 * STRIPE
    } else {
        8 * STRIPE
    }
}

/// The stripes of block `[offset, offset + block)`: (offset in the block, bytes).
fn stripes_of(block: u64) -> impl Iterator<Item = (usize, usize)> {
    (0..block).step_by(STRIPE as usize).map(move |at| (at as usize, (block - at).min(STRIPE) as usize))
}

/// Bytes of every shard of a group whose longest member is `longest`.
fn shard_len(longest: u64) -> u64 {
    longest.max(2).next_multiple_of(2)
}

/// A parity shard this agent encodes for another holder: written there
/// block by block, then sealed with the checksums computed here.
struct ShardSink {
    holder: AgentInfo,
    piece: PieceId,
    /// Its parity index in the group.
    index: u8,
    session: PeerSession,
    region: RemoteRegion,
    crcs: Vec<u32>,
    /// Why the holder does not get its shard (it is written no more).
    failed: Option<String>,
}

/// Where an encoder's time went: the blocks' wall time, and summed over
/// blocks, the fabric's batches (each block's reads with the writes of the
/// block before, on a second thread) and the coding, which overlap.
#[derive(Default)]
struct Spent {
    total: Duration,
    moving: Duration,
    encoding: Duration,
}

/// Encodes one loaded block (`offset`, `block` bytes) of the data shards
/// in `stripes` (a [`ShardBlocks`] buffer of `slots` slots per stripe),
/// each checked first against its rank's checksums by its `checks` (one
/// per shard): codes shard `index` straight into `file` (and keeps its
/// stripe checksums), and sink j's shard of the block at `j *`
/// [`sink_stride`] of `staging` (its checksums in `sink_crcs[j]`), to be
/// written to its holder. Nothing is copied after the coder.
#[allow(clippy::too_many_arguments)]
fn encode_block(
    task: &PieceTask,
    (sources, stripes, checks, slots): (&[ShardSource], &mut [u8], &mut [InOrderCheck<'_>], usize),
    (offset, block): (u64, u64),
    mut own: Option<(u8, &mut MappedFile, &mut Vec<u32>)>,
    sinks: &[ShardSink],
    (staging, sink_crcs): (&mut RegisteredBuffer, &mut [Vec<u32>]),
    encoder: &mut redundancy::StripeEncoder,
) -> Result<(), String> {
    let (parity, shards) = (usize::from(task.parity), checks.len());
    let own_index = own.as_ref().map(|(index, _, _)| usize::from(*index));
    if let Some(index) = own_index.filter(|index| *index >= parity) {
        return Err(format!("the group has no parity shard {index}"));
    }
    let stride = sink_stride(staging, sinks);
    // A parity shard whose holder is given up is still coded (the coder
    // makes every row), into memory of its own that nobody reads.
    let live = |j: usize| sinks.iter().position(|sink| usize::from(sink.index) == j && sink.failed.is_none());
    let unread = (0..parity).filter(|j| Some(*j) != own_index && live(*j).is_none()).count();
    let mut unread = vec![vec![0u8; STRIPE as usize]; unread];
    for (at, n) in stripes_of(block) {
        let start = offset as usize + at;
        // Tests damage the first member's first byte as read (memory gone
        // bad at its agent, or on the way).
        if start == 0 && icheck_core::failpoint::fails("agent.member_read_damaged") {
            stripes[slot_offset(slots, 0, 0)] ^= 1;
        }
        let stripes = &*stripes;
        // This agent's own memory is coded where it lies ([`copy_local`]).
        let originals: Vec<&[u8]> = (0..shards)
            .map(|shard| {
                local_stripe(&sources[shard], (offset + at as u64, n))
                    .unwrap_or_else(|| &stripes[slot_offset(slots, shard, at)..][..n])
            })
            .collect();
        for (check, bytes) in checks.iter_mut().zip(&originals) {
            check.feed(bytes).map_err(|e| format!("a member as read: {e}"))?;
        }
        // Each parity shard is coded where it goes: this agent's into its
        // file, the others' into the staging buffer the fabric writes from.
        let mut to_sinks: Vec<Option<&mut [u8]>> = staging.as_mut_slice().chunks_mut(stride.max(1)).map(Some).collect();
        let mut to_nobody = unread.iter_mut();
        let mut kept = own.as_mut().map(|(_, file, _)| &mut file.as_mut_slice()[start..start + n]);
        let mut out: Vec<&mut [u8]> = Vec::with_capacity(parity);
        for j in 0..parity {
            let place = match live(j) {
                _ if Some(j) == own_index => kept.take(),
                Some(sink) => to_sinks[sink].take().map(|part| &mut part[at..at + n]),
                None => to_nobody.next().map(|spare| &mut spare[..n]),
            };
            out.push(place.ok_or_else(|| format!("no memory for parity shard {j} of the group"))?);
        }
        encoder.encode_into(&originals, &mut out).map_err(|e| e.to_string())?;
        let own_crc = own_index.map(|index| icheck_core::format::crc32c(&out[index][..]));
        for (j, shard) in out.iter().enumerate() {
            if let Some(sink) = live(j).filter(|_| Some(j) != own_index) {
                sink_crcs[sink].push(icheck_core::format::crc32c(shard));
            }
        }
        drop(out);
        if let (Some(crc), Some((_, _, crcs))) = (own_crc, own.as_mut()) {
            crcs.push(crc);
        }
    }
    Ok(())
}

/// One fabric batch of an encoder: block `read` of every source into
/// `into`, and the coded block `write` (sink j's at `j *` [`sink_stride`] of
/// `coded`) to every sink still taking its shard. A failed batch whose
/// reads succeed again alone failed at the sinks: each is given up with
/// the reason (returned as `(sink, why)`), and the encoding goes on for
/// this shard and the other sinks'.
fn move_blocks(
    job: &Job<'_>,
    sources: (&[ShardSource], usize),
    (read, into): (Option<(u64, usize)>, &mut RegisteredBuffer),
    sinks: &[ShardSink],
    (write, coded): (Option<(u64, usize)>, &RegisteredBuffer),
) -> Result<Vec<(usize, String)>, String> {
    let writes: Vec<PeerOp<'_>> = write
        .map(|(offset, len)| {
            // Tests make the holders refuse the writes (a wrong key, which
            // providers that check keys fail in the batch, as a holder gone
            // or its memory withdrawn would).
            let refused = icheck_core::failpoint::fails("agent.shard_writes_refused");
            let live = sinks.iter().enumerate().filter(|(_, sink)| sink.failed.is_none());
            live.map(|(j, sink)| {
                let local_offset = j * sink_stride(coded, sinks);
                let mut op = RmaOp { local_offset, remote: sink.region, remote_offset: offset, len };
                if refused {
                    op.remote.key ^= 0x5a5a;
                }
                PeerOp { peer: &sink.session.peer, op }
            })
            .collect()
        })
        .unwrap_or_default();
    if writes.is_empty() {
        // Only reads (or nothing): a member's failure is named by `read_blocks`.
        if let Some(block) = read {
            read_blocks(job, sources, block, into)?;
        }
        return Ok(Vec::new());
    }
    let reads = read.map(|block| read_ops(sources, block)).unwrap_or_default();
    let options =
        TransferOptions { inflight: (4 * (reads.len() + writes.len())).clamp(8, 32), ..TransferOptions::default() };
    match job.endpoint.read_and_write((into.target(), &reads), (coded.source(), &writes), &options) {
        Ok(_) => {
            if let Some(block) = read {
                copy_local(sources, block, into);
                zero_padding(sources, block, into);
            }
            Ok(Vec::new())
        }
        Err(e) => {
            // Which side failed: the reads again, alone.
            if let Some(block) = read {
                read_blocks(job, sources, block, into)?;
            }
            Ok(give_up_sinks(sinks, &e))
        }
    }
}

/// Where each sink's coded block starts in a staging buffer made by
/// [`block_buffer`] for `sinks`: one block apart.
fn sink_stride(staging: &RegisteredBuffer, sinks: &[ShardSink]) -> usize {
    staging.as_slice().len() / sinks.len().max(1)
}

/// The live sinks a failed write names (its fabric peer), or all live
/// sinks when it names none of them, each with the reason.
fn give_up_sinks(sinks: &[ShardSink], error: &FabricError) -> Vec<(usize, String)> {
    let live = || sinks.iter().enumerate().filter(|(_, sink)| sink.failed.is_none());
    let named: Vec<usize> = match error {
        FabricError::Completion { peer, .. } => {
            live().filter(|(_, sink)| sink.session.peer.name() == peer.as_str()).map(|(j, _)| j).collect()
        }
        _ => Vec::new(),
    };
    live()
        .filter(|(j, _)| named.is_empty() || named.contains(j))
        .map(|(j, _)| (j, format!("writing its shard: {error}")))
        .collect()
}

/// A member's primary, exposed by its agent for this session: its manifest
/// and the region holding its bytes.
type FetchedMember = (PeerSession, Manifest, RemoteRegion);

/// Encodes `group` once: reads every member's primary a block at a time,
/// keeps parity shard `index` here, and writes the shards of `task.also`
/// (indices `index + 1`..) to their holders. Returns how each shard ended,
/// this agent's first; an error means none was built.
fn build_parity(job: &Job<'_>, task: &PieceTask, group: u32, index: u8) -> Result<Vec<PieceOutcome>, String> {
    let started = Instant::now();
    let version = task.version;
    // A sliced group lists its one rank once per slice: fetched once.
    let sliced_member = task.sliced_member();
    let sliced = sliced_member.is_some();
    // A sliced group's primary's agent encodes it from its own memory, and
    // keeps none of the shards (`PieceTask::keeps_nothing`).
    let local = sliced_member.filter(|(_, from)| from.id == job.id);
    let to_fetch = match (local.is_some(), sliced) {
        (true, _) => &task.members[..0],
        (false, true) => &task.members[..1],
        (false, false) => &task.members[..],
    };
    // Every member's agent checks the rank before exposing it: asked all at
    // once, they check at the same time instead of one after another.
    let fetched: Vec<Result<Option<FetchedMember>, String>> = std::thread::scope(|scope| {
        let asks: Vec<_> = to_fetch
            .iter()
            .map(|member| {
                scope.spawn(move || {
                    let Some((rank, from)) = member else { return Ok(None) };
                    let mut session = PeerSession::open(job, from, *rank)?;
                    // The coder checks every stripe it reads (`InOrderCheck`).
                    let (manifest, region) = session.fetch(job, (*rank, version), true)?;
                    Ok(Some((session, manifest, region)))
                })
            })
            .collect();
        asks.into_iter().map(|ask| ask.join().unwrap_or_else(|_| Err("a fetching thread panicked".into()))).collect()
    });
    let fetched: Vec<Option<FetchedMember>> = fetched.into_iter().collect::<Result<_, _>>()?;
    // Tests lose a member's node here, between its exposure and the reads.
    icheck_core::failpoint::hit("agent.before_member_reads");
    if let ([Some(_)], true, false) = (fetched.as_slice(), task.also.is_empty(), sliced) {
        let Some(Some(member)) = fetched.into_iter().next() else { unreachable!("matched above") };
        return build_repeated(job, task, group, index, member, started);
    }
    let mut manifests = Vec::with_capacity(task.members.len());
    let mut exposed = Vec::with_capacity(task.members.len());
    for member in fetched {
        let (origin, manifest) =
            member.map(|(session, manifest, region)| (ShardOrigin::Peer(Arc::new(session), region), manifest)).unzip();
        exposed.push(origin);
        manifests.push(manifest);
    }
    if let Some((rank, _)) = local {
        let (manifest, file) = open_own_primary(job, *rank, version)?;
        exposed.push(Some(ShardOrigin::Local(file)));
        manifests.push(Some(manifest));
    }
    if sliced {
        // Data shard i is slice i of the one rank (`data_shard_ranges`).
        manifests = vec![manifests[0].clone(); task.members.len()];
        exposed = vec![exposed[0].clone(); task.members.len()];
    }
    let ranges = data_shard_ranges(&manifests.iter().map(Option::as_ref).collect::<Vec<_>>());
    // The code is over the present members only (`ParityMeta::members`).
    let sources: Vec<ShardSource> = (exposed.into_iter().zip(&ranges))
        .filter_map(|(exposed, range)| exposed.zip(*range))
        .map(|(origin, (start, end))| ShardSource { from: Some(origin), offset: start, len: end - start })
        .collect();
    let fetched_at = started.elapsed();
    let longest = ranges.iter().flatten().map(|(start, end)| end - start).max().unwrap_or(0);
    let shard_len = shard_len(longest);
    let store = &job.settings.store;
    let piece = PieceId::Parity { group, index };
    let keeps = !task.keeps_nothing();
    let any_rank = task.members.iter().flatten().map(|(rank, _)| *rank).next().unwrap_or(0);
    // This shard's file and the other holders' (each made by its agent)
    // are made at the same time: backing a shard's pages takes a while
    // (tmpfs allocates and zeroes each), and nothing is encoded before
    // they exist.
    let open_sink = |j: usize, holder: &AgentInfo| -> Result<ShardSink, PieceOutcome> {
        let their_index = if keeps { index + 1 + j as u8 } else { j as u8 };
        let their = PieceId::Parity { group, index: their_index };
        let refused = |why: String| PieceOutcome { agent: holder.id, piece: their, result: Err(why) };
        if their_index >= task.parity {
            return Err(refused(format!("the group has {} parity shards, not a shard {their_index}", task.parity)));
        }
        let mut session = PeerSession::open(job, holder, any_rank).map_err(refused)?;
        let region = session.put_piece(version, their, shard_len).map_err(refused)?;
        Ok(ShardSink {
            holder: holder.clone(),
            piece: their,
            index: their_index,
            session,
            region,
            crcs: Vec::new(),
            failed: None,
        })
    };
    let (file, opened, created_at) = std::thread::scope(|scope| {
        let opening: Vec<_> =
            task.also.iter().enumerate().map(|(j, holder)| scope.spawn(move || open_sink(j, holder))).collect();
        let file = match keeps {
            true => store.create_piece(&job.app, version, piece, shard_len).map(Some).map_err(|e| e.to_string()),
            false => Ok(None),
        };
        let created_at = started.elapsed();
        let opened: Vec<Result<ShardSink, PieceOutcome>> = opening
            .into_iter()
            .zip(&task.also)
            .map(|(thread, holder)| {
                thread.join().unwrap_or_else(|_| {
                    Err(PieceOutcome { agent: holder.id, piece, result: Err("an opening thread panicked".into()) })
                })
            })
            .collect();
        (file, opened, created_at)
    });
    let mut file = file?;
    let mut sinks: Vec<ShardSink> = Vec::with_capacity(task.also.len());
    let mut unreachable: Vec<PieceOutcome> = Vec::new();
    for sink in opened {
        match sink {
            Ok(sink) => sinks.push(sink),
            Err(outcome) => unreachable.push(outcome),
        }
    }
    let slots = sources.len();
    let mut sources = ShardBlocks::new(job, sources, slots)?;
    // The members' agents exposed them unchecked (`reader_checks`).
    let mut checks: Vec<InOrderCheck<'_>> = (manifests.iter().zip(&ranges))
        .filter_map(|(manifest, range)| manifest.as_ref().zip(*range))
        .map(|(manifest, range)| InOrderCheck::over(manifest, range))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    // Block i+1 is read on a second thread into `ahead`, in one batch with
    // the writes of block i-1's coded shards (`coded`), while block i is
    // coded into `staging`; then each pair swaps.
    let mut ahead = sources.spare_buffer(job)?;
    let mut staging = block_buffer(job, sinks.len())?;
    let mut coded = block_buffer(job, sinks.len())?;
    let mut sink_crcs: Vec<Vec<u32>> = vec![Vec::new(); sinks.len()];
    let sinks_at = started.elapsed();
    let mut crcs = Vec::new();
    let mut spent = Spent::default();
    let mut encoder = redundancy::StripeEncoder::default();
    let blocks_started = Instant::now();
    let block_len = block_len(job);
    let block_at = |offset: u64| (shard_len - offset).min(block_len);
    sources.load(job, 0, block_at(0) as usize)?;
    let (mut offset, mut behind): (u64, Option<(u64, usize)>) = (0, None);
    while offset < shard_len || behind.is_some() {
        let block = if offset < shard_len { block_at(offset) } else { 0 };
        let next = offset + block;
        let read = (next < shard_len).then(|| (next, block_at(next) as usize));
        let (moved, encoded) = std::thread::scope(|scope| {
            let shard_sources = (sources.sources.as_slice(), sources.slots);
            let (sinks, coded, ahead) = (&sinks, &coded, &mut ahead);
            let mover = scope.spawn(move || {
                crate::manager::lower_thread_priority();
                let started = Instant::now();
                let failed = move_blocks(job, shard_sources, (read, ahead), sinks, (behind, coded))?;
                Ok::<_, String>((failed, started.elapsed()))
            });
            let started = Instant::now();
            let encoded = if block > 0 {
                let mine = file.as_mut().map(|file| (index, file, &mut crcs));
                let sinks_side = (&mut *staging, sink_crcs.as_mut_slice());
                let stripes =
                    (sources.sources.as_slice(), sources.buffer.as_mut_slice(), checks.as_mut_slice(), sources.slots);
                encode_block(task, stripes, (offset, block), mine, sinks, sinks_side, &mut encoder)
            } else {
                Ok(())
            };
            let encoded = encoded.map(|()| started.elapsed());
            (mover.join().unwrap_or_else(|_| Err("the fabric thread panicked".into())), encoded)
        });
        let (failed, moving) = moved?;
        spent.encoding += encoded?;
        spent.moving += moving;
        for (j, why) in failed {
            sinks[j].failed.get_or_insert(why);
        }
        std::mem::swap(&mut sources.buffer, &mut ahead);
        std::mem::swap(&mut staging, &mut coded);
        behind = (block > 0).then_some((offset, block as usize));
        offset = next;
    }
    for (sink, crcs) in sinks.iter_mut().zip(sink_crcs) {
        sink.crcs = crcs;
    }
    spent.total = blocks_started.elapsed();
    if let Some(short) = checks.iter().position(|check| !check.complete()) {
        return Err(format!("member {short} of group {group} was not read whole"));
    }
    drop(checks);
    drop(sources);
    tracing::debug!(
        version,
        group,
        blocks_ms = spent.total.as_secs_f64() * 1e3,
        moving_ms = spent.moving.as_secs_f64() * 1e3,
        encoding_ms = spent.encoding.as_secs_f64() * 1e3,
        "group's steps (moving overlaps encoding)"
    );
    let meta = |index: u8, crcs: Vec<u32>| parity_meta(job, task, (group, index), shard_len, manifests.clone(), crcs);
    let encoded_at = started.elapsed();
    let mut outcomes = Vec::with_capacity(1 + sinks.len());
    if let Some(file) = file {
        let sealed = PieceMeta::Parity(meta(index, crcs));
        store.seal_piece(&job.app, version, piece, &sealed).map_err(|e| e.to_string())?;
        super::piece_sealed(job, version, piece, file, shard_len);
        outcomes.push(PieceOutcome { agent: job.id, piece, result: Ok(shard_len) });
    }
    let sealed_at = started.elapsed();
    for mut sink in sinks {
        let result = match sink.failed.take() {
            Some(why) => Err(why),
            None => {
                let crcs = std::mem::take(&mut sink.crcs);
                let meta = PieceMeta::Parity(meta(sink.index, crcs));
                sink.session.seal_piece(meta).map(|()| shard_len)
            }
        };
        let result = result.map_err(|why| format!("writing the {} to {}: {why}", sink.piece, sink.holder.node));
        outcomes.push(PieceOutcome { agent: sink.holder.id, piece: sink.piece, result });
    }
    outcomes.extend(unreachable);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    tracing::debug!(
        version,
        group,
        fetched_ms = ms(fetched_at),
        created_ms = ms(created_at),
        sinks_ms = ms(sinks_at),
        encoded_ms = ms(encoded_at),
        sealed_ms = ms(sealed_at),
        sinks_sealed_ms = ms(started.elapsed()),
        "group's timeline"
    );
    Ok(outcomes)
}

/// This agent's own primary of `rank`'s `version`, for its encoder: the
/// mapping kept for readers if there is one, else the stored version
/// opened (an incremental one composed). The encoder checks every stripe.
fn open_own_primary(job: &Job<'_>, rank: u32, version: u64) -> Result<(Manifest, SharedMapping), String> {
    let store = &job.settings.store;
    match job.kept.share(store, &job.app, (rank, version), false) {
        Some(kept) => Ok((kept.manifest, kept.file)),
        None => {
            let (manifest, file) = store.open(&job.app, rank, version).map_err(|e| e.to_string())?;
            Ok((manifest, SharedMapping::new(file)))
        }
    }
}

/// The description of parity shard `index` of `group` for `task`'s version.
fn parity_meta(
    job: &Job<'_>,
    task: &PieceTask,
    (group, index): (u32, u8),
    shard_len: u64,
    members: Vec<Option<Manifest>>,
    crcs: Vec<u32>,
) -> ParityMeta {
    let (app, version, parity) = (job.app.clone(), task.version, task.parity);
    ParityMeta { app, version, group, index, parity, shard_len, members, crcs }
}

// A shard's stripe checksums are the version grid's block checksums.
const _: () = assert!(STRIPE == icheck_core::delta::BLOCK_SIZE);

/// Parity shard `index` of a group of one member, whose every parity shard
/// is the member's bytes zero-padded to the shard's length (a repetition
/// code, [`redundancy::StripeEncoder`]): read straight into the shard's
/// file as a copy is, the fabric pipelining the whole version, instead of
/// block by block through a buffer and the coder. Each stripe is checked
/// against the member's chunk checksums and checksummed for the shard's
/// description in the same pass, as it arrives (a second pass over 1 GiB
/// after the read took 100-130 ms of the shard's 1.0-1.1 s over tcp).
fn build_repeated(
    job: &Job<'_>,
    task: &PieceTask,
    group: u32,
    index: u8,
    (mut session, manifest, region): FetchedMember,
    started: Instant,
) -> Result<Vec<PieceOutcome>, String> {
    let version = task.version;
    let piece = PieceId::Parity { group, index };
    let fail = |what: String| format!("building the {piece} for version {version}: {what}");
    let fetched_at = started.elapsed();
    let (len, shard_len) = (manifest.total_len, shard_len(manifest.total_len));
    let store = &job.settings.store;
    let file = store.create_piece(&job.app, version, piece, shard_len).map_err(|e| fail(e.to_string()))?;
    let mut file = job.endpoint.register(file, Access::LOCAL).map_err(|e| fail(e.to_string()))?;
    let created_at = started.elapsed();
    let (Ok(len), Ok(shard)) = (usize::try_from(len), usize::try_from(shard_len)) else {
        return Err(fail(format!("a shard of {shard_len} bytes does not fit this machine's memory")));
    };
    // Each stripe is checked against the member's chunk checksums and
    // checksummed for the shard's own description in one pass, as it arrives.
    let mut check = InOrderCheck::new(&manifest).map_err(|e| fail(e.to_string()))?;
    let mut crcs = Vec::with_capacity(shard.div_ceil(STRIPE as usize));
    let take = |bytes: &[u8]| check.feed(bytes).map(|crc| crcs.push(crc)).map_err(|e| e.to_string());
    session.read_in_pieces(job, (region, 0, len), &mut file, STRIPE as usize, take).map_err(fail)?;
    session.done_reading();
    if !check.complete() {
        return Err(fail("the member's bytes ended early".into()));
    }
    let read_at = started.elapsed();
    // A reused spare piece holds an older shard's bytes past the member's.
    file.as_mut_slice()[len..shard].fill(0);
    // The stripes the member's bytes did not fill are checksummed with
    // their padding.
    let full = len / STRIPE as usize;
    crcs.truncate(full);
    crcs.extend(
        file.as_slice()[full * STRIPE as usize..shard].chunks(STRIPE as usize).map(icheck_core::format::crc32c),
    );
    let meta = parity_meta(job, task, (group, index), shard_len, vec![Some(manifest)], crcs);
    store.seal_piece(&job.app, version, piece, &PieceMeta::Parity(meta)).map_err(|e| fail(e.to_string()))?;
    super::piece_sealed(job, version, piece, file.into_inner(), shard_len);
    let (fetched, created, read) = (fetched_at.as_secs_f64(), created_at.as_secs_f64(), read_at.as_secs_f64());
    let sealed = started.elapsed().as_secs_f64();
    tracing::debug!(version, group, fetched, created, read, sealed, "repeated shard's timeline (seconds)");
    Ok(vec![PieceOutcome { agent: job.id, piece, result: Ok(shard_len) }])
}

/// Rebuilds `rank`'s `version` into this node's store (as its primary) from
/// `source`. Returns the rank's bytes.
pub(super) fn rebuild(job: &Job<'_>, rank: u32, version: u64, source: &RebuildSource) -> Result<u64, String> {
    let started = Instant::now();
    let fail = |what: String| format!("rebuilding rank {rank} version {version}: {what}");
    if icheck_core::failpoint::fails("agent.rebuild_rank") {
        return Err(fail("the failpoint agent.rebuild_rank refused it".into()));
    }
    let (manifest, how) = match source {
        RebuildSource::Copies(holders) => {
            let mut why = Vec::new();
            let mut rebuilt = None;
            for holder in holders {
                match rebuild_from_copy(job, rank, version, holder) {
                    Ok(manifest) => {
                        rebuilt = Some((manifest, format!("copy on {}", holder.node)));
                        break;
                    }
                    Err(err) => why.push(err),
                }
            }
            rebuilt.ok_or_else(|| fail(format!("no copy could be read ({})", why.join("; "))))?
        }
        RebuildSource::Decode { group, shard, members, parity } => {
            let manifest = decode_member(job, rank, version, *group, *shard, members, parity).map_err(fail)?;
            (manifest, format!("decoded from group {group}"))
        }
        RebuildSource::Slices { group, slices, parity } => {
            let manifest = decode_sliced(job, (rank, version, *group), slices, parity).map_err(fail)?;
            (manifest, format!("rebuilt from the slices of group {group}"))
        }
    };
    job.completed(rank, version);
    tracing::info!(rank, version, bytes = manifest.total_len, from = %how, ms = started.elapsed().as_secs_f64() * 1e3, "rank rebuilt");
    Ok(manifest.total_len)
}

fn rebuild_from_copy(job: &Job<'_>, rank: u32, version: u64, holder: &AgentInfo) -> Result<Manifest, String> {
    let mut session = PeerSession::open(job, holder, rank)?;
    let (meta, region) = session.fetch_piece(job, version, PieceId::Copy { rank })?;
    let PieceMeta::Copy(manifest) = meta else { unreachable!("fetch_piece checked the kind") };
    let from = format!("the copy on {}", holder.node);
    read_rank_into_primary(job, &mut session, &manifest, region, &from)?;
    Ok(manifest)
}

/// Rebuilds the lone member of a group described by `manifest` from one of
/// its parity shards (its bytes, zero-padded), as a partner copy is.
fn copy_repeated_member(job: &Job<'_>, manifest: &Manifest, source: ShardSource) -> Result<(), String> {
    let Some(ShardOrigin::Peer(session, region)) = source.from else { return Err("the shard has no session".into()) };
    let mut session = Arc::try_unwrap(session).map_err(|_| "the shard's session is shared")?;
    let from = format!("the parity shard on {}", session.from.node);
    read_rank_into_primary(job, &mut session, manifest, region, &from)
}

/// Reads the rank `manifest` describes from `region` of `session`'s peer
/// (a copy, a repeated parity shard, or the primary taken over: `from`)
/// into the rank's new file, each chunk checked as it arrives
/// ([`PeerSession::read_checked`]), and seals it as this node's primary.
pub(super) fn read_rank_into_primary(
    job: &Job<'_>,
    session: &mut PeerSession,
    manifest: &Manifest,
    region: RemoteRegion,
    from: &str,
) -> Result<(), String> {
    let store = &job.settings.store;
    let file =
        store.create(&job.app, manifest.rank, manifest.version, manifest.total_len).map_err(|e| e.to_string())?;
    let mut file = job.endpoint.register(file, Access::LOCAL).map_err(|e| e.to_string())?;
    session.read_checked(job, region, &mut file, manifest).map_err(|e| format!("{from}: {e}"))?;
    session.done_reading();
    super::seal_checked(job, manifest, file.into_inner())
}

/// The parity shards of `group` a decode reads, with what they say: the
/// group's description (every readable shard's must agree), a source per
/// shard (`None`: lost, unreadable or disagreeing, each said in `lost`),
/// and each shard's stripe checksums.
struct ParityShards {
    meta: Option<ParityMeta>,
    sources: Vec<Option<ShardSource>>,
    crcs: Vec<Vec<u32>>,
}

/// Asks every surviving holder in `parity` for its shard of `group`.
fn fetch_parity(
    job: &Job<'_>,
    (rank, version, group): (u32, u64, u32),
    parity: &[Option<AgentInfo>],
    lost: &mut Vec<String>,
) -> ParityShards {
    let mut shards = ParityShards { meta: None, sources: Vec::new(), crcs: Vec::new() };
    for (index, holder) in parity.iter().enumerate() {
        let piece = PieceId::Parity { group, index: index as u8 };
        let Some(holder) = holder else {
            lost.push(format!("parity shard {index} (its node is lost)"));
            shards.sources.push(None);
            shards.crcs.push(Vec::new());
            continue;
        };
        let fetched = PeerSession::open(job, holder, rank).and_then(|mut session| {
            let (piece_meta, region) = session.fetch_piece(job, version, piece)?;
            let PieceMeta::Parity(parity_meta) = piece_meta else { unreachable!("fetch_piece checked the kind") };
            Ok((session, region, parity_meta))
        });
        match fetched {
            Ok((session, region, parity_meta)) => {
                let len = parity_meta.shard_len;
                let meta = &shards.meta;
                if meta.as_ref().is_some_and(|m| m.shard_len != len || m.members != parity_meta.members) {
                    lost.push(format!("parity shard {index} (it disagrees with the others)"));
                    shards.sources.push(None);
                    shards.crcs.push(Vec::new());
                    continue;
                }
                shards.crcs.push(parity_meta.crcs.clone());
                shards.meta.get_or_insert(parity_meta);
                shards.sources.push(Some(ShardSource::whole(session, region, len)));
            }
            Err(err) => {
                tracing::warn!(group, index, %err, "a parity shard cannot be read; decoding without it");
                lost.push(format!("parity shard {index} ({err})"));
                shards.sources.push(None);
                shards.crcs.push(Vec::new());
            }
        }
    }
    shards
}

/// Decodes member `shard` (rank `rank`) of `group` from the survivors.
fn decode_member(
    job: &Job<'_>,
    rank: u32,
    version: u64,
    group: u32,
    shard: u8,
    members: &[Option<(u32, Option<AgentInfo>)>],
    parity: &[Option<AgentInfo>],
) -> Result<Manifest, String> {
    let k = members.len();
    let shard = usize::from(shard);
    if shard >= k || members[shard].as_ref().map(|m| m.0) != Some(rank) {
        return Err(format!("rank {rank} is not shard {shard} of group {group}"));
    }
    // The code's data shards are the present members (`ParityMeta::members`):
    // this rank's index among them, and how many there are.
    let coded = members[..shard].iter().flatten().count();
    let present = members.iter().flatten().count();
    let mut lost = Vec::new();
    // Parity first: its description carries every member's manifest.
    let parity = fetch_parity(job, (rank, version, group), parity, &mut lost);
    let meta = parity.meta.clone();
    let meta = meta.ok_or_else(|| format!("no parity shard of group {group} could be read: {}", lost.join("; ")))?;
    if meta.members.len() != k {
        return Err(format!("the parity of group {group} has {} members, the plan {k}", meta.members.len()));
    }
    let manifest = meta.members[shard]
        .clone()
        .filter(|m| m.rank == rank)
        .ok_or_else(|| format!("the parity of group {group} does not describe rank {rank} as shard {shard}"))?;
    if present == 1 {
        // A lone member's every parity shard is its bytes, zero-padded (a
        // repetition code): one shard read whole is the rank, where the
        // decoder would read every shard and code each stripe (a lone
        // 1 GiB rank: 3.5 s).
        for (index, source) in parity.sources.into_iter().enumerate() {
            let Some(source) = source else { continue };
            match copy_repeated_member(job, &manifest, source) {
                Ok(()) => {
                    tracing::info!(rank, version, group, index, "rank copied from a parity shard of its group of one");
                    return Ok(manifest);
                }
                Err(err) => {
                    tracing::warn!(group, index, %err, "a parity shard cannot be copied; trying the next");
                    lost.push(format!("parity shard {index} ({err})"));
                }
            }
        }
        return Err(format!("no parity shard of group {group} could be copied: {}", lost.join("; ")));
    }
    let mut data_sources: Vec<Option<ShardSource>> = Vec::with_capacity(present);
    for (index, member) in members.iter().enumerate() {
        let source = match member {
            None => continue,
            Some(_) if index == shard => None,
            Some((member_rank, None)) => {
                lost.push(format!("rank {member_rank} (its node is lost)"));
                None
            }
            Some((member_rank, Some(holder))) => {
                let fetched = PeerSession::open(job, holder, *member_rank)
                    .and_then(|mut session| session.fetch(job, (*member_rank, version), false).map(|f| (session, f)));
                match fetched {
                    Ok((session, (member_manifest, region))) => {
                        if meta.members[index].as_ref() != Some(&member_manifest) {
                            lost.push(format!(
                                "rank {member_rank} (its primary is not the version the parity encodes)"
                            ));
                            None
                        } else {
                            Some(ShardSource::whole(session, region, member_manifest.total_len))
                        }
                    }
                    Err(err) => {
                        tracing::warn!(group, rank = member_rank, %err, "a member cannot be read; decoding without it");
                        lost.push(format!("rank {member_rank} ({err})"));
                        None
                    }
                }
            }
        };
        data_sources.push(source);
    }
    // Only this rank's shard goes into the file, whole.
    let mut targets = vec![None; data_sources.len()];
    targets[coded] = Some((0, manifest.total_len));
    decode_into_primary(job, (group, &manifest, &meta), (data_sources, parity), &targets, lost)?;
    Ok(manifest)
}

/// Rebuilds the one member (rank `rank`) of sliced group `group`, whose
/// slice 0 went with its primary, from the surviving slices (`slices`:
/// the holders of slices 1..K) and parity shards: each surviving slice is
/// copied into place and each lost one decoded.
fn decode_sliced(
    job: &Job<'_>,
    (rank, version, group): (u32, u64, u32),
    slices: &[Option<AgentInfo>],
    parity: &[Option<AgentInfo>],
) -> Result<Manifest, String> {
    let k = slices.len() + 1;
    let mut lost = vec![format!("slice 0 (in the primary of rank {rank})")];
    let parity = fetch_parity(job, (rank, version, group), parity, &mut lost);
    let meta = parity.meta.clone();
    let meta = meta.ok_or_else(|| format!("no parity shard of group {group} could be read: {}", lost.join("; ")))?;
    let members: Vec<Option<&Manifest>> = meta.members.iter().map(Option::as_ref).collect();
    let manifest = match icheck_core::protocol::sliced_member(&members) {
        Some(manifest) if manifest.rank == rank && members.len() == k => manifest.clone(),
        _ => return Err(format!("the parity of group {group} does not describe rank {rank} cut into {k} slices")),
    };
    let ranges = manifest.slices(k);
    let mut data_sources: Vec<Option<ShardSource>> = vec![None];
    for (at, holder) in slices.iter().enumerate() {
        let index = at as u8 + 1;
        let Some(holder) = holder else {
            lost.push(format!("slice {index} (its node is lost)"));
            data_sources.push(None);
            continue;
        };
        let piece = PieceId::Slice { group, index };
        let fetched = PeerSession::open(job, holder, rank).and_then(|mut session| {
            let (piece_meta, region) = session.fetch_piece(job, version, piece)?;
            let PieceMeta::Slice(slice) = piece_meta else { unreachable!("fetch_piece checked the kind") };
            Ok((session, region, slice))
        });
        match fetched {
            Ok((_, _, slice)) if slice.manifest != manifest || usize::from(slice.slices) != k => {
                lost.push(format!("slice {index} (it is not of the version the parity encodes)"));
                data_sources.push(None);
            }
            Ok((session, region, _)) => {
                let (start, end) = ranges[usize::from(index)];
                data_sources.push(Some(ShardSource::whole(session, region, end - start)));
            }
            Err(err) => {
                tracing::warn!(group, index, %err, "a slice cannot be read; decoding without it");
                lost.push(format!("slice {index} ({err})"));
                data_sources.push(None);
            }
        }
    }
    // Every slice goes into the file at its place in the rank.
    let targets: Vec<Option<(u64, u64)>> = ranges.into_iter().map(Some).collect();
    decode_into_primary(job, (group, &manifest, &meta), (data_sources, parity), &targets, lost)?;
    Ok(manifest)
}

/// Decodes what `targets` asks of a group's data shards into a new primary
/// file of the rank `manifest` describes, and seals it once it verifies:
/// data shard i's real bytes go to `targets[i]` (start and end in the
/// rank), decoded when `data[i]` is `None`, copied from its survivor when
/// not. `lost` says what is missing, for the error when too much is.
fn decode_into_primary(
    job: &Job<'_>,
    (group, manifest, meta): (u32, &Manifest, &ParityMeta),
    (data, parity): (Vec<Option<ShardSource>>, ParityShards),
    targets: &[Option<(u64, u64)>],
    lost: Vec<String>,
) -> Result<(), String> {
    let needed = data.len();
    let ParityShards { sources: mut parity_sources, crcs: parity_crcs, .. } = parity;
    let survivors = data.iter().flatten().count() + parity_sources.iter().flatten().count();
    if survivors < needed {
        return Err(format!(
            "group {group} has {survivors} readable shards of the {needed} decoding needs; missing: {}",
            lost.join("; ")
        ));
    }
    // The code needs K shards: the data shards, then parity shards in order.
    // Those beyond are let go unread (every holder checked its shard before
    // exposing it, so a spare one would only be read).
    let mut wanted = needed - data.iter().flatten().count();
    for source in parity_sources.iter_mut().filter(|source| source.is_some()) {
        match wanted {
            0 => *source = None,
            _ => wanted -= 1,
        }
    }
    // Every readable shard is read in one batch per block; `data_at` and
    // `parity_at` say where each data and parity shard's block lies.
    let mut readable = Vec::with_capacity(survivors);
    let mut place = |source: Option<ShardSource>| {
        source.map(|source| {
            readable.push(source);
            readable.len() - 1
        })
    };
    let data_at: Vec<Option<usize>> = data.into_iter().map(&mut place).collect();
    let parity_at: Vec<Option<usize>> = parity_sources.into_iter().map(&mut place).collect();
    let slots = readable.len();
    let mut shards = ShardBlocks::new(job, readable, slots)?;
    let store = &job.settings.store;
    let rank = manifest.rank;
    let mut file = store.create(&job.app, rank, manifest.version, manifest.total_len).map_err(|e| e.to_string())?;
    let until = targets.iter().flatten().map(|(start, end)| end - start).max().unwrap_or(0);
    let mut decoder = redundancy::StripeDecoder::default();
    for_each_block(job, &mut shards, (until, meta.shard_len), |offset, block, shards| {
        for (at, n) in stripes_of(block) {
            let stripe = (offset as usize + at) / STRIPE as usize;
            let originals: Vec<Option<&[u8]>> =
                data_at.iter().map(|shard| shard.map(|shard| shards.bytes(shard, at, n))).collect();
            let mut recovery: Vec<Option<&[u8]>> = Vec::with_capacity(parity_at.len());
            for (index, shard) in parity_at.iter().enumerate() {
                let bytes = shard.map(|shard| shards.bytes(shard, at, n));
                if bytes
                    .is_some_and(|bytes| parity_crcs[index].get(stripe) != Some(&icheck_core::format::crc32c(bytes)))
                {
                    let from = offset as usize + at;
                    return Err(format!("parity shard {index} of group {group} is damaged at bytes {from}.."));
                }
                recovery.push(bytes);
            }
            // Where stripe bytes of data shard i go in the rank, if anywhere.
            let start = offset + at as u64;
            let place = |i: usize| {
                let (first, end) = targets.get(i).copied().flatten()?;
                let real = (end - first).checked_sub(start).filter(|left| *left > 0)?.min(n as u64) as usize;
                Some(((first + start) as usize, real))
            };
            let file = file.as_mut_slice();
            for (i, bytes) in originals.iter().enumerate() {
                if let (Some(bytes), Some((to, real))) = (bytes, place(i)) {
                    file[to..to + real].copy_from_slice(&bytes[..real]);
                }
            }
            let mut missing = (0..originals.len()).filter(|i| originals[*i].is_none() && place(*i).is_some()).count();
            if missing == 0 {
                continue;
            }
            decoder
                .decode(&originals, &recovery, |i, shard| {
                    if let Some((to, real)) = place(i) {
                        file[to..to + real].copy_from_slice(&shard[..real]);
                        missing -= 1;
                    }
                })
                .map_err(|e| e.to_string())?;
            if missing > 0 {
                return Err("the decoder did not restore every shard".into());
            }
        }
        Ok(())
    })?;
    let what = if targets.iter().flatten().count() > 1 { "rebuilt from the slices of" } else { "decoded from" };
    manifest
        .verify(file.as_slice())
        .map_err(|e| format!("rank {rank} {what} group {group} fails its checksums: {e}"))?;
    super::seal_checked(job, manifest, file)
}
