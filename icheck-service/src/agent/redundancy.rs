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

use std::time::Instant;

use icheck_core::control::BlockingConnection;
use icheck_core::fabric::{Access, AlignedBuffer, Peer, RegisteredBuffer, RemoteRegion, RmaOp, TransferOptions};
use icheck_core::protocol::{
    check_fetched, AgentInfo, AgentReply, AgentRequest, FetchWanted, Fetched, Manifest, ParityMeta, PieceMeta,
    PieceTask, RebuildSource, STRIPE,
};
use icheck_core::redundancy::{self, PieceId};

use super::{Shared, TAKE_OVER_CONNECT_TIMEOUT, TAKE_OVER_TIMEOUT};

/// A session with another agent of the same application, admitted by the
/// node token (it presents no capability): what reading a peer's primary
/// or piece takes.
pub(super) struct PeerSession {
    conn: BlockingConnection,
    peer: Peer,
    from: AgentInfo,
    fetching: bool,
}

impl PeerSession {
    /// Opens a session with `from` bound to `rank`.
    pub(super) fn open(shared: &Shared, from: &AgentInfo, rank: u32) -> Result<PeerSession, String> {
        let fail = |what: String| format!("agent {} on {} ({}): {what}", from.id, from.node, from.control);
        let mut conn =
            BlockingConnection::connect(&from.control, &shared.settings.node_token, TAKE_OVER_CONNECT_TIMEOUT)
                .map_err(|e| fail(e.to_string()))?;
        conn.set_timeout(TAKE_OVER_TIMEOUT);
        let peer = shared.endpoint.insert_peer(&from.address).map_err(|e| fail(e.to_string()))?;
        let mut session = PeerSession { conn, peer, from: from.clone(), fetching: false };
        let open = AgentRequest::Open {
            app: shared.app.clone(),
            rank,
            address: shared.endpoint.address().clone(),
            capability: String::new(),
            pfs_key: None,
        };
        session.call(&open)?;
        Ok(session)
    }

    fn fail(&self, what: impl std::fmt::Display) -> String {
        format!("agent {} on {} ({}): {what}", self.from.id, self.from.node, self.from.control)
    }

    fn call(&mut self, request: &AgentRequest) -> Result<AgentReply, String> {
        match self.conn.call::<_, AgentReply>(request) {
            Ok(AgentReply::Error(message)) => Err(self.fail(message)),
            Ok(reply) => Ok(reply),
            Err(err) => Err(self.fail(err)),
        }
    }

    /// The rank's intact primary of `version` (the peer refuses to call a
    /// damaged one intact), checked like a restarting rank's.
    pub(super) fn fetch(
        &mut self,
        shared: &Shared,
        rank: u32,
        version: u64,
    ) -> Result<(Manifest, RemoteRegion), String> {
        let reply = self.call(&AgentRequest::Fetch { version })?;
        self.fetching = true;
        match check_fetched(reply, FetchWanted { app: &shared.app, rank, version }) {
            Ok(Fetched { damaged: Some(damage), .. }) => Err(self.fail(format!("rank {rank} is damaged: {damage}"))),
            Ok(Fetched { manifest, region, damaged: None }) => Ok((manifest, region)),
            Err(refused) => Err(self.fail(refused)),
        }
    }

    /// A piece the peer holds (verified by the peer before it is exposed),
    /// checked before any of its lengths is used.
    pub(super) fn fetch_piece(
        &mut self,
        shared: &Shared,
        version: u64,
        piece: PieceId,
    ) -> Result<(PieceMeta, RemoteRegion), String> {
        let reply = self.call(&AgentRequest::FetchPiece { version, piece })?;
        self.fetching = true;
        let AgentReply::Piece { meta, region } = reply else {
            return Err(self.fail(format!("unexpected answer to FetchPiece: {reply:?}")));
        };
        let len =
            meta.check(&shared.app, version, piece).map_err(|e| self.fail(format!("the {piece} it sent: {e}")))?;
        if region.len < len {
            return Err(self.fail(format!("the {piece} exposes {} of its {len} bytes", region.len)));
        }
        Ok((meta, region))
    }

    /// Reads `len` bytes at `offset` of `region` into the start of `into`.
    fn read<B: icheck_core::fabric::StableBuffer>(
        &self,
        shared: &Shared,
        region: RemoteRegion,
        offset: u64,
        into: &mut RegisteredBuffer<B>,
        len: usize,
    ) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let ops = [RmaOp { local_offset: 0, remote: region, remote_offset: offset, len }];
        shared
            .endpoint
            .read(&self.peer, into.target(), &ops, &TransferOptions::default())
            .map(|_| ())
            .map_err(|e| self.fail(e))
    }

    /// Reads all of `region` into a registered file.
    pub(super) fn read_whole<B: icheck_core::fabric::StableBuffer>(
        &self,
        shared: &Shared,
        region: RemoteRegion,
        into: &mut RegisteredBuffer<B>,
        len: usize,
    ) -> Result<(), String> {
        self.read(shared, region, 0, into, len)
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

/// Builds `task`'s piece in this node's store. Returns the bytes it holds.
pub(super) fn protect(shared: &Shared, task: &PieceTask) -> Result<u64, String> {
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
            let mut session = PeerSession::open(shared, from, rank).map_err(fail)?;
            let (manifest, region) = session.fetch(shared, rank, version).map_err(fail)?;
            let fetched = started.elapsed();
            let store = &shared.settings.store;
            let file = store
                .create_piece(&shared.app, version, task.piece, manifest.total_len)
                .map_err(|e| fail(e.to_string()))?;
            let mut file = shared.endpoint.register(file, Access::LOCAL).map_err(|e| fail(e.to_string()))?;
            let created = started.elapsed();
            session.read_whole(shared, region, &mut file, manifest.total_len as usize).map_err(fail)?;
            session.done_reading();
            let read = started.elapsed();
            manifest.verify(file.as_slice()).map_err(|e| fail(e.to_string()))?;
            let verified = started.elapsed();
            store
                .seal_piece(&shared.app, version, task.piece, &PieceMeta::Copy(manifest.clone()))
                .map_err(|e| fail(e.to_string()))?;
            tracing::debug!(
                version,
                rank,
                fetch_ms = fetched.as_secs_f64() * 1e3,
                create_ms = (created - fetched).as_secs_f64() * 1e3,
                read_ms = (read - created).as_secs_f64() * 1e3,
                verify_ms = (verified - read).as_secs_f64() * 1e3,
                "copy's steps"
            );
            manifest.total_len
        }
        PieceId::Parity { group, index } => build_parity(shared, task, group, index).map_err(fail)?,
    };
    tracing::info!(version, piece = %task.piece, bytes, ms = started.elapsed().as_secs_f64() * 1e3, "piece of redundancy built");
    Ok(bytes)
}

/// A source of one shard of a group, stripe by stripe: a member's primary
/// (shorter ones read as zero-padded), a parity shard, or zeros.
struct ShardSource {
    session: Option<PeerSession>,
    region: RemoteRegion,
    /// Bytes of real data (the rest of the shard is zeros).
    len: u64,
    buffer: RegisteredBuffer,
}

impl ShardSource {
    fn zeros(shared: &Shared) -> Result<ShardSource, String> {
        Self::with(shared, None, RemoteRegion { addr: 0, len: 0, key: 0 }, 0)
    }

    fn with(
        shared: &Shared,
        session: Option<PeerSession>,
        region: RemoteRegion,
        len: u64,
    ) -> Result<ShardSource, String> {
        let buffer = shared
            .endpoint
            .register(AlignedBuffer::zeroed(BLOCK as usize), Access::LOCAL)
            .map_err(|e| e.to_string())?;
        Ok(ShardSource { session, region, len, buffer })
    }

    /// Loads block `[offset, offset + n)` of the shard into the buffer: one
    /// read of its real bytes (the fabric pipelines it), zeros after them.
    fn load(&mut self, shared: &Shared, offset: u64, n: usize) -> Result<(), String> {
        let real = self.len.saturating_sub(offset).min(n as u64) as usize;
        if let Some(session) = &self.session {
            session.read(shared, self.region, offset, &mut self.buffer, real)?;
        }
        self.buffer.as_mut_slice()[real..n].fill(0);
        Ok(())
    }

    /// `n` bytes of the loaded block from `at`.
    fn bytes(&self, at: usize, n: usize) -> &[u8] {
        &self.buffer.as_slice()[at..at + n]
    }
}

/// Bytes of each shard read at once (a whole number of stripes): one RMA
/// read per member per block keeps the fabric busy, where one per stripe
/// would wait a round trip every megabyte.
const BLOCK: u64 = 8 * STRIPE;

/// The stripes of block `[offset, offset + block)`: (offset in the block, bytes).
fn stripes_of(block: u64) -> impl Iterator<Item = (usize, usize)> {
    (0..block).step_by(STRIPE as usize).map(move |at| (at as usize, (block - at).min(STRIPE) as usize))
}

/// Bytes of every shard of a group whose longest member is `longest`.
fn shard_len(longest: u64) -> u64 {
    longest.max(2).next_multiple_of(2)
}

/// Builds parity shard `index` of `group`: reads every member's primary a
/// stripe at a time, encodes, keeps this shard.
fn build_parity(shared: &Shared, task: &PieceTask, group: u32, index: u8) -> Result<u64, String> {
    let version = task.version;
    let mut manifests = Vec::with_capacity(task.members.len());
    let mut sources = Vec::with_capacity(task.members.len());
    for member in &task.members {
        match member {
            None => {
                manifests.push(None);
                sources.push(ShardSource::zeros(shared)?);
            }
            Some((rank, from)) => {
                let mut session = PeerSession::open(shared, from, *rank)?;
                let (manifest, region) = session.fetch(shared, *rank, version)?;
                sources.push(ShardSource::with(shared, Some(session), region, manifest.total_len)?);
                manifests.push(Some(manifest));
            }
        }
    }
    let longest = manifests.iter().flatten().map(|m| m.total_len).max().unwrap_or(0);
    let shard_len = shard_len(longest);
    let store = &shared.settings.store;
    let piece = PieceId::Parity { group, index };
    let mut file = store.create_piece(&shared.app, version, piece, shard_len).map_err(|e| e.to_string())?;
    let mut crcs = Vec::new();
    let mut offset = 0;
    while offset < shard_len {
        let block = (shard_len - offset).min(BLOCK);
        for source in &mut sources {
            source.load(shared, offset, block as usize)?;
        }
        for (at, n) in stripes_of(block) {
            let originals: Vec<&[u8]> = sources.iter().map(|source| source.bytes(at, n)).collect();
            let parity = redundancy::encode(usize::from(task.parity), &originals).map_err(|e| e.to_string())?;
            let mine = &parity[usize::from(index)];
            let start = offset as usize + at;
            file.as_mut_slice()[start..start + n].copy_from_slice(mine);
            crcs.push(crc32c::crc32c(mine));
        }
        offset += block;
    }
    drop(sources);
    let meta = ParityMeta {
        app: shared.app.clone(),
        version,
        group,
        index,
        parity: task.parity,
        shard_len,
        members: manifests,
        crcs,
    };
    store.seal_piece(&shared.app, version, piece, &PieceMeta::Parity(meta)).map_err(|e| e.to_string())?;
    Ok(shard_len)
}

/// Rebuilds `rank`'s `version` into this node's store (as its primary) from
/// `source`. Returns the rank's bytes.
pub(super) fn rebuild(shared: &Shared, rank: u32, version: u64, source: &RebuildSource) -> Result<u64, String> {
    let started = Instant::now();
    let fail = |what: String| format!("rebuilding rank {rank} version {version}: {what}");
    let (manifest, how) = match source {
        RebuildSource::Copies(holders) => {
            let mut why = Vec::new();
            let mut rebuilt = None;
            for holder in holders {
                match rebuild_from_copy(shared, rank, version, holder) {
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
            let manifest = decode_member(shared, rank, version, *group, *shard, members, parity).map_err(fail)?;
            (manifest, format!("decoded from group {group}"))
        }
    };
    shared.completed(rank, version);
    tracing::info!(rank, version, bytes = manifest.total_len, from = %how, ms = started.elapsed().as_secs_f64() * 1e3, "rank rebuilt");
    Ok(manifest.total_len)
}

fn rebuild_from_copy(shared: &Shared, rank: u32, version: u64, holder: &AgentInfo) -> Result<Manifest, String> {
    let mut session = PeerSession::open(shared, holder, rank)?;
    let (meta, region) = session.fetch_piece(shared, version, PieceId::Copy { rank })?;
    let PieceMeta::Copy(manifest) = meta else { unreachable!("fetch_piece checked the kind") };
    let store = &shared.settings.store;
    let file = store.create(&shared.app, rank, version, manifest.total_len).map_err(|e| e.to_string())?;
    let mut file = shared.endpoint.register(file, Access::LOCAL).map_err(|e| e.to_string())?;
    session.read_whole(shared, region, &mut file, manifest.total_len as usize)?;
    session.done_reading();
    manifest.verify(file.as_slice()).map_err(|e| format!("the copy on {} fails its checksums: {e}", holder.node))?;
    store.seal(&manifest).map_err(|e| e.to_string())?;
    Ok(manifest)
}

/// Decodes member `shard` (rank `rank`) of `group` from the survivors.
fn decode_member(
    shared: &Shared,
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
    let mut lost = Vec::new();
    // Parity first: its description carries every member's manifest.
    let mut meta: Option<ParityMeta> = None;
    let mut parity_sources: Vec<Option<ShardSource>> = Vec::with_capacity(parity.len());
    // Each parity shard's own stripe checksums.
    let mut parity_crcs: Vec<Vec<u32>> = Vec::with_capacity(parity.len());
    for (index, holder) in parity.iter().enumerate() {
        let piece = PieceId::Parity { group, index: index as u8 };
        let Some(holder) = holder else {
            lost.push(format!("parity shard {index} (its node is lost)"));
            parity_sources.push(None);
            parity_crcs.push(Vec::new());
            continue;
        };
        let fetched = PeerSession::open(shared, holder, rank).and_then(|mut session| {
            let (piece_meta, region) = session.fetch_piece(shared, version, piece)?;
            let PieceMeta::Parity(parity_meta) = piece_meta else { unreachable!("fetch_piece checked the kind") };
            Ok((session, region, parity_meta))
        });
        match fetched {
            Ok((session, region, parity_meta)) => {
                let len = parity_meta.shard_len;
                if meta.as_ref().is_some_and(|m| m.shard_len != len || m.members != parity_meta.members) {
                    lost.push(format!("parity shard {index} (it disagrees with the others)"));
                    parity_sources.push(None);
                    parity_crcs.push(Vec::new());
                    continue;
                }
                parity_crcs.push(parity_meta.crcs.clone());
                meta.get_or_insert(parity_meta);
                parity_sources.push(Some(ShardSource::with(shared, Some(session), region, len)?));
            }
            Err(err) => {
                tracing::warn!(group, index, %err, "a parity shard cannot be read; decoding without it");
                lost.push(format!("parity shard {index} ({err})"));
                parity_sources.push(None);
                parity_crcs.push(Vec::new());
            }
        }
    }
    let meta = meta.ok_or_else(|| format!("no parity shard of group {group} could be read: {}", lost.join("; ")))?;
    if meta.members.len() != k {
        return Err(format!("the parity of group {group} has {} members, the plan {k}", meta.members.len()));
    }
    let manifest = meta.members[shard]
        .clone()
        .filter(|m| m.rank == rank)
        .ok_or_else(|| format!("the parity of group {group} does not describe rank {rank} as shard {shard}"))?;
    let mut data_sources: Vec<Option<ShardSource>> = Vec::with_capacity(k);
    for (index, member) in members.iter().enumerate() {
        let source = match member {
            None => Some(ShardSource::zeros(shared)?),
            Some(_) if index == shard => None,
            Some((member_rank, None)) => {
                lost.push(format!("rank {member_rank} (its node is lost)"));
                None
            }
            Some((member_rank, Some(holder))) => {
                let fetched = PeerSession::open(shared, holder, *member_rank)
                    .and_then(|mut session| session.fetch(shared, *member_rank, version).map(|f| (session, f)));
                match fetched {
                    Ok((session, (member_manifest, region))) => {
                        if meta.members[index].as_ref() != Some(&member_manifest) {
                            lost.push(format!(
                                "rank {member_rank} (its primary is not the version the parity encodes)"
                            ));
                            None
                        } else {
                            Some(ShardSource::with(shared, Some(session), region, member_manifest.total_len)?)
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
    let survivors = data_sources.iter().flatten().count() + parity_sources.iter().flatten().count();
    if survivors < k {
        return Err(format!(
            "group {group} has {survivors} readable shards of the {k} decoding needs; missing: {}",
            lost.join("; ")
        ));
    }
    let store = &shared.settings.store;
    let mut file = store.create(&shared.app, rank, version, manifest.total_len).map_err(|e| e.to_string())?;
    let mut offset = 0;
    while offset < manifest.total_len {
        let block = (meta.shard_len - offset).min(BLOCK);
        for source in data_sources.iter_mut().chain(parity_sources.iter_mut()).flatten() {
            source.load(shared, offset, block as usize)?;
        }
        for (at, n) in stripes_of(block) {
            let stripe = (offset as usize + at) / STRIPE as usize;
            let originals: Vec<Option<&[u8]>> =
                data_sources.iter().map(|s| s.as_ref().map(|s| s.bytes(at, n))).collect();
            let mut recovery: Vec<Option<&[u8]>> = Vec::with_capacity(parity_sources.len());
            for (index, source) in parity_sources.iter().enumerate() {
                let bytes = source.as_ref().map(|s| s.bytes(at, n));
                if bytes.is_some_and(|bytes| parity_crcs[index].get(stripe) != Some(&crc32c::crc32c(bytes))) {
                    let from = offset as usize + at;
                    return Err(format!("parity shard {index} of group {group} is damaged at bytes {from}.."));
                }
                recovery.push(bytes);
            }
            let restored = redundancy::decode(&originals, &recovery).map_err(|e| e.to_string())?;
            let mine = restored.get(&shard).ok_or("the decoder did not restore the shard")?;
            let start = offset + at as u64;
            if start >= manifest.total_len {
                break;
            }
            let real = (manifest.total_len - start).min(n as u64) as usize;
            file.as_mut_slice()[start as usize..start as usize + real].copy_from_slice(&mine[..real]);
        }
        offset += block;
    }
    manifest
        .verify(file.as_slice())
        .map_err(|e| format!("rank {rank} decoded from group {group} fails its checksums: {e}"))?;
    drop(file);
    store.seal(&manifest).map_err(|e| e.to_string())?;
    Ok(manifest)
}
