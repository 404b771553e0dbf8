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

/// Most files one handoff carries (one message's descriptors): an
/// incremental version whose blocks lie in more files is read over the
/// fabric.
pub const MAX_FILES: usize = 64;

/// `len` bytes at `offset` of a version lie at `file_offset` of handed-over
/// file number `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileExtent {
    /// Offset in the version's data.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Which of the handed-over files.
    pub file: u32,
    /// Offset in that file.
    pub file_offset: u64,
}

/// Where and with what a rank takes the files of the version it fetched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handoff {
    /// The abstract socket's name (without the leading NUL).
    pub socket: String,
    /// Opens the files once.
    pub ticket: Ticket,
    /// Where the version's bytes lie in the files, in order: one extent of
    /// one file for a version stored whole, several for an incremental
    /// version whose blocks other versions' files hold.
    pub extents: Vec<FileExtent>,
}

/// The handed-over files of one version, and where its bytes lie in them
/// (checked to cover the version exactly once, in order).
#[derive(Debug)]
pub struct VersionFiles {
    files: Vec<File>,
    extents: Vec<FileExtent>,
}

impl VersionFiles {
    /// Checks that `extents` lie back to back from 0 to `total_len`, each
    /// in one of `files`.
    pub fn new(files: Vec<File>, extents: Vec<FileExtent>, total_len: u64) -> Result<VersionFiles, HandoffError> {
        let mut next = 0u64;
        for extent in &extents {
            let fits = extent.offset == next
                && extent.len > 0
                && (extent.file as usize) < files.len()
                && extent.file_offset.checked_add(extent.len).is_some();
            if !fits {
                return Err(HandoffError::Layout(format!(
                    "extent {extent:?} after {next} bytes, {} files",
                    files.len()
                )));
            }
            next += extent.len;
        }
        if next != total_len {
            return Err(HandoffError::Layout(format!("the extents cover {next} bytes, the version has {total_len}")));
        }
        Ok(VersionFiles { files, extents })
    }

    /// Reads exactly `buf.len()` bytes at `offset` of the version.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let past = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "past the version's end");
        let mut at = self.extents.partition_point(|e| e.offset + e.len <= offset);
        let (mut done, mut offset) = (0usize, offset);
        while done < buf.len() {
            let extent = self.extents.get(at).ok_or_else(past)?;
            let into = offset - extent.offset;
            let take = usize::try_from(extent.len - into).unwrap_or(usize::MAX).min(buf.len() - done);
            self.files[extent.file as usize].read_exact_at(&mut buf[done..done + take], extent.file_offset + into)?;
            done += take;
            offset += take as u64;
            at += 1;
        }
        Ok(())
    }
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
    /// The extents do not describe the version.
    #[error("the handed-over files do not describe the version: {0}")]
    Layout(String),
    /// More files than one handoff carries.
    #[error("{0} files are more than one handoff carries ({MAX_FILES})")]
    TooManyFiles(usize),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> HandoffError {
    let what = what.into();
    move |source| HandoffError::Io { what, source }
}

fn errno(what: &str) -> impl FnOnce(nix::errno::Errno) -> HandoffError + '_ {
    move |errno| HandoffError::Io { what: what.to_string(), source: errno.into() }
}

/// Connects to `handoff.socket`, presents the ticket and returns the files
/// it opens (read-only, close-on-exec), checked against the extents of a
/// version of `total_len` bytes.
pub fn take_files(handoff: &Handoff, total_len: u64) -> Result<VersionFiles, HandoffError> {
    let address = SocketAddr::from_abstract_name(handoff.socket.as_bytes())
        .map_err(io(format!("socket name {:?}", handoff.socket)))?;
    let mut stream = UnixStream::connect_addr(&address).map_err(io(format!("connect to @{}", handoff.socket)))?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(io("set a read timeout"))?;
    stream.set_write_timeout(Some(ANSWER_TIMEOUT)).map_err(io("set a write timeout"))?;
    stream.write_all(&handoff.ticket.0).map_err(io(format!("send the ticket to @{}", handoff.socket)))?;
    let mut answer = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut answer)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; MAX_FILES]);
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
    match (message.bytes, answer[0], received.is_empty()) {
        (1, b'Y', false) => {
            VersionFiles::new(received.into_iter().map(File::from).collect(), handoff.extents.clone(), total_len)
        }
        (1, b'N', _) => Err(HandoffError::Refused),
        _ => Err(HandoffError::NoDescriptor),
    }
}

/// Offered files by ticket.
type Offers = Mutex<HashMap<Ticket, (Vec<File>, Instant)>>;

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

    /// Offers `files`, holding a version's bytes where `extents` say, under
    /// a new ticket until the returned guard drops.
    pub fn offer(&self, files: Vec<File>, extents: Vec<FileExtent>) -> Result<(Handoff, Offered), HandoffError> {
        if files.is_empty() || files.len() > MAX_FILES {
            return Err(HandoffError::TooManyFiles(files.len()));
        }
        let mut ticket = [0u8; 16];
        getrandom::fill(&mut ticket).map_err(|e| HandoffError::Random(e.to_string()))?;
        let ticket = Ticket(ticket);
        let mut offers = self.offers.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        offers.retain(|_, (_, offered)| offered.elapsed() < TICKET_LIFETIME);
        offers.insert(ticket, (files, Instant::now()));
        let handoff = Handoff { socket: self.name.clone(), ticket, extents };
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
    let Some((files, _)) = offered else {
        stream.write_all(b"N").map_err(io("refuse a ticket"))?;
        return Err(HandoffError::Refused);
    };
    let fds: Vec<std::os::fd::RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
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

    fn file_with(bytes: &[u8]) -> File {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("icheck-handoff-test-{}-{n}", std::process::id()));
        let mut file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file.write_all(bytes).unwrap();
        file.rewind().unwrap();
        file
    }

    /// One file holding a whole version of `len` bytes.
    fn whole(len: u64) -> Vec<FileExtent> {
        vec![FileExtent { offset: 0, len, file: 0, file_offset: 0 }]
    }

    fn read_all(files: &VersionFiles, len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        files.read_exact_at(&mut bytes, 0).unwrap();
        bytes
    }

    #[test]
    fn a_ticket_opens_its_files_once_and_only_its_files() {
        let server = HandoffServer::bind().unwrap();
        let (first, _first_guard) = server.offer(vec![file_with(b"first file")], whole(10)).unwrap();
        let (second, _second_guard) = server.offer(vec![file_with(b"second")], whole(6)).unwrap();
        assert_eq!(server.outstanding(), 2);
        assert_eq!(read_all(&take_files(&second, 6).unwrap(), 6), b"second");
        assert!(matches!(take_files(&second, 6), Err(HandoffError::Refused)), "a ticket opens once");
        let guessed = Handoff { ticket: Ticket([7; 16]), ..first.clone() };
        assert!(matches!(take_files(&guessed, 10), Err(HandoffError::Refused)));
        assert_eq!(read_all(&take_files(&first, 10).unwrap(), 10), b"first file");
        assert_eq!(server.outstanding(), 0);
        // Counted by the answering thread after it sent the descriptors.
        let counted = Instant::now();
        while server.files_taken() < 2 && counted.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(server.files_taken(), 2);
    }

    #[test]
    fn a_version_in_several_files_reads_across_their_extents() {
        let server = HandoffServer::bind().unwrap();
        // "abcdefghij" = "ab" (file 1 at 3) + "cdefg" (file 0 at 0) + "hij" (file 1 at 0).
        let files = vec![file_with(b"cdefgXX"), file_with(b"hijab")];
        let extents = vec![
            FileExtent { offset: 0, len: 2, file: 1, file_offset: 3 },
            FileExtent { offset: 2, len: 5, file: 0, file_offset: 0 },
            FileExtent { offset: 7, len: 3, file: 1, file_offset: 0 },
        ];
        let (handoff, _guard) = server.offer(files, extents).unwrap();
        let version = take_files(&handoff, 10).unwrap();
        assert_eq!(read_all(&version, 10), b"abcdefghij");
        let mut middle = [0u8; 6];
        version.read_exact_at(&mut middle, 1).unwrap();
        assert_eq!(&middle, b"bcdefg");
        let mut past = [0u8; 2];
        assert_eq!(version.read_exact_at(&mut past, 9).unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn extents_that_do_not_describe_the_version_are_refused() {
        let extent = |offset, len, file| FileExtent { offset, len, file, file_offset: 0 };
        for (extents, total) in [
            (vec![extent(0, 4, 0)], 5),                  // short
            (vec![extent(0, 4, 0), extent(3, 2, 0)], 5), // overlapping
            (vec![extent(1, 4, 0)], 5),                  // a hole at the start
            (vec![extent(0, 5, 1)], 5),                  // no such file
            (vec![extent(0, 0, 0), extent(0, 5, 0)], 5), // empty extent
        ] {
            let err = VersionFiles::new(vec![file_with(b"12345")], extents.clone(), total).unwrap_err();
            assert!(matches!(err, HandoffError::Layout(_)), "{extents:?}: {err}");
        }
        let server = HandoffServer::bind().unwrap();
        assert!(matches!(server.offer(Vec::new(), whole(0)), Err(HandoffError::TooManyFiles(0))));
        let many: Vec<File> = (0..=MAX_FILES).map(|_| file_with(b"x")).collect();
        assert!(matches!(server.offer(many, whole(1)), Err(HandoffError::TooManyFiles(_))));
    }

    #[test]
    fn a_dropped_guard_revokes_its_ticket() {
        let server = HandoffServer::bind().unwrap();
        let (handoff, guard) = server.offer(vec![file_with(b"x")], whole(1)).unwrap();
        drop(guard);
        assert_eq!(server.outstanding(), 0);
        assert!(matches!(take_files(&handoff, 1), Err(HandoffError::Refused)));
    }

    #[test]
    fn the_server_survives_hostile_connections() {
        let server = HandoffServer::bind().unwrap();
        let address = SocketAddr::from_abstract_name(server.name().as_bytes()).unwrap();
        // Nothing sent, a short ticket, garbage beyond a ticket, silence.
        drop(UnixStream::connect_addr(&address).unwrap());
        let mut short = UnixStream::connect_addr(&address).unwrap();
        short.write_all(b"abc").unwrap();
        let mut long = UnixStream::connect_addr(&address).unwrap();
        long.write_all(&[0xff; 4096]).unwrap();
        let silent = UnixStream::connect_addr(&address).unwrap();
        let (handoff, _guard) = server.offer(vec![file_with(b"still served")], whole(12)).unwrap();
        assert_eq!(read_all(&take_files(&handoff, 12).unwrap(), 12), b"still served");
        drop((short, long, silent));
    }

    #[test]
    fn no_socket_is_an_error_that_names_it() {
        let handoff =
            Handoff { socket: "icheck-handoff-nobody-listens".into(), ticket: Ticket([1; 16]), extents: whole(1) };
        let err = take_files(&handoff, 1).unwrap_err().to_string();
        assert!(err.contains("@icheck-handoff-nobody-listens"), "{err}");
    }

    #[test]
    fn this_process_knows_its_host() {
        let here = HostId::current().expect("/proc tells");
        assert_eq!(HostId::current(), Some(here.clone()));
        assert!(here.net_namespace > 0 && here.boot.len() >= 32, "{here:?}");
    }
}
