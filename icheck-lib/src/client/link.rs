//! The agent link: a rank's (or SHMR node leader's) session with its agent
//! (Open, Begin, Pull, Seal) and `commit_version`, the one
//! Begin → transfer while checksumming → Seal sequence every data path uses.

use super::watch::{AgentWatch, Verdict};
use super::*;
use std::sync::Arc;

/// The slowest an agent may move or check a version's bytes before it
/// counts as unreachable: every wait is `request_timeout` plus one second
/// per this many bytes the request covers.
const SLOWEST_BYTES_PER_SEC: f64 = 10e6;

/// How long a rank waits for its agent: to connect, and for an answer to
/// a request that moves no data (`client.connect_timeout`,
/// `client.request_timeout`); and whom it asks, during a long wait,
/// whether the agent was given up meanwhile.
#[derive(Clone, Debug)]
pub(super) struct Waits {
    pub(super) connect: Duration,
    pub(super) request: Duration,
    pub(super) watch: Option<Arc<AgentWatch>>,
}

/// How a wait for the agent's answer ended.
enum Awaited {
    /// Something arrived (or the connection closed): read it.
    Arrived,
    /// Nothing within the request's bound.
    TimedOut(Duration),
    /// The controller no longer lists the agent, `Duration` into the wait.
    GivenUp(Duration),
}

/// This rank's session with its agent.
pub(super) struct AgentLink {
    pub(super) info: AgentInfo,
    /// The agent's endpoint: what this rank writes to (a push commit).
    pub(super) peer: Peer,
    /// Where this session reads the agent's exposed versions from: an
    /// endpoint the agent serves this session from apart
    /// (`ServeApart`), so that ranks restoring from one agent at once
    /// copy side by side instead of taking turns on the agent's shm lock;
    /// `None`, the agent's own endpoint. Asked once per session.
    reads_from: Option<Peer>,
    apart_asked: bool,
    endpoint: Endpoint,
    /// The session's connection; behind a lock so that a restore, which
    /// borrows the library shared, can carry `Deliver` requests on it.
    conn: std::sync::Mutex<BlockingConnection>,
    /// How long a request that moves no data may wait for its answer.
    pub(super) request_timeout: Duration,
    /// What opening the session again takes (after the agent closed it
    /// idle): the token, the connect bound and the `Open` request.
    token: String,
    connect_timeout: Duration,
    open: AgentRequest,
    /// The agent spilled the last sealed version to the PFS (its memory
    /// budget was used up); the controller must have it copied.
    pub(super) spilled: bool,
    /// What this session's transfers moved since the client last took it
    /// (`transfer = "auto"` measures the directions with it).
    pub(super) moved: TransferTally,
    /// Whom to ask whether the agent was given up, during long waits.
    watch: Option<Arc<AgentWatch>>,
    /// The application, as the controller knows it (for those questions).
    app: String,
    /// Its capability, which the questions present.
    capability: String,
}

impl AgentLink {
    pub(super) fn open(
        endpoint: &Endpoint,
        info: &AgentInfo,
        access: &ServiceAccess,
        app: &str,
        rank: u32,
        waits: Waits,
    ) -> Result<Self> {
        let Waits { connect: timeout, request: request_timeout, watch } = waits;
        let fail = |message: String| Error::Agent {
            agent: info.id,
            node: info.node.clone(),
            peer: info.control.clone(),
            message,
            unreachable: true,
        };
        let mut conn =
            BlockingConnection::connect(&info.control, &access.token, timeout).map_err(|e| fail(e.to_string()))?;
        conn.set_timeout(request_timeout);
        let peer = endpoint.insert_peer(&info.address)?;
        let open = AgentRequest::Open {
            app: app.to_string(),
            rank,
            address: endpoint.address().clone(),
            capability: access.capability.clone(),
            pfs_key: access.pfs_key.as_ref().map(|k| *k.bytes()),
        };
        let mut link = AgentLink {
            info: info.clone(),
            peer,
            conn: std::sync::Mutex::new(conn),
            request_timeout,
            token: access.token.clone(),
            connect_timeout: timeout,
            open: open.clone(),
            spilled: false,
            moved: TransferTally::default(),
            reads_from: None,
            apart_asked: false,
            endpoint: endpoint.clone(),
            watch,
            app: app.to_string(),
            capability: access.capability.clone(),
        };
        link.call(&open)?;
        Ok(link)
    }

    /// Opens the session again if the agent closed it while it was idle
    /// (`ClientIdleTimeout`: a job may compute for hours between commits).
    /// Called only where a request starts a new exchange (Begin, Fetch), so
    /// no half-done commit or restart is ever continued on a new session.
    fn reopen_if_closed(&mut self) -> Result<()> {
        if !self.conn().is_stale() {
            return Ok(());
        }
        tracing::info!(agent = self.info.id, peer = %self.info.control, "the agent closed this idle session; opening a new one");
        let mut conn = BlockingConnection::connect(&self.info.control, &self.token, self.connect_timeout)
            .map_err(|e| self.unreached(e.to_string()))?;
        conn.set_timeout(self.request_timeout);
        *self.conn() = conn;
        // The new session is served from the agent's own endpoint until it
        // asks again.
        (self.reads_from, self.apart_asked) = (None, false);
        let open = self.open.clone();
        self.call(&open).map(|_| ())
    }

    /// The peer this session's reads of a fetched version go to.
    pub(super) fn read_peer(&self) -> &Peer {
        self.reads_from.as_ref().unwrap_or(&self.peer)
    }

    /// Before the session's first fetch: asks the agent to serve this
    /// session's reads from an endpoint of its own. An agent that cannot
    /// (or an older one) leaves the reads on its own endpoint.
    fn serve_apart(&mut self) {
        if std::mem::replace(&mut self.apart_asked, true) {
            return;
        }
        match self.call(&AgentRequest::ServeApart) {
            Ok(AgentReply::Apart(address)) => match self.endpoint.insert_peer(&address) {
                Ok(peer) => self.reads_from = Some(peer),
                Err(err) => {
                    tracing::debug!(%err, "cannot reach the endpoint the agent serves reads from; reading from its own")
                }
            },
            Ok(_) => {}
            Err(err) => {
                tracing::debug!(%err, "the agent does not serve this session apart; reading from its own endpoint")
            }
        }
    }

    /// Asks for `version` to restart from (on a session opened again if the
    /// agent closed the idle one); `reader` (this process's host) lets an
    /// agent on the same host offer the version's file instead.
    pub(super) fn fetch(&mut self, version: u64, reader: Option<HostId>) -> Result<AgentReply> {
        self.reopen_if_closed()?;
        self.serve_apart();
        self.call(&AgentRequest::Fetch { version, reader, reader_checks: false })
    }

    /// Tells the agent the restart data is no longer needed. A session the
    /// agent closed meanwhile released it already.
    pub(super) fn fetch_done(&mut self) -> Result<()> {
        if self.conn().is_stale() {
            return Ok(());
        }
        self.call(&AgentRequest::FetchDone).map(|_| ())
    }

    /// An error the agent answered, or found in what it answered.
    pub(super) fn error(&self, message: String) -> Error {
        self.agent_error(message, false)
    }

    /// The agent could not be reached, its connection broke, or it did not
    /// answer in time.
    pub(super) fn unreached(&self, message: String) -> Error {
        self.agent_error(message, true)
    }

    fn agent_error(&self, message: String, unreachable: bool) -> Error {
        let (agent, node, peer) = (self.info.id, self.info.node.clone(), self.info.control.clone());
        Error::Agent { agent, node, peer, message, unreachable }
    }

    /// Bounds the following requests' waits for requests covering `bytes`
    /// of a version (0: requests that move no data).
    pub(super) fn expect_bytes(&self, bytes: u64) {
        let extra = Duration::from_secs_f64(bytes as f64 / SLOWEST_BYTES_PER_SEC);
        self.conn().set_timeout(self.request_timeout + extra);
    }

    /// The session's connection (a poisoned lock only means a panic
    /// elsewhere; the connection itself is whole or stale, which
    /// `is_stale` tells).
    fn conn(&self) -> std::sync::MutexGuard<'_, BlockingConnection> {
        self.conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn call(&mut self, request: &AgentRequest) -> Result<AgentReply> {
        self.send(request)?;
        self.receive(request)
    }

    /// Sends `request` without waiting for its reply ([`receive`](Self::receive)).
    pub(super) fn send(&self, request: &AgentRequest) -> Result<()> {
        self.conn().send(request).map_err(|err| self.unreached(err.to_string()))
    }

    /// The reply to the oldest request sent and not answered yet, which was
    /// like `request` (named in a timeout's error).
    pub(super) fn receive(&self, request: &AgentRequest) -> Result<AgentReply> {
        let name = || {
            let what = format!("{request:?}");
            what.chars().take_while(char::is_ascii_alphanumeric).collect::<String>()
        };
        let timed_out = |waited: Duration| {
            self.unreached(format!(
                "no answer to {} within {waited:.1?}: the agent or its node is stopped, hung or cut off \
                 (the bound is client.request_timeout plus 1 s per 10 MB)",
                name()
            ))
        };
        match self.await_answer() {
            Awaited::Arrived => {}
            Awaited::TimedOut(waited) => return Err(timed_out(waited)),
            Awaited::GivenUp(waited) => {
                return Err(self.unreached(format!(
                    "the controller gave this agent up while this rank waited {waited:.1?} for its answer to {} \
                     (its node missed its heartbeats or was lost)",
                    name()
                )))
            }
        }
        let received = self.conn().receive::<AgentReply>();
        match received {
            Ok(AgentReply::Error(message)) => Err(self.error(message)),
            Ok(reply) => Ok(reply),
            Err(ServiceError::Protocol(ProtocolError::Timeout(waited))) => Err(timed_out(waited)),
            Err(err) => Err(self.unreached(err.to_string())),
        }
    }

    /// Waits, within the request's bound, for the agent's answer to start
    /// arriving. Once the wait has outlasted the controller's failure
    /// detection, asks it now and then (ever less often) whether this
    /// agent is still the application's: a version on an agent it gave up
    /// is never recorded, so waiting on longer would only delay the move
    /// to new agents (by up to `client.request_timeout`, 30 s).
    fn await_answer(&self) -> Awaited {
        let bound = self.conn().timeout();
        let Some(watch) = self.watch.as_deref() else {
            return Awaited::Arrived;
        };
        let started = Instant::now();
        let mut ask_at = watch.first_question();
        // Kept from one question to the next within this wait.
        let mut controller = None;
        loop {
            let waited = started.elapsed();
            if waited >= bound {
                return Awaited::TimedOut(waited);
            }
            let slice = ask_at.saturating_sub(waited).min(bound - waited);
            if self.conn().wait_readable(slice) {
                return Awaited::Arrived;
            }
            if started.elapsed() < ask_at {
                continue;
            }
            match watch.ask(&mut controller, &self.token, &self.app, &self.capability, self.info.id) {
                Verdict::GivenUp => return Awaited::GivenUp(started.elapsed()),
                Verdict::Listed | Verdict::Unknown => {}
            }
            ask_at = watch.next_question(started.elapsed());
        }
    }

    pub(super) fn begin(&mut self, version: u64, shape: Shape, labels: Vec<LabelLayout>, push: bool) -> Result<Target> {
        let Shape { ranks, epoch } = shape;
        self.reopen_if_closed()?;
        match self.call(&AgentRequest::Begin { version, ranks, epoch, labels, push })? {
            AgentReply::Target(region) => Ok(Target { region, push, measured: true }),
            AgentReply::SpillByPull => Ok(self.spill_by_pull(version)),
            other => Err(self.error(format!("unexpected answer to Begin: {other:?}"))),
        }
    }

    /// The agent's node is full and spills `version` to the PFS, which it
    /// can do only for bytes it reads: this version is pulled.
    fn spill_by_pull(&self, version: u64) -> Target {
        tracing::info!(version, agent = self.info.id, "the agent's node is full: it spills this version, pulled");
        Target { region: RemoteRegion { addr: 0, len: 0, key: 0 }, push: false, measured: false }
    }

    /// Begins an incremental version over `parent` with the `changed`
    /// blocks: `(target, true)` where the changed blocks go, packed;
    /// `(target, false)` for the whole version when the agent takes it
    /// whole (it lacks the parent, or spills).
    pub(super) fn begin_delta(
        &mut self,
        header: &VersionHeader,
        parent: u64,
        changed: Vec<BlockRun>,
    ) -> Result<(Target, bool)> {
        let Shape { ranks, epoch } = header.shape;
        self.reopen_if_closed()?;
        let request = AgentRequest::BeginDelta {
            version: header.version,
            ranks,
            epoch,
            labels: header.layout.clone(),
            push: header.push,
            parent,
            changed,
        };
        let push = header.push;
        match self.call(&request)? {
            AgentReply::DeltaTarget(region) => Ok((Target { region, push, measured: true }, true)),
            AgentReply::Target(region) => Ok((Target { region, push, measured: true }, false)),
            AgentReply::SpillByPull => Ok((self.spill_by_pull(header.version), false)),
            other => Err(self.error(format!("unexpected answer to BeginDelta: {other:?}"))),
        }
    }

    /// Pull mode: the agent reads `segments` while this process drives its
    /// endpoint's progress.
    pub(super) fn pull(&mut self, endpoint: &Endpoint, segments: Vec<PullSegment>) -> Result<u64> {
        let progress = ProgressThread::serving_reads(endpoint)
            .map_err(|e| self.error(format!("cannot start a progress thread: {e}")))?;
        let request = AgentRequest::Pull(segments);
        let reply = self.send(&request).and_then(|()| {
            // A crash here: the rank dies while its agent reads its memory.
            icheck_core::failpoint::hit("client.during_pull");
            self.receive(&request)
        });
        progress.stop();
        match reply? {
            AgentReply::Pulled { bytes } => Ok(bytes),
            other => Err(self.error(format!("unexpected answer to Pull: {other:?}"))),
        }
    }

    pub(super) fn seal(&mut self, crcs: Vec<Vec<u32>>) -> Result<Manifest> {
        icheck_core::failpoint::hit("client.before_seal");
        self.spilled = false;
        match self.call(&AgentRequest::Seal { crcs })? {
            AgentReply::Sealed(manifest) => Ok(manifest),
            AgentReply::Spilled(manifest) => {
                self.spilled = true;
                Ok(manifest)
            }
            other => Err(self.error(format!("unexpected answer to Seal: {other:?}"))),
        }
    }
}

/// What a version is written by: the process count (node count in SHMR
/// mode, where a node is one writer) and the resize epoch.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) ranks: u32,
    pub(super) epoch: u32,
}

/// What the library presents to the service: the client token (in every
/// Hello) and the application's capability (in every agent session and
/// every controller request about the application; empty until the
/// controller handed one out).
#[derive(Clone)]
pub(super) struct ServiceAccess {
    pub(super) token: String,
    pub(super) capability: String,
    /// The key of the application's encrypted PFS copies (its agents get
    /// it at `Open`); `None`: copies are not encrypted.
    pub(super) pfs_key: Option<icheck_core::cipher::PfsKey>,
}

impl ServiceAccess {
    /// The capability to present at registration, if there is one.
    pub(super) fn presented(&self) -> Option<String> {
        (!self.capability.is_empty()).then(|| self.capability.clone())
    }
}

/// Opens this process's session with its agent: in MR mode every rank's
/// (agent by rank), in SHMR mode only the node leader's (agent by node, and
/// the node index stands in for the rank).
pub(super) fn open_link(
    comm: &dyn Communicator,
    mode: TransferMode,
    endpoint: &Endpoint,
    agents: &[AgentInfo],
    access: &ServiceAccess,
    app: &str,
    waits: Waits,
) -> Result<Option<AgentLink>> {
    let count = agents.len() as u32;
    let (who, of) = match mode {
        TransferMode::Mr => (comm.rank(), comm.size()),
        TransferMode::Shmr if comm.node_rank() == 0 => (comm.node_index(), comm.node_counts().0),
        TransferMode::Shmr => return Ok(None),
    };
    let mine = &agents[agent_for_rank(who, of, count) as usize];
    AgentLink::open(endpoint, mine, access, app, who, waits).map(Some)
}

/// One piece of a version on its way to the agent: registered local memory
/// and where the piece goes in the version's file.
#[derive(Clone, Copy)]
pub(super) struct Piece<'a> {
    /// The registered memory, as the source of the library's writes (push).
    pub(super) source: LocalSource<'a>,
    /// The same memory as the agent reads it (pull).
    pub(super) remote: RemoteRegion,
    /// Where the piece starts in that memory.
    pub(super) local_offset: usize,
    /// Where it goes in the version's file.
    pub(super) file_offset: u64,
    /// Its length in bytes.
    pub(super) len: usize,
}

/// Where a begun version goes, and how this process moves it there.
#[derive(Clone, Copy, Debug)]
pub(super) struct Target {
    /// The agent's memory for the version (unused when pulling).
    pub(super) region: RemoteRegion,
    /// The library writes it (else the agent reads it); a pushed `Begin`
    /// is pulled when the agent spills ([`AgentReply::SpillByPull`]).
    pub(super) push: bool,
    /// Whether the move says how fast this direction is (`transfer =
    /// "auto"`): not a spill, which goes at the PFS's pace.
    pub(super) measured: bool,
}

/// Moves pieces into the version [`commit_version`] began.
pub(super) struct Mover<'l> {
    link: &'l mut AgentLink,
    endpoint: &'l Endpoint,
    target: Target,
}

impl Mover<'_> {
    /// Moves `pieces`: the library writes each (push), or the agent reads
    /// them all in one request while this process drives its endpoint's
    /// progress (pull). Returns the bytes moved.
    pub(super) fn send(&mut self, pieces: &[Piece<'_>]) -> Result<u64> {
        let started = Instant::now();
        let moved = self.transfer(pieces)?;
        if self.target.measured {
            let tally = if self.target.push { &mut self.link.moved.push } else { &mut self.link.moved.pull };
            tally.add(moved, started.elapsed().as_secs_f64());
        }
        Ok(moved)
    }

    fn transfer(&mut self, pieces: &[Piece<'_>]) -> Result<u64> {
        if self.target.push {
            let options = TransferOptions::default();
            let mut moved = 0;
            for piece in pieces {
                let op = RmaOp {
                    local_offset: piece.local_offset,
                    remote: self.target.region,
                    remote_offset: piece.file_offset,
                    len: piece.len,
                };
                moved += self.endpoint.write(&self.link.peer, piece.source, &[op], &options)?.bytes;
            }
            return Ok(moved);
        }
        let segments = pieces
            .iter()
            .map(|piece| PullSegment {
                source: piece.remote,
                source_offset: piece.local_offset as u64,
                file_offset: piece.file_offset,
                len: piece.len as u64,
            })
            .collect();
        self.link.pull(self.endpoint, segments)
    }
}

/// What a version is begun with at the agent.
pub(super) struct VersionHeader {
    pub(super) version: u64,
    pub(super) shape: Shape,
    pub(super) layout: Vec<LabelLayout>,
    /// The library writes (push) rather than the agent reads (pull).
    pub(super) push: bool,
}

/// The one commit sequence, whatever the data path: Begin at the agent;
/// `transfer` moves the bytes through a [`Mover`] while another core
/// checksums `labels` (the version's bytes label by label, in this
/// process's memory: end to end, and off the transfer's path); then Seal
/// with those checksums. Returns the bytes `transfer` moved.
pub(super) fn commit_version(
    link: &mut AgentLink,
    endpoint: &Endpoint,
    header: VersionHeader,
    labels: &[&[u8]],
    transfer: impl FnOnce(&mut Mover<'_>) -> Result<u64>,
) -> Result<u64> {
    commit_whole(link, endpoint, header, labels, transfer).map(|(moved, _, _)| moved)
}

/// [`commit_version`], also returning the version's chunk and block
/// checksums ([`icheck_core::delta`]), computed in one pass on one core:
/// the transfer needs the others.
fn commit_whole(
    link: &mut AgentLink,
    endpoint: &Endpoint,
    header: VersionHeader,
    labels: &[&[u8]],
    transfer: impl FnOnce(&mut Mover<'_>) -> Result<u64>,
) -> Result<(u64, Vec<Vec<u32>>, Vec<u32>)> {
    let VersionHeader { version, shape, layout, push } = header;
    link.expect_bytes(layout.iter().map(|l| l.len).sum());
    let target = link.begin(version, shape, layout, push)?;
    let (moved, (crcs, blocks)) = std::thread::scope(|scope| {
        let checksums = scope.spawn(|| icheck_core::delta::checksums_on(labels, 1));
        let moved = transfer(&mut Mover { link: &mut *link, endpoint, target });
        let sums = checksums.join().map_err(|_| Error::Order("the checksum thread panicked"))?;
        Ok::<_, Error>((moved?, sums))
    })?;
    link.seal(crcs.clone())?;
    Ok((moved, crcs, blocks))
}

/// What [`commit_incremental`] did.
pub(super) struct IncrementalCommit {
    /// Bytes that crossed the fabric.
    pub(super) moved: u64,
    /// The version's block checksums (the next commit's `before`).
    pub(super) blocks: Vec<u32>,
    /// The version's chunk checksums, label by label (what page tracking
    /// updates next time).
    pub(super) chunks: Vec<Vec<u32>>,
    /// Bytes read to checksum the version.
    pub(super) checksummed: u64,
    /// Whether page tracking limited the checksum pass.
    pub(super) tracked: bool,
    /// Fraction of blocks that differ from the previous version's (1 when
    /// there was none to compare with, or the layout changed: as if
    /// everything changed, so the next commit is sent whole and measured).
    pub(super) changed: f64,
}

/// An incremental commit ([`icheck_core::delta`]) of `labels`, whose
/// pieces of a byte range `pieces_of(start, end, at)` gives (placed at
/// file offset `at` of the destination).
///
/// With a previous version (`parent`, whose block checksums are `before`)
/// and a small change expected (`!expect_most_changed`), it checksums
/// first (chunks and blocks, one pass), begins the version over the parent
/// with the blocks that changed and moves only those; an agent without the
/// parent takes every byte. Otherwise it commits the whole version as
/// [`commit_version`] does, checksumming (blocks too) while the bytes move:
/// when most blocks change, checksumming first would only add its time.
///
/// With `written` (page tracking, relative to the same parent) only the
/// chunks and blocks with written bytes are checksummed first.
#[allow(clippy::too_many_arguments)]
pub(super) fn commit_incremental<'p>(
    link: &mut AgentLink,
    endpoint: &Endpoint,
    header: VersionHeader,
    labels: &[&[u8]],
    previous: Option<(u64, &[u32])>,
    expect_most_changed: bool,
    written: Option<WrittenSince>,
    pieces_of: impl Fn(u64, u64, u64) -> Vec<Piece<'p>>,
) -> Result<IncrementalCommit> {
    let total: u64 = header.layout.iter().map(|l| l.len).sum();
    let fraction = |blocks: &[u32]| match previous.and_then(|(_, before)| changed_runs(before, blocks)) {
        Some(runs) if !blocks.is_empty() => runs.iter().map(|r| r.count).sum::<u64>() as f64 / blocks.len() as f64,
        Some(_) => 0.0,
        None => 1.0,
    };
    let push = header.push;
    if previous.is_none() || expect_most_changed {
        let pieces = pieces_of(0, total, 0);
        let (moved, chunks, blocks) =
            commit_whole(
                link,
                endpoint,
                header,
                labels,
                |mover| {
                    if pieces.is_empty() {
                        Ok(0)
                    } else {
                        mover.send(&pieces)
                    }
                },
            )?;
        let changed = fraction(&blocks);
        return Ok(IncrementalCommit { moved, blocks, chunks, changed, checksummed: total, tracked: false });
    }
    link.expect_bytes(total);
    let started = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    let partial = written.as_ref().zip(previous).filter(|(w, (parent, _))| w.since == *parent).and_then(
        |(written, (_, before))| {
            icheck_core::delta::checksums_where_written(labels, &written.ranges, &written.chunks, before, threads)
        },
    );
    let tracked = partial.is_some();
    let ((crcs, blocks), checksummed) = partial.unwrap_or_else(|| (icheck_core::delta::checksums(labels), total));
    let changed = fraction(&blocks);
    let checksummed_at = started.elapsed();
    let runs = previous.and_then(|(parent, before)| Some((parent, changed_runs(before, &blocks)?)));
    let (target, runs) = match runs {
        Some((parent, runs)) => match link.begin_delta(&header, parent, runs.clone())? {
            (target, true) => (target, Some(runs)),
            (target, false) => (target, None),
        },
        None => (link.begin(header.version, header.shape, header.layout, push)?, None),
    };
    let pieces = match &runs {
        // Changed blocks, packed back to back in run order.
        Some(runs) => {
            let mut packed = 0u64;
            let mut pieces = Vec::new();
            for run in runs {
                let start = run.first * BLOCK_SIZE;
                let end = ((run.first + run.count) * BLOCK_SIZE).min(total);
                pieces.extend(pieces_of(start, end, packed));
                packed += end - start;
            }
            pieces
        }
        None => pieces_of(0, total, 0),
    };
    let begun_at = started.elapsed();
    let moved = if pieces.is_empty() { 0 } else { Mover { link: &mut *link, endpoint, target }.send(&pieces)? };
    let moved_at = started.elapsed();
    link.seal(crcs.clone())?;
    tracing::debug!(
        checksum_ms = checksummed_at.as_secs_f64() * 1e3,
        begin_ms = (begun_at - checksummed_at).as_secs_f64() * 1e3,
        move_ms = (moved_at - begun_at).as_secs_f64() * 1e3,
        seal_ms = (started.elapsed() - moved_at).as_secs_f64() * 1e3,
        pieces = pieces.len(),
        "incremental commit phases"
    );
    Ok(IncrementalCommit { moved, blocks, chunks: crcs, changed, checksummed, tracked })
}

/// Commits a version whose bytes are one registered buffer (the async
/// staging buffer, the SHMR node segment) as one piece, checksummed label
/// by label of the header's layout. `registered` is `None` only when there
/// are no bytes.
pub(super) fn commit_buffer(
    link: &mut AgentLink,
    endpoint: &Endpoint,
    header: VersionHeader,
    registered: Option<(LocalSource<'_>, RemoteRegion)>,
    bytes: &[u8],
) -> Result<u64> {
    let slices: Vec<&[u8]> =
        header.layout.iter().map(|l| &bytes[l.offset as usize..(l.offset + l.len) as usize]).collect();
    commit_version(link, endpoint, header, &slices, |mover| {
        if bytes.is_empty() {
            return Ok(0);
        }
        let (source, remote) = registered.ok_or(Error::Order("the bytes to send are not registered"))?;
        mover.send(&[Piece { source, remote, local_offset: 0, file_offset: 0, len: bytes.len() }])
    })
}
