//! The client side of the control plane, used by applications and by the
//! `icheck` command.

#![forbid(unsafe_code)]

use std::time::Duration;

use tokio::net::TcpStream;

use super::ServiceError;
use crate::config::StaticConfig;
use crate::protocol::{self, ClientReply, ClientRequest, Hello, HelloReply, ProtocolError, Role};

/// A connection to the controller.
pub struct ControllerClient {
    stream: TcpStream,
    peer: String,
    timeout: Duration,
}

impl ControllerClient {
    /// Connects and completes the handshake, within `timeout`.
    pub async fn connect(config: &StaticConfig, timeout: Duration) -> Result<ControllerClient, ServiceError> {
        let peer = config.controller_endpoint();
        let stream = tokio::time::timeout(timeout, TcpStream::connect(&peer))
            .await
            .map_err(|_| ProtocolError::Timeout(timeout))
            .map_err(ServiceError::from)?
            .map_err(|error| ServiceError::Io { what: format!("cannot connect to the controller at {peer}"), error })?;
        stream.set_nodelay(true).ok();
        let mut client = ControllerClient { stream, peer, timeout };
        protocol::send(&mut client.stream, &Hello::new(&config.effective_token(), Role::Client)).await?;
        match protocol::recv_timeout::<_, HelloReply>(&mut client.stream, timeout).await? {
            HelloReply::Welcome => Ok(client),
            HelloReply::Refused(reason) => Err(ProtocolError::Refused { peer: client.peer, reason }.into()),
        }
    }

    /// Sends a request and waits for its reply.
    pub async fn request(&mut self, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
        protocol::send(&mut self.stream, request).await?;
        let reply = protocol::recv_timeout(&mut self.stream, self.timeout).await?;
        if let ClientReply::Error(message) = reply {
            return Err(ServiceError::Remote(message));
        }
        Ok(reply)
    }
}

/// Runs one request on a fresh connection, blocking (for commands and tests).
pub fn request_blocking(config: &StaticConfig, request: &ClientRequest) -> Result<ClientReply, ServiceError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| ServiceError::Io { what: "cannot start a tokio runtime".into(), error })?;
    runtime.block_on(async {
        let mut client = ControllerClient::connect(config, protocol::REQUEST_TIMEOUT).await?;
        client.request(request).await
    })
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
