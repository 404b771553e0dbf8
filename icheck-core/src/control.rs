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

/// Runs one request on a fresh connection to the controller (for commands
/// and tests).
pub fn request_blocking(config: &StaticConfig, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
    let peer = config.controller_endpoint();
    let mut connection = BlockingConnection::connect(&peer, &config.effective_token(), protocol::REQUEST_TIMEOUT)
        .map_err(|err| match err {
            ServiceError::Io { error, .. } => {
                ServiceError::Io { what: format!("cannot connect to the controller at {peer}"), error }
            }
            other => other,
        })?;
    connection.request(request)
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
        let reply: HelloReply = connection.call(&Hello::new(token, Role::Client))?;
        match reply {
            HelloReply::Welcome => Ok(connection),
            HelloReply::Refused(reason) => Err(ProtocolError::Refused { peer: connection.peer, reason }.into()),
        }
    }

    /// Sets how long requests wait for their reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        let _ = self.stream.set_read_timeout(Some(timeout));
        let _ = self.stream.set_write_timeout(Some(timeout));
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sends a request and waits for its reply.
    pub fn call<Q: serde::Serialize, A: serde::de::DeserializeOwned>(
        &mut self,
        request: &Q,
    ) -> Result<A, ServiceError> {
        protocol::send_blocking(&mut self.stream, request)?;
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
