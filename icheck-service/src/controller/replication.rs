//! The I/O of the standby controller (the sans-IO rules are in
//! `replica.rs`): the standby phase (`follow`: attach to the primary,
//! sync every journaled event, take over when the primary falls silent),
//! the primary's stream to its standby (`replica_stream`), and the
//! primary's probes of its partner (`watch_partners`).
//!
//! Architecture invariant: a standby acknowledges an event only after it
//! is synced to its own journal, and it never takes over before it holds
//! a copy of the journal.

use super::*;

/// The standby phase: follows the primary's journal (the first other
/// controller that answers as the primary at an epoch no older than the
/// one this journal has seen) and returns once it took over: the primary
/// was silent for the whole takeover window and could not be reached
/// again. Until it holds a copy of the journal, it never takes over.
pub(super) async fn follow(
    config: &StaticConfig,
    tokens: &DaemonTokens,
    me: &str,
    controllers: &[String],
    dir: &std::path::Path,
) -> Result<(), ServiceError> {
    let window = config.takeover_after();
    let listener = TcpListener::bind(me)
        .await
        .map_err(|error| ServiceError::Io { what: format!("cannot listen on {me}"), error })?;
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(answer_as_standby(listener, tokens.clone(), synced.clone()));
    let mut epoch = Journal::peek(dir).epoch;
    tracing::info!(%me, epoch, ?window, "standby: following the primary");
    let mut mirror: Option<Journal> = None;
    let mut last_heard = Instant::now();
    loop {
        for peer in controllers.iter().filter(|c| c.as_str() != me) {
            let mut follower = Follower { dir, epoch, window, mirror: &mut mirror, last_heard: &mut last_heard };
            let result = follower.follow(peer, &tokens.node, &synced).await;
            epoch = follower.epoch;
            match result {
                Ok(()) => tracing::warn!(primary = %peer, "the primary ended the journal stream"),
                Err(reason) => tracing::debug!(primary = %peer, %reason, "not following"),
            }
        }
        let synced_now = synced.load(std::sync::atomic::Ordering::SeqCst);
        if replica::takeover_due(synced_now, last_heard, Instant::now(), window) {
            let journal = mirror.as_mut().expect("synced: the mirror exists");
            let state = journal.state();
            let took_over = Event::Epoch {
                epoch: state.epoch.max(epoch) + 1,
                took_over_unix_ms: Some(unix_ms()),
                takeovers: state.takeovers + 1,
            };
            journal.append(&took_over).map_err(|err| ServiceError::Remote(err.to_string()))?;
            tracing::warn!(
                silent = ?last_heard.elapsed(),
                ?took_over,
                "the primary is silent and unreachable: taking over"
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Answers every Hello while this controller is a standby: not the
/// primary, and whether it holds the journal.
pub(super) async fn answer_as_standby(
    listener: TcpListener,
    tokens: DaemonTokens,
    synced: Arc<std::sync::atomic::AtomicBool>,
) {
    // As the primary's accept loop: a bounded number of waiting peers.
    let mut listener =
        crate::accept::BoundedListener::new(listener, MAX_UNAUTHENTICATED, "standby controller", "a Hello");
    loop {
        let (mut stream, _, permit) = listener.accept().await;
        let (tokens, synced) = (tokens.clone(), synced.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(hello) = framing::recv_hello(&mut stream, HELLO_TIMEOUT).await else { return };
            let reply = match protocol::admit_hello(&hello, &accepted_tokens(&tokens)) {
                Err(reason) => HelloReply::Refused(reason),
                Ok(_) => HelloReply::Standby { synced: synced.load(std::sync::atomic::Ordering::SeqCst) },
            };
            let _ = framing::send(&mut stream, &reply).await;
        });
    }
}

/// One attachment of a standby to a primary.
pub(super) struct Follower<'a> {
    dir: &'a std::path::Path,
    /// The highest epoch seen.
    epoch: u64,
    window: Duration,
    mirror: &'a mut Option<Journal>,
    last_heard: &'a mut Instant,
}

impl Follower<'_> {
    /// Attaches to `peer` and follows its journal until the stream ends or
    /// is silent for the takeover window.
    async fn follow(&mut self, peer: &str, token: &str, synced: &std::sync::atomic::AtomicBool) -> Result<(), String> {
        let limit = self.window / 4;
        let attach = async {
            let mut stream = TcpStream::connect(peer).await.map_err(|e| e.to_string())?;
            stream.set_nodelay(true).ok();
            framing::send(&mut stream, &Hello::with_epoch(token, Role::Standby, self.epoch))
                .await
                .map_err(|e| e.to_string())?;
            let reply = framing::recv::<_, HelloReply>(&mut stream).await.map_err(|e| e.to_string())?;
            protocol::accept_controller(peer, reply, self.epoch).map_err(|e| e.to_string()).map(|e| (stream, e))
        };
        let (mut stream, epoch) = tokio::time::timeout(limit, attach).await.map_err(|_| "no answer".to_string())??;
        self.epoch = epoch;
        let silent = |what: &str| format!("{what} for {:?}", self.window);
        let mut events = Vec::new();
        let seq = loop {
            match tokio::time::timeout(self.window, framing::recv::<_, ToStandby>(&mut stream)).await {
                Err(_) => return Err(silent("no snapshot")),
                Ok(Err(err)) => return Err(err.to_string()),
                Ok(Ok(ToStandby::Snapshot { events: part, done, seq, .. })) => {
                    events.extend(part);
                    if done {
                        break seq;
                    }
                }
                Ok(Ok(other)) => return Err(format!("expected the journal snapshot, got {other:?}")),
            }
        };
        let journal = Journal::mirror(self.dir, &events).map_err(|e| e.to_string())?;
        *self.mirror = Some(journal);
        synced.store(true, std::sync::atomic::Ordering::SeqCst);
        *self.last_heard = Instant::now();
        tracing::info!(primary = %peer, epoch, events = events.len(), "standby synced with the primary's journal");
        let (mut synced_seq, mut beat) = (seq, 0);
        loop {
            let message = match tokio::time::timeout(self.window, framing::recv::<_, ToStandby>(&mut stream)).await {
                Err(_) => return Err(silent("the primary said nothing")),
                Ok(Err(ProtocolError::Closed)) => return Ok(()),
                Ok(Err(err)) => return Err(err.to_string()),
                Ok(Ok(message)) => message,
            };
            *self.last_heard = Instant::now();
            match message {
                ToStandby::Append { seq, event } => {
                    let journal = self.mirror.as_mut().expect("set above");
                    journal.append(&event).map_err(|e| format!("cannot keep the journal copy: {e}"))?;
                    self.epoch = self.epoch.max(journal.state().epoch);
                    synced_seq = seq;
                }
                ToStandby::Beat { id } => beat = id,
                ToStandby::Snapshot { .. } => return Err("a second snapshot on one stream".into()),
            }
            let ack = ToPrimary::Ack { seq: synced_seq, beat };
            framing::send(&mut stream, &ack).await.map_err(|e| e.to_string())?;
        }
    }
}

/// A standby attached (`Standby` Hello): it gets the journal's state, then
/// every appended event and a heartbeat every eighth of the takeover
/// window; its acknowledgements renew this primary's lease.
pub(super) async fn replica_stream(
    shared: Arc<Shared>,
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
) -> Result<(), ProtocolError> {
    let refused = {
        let state = shared.state();
        if state.journal.is_none() {
            Some("this controller keeps no journal (no --state-dir or ControllerStateDir) to follow".to_string())
        } else {
            state.lease.attached().map(|other| format!("standby {other} already follows this controller"))
        }
    };
    if let Some(reason) = refused {
        framing::send(&mut stream, &not_primary(&shared, reason)).await?;
        return Ok(());
    }
    let epoch = shared.state().epoch;
    framing::send(&mut stream, &HelloReply::Primary { epoch }).await?;
    // At most two controllers: the standby is the other one.
    let peer_name = match shared.controllers.iter().find(|c| **c != shared.me) {
        Some(standby) => format!("{standby} (from {peer})"),
        None => peer.to_string(),
    };
    // The snapshot and the channel are taken under one lock: every event
    // is in the snapshot or in the channel, never in both or neither.
    let (tx, mut rx) = mpsc::unbounded_channel();
    let (events, seq) = {
        let mut state = shared.state();
        let events = state.journal.as_ref().map(|j| j.state().snapshot()).unwrap_or_default();
        state.standby = Some(tx);
        state.lease.attach(&peer_name);
        (events, state.lease.seq())
    };
    tracing::info!(standby = %peer, events = events.len(), "standby attached; sending the journal");
    let (mut reader, mut writer) = stream.into_split();
    let result = async {
        let chunks: Vec<&[Event]> = events.chunks(replica::SNAPSHOT_CHUNK).collect();
        let last = chunks.len().saturating_sub(1);
        if chunks.is_empty() {
            framing::send(&mut writer, &ToStandby::Snapshot { epoch, events: Vec::new(), done: true, seq }).await?;
        }
        for (index, chunk) in chunks.into_iter().enumerate() {
            let part = ToStandby::Snapshot { epoch, events: chunk.to_vec(), done: index == last, seq };
            framing::send(&mut writer, &part).await?;
        }
        // Acknowledgements arrive on their own task: a frame read is not
        // cancel-safe, so it never races the sends below in a select.
        let (ack_tx, mut acks) = mpsc::unbounded_channel();
        let ack_reader = tokio::spawn(async move {
            loop {
                let ack: Result<ToPrimary, ProtocolError> = framing::recv(&mut reader).await;
                let failed = ack.is_err();
                if ack_tx.send(ack).is_err() || failed {
                    break;
                }
            }
        });
        let mut beat = tokio::time::interval(shared.window / 8);
        let outcome = loop {
            tokio::select! {
                event = rx.recv() => match event {
                    Some(event) => framing::send(&mut writer, &event).await?,
                    None => break Ok(()),
                },
                _ = beat.tick() => {
                    let id = shared.state().lease.beat_sent(Instant::now());
                    framing::send(&mut writer, &ToStandby::Beat { id }).await?;
                }
                ack = acks.recv() => match ack {
                    Some(Ok(ToPrimary::Ack { seq, beat })) => {
                        shared.state().lease.acked(seq, beat);
                        shared.acked.notify_waiters();
                    }
                    Some(Err(err)) => break Err(err),
                    None => break Err(ProtocolError::Closed),
                },
            }
        };
        ack_reader.abort();
        outcome
    }
    .await;
    {
        let mut state = shared.state();
        state.standby = None;
        state.lease.detach();
    }
    shared.acked.notify_waiters();
    tracing::warn!(standby = %peer, ?result, "standby detached");
    result
}

/// Answers a probe of a partner controller, and what this primary makes of it.
pub(super) enum PartnerSays {
    /// Nothing listens there, or it holds no copy of the journal: it
    /// cannot take over.
    Inert,
    /// A standby with the journal: it will attach.
    Following,
    /// A primary at this epoch.
    Primary(u64),
    /// A primary not acting (it cannot confirm its lease), at this epoch
    /// and journal sequence: it cannot take over (only a synced standby can).
    NotActing(u64, u64),
    /// No answer in time (stopped, cut off): it may be taking over.
    Silent,
}

/// Asks the controller at `peer` what it is (a client Hello, then closed).
pub(super) async fn probe_partner(peer: &str, token: &str, epoch: u64, limit: Duration) -> PartnerSays {
    let attempt = async {
        let mut stream = TcpStream::connect(peer).await?;
        framing::send(&mut stream, &Hello::with_epoch(token, Role::Client, epoch))
            .await
            .map_err(std::io::Error::other)?;
        framing::recv::<_, HelloReply>(&mut stream).await.map_err(std::io::Error::other)
    };
    match tokio::time::timeout(limit, attempt).await {
        Err(_) => PartnerSays::Silent,
        Ok(Err(err)) if err.kind() == std::io::ErrorKind::ConnectionRefused => PartnerSays::Inert,
        Ok(Err(_)) => PartnerSays::Silent,
        Ok(Ok(HelloReply::Standby { synced: false })) => PartnerSays::Inert,
        Ok(Ok(HelloReply::Standby { synced: true })) => PartnerSays::Following,
        Ok(Ok(HelloReply::Primary { epoch })) => PartnerSays::Primary(epoch),
        Ok(Ok(HelloReply::NotPrimary { epoch, sequence, .. })) => PartnerSays::NotActing(epoch, sequence),
        Ok(Ok(_)) => PartnerSays::Silent,
    }
}

/// While no standby is attached, asks the other controllers every quarter
/// of the takeover window what they are. One that cannot take over (not
/// running, without the journal, or a primary that cannot act either) lets
/// this primary act alone. This one steps down for a primary acting at
/// its epoch or a higher one, and for one that cannot act either but is
/// at a higher epoch, or at the same epoch with a longer journal (or as
/// long and listed first): of two controllers at one epoch, the one that
/// recorded more holds the newer state.
pub(super) async fn watch_partners(shared: Arc<Shared>) {
    let index = |peer: &str| shared.controllers.iter().position(|c| c == peer).unwrap_or(usize::MAX);
    let mine = index(&shared.me);
    loop {
        if shared.state().lease.attached().is_none() {
            // Two statements: the state lock is not reentrant.
            let epoch = shared.state().epoch;
            let sequence = sequence(&shared);
            let mut inert = true;
            for peer in shared.controllers.iter().filter(|c| **c != shared.me) {
                match probe_partner(peer, &shared.tokens.node, epoch, shared.window / 4).await {
                    PartnerSays::Inert => {}
                    PartnerSays::Primary(theirs) if theirs >= epoch => {
                        shared.step_down(&format!("{peer} is the primary at epoch {theirs} (this one has {epoch})"));
                        return;
                    }
                    PartnerSays::NotActing(theirs, longer)
                        if (theirs, longer, std::cmp::Reverse(index(peer)))
                            > (epoch, sequence, std::cmp::Reverse(mine)) =>
                    {
                        shared.step_down(&format!(
                            "{peer} cannot act as the primary either, but it is at epoch {theirs} with {longer} \
                             journaled events (this one: epoch {epoch}, {sequence} events)"
                        ));
                        return;
                    }
                    PartnerSays::NotActing(..) => {}
                    _ => inert = false,
                }
            }
            if inert {
                shared.state().lease.partner_inert(Instant::now());
            }
        }
        tokio::time::sleep(shared.window / 4).await;
    }
}
