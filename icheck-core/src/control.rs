//! The blocking client side of the control plane: applications (through the
//! client library) and the `icheck` command talk to the controller and to
//! agents' command channels with it. No async runtime is involved.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::time::Duration;

use crate::config::StaticConfig;
use crate::protocol::{self, ClientReply, ClientRequest, Hello, HelloReply, ProtocolError, Role};

/// Errors of talking to the service (and of the service processes, which
/// re-export this type).
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Control-plane problem.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// Fabric problem.
    #[error(transparent)]
    Fabric(#[from] crate::fabric::FabricError),
    /// Socket or file problem, with what was being done.
    #[error("{what}: {error}")]
    Io {
        /// What failed.
        what: String,
        /// The error.
        error: std::io::Error,
    },
    /// The controller answered with an error.
    #[error("controller: {0}")]
    Remote(String),
}

/// Runs one request on a fresh connection to the primary controller
/// (for commands and tests) with the operator's token (the admin token
/// where one is configured): the configured controllers are tried in
/// order (see [`ControllerLink`]).
pub fn request_blocking(config: &StaticConfig, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
    let timeout = protocol::REQUEST_TIMEOUT;
    ControllerLink::new(config, &config.operator_token(), timeout, timeout).request(request)
}

/// Pause between passes over the controller list while none is primary.
const FAILOVER_PAUSE: Duration = Duration::from_millis(100);
/// The least a request that starts no agents waits for its answer when a
/// standby could take over.
const QUICK_ANSWER: Duration = Duration::from_secs(5);

/// The client side of the controllers: the configured list, tried in
/// order; the highest fencing epoch seen; one open connection to the
/// primary. A request that finds its controller gone, stopped, not the
/// primary or stale is sent again to the next one that is, for the
/// failover window (twice the takeover window, plus five seconds); with a
/// single controller it fails at once, as before.
///
/// Sending a request again is safe: the controller does nothing for a
/// request it answers `NotPrimary` to, and recording a version it already
/// recorded is answered `Ok`.
pub struct ControllerLink {
    endpoints: Vec<String>,
    token: String,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// `TakeoverAfter` with a standby configured; zero with one controller.
    takeover: Duration,
    epoch: u64,
    current: Option<BlockingConnection>,
    /// Where the next pass over the list starts: after a controller that
    /// failed a request, the others are tried first.
    start_at: usize,
}

/// Whether every controller of a pass refused the connection.
struct AllRefused(bool);

impl ControllerLink {
    /// A link to the controllers of `config` (no connection yet). Every
    /// connection attempt is bounded by `connect_timeout`, every answer by
    /// `request_timeout`.
    pub fn new(
        config: &StaticConfig,
        token: &str,
        connect_timeout: Duration,
        request_timeout: Duration,
    ) -> ControllerLink {
        let endpoints = config.controller_endpoints();
        let takeover = if endpoints.len() > 1 { config.takeover_after() } else { Duration::ZERO };
        ControllerLink {
            endpoints,
            token: token.to_string(),
            connect_timeout,
            request_timeout,
            takeover,
            epoch: 0,
            current: None,
            start_at: 0,
        }
    }

    /// Connects to the primary if no connection is open. While every
    /// controller refuses the connection (nothing listens: it is starting,
    /// restarting, or not there), passes over the list are repeated with a
    /// growing, jittered pause until `connect_timeout`; anything else ends
    /// the attempt at once. The error names every controller and why it
    /// was not used, and says what to check when nothing listens.
    pub fn connect(&mut self) -> Result<(), ServiceError> {
        let deadline = std::time::Instant::now() + self.connect_timeout;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.connect_once() {
                Err((ServiceError::Io { what, error }, AllRefused(true))) => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        let what = format!(
                            "{what} (nothing listens there: is the service up? `icheck up` starts a local one, and \
                             ICHECK_CONFIG or client.config names the configuration of a running one)"
                        );
                        return Err(ServiceError::Io { what, error });
                    }
                    // Up to 50 % jitter, so that the ranks of a job do not
                    // knock together when the controller comes back.
                    let mut byte = [0u8];
                    let jitter = getrandom::fill(&mut byte).map_or(0, |()| u64::from(byte[0]));
                    let jittered = pause + pause.mul_f64(jitter as f64 / 510.0);
                    std::thread::sleep(jittered.min(left));
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                other => return other.map_err(|(err, _)| err),
            }
        }
    }

    /// One pass over the list of controllers. A failure says whether every
    /// controller refused the connection (nothing listened): worth trying
    /// again within `connect_timeout`.
    fn connect_once(&mut self) -> Result<(), (ServiceError, AllRefused)> {
        if let Some(current) = &self.current {
            if !current.is_stale() {
                return Ok(());
            }
            // Idle past the controller's `ClientIdleTimeout` (or the
            // controller restarted): nothing was asked on it, so a new
            // connection loses nothing.
            tracing::debug!(controller = %current.peer(), "the controller closed the idle connection; connecting again");
            self.current = None;
        }
        let mut why = Vec::new();
        let mut last = None;
        let count = self.endpoints.len();
        let mut all_refused = true;
        for peer in (0..count).map(|i| &self.endpoints[(self.start_at + i) % count]) {
            match BlockingConnection::connect_controller(peer, &self.token, self.connect_timeout, self.epoch) {
                Ok((mut connection, epoch)) => {
                    connection.set_timeout(self.request_timeout);
                    self.epoch = epoch;
                    self.current = Some(connection);
                    return Ok(());
                }
                Err(err) => {
                    let refused = matches!(&err, ServiceError::Io { error, .. }
                        if error.kind() == std::io::ErrorKind::ConnectionRefused);
                    all_refused &= refused;
                    why.push(format!("{peer}: {err}"));
                    last = Some(err);
                }
            }
        }
        let err = match (last, self.endpoints.len()) {
            // One controller: its own error, as it always was.
            (Some(ServiceError::Io { error, .. }), 1) => {
                ServiceError::Io { what: format!("cannot connect to the controller at {}", self.endpoints[0]), error }
            }
            (Some(err), 1) => err,
            (last, _) => {
                let reason = format!("no primary controller answered ({})", why.join("; "));
                match last {
                    Some(ServiceError::Io { error, .. }) => ServiceError::Io { what: reason, error },
                    _ => ServiceError::Protocol(ProtocolError::NotPrimary { peer: self.endpoints.join(", "), reason }),
                }
            }
        };
        Err((err, AllRefused(all_refused)))
    }

    /// Sends `request` to the primary and returns its answer; an error
    /// answer becomes [`ServiceError::Remote`].
    ///
    /// With a standby, requests that start no agents (recording a version,
    /// finishing, status) wait at most the failover window for one answer:
    /// a primary that is stopped or cut off must not hold the application
    /// for the whole request timeout when another has taken over.
    pub fn request(&mut self, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
        let starts_agents = matches!(
            request,
            ClientRequest::RegisterApp { .. } | ClientRequest::Probe { .. } | ClientRequest::DeleteApp { .. }
        );
        let standby = !self.takeover.is_zero();
        let answer_within = match (starts_agents, standby) {
            // Twice the lease-bounded wait for the standby, and then some.
            (false, true) => self.request_timeout.min((self.takeover * 2).max(QUICK_ANSWER)),
            _ => self.request_timeout,
        };
        // One controller: one attempt, as before standbys existed. With a
        // standby: the failover window (twice the takeover window, plus 5 s).
        let deadline = if standby {
            std::time::Instant::now() + self.takeover * 2 + Duration::from_secs(5) + answer_within
        } else {
            std::time::Instant::now()
        };
        loop {
            let error = match self.connect() {
                Err(err) => err,
                Ok(()) => {
                    let connection = self.current.as_mut().expect("connected above");
                    connection.set_timeout(answer_within);
                    match connection.call(request) {
                        Ok(ClientReply::Error(message)) => return Err(ServiceError::Remote(message)),
                        Ok(ClientReply::NotPrimary(reason)) => {
                            ServiceError::Protocol(ProtocolError::NotPrimary { peer: connection.peer.clone(), reason })
                        }
                        Ok(reply) => return Ok(reply),
                        Err(err) => err,
                    }
                }
            };
            // The controller is gone, stopped, replaced or cut off: the
            // next pass looks for the primary again, starting after it.
            if let Some(failed) = self.current.take() {
                let index = self.endpoints.iter().position(|e| e == failed.peer()).unwrap_or(0);
                self.start_at = (index + 1) % self.endpoints.len();
            }
            if std::time::Instant::now() >= deadline {
                return Err(error);
            }
            std::thread::sleep(FAILOVER_PAUSE);
        }
    }
}

/// A blocking control-plane connection (to the controller or to an agent's
/// command channel), for processes without an async runtime: the client
/// library and its C ABI.
pub struct BlockingConnection {
    stream: std::net::TcpStream,
    peer: String,
    timeout: Duration,
}

impl BlockingConnection {
    /// Connects to `peer` ("host:port") and completes the handshake; every
    /// step is bounded by `timeout`. Later requests wait up to `timeout` for
    /// their reply (change it with [`set_timeout`](Self::set_timeout)).
    pub fn connect(peer: &str, token: &str, timeout: Duration) -> Result<BlockingConnection, ServiceError> {
        let mut connection = Self::open(peer, timeout)?;
        let reply: HelloReply = connection.call(&Hello::new(token, Role::Client))?;
        match reply {
            HelloReply::Welcome => Ok(connection),
            HelloReply::Refused(reason) => Err(ProtocolError::Refused { peer: connection.peer, reason }.into()),
            other => Err(ProtocolError::Unexpected { peer: connection.peer, what: format!("{other:?}") }.into()),
        }
    }

    /// Connects to the controller at `peer` as a client that has seen
    /// controller epoch `seen`; succeeds only if it is the primary at that
    /// epoch or a higher one, which it returns.
    pub fn connect_controller(
        peer: &str,
        token: &str,
        timeout: Duration,
        seen: u64,
    ) -> Result<(BlockingConnection, u64), ServiceError> {
        let mut connection = Self::open(peer, timeout)?;
        let reply: HelloReply = connection.call(&Hello::with_epoch(token, Role::Client, seen))?;
        let epoch = protocol::accept_controller(peer, reply, seen)?;
        Ok((connection, epoch))
    }

    /// The TCP connection, before any handshake.
    fn open(peer: &str, timeout: Duration) -> Result<BlockingConnection, ServiceError> {
        use std::net::ToSocketAddrs;
        let io = |error| ServiceError::Io { what: format!("cannot connect to {peer}"), error };
        let addresses: Vec<_> = peer.to_socket_addrs().map_err(io)?.collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        let stream = addresses
            .iter()
            .find_map(|addr| std::net::TcpStream::connect_timeout(addr, timeout).map_err(|e| last = e).ok())
            .ok_or_else(|| io(last))?;
        stream.set_nodelay(true).ok();
        let mut connection = BlockingConnection { stream, peer: peer.to_string(), timeout };
        connection.set_timeout(timeout);
        Ok(connection)
    }

    /// Sets how long requests wait for their reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        let _ = self.stream.set_read_timeout(Some(timeout));
        let _ = self.stream.set_write_timeout(Some(timeout));
    }

    /// How long requests wait for their reply.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Waits up to `within` for the peer to send something (or close the
    /// connection), consuming nothing: whether it did. Lets a caller wait
    /// for a reply in slices and look elsewhere between them without
    /// cutting a frame in two.
    pub fn wait_readable(&self, within: Duration) -> bool {
        // A zero read timeout is refused by the standard library.
        let _ = self.stream.set_read_timeout(Some(within.max(Duration::from_millis(1))));
        let mut byte = [0u8; 1];
        let readable = match self.stream.peek(&mut byte) {
            Ok(_) => true,
            Err(err) => !matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
            ),
        };
        let _ = self.stream.set_read_timeout(Some(self.timeout));
        readable
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether this connection can no longer carry a request: the peer
    /// closed it (a daemon closes idle client connections after
    /// `ClientIdleTimeout`) or sent something nobody asked for, which
    /// leaves the stream out of step. Looks without waiting or consuming.
    pub fn is_stale(&self) -> bool {
        if self.stream.set_nonblocking(true).is_err() {
            return true;
        }
        let mut byte = [0u8; 1];
        let stale = match self.stream.peek(&mut byte) {
            // End of stream, or an unasked-for byte.
            Ok(_) => true,
            Err(err) => err.kind() != std::io::ErrorKind::WouldBlock,
        };
        stale || self.stream.set_nonblocking(false).is_err()
    }

    /// Sends a request and waits for its reply.
    pub fn call<Q: serde::Serialize, A: serde::de::DeserializeOwned>(
        &mut self,
        request: &Q,
    ) -> Result<A, ServiceError> {
        self.send(request)?;
        self.receive()
    }

    /// Sends a request without waiting: its reply comes from a later
    /// [`receive`](Self::receive), in order. A peer that serves requests
    /// one after another (agents do) starts the next one as soon as it has
    /// answered the one before, so a caller can keep one queued.
    pub fn send<Q: serde::Serialize>(&mut self, request: &Q) -> Result<(), ServiceError> {
        Ok(protocol::send_blocking(&mut self.stream, request)?)
    }

    /// Waits for the reply to the oldest request not answered yet.
    pub fn receive<A: serde::de::DeserializeOwned>(&mut self) -> Result<A, ServiceError> {
        Ok(protocol::recv_blocking(&mut self.stream, self.timeout)?)
    }

    /// Sends a controller request; an error reply becomes [`ServiceError::Remote`].
    pub fn request(&mut self, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
        match self.call(request)? {
            ClientReply::Error(message) => Err(ServiceError::Remote(message)),
            reply => Ok(reply),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Hello, HelloReply};
    use std::net::TcpListener;
    use std::time::Instant;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    fn link(port: u16, connect_timeout: Duration) -> ControllerLink {
        ControllerLink {
            endpoints: vec![format!("127.0.0.1:{port}")],
            token: "token".into(),
            connect_timeout,
            request_timeout: Duration::from_secs(5),
            takeover: Duration::ZERO,
            epoch: 0,
            current: None,
            start_at: 0,
        }
    }

    #[test]
    fn a_controller_that_starts_late_is_reached_within_the_connect_timeout() {
        let port = free_port();
        let controller = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
            let (mut stream, _) = listener.accept().unwrap();
            let _hello: Hello = protocol::recv_blocking(&mut stream, Duration::from_secs(5)).unwrap();
            protocol::send_blocking(&mut stream, &HelloReply::Primary { epoch: 3 }).unwrap();
        });
        let mut link = link(port, Duration::from_secs(5));
        link.connect().expect("connected once the controller listens");
        assert_eq!(link.epoch, 3);
        controller.join().unwrap();
    }

    #[test]
    fn waiting_for_a_reply_in_slices_leaves_its_frame_whole() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (send_now, sent) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            sent.recv().unwrap();
            protocol::send_blocking(&mut stream, &HelloReply::Welcome).unwrap();
        });
        let connection = BlockingConnection::open(&format!("127.0.0.1:{port}"), Duration::from_secs(5)).unwrap();
        let mut connection = connection;
        assert!(!connection.wait_readable(Duration::from_millis(50)), "nothing was sent yet");
        // The slice's own bound is gone again: requests wait their timeout.
        assert_eq!(connection.timeout(), Duration::from_secs(5));
        send_now.send(()).unwrap();
        assert!(connection.wait_readable(Duration::from_secs(5)));
        let reply: HelloReply = connection.receive().expect("the whole frame is still there");
        assert!(matches!(reply, HelloReply::Welcome), "{reply:?}");
        peer.join().unwrap();
        // Closed by the peer: readable (the next receive reports it).
        assert!(connection.wait_readable(Duration::from_secs(5)));
    }

    #[test]
    fn nothing_listening_is_reported_after_the_timeout_with_what_to_check() {
        let port = free_port();
        let started = Instant::now();
        let err = link(port, Duration::from_millis(600)).connect().unwrap_err().to_string();
        assert!(started.elapsed() >= Duration::from_millis(600), "gave up after {:?}", started.elapsed());
        assert!(err.contains(&format!("127.0.0.1:{port}")) && err.contains("icheck up"), "{err}");
    }
}
