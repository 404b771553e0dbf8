//! The client side of the control plane, used by applications and by the
//! `icheck` command.

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
