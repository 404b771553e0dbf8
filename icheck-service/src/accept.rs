//! One accept loop for the daemons' listeners (the primary controller's,
//! a standby's, `/metrics`): a bounded number of connections served at
//! once, and no spin on an accept error.
//!
//! Architecture invariant: [`BoundedListener::accept`] is cancel-safe.
//! A connection it accepted is either returned or closed before it next
//! awaits, so a caller may `select!` it against a shutdown signal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long an accept loop pauses after an accept error (descriptors used
/// up, say) before trying again, rather than spinning a core on it.
const PAUSE_AFTER_ERROR: Duration = Duration::from_millis(50);

/// A listener that hands out at most `limit` connections at a time: a
/// flood of peers that never finish their request holds at most that many
/// descriptors, and connections beyond it are closed at once.
pub(crate) struct BoundedListener {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    /// What the listener serves, for the log ("controller", "metrics", ...).
    what: &'static str,
    /// What a served connection has not sent yet while it holds its place
    /// ("a Hello", "a complete request"), for the log.
    awaiting: &'static str,
    turned_away: u64,
}

impl BoundedListener {
    /// Bounds `listener`, which serves `what`, to `limit` connections
    /// served at once; connections hold their place until they sent
    /// `awaiting` (and, for the controller, for as long as they stay).
    pub(crate) fn new(
        listener: TcpListener,
        limit: usize,
        what: &'static str,
        awaiting: &'static str,
    ) -> BoundedListener {
        BoundedListener { listener, permits: Arc::new(Semaphore::new(limit)), what, awaiting, turned_away: 0 }
    }

    /// The next connection and its place among the `limit`, which it
    /// holds until the permit drops. Accept errors are logged and waited
    /// out; connections beyond the limit are closed (logged at powers of
    /// two, so a flood cannot fill the log).
    pub(crate) async fn accept(&mut self) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    tracing::warn!(what = self.what, %err, "accept failed");
                    tokio::time::sleep(PAUSE_AFTER_ERROR).await;
                    continue;
                }
            };
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => return (stream, peer, permit),
                Err(_) => {
                    self.turned_away += 1;
                    if self.turned_away.is_power_of_two() {
                        tracing::warn!(
                            what = self.what,
                            turned_away = self.turned_away,
                            %peer,
                            "too many connections without {}; closing new ones at once",
                            self.awaiting
                        );
                    }
                }
            }
        }
    }
}
