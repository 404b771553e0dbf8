//! Control-plane frames on tokio streams, for the controller's and the
//! manager's connections. The bytes are [`protocol::encode_frame`]'s and the
//! prefix check is [`protocol::frame_len`], the ones the blocking side uses.
//!
//! Not tokio-util's `LengthDelimitedCodec`: the frame format belongs to
//! the sans-IO protocol in icheck-core, which the blocking client (no
//! tokio) shares, and each limit depends on the message expected
//! ([`recv_limited`]). Its advantage, cancel-safe reads, is not needed:
//! every `select!` that reads a frame here ends the session when another
//! branch wins, so a half-read frame is never resumed.

#![forbid(unsafe_code)]
#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use std::time::Duration;

use icheck_core::protocol::{self, ProtocolError, MAX_FRAME};
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Writes one message as a frame.
pub async fn send<W: AsyncWriteExt + Unpin, T: Serialize>(writer: &mut W, message: &T) -> Result<(), ProtocolError> {
    writer.write_all(&protocol::encode_frame(message)?).await?;
    writer.flush().await?;
    Ok(())
}

/// Reads one frame and decodes it.
pub async fn recv<R: AsyncReadExt + Unpin, T: DeserializeOwned>(reader: &mut R) -> Result<T, ProtocolError> {
    recv_limited(reader, MAX_FRAME).await
}

/// Reads one frame of at most `limit` bytes (the bound of the message
/// type expected: [`protocol::MAX_HELLO`], [`protocol::MAX_CLIENT_REQUEST`])
/// and decodes it; a longer one is refused before anything is allocated.
pub async fn recv_limited<R: AsyncReadExt + Unpin, T: DeserializeOwned>(
    reader: &mut R,
    limit: usize,
) -> Result<T, ProtocolError> {
    let mut prefix = [0u8; 4];
    match reader.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ProtocolError::Closed),
        Err(err) => return Err(err.into()),
    }
    let mut payload = vec![0u8; protocol::frame_len(prefix, limit)?];
    reader.read_exact(&mut payload).await?;
    protocol::decode(&payload)
}

/// [`recv`] with a deadline.
pub async fn recv_timeout<R: AsyncReadExt + Unpin, T: DeserializeOwned>(
    reader: &mut R,
    timeout: Duration,
) -> Result<T, ProtocolError> {
    tokio::time::timeout(timeout, recv(reader)).await.map_err(|_| ProtocolError::Timeout(timeout))?
}

/// A Hello, within `timeout` and [`protocol::MAX_HELLO`] bytes: what every
/// listening port reads first from a peer it knows nothing about.
pub async fn recv_hello<R: AsyncReadExt + Unpin>(
    reader: &mut R,
    timeout: Duration,
) -> Result<protocol::Hello, ProtocolError> {
    let hello = recv_limited(reader, protocol::MAX_HELLO);
    tokio::time::timeout(timeout, hello).await.map_err(|_| ProtocolError::Timeout(timeout))?
}
