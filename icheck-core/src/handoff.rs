//! Same-host restarts: the agent hands a restarting rank on its own host a
//! read-only descriptor of the version's file, and the rank `pread`s it
//! instead of moving the bytes over the fabric.
//!
//! Why: on one host, every fabric provider is a memory copy wrapped in a
//! protocol. Over shm the reader's progress thread copies with
//! `process_vm_readv` while the agent's spins to take its notices; over
//! tcp the bytes cross the loopback twice. A `pread` from the agent's
//! tmpfs file is one kernel copy on the rank's own thread, and the rank
//! checks each chunk while it is still in the cache. This is what the
//! peers' node-local restarts do, and what issue 24 asks a one-host
//! restart to match.
//!
//! How: each manager binds a [`HandoffServer`] on an abstract Unix socket
//! with a random name. Abstract sockets belong to a network namespace, so
//! only processes of this host *and* namespace can reach it (the test
//! suite's network-namespace nodes count as other hosts, as they should).
//! A Fetch that says its rank runs on the agent's host ([`HostId`]) is
//! answered with a [`Handoff`]: the socket's name and a one-time random
//! [`Ticket`]. The rank connects, writes the ticket, and receives the
//! descriptor (`SCM_RIGHTS`) with one `Y` byte, or one `N` byte and
//! nothing else. A rank that cannot take it fetches again over the fabric.
//!
//! Architecture invariant: the socket authenticates nothing but the
//! ticket. A ticket is 128 random bits, travels only on the agent session
//! (which the rank opened with its application's capability), opens one
//! file once, read-only, and expires: when taken, when its guard drops (a
//! new Fetch, `FetchDone`, the session's end), or after
//! [`TICKET_LIFETIME`]. Whatever a connection sends, the server answers it
//! within [`READ_TIMEOUT`] and goes on serving.

#![deny(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_possible_wrap)]

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an offered file waits for its rank.
pub const TICKET_LIFETIME: Duration = Duration::from_secs(60);

/// How long the server waits for a connection's ticket.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a rank waits for the server's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections answered at once; more are closed unanswered (their ranks
/// fetch over the fabric instead).
const MAX_CONNECTIONS: usize = 32;

/// Which host and network namespace a process runs in: two processes with
/// equal ids can reach each other's abstract Unix sockets and read the
/// same tmpfs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostId {
    /// The kernel's random id of this boot (`/proc/sys/kernel/random/boot_id`).
    pub boot: String,
    /// The inode of `/proc/self/ns/net`: the network namespace.
    pub net_namespace: u64,
}

impl HostId {
    /// This process's host, or `None` where `/proc` does not tell.
    pub fn current() -> Option<HostId> {
        use std::os::unix::fs::MetadataExt;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?.trim().to_string();
        let net_namespace = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
        (!boot.is_empty()).then_some(HostId { boot, net_namespace })
    }
}

/// A one-time secret that opens one offered file.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Ticket(pub [u8; 16]);

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A secret: never in logs.
        f.write_str("Ticket(..)")
    }
}

/// Where and with what a rank takes the file of the version it fetched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// The abstract socket's name (without the leading NUL).
    pub socket: String,
    /// Opens the file once.
    pub ticket: Ticket,
}

/// Why a handoff failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The server did not know the ticket (taken, revoked or expired).
    #[error("the agent refused the ticket (already used or expired)")]
    Refused,
    /// The server answered without a descriptor, or with something else.
    #[error("the agent's answer carried no file descriptor")]
    NoDescriptor,
    /// No random bytes for a ticket.
    #[error("no random bytes for a ticket: {0}")]
    Random(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HandoffError {
    let what = what.into();
    move |source| HandoffError::Io { what, source }
}

fn errno(what: &str) -> impl FnOnce(nix::errno::Errno) -> HandoffError + '_ {
    move |errno| HandoffError::Io { what: what.to_string(), source: errno.into() }
}

/// Connects to `handoff.socket`, presents the ticket and returns the file
/// it opens (read-only, close-on-exec).
pub fn take_file(handoff: &Handoff) -> Result<File, HandoffError> {
    let address = SocketAddr::from_abstract_name(handoff.socket.as_bytes())
        .map_err(io(format!("socket name {:?}", handoff.socket)))?;
    let mut stream = UnixStream::connect_addr(&address).map_err(io(format!("connect to @{}", handoff.socket)))?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(io("set a read timeout"))?;
    stream.set_write_timeout(Some(ANSWER_TIMEOUT)).map_err(io("set a write timeout"))?;
    stream.write_all(&handoff.ticket.0).map_err(io(format!("send the ticket to @{}", handoff.socket)))?;
    let mut answer = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut answer)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let message = nix::sys::socket::recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(errno("receive the file"))?;
    let mut received: Vec<OwnedFd> = Vec::new();
    for control in message.cmsgs().map_err(errno("read the answer's control data"))? {
        if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = control {
            // SAFETY: the kernel installed these descriptors in this process
            // for this message; nothing else owns them.
            received.extend(fds.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    let bytes = message.bytes;
    match (bytes, answer[0], received.len()) {
        (1, b'Y', 1) => Ok(File::from(received.pop().expect("one descriptor"))),
        (1, b'N', _) => Err(HandoffError::Refused),
        _ => Err(HandoffError::NoDescriptor),
    }
}

/// Offered files by ticket.
type Offers = Mutex<HashMap<Ticket, (File, Instant)>>;

/// The manager's side: offers files to same-host ranks on one abstract
/// socket, served by one thread.
pub struct HandoffServer {
    name: String,
    host: Option<HostId>,
    offers: Arc<Offers>,
    taken: Arc<std::sync::atomic::AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HandoffServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffServer").field("socket", &self.name).finish_non_exhaustive()
    }
}

/// An offered file: revoked when dropped (taking it first makes that a
/// no-op).
#[derive(Debug)]
pub struct Offered {
    offers: Arc<Offers>,
    ticket: Ticket,
}

impl Drop for Offered {
    fn drop(&mut self) {
        if let Ok(mut offers) = self.offers.lock() {
            offers.remove(&self.ticket);
        }
    }
}

impl HandoffServer {
    /// Binds a socket named `icheck-handoff-<pid>-<random>` and starts
    /// serving it.
    pub fn bind() -> Result<HandoffServer, HandoffError> {
        let mut random = [0u8; 8];
        getrandom::fill(&mut random).map_err(|e| HandoffError::Random(e.to_string()))?;
        let suffix: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("icheck-handoff-{}-{suffix}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io(format!("socket name {name:?}")))?;
        let listener = UnixListener::bind_addr(&address).map_err(io(format!("bind @{name}")))?;
        let offers: Arc<Offers> = Arc::default();
        let taken = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (offers, taken, stop) = (offers.clone(), taken.clone(), stop.clone());
            std::thread::Builder::new()
                .name("icheck-handoff".into())
                .spawn(move || serve(&listener, &offers, &taken, &stop))
                .map_err(io("start the handoff thread"))?
        };
        Ok(HandoffServer { name, host: HostId::current(), offers, taken, stop, thread: Some(thread) })
    }

    /// The host and network namespace the socket serves (`None`: unknown,
    /// and nothing is offered).
    pub fn host(&self) -> Option<&HostId> {
        self.host.as_ref()
    }

    /// Files ranks have taken since the server started.
    pub fn files_taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// The socket's abstract name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Offers `file` under a new ticket until the returned guard drops.
    pub fn offer(&self, file: File) -> Result<(Handoff, Offered), HandoffError> {
        let mut ticket = [0u8; 16];
        getrandom::fill(&mut ticket).map_err(|e| HandoffError::Random(e.to_string()))?;
        let ticket = Ticket(ticket);
        let mut offers = self.offers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        offers.retain(|_, (_, offered)| offered.elapsed() < TICKET_LIFETIME);
        offers.insert(ticket, (file, Instant::now()));
        let handoff = Handoff { socket: self.name.clone(), ticket };
        Ok((handoff, Offered { offers: self.offers.clone(), ticket }))
    }

    /// Files offered and not yet taken or revoked.
    pub fn outstanding(&self) -> usize {
        self.offers.lock().map_or(0, |offers| offers.len())
    }
}

impl Drop for HandoffServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the blocking accept; it then sees `stop`.
        if let Ok(address) = SocketAddr::from_abstract_name(self.name.as_bytes()) {
            let _ = UnixStream::connect_addr(&address);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts connections and answers each on its own short-lived thread (a
/// connection that sends nothing holds up no other): each sends 16 bytes
/// within [`READ_TIMEOUT`] and gets its answer (see the module doc).
fn serve(listener: &UnixListener, offers: &Arc<Offers>, taken: &Arc<std::sync::atomic::AtomicU64>, stop: &AtomicBool) {
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for stream in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let Ok(mut stream) = stream else { continue };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let (offers, taken, finished) = (offers.clone(), taken.clone(), active.clone());
        let spawned = std::thread::Builder::new().name("icheck-handoff-answer".into()).spawn(move || {
            match answer(&mut stream, &offers) {
                Ok(()) => {
                    taken.fetch_add(1, Ordering::Relaxed);
                }
                Err(err) => tracing::debug!(%err, "a handoff connection ended without a file"),
            }
            finished.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn answer(stream: &mut UnixStream, offers: &Offers) -> Result<(), HandoffError> {
    stream.set_read_timeout(Some(READ_TIMEOUT)).map_err(io("set a read timeout"))?;
    stream.set_write_timeout(Some(READ_TIMEOUT)).map_err(io("set a write timeout"))?;
    let mut ticket = [0u8; 16];
    stream.read_exact(&mut ticket).map_err(io("read a ticket"))?;
    let offered = {
        let mut offers = offers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        offers.remove(&Ticket(ticket)).filter(|(_, offered)| offered.elapsed() < TICKET_LIFETIME)
    };
    let Some((file, _)) = offered else {
        stream.write_all(b"N").map_err(io("refuse a ticket"))?;
        return Err(HandoffError::Refused);
    };
    let fds = [file.as_raw_fd()];
    let control = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
    nix::sys::socket::sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(b"Y")],
        &control,
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(errno("send the file"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Seek;
    use std::os::unix::fs::FileExt;

    fn file_with(bytes: &[u8]) -> File {
        let mut file = tempfile_in_tmp();
        file.write_all(bytes).unwrap();
        file.rewind().unwrap();
        file
    }

    fn tempfile_in_tmp() -> File {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("icheck-handoff-test-{}-{n}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }

    #[test]
    fn a_ticket_opens_its_file_once_and_only_its_file() {
        let server = HandoffServer::bind().unwrap();
        let (first, _first_guard) = server.offer(file_with(b"first file")).unwrap();
        let (second, _second_guard) = server.offer(file_with(b"second")).unwrap();
        assert_eq!(server.outstanding(), 2);
        let taken = take_file(&second).unwrap();
        let mut bytes = [0u8; 6];
        taken.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(&bytes, b"second");
        assert!(matches!(take_file(&second), Err(HandoffError::Refused)), "a ticket opens once");
        let guessed = Handoff { ticket: Ticket([7; 16]), ..first.clone() };
        assert!(matches!(take_file(&guessed), Err(HandoffError::Refused)));
        let taken = take_file(&first).unwrap();
        let mut bytes = [0u8; 10];
        taken.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(&bytes, b"first file");
        assert_eq!(server.outstanding(), 0);
        // Counted by the answering thread after it sent the descriptor.
        let counted = Instant::now();
        while server.files_taken() < 2 && counted.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(server.files_taken(), 2);
    }

    #[test]
    fn a_dropped_guard_revokes_its_ticket() {
        let server = HandoffServer::bind().unwrap();
        let (handoff, guard) = server.offer(file_with(b"x")).unwrap();
        drop(guard);
        assert_eq!(server.outstanding(), 0);
        assert!(matches!(take_file(&handoff), Err(HandoffError::Refused)));
    }

    #[test]
    fn the_server_survives_hostile_connections() {
        let server = HandoffServer::bind().unwrap();
        let address = SocketAddr::from_abstract_name(server.name().as_bytes()).unwrap();
        // Nothing sent, a short ticket, garbage beyond a ticket, a hang-up.
        drop(UnixStream::connect_addr(&address).unwrap());
        let mut short = UnixStream::connect_addr(&address).unwrap();
        short.write_all(b"abc").unwrap();
        let mut long = UnixStream::connect_addr(&address).unwrap();
        long.write_all(&[0xff; 4096]).unwrap();
        let silent = UnixStream::connect_addr(&address).unwrap();
        let (handoff, _guard) = server.offer(file_with(b"still served")).unwrap();
        let taken = take_file(&handoff).unwrap();
        let mut bytes = [0u8; 12];
        taken.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(&bytes, b"still served");
        drop((short, long, silent));
    }

    #[test]
    fn no_socket_is_an_error_that_names_it() {
        let handoff = Handoff { socket: "icheck-handoff-nobody-listens".into(), ticket: Ticket([1; 16]) };
        let err = take_file(&handoff).unwrap_err().to_string();
        assert!(err.contains("@icheck-handoff-nobody-listens"), "{err}");
    }

    #[test]
    fn this_process_knows_its_host() {
        let here = HostId::current().expect("/proc tells");
        assert_eq!(HostId::current(), Some(here.clone()));
        assert!(here.net_namespace > 0 && here.boot.len() >= 32, "{here:?}");
    }
}
