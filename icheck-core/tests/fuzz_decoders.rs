//! Every decoder of untrusted bytes in icheck-core, fed random and mutated
//! input: control frames of every message type on every port (and what the
//! frame assembler makes of a byte stream), manifests as stored and as an
//! agent answers them, the PFS level's MANIFEST and rank files as read back
//! from disk, and configuration files. Nothing may panic: every answer is a
//! value or a typed error. Allocation is bounded by the codecs' limits (a
//! frame announcing 4 GiB is refused before anything is allocated; see
//! `oversized_announcements_are_refused_before_allocation`).
//!
//! CI runs the committed corpus (`tests/corpus/`, every file through every
//! decoder) and a few hundred cases per property. The long run:
//!
//! ```text
//! PROPTEST_CASES=200000 cargo test --release -p icheck-core --test fuzz_decoders
//! ```
//!
//! `ICHECK_WRITE_CORPUS=1` rewrites the corpus from the seeds below.

use std::path::{Path, PathBuf};

use icheck_core::config::{DynamicConfig, StaticConfig};
use icheck_core::fabric::{FabricAddress, RemoteRegion};
use icheck_core::format::{self, label_crcs, DataKind, LabelLayout, Manifest, CHUNK_SIZE};
use icheck_core::pfs::{Compression, PfsStore};
use icheck_core::protocol::{
    self, AgentInfo, AgentReply, AgentRequest, AppRegistration, ClientReply, ClientRequest, ControllerToManager,
    FetchWanted, Hello, HelloReply, ManagerToController, NodeStatus, ParityMeta, PieceMeta, PieceTask, PullSegment,
    Role, TransferMode,
};
use icheck_core::redundancy::PieceId;
use proptest::prelude::*;

/// A valid manifest of one rank: two labels of 100 and 28 bytes.
fn manifest() -> Manifest {
    let data = [7u8; 128];
    Manifest {
        app: "app".into(),
        rank: 0,
        ranks: 2,
        epoch: 0,
        version: 1,
        labels: vec![
            LabelLayout { label: "a".into(), kind: DataKind::Binary, offset: 0, len: 100, adapt: None },
            LabelLayout { label: "b".into(), kind: DataKind::Binary, offset: 100, len: 28, adapt: None },
        ],
        total_len: 128,
        chunk_size: CHUNK_SIZE,
        crcs: label_crcs(&[&data[..100], &data[100..]]),
        sealed_unix_ms: 1,
    }
}

fn agent() -> AgentInfo {
    AgentInfo {
        id: 3,
        node: "n1".into(),
        address: FabricAddress(vec![1, 2, 3, 4]),
        provider: "tcp".into(),
        probe: RemoteRegion { addr: 0, key: 9, len: 4096 },
        control: "127.0.0.1:9".into(),
    }
}

/// Valid encodings of each kind of input: what mutation starts from.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let registration = AppRegistration {
        name: "heat".into(),
        ranks: 4,
        nodes: 2,
        ranks_per_node: 2,
        mode: TransferMode::Mr,
        pfs_interval: 2,
        compression: icheck_core::pfs::CompressionPolicy::Never,
        encrypted: false,
        redundancy: None,
    };
    let cap = "00112233445566778899aabbccddeeff".to_string();
    let enc = |bytes: Result<Vec<u8>, protocol::ProtocolError>| bytes.expect("seeds encode");
    vec![
        ("hello", enc(protocol::encode(&Hello::with_epoch("token", Role::Client, 3)))),
        ("hello-reply", enc(protocol::encode(&HelloReply::NotPrimary { reason: "r".into(), epoch: 2, sequence: 9 }))),
        (
            "client-request",
            enc(protocol::encode(&ClientRequest::RegisterApp { registration, capability: Some(cap.clone()), uid: 0 })),
        ),
        (
            "client-request",
            enc(protocol::encode(&ClientRequest::Probe {
                name: "heat".into(),
                agents: vec![1, 2],
                remaining_commits: 3,
                capability: cap.clone(),
                at_init: true,
                unreachable: vec![2],
            })),
        ),
        ("client-reply", enc(protocol::encode(&ClientReply::Agents(vec![agent()])))),
        (
            "manager",
            enc(protocol::encode(&ManagerToController::Register {
                node: "n1".into(),
                pid: 7,
                status: NodeStatus::default(),
                agents: vec![agent()],
                stored: Vec::new(),
                pieces: Vec::new(),
            })),
        ),
        ("controller", enc(protocol::encode(&ControllerToManager::DropRanks { app: "a".into(), ranks: vec![0, 1] }))),
        (
            "agent-request",
            enc(protocol::encode(&AgentRequest::Begin {
                version: 2,
                ranks: 2,
                epoch: 0,
                labels: manifest().labels,
                push: false,
            })),
        ),
        (
            "agent-request",
            enc(protocol::encode(&AgentRequest::Pull(vec![PullSegment {
                source: RemoteRegion { addr: 4096, key: 1, len: 128 },
                source_offset: 0,
                file_offset: 0,
                len: 128,
            }]))),
        ),
        (
            "agent-reply",
            enc(protocol::encode(&AgentReply::Fetch {
                manifest: manifest(),
                region: RemoteRegion { addr: 0, key: 1, len: 128 },
                damaged: None,
                handoff: Some(icheck_core::handoff::Handoff {
                    socket: "icheck-handoff-1-00".into(),
                    ticket: icheck_core::handoff::Ticket([3; 16]),
                    extents: vec![icheck_core::handoff::FileExtent { offset: 0, len: 128, file: 0, file_offset: 0 }],
                }),
            })),
        ),
        (
            "frame",
            enc(protocol::encode_frame(&AgentRequest::Fetch {
                version: 5,
                reader: Some(icheck_core::handoff::HostId { boot: "b".into(), net_namespace: 7 }),
                reader_checks: true,
            })),
        ),
        ("manifest", format::encode_stored(&manifest()).expect("encodes")),
        ("config", include_bytes!("../../config/icheck.toml").to_vec()),
        ("dynamic", include_bytes!("../../config/dynamic.toml").to_vec()),
        (
            "controller",
            enc(protocol::encode(&ControllerToManager::Protect {
                agent: 3,
                task: PieceTask {
                    version: 4,
                    attempt: 2,
                    piece: PieceId::Parity { group: 1, index: 0 },
                    members: vec![Some((0, agent())), None],
                    parity: 2,
                    also: vec![agent()],
                },
            })),
        ),
        (
            "agent-reply",
            enc(protocol::encode(&AgentReply::Piece {
                meta: PieceMeta::Parity(parity()),
                region: RemoteRegion { addr: 0, key: 1, len: 1 << 20 },
            })),
        ),
        (
            "agent-request",
            enc(protocol::encode(&AgentRequest::PutPiece {
                version: 4,
                piece: PieceId::Parity { group: 1, index: 1 },
                len: 1 << 20,
            })),
        ),
        ("agent-request", enc(protocol::encode(&AgentRequest::SealPiece { meta: PieceMeta::Parity(parity()) }))),
        ("piece", format::encode_stored(&PieceMeta::Parity(parity())).expect("encodes")),
        ("piece", format::encode_stored(&PieceMeta::Copy(manifest())).expect("encodes")),
    ]
}

/// A parity shard's description as an agent stores and serves it.
fn parity() -> ParityMeta {
    let mut member = manifest();
    member.app = "app".into();
    ParityMeta {
        app: "app".into(),
        version: member.version,
        group: 1,
        index: 0,
        parity: 2,
        shard_len: 1 << 20,
        members: vec![Some(member), None],
        crcs: vec![7],
    }
}

/// Runs `bytes` through every decoder; panics only if one does.
fn feed(bytes: &[u8]) {
    let _ = protocol::decode::<Hello>(bytes);
    let _ = protocol::decode::<HelloReply>(bytes);
    let _ = protocol::decode::<ClientRequest>(bytes);
    let _ = protocol::decode::<ClientReply>(bytes);
    let _ = protocol::decode::<ManagerToController>(bytes);
    let _ = protocol::decode::<ControllerToManager>(bytes);
    let _ = protocol::decode::<AgentRequest>(bytes);
    // An agent's answer to Fetch passes the one gate before any offset is used.
    if let Ok(reply) = protocol::decode::<AgentReply>(bytes) {
        if let Ok(fetched) = protocol::check_fetched(reply, FetchWanted { app: "app", rank: 0, version: 1 }) {
            let data = vec![7u8; usize::try_from(fetched.manifest.total_len).expect("checked length")];
            let _ = fetched.manifest.verify(&data);
        }
    }
    // A piece of redundancy, from a peer or from disk: checked before any
    // length in it is used.
    if let Ok(AgentReply::Piece { meta: PieceMeta::Parity(parity), .. }) = protocol::decode::<AgentReply>(bytes) {
        let _ = parity.validate();
    }
    if let Ok(PieceMeta::Parity(parity)) = format::decode_stored::<PieceMeta>(bytes) {
        if parity.validate().is_ok() && parity.shard_len <= 1 << 22 {
            let data = vec![7u8; usize::try_from(parity.shard_len).expect("small")];
            let _ = data.chunks(protocol::STRIPE as usize).zip(&parity.crcs).all(|(c, crc)| crc32c::crc32c(c) == *crc);
        }
    }
    // A manifest as stored: validated before any offset is used, then verified.
    if let Ok(manifest) = format::decode_stored::<Manifest>(bytes) {
        if manifest.validate().is_ok() && manifest.total_len <= 1 << 20 {
            let data = vec![7u8; usize::try_from(manifest.total_len).expect("small")];
            let _ = manifest.verify(&data);
            if let (Some(label), Some(crcs)) = (manifest.labels.first(), manifest.crcs.first()) {
                let len = usize::try_from(label.len).expect("validated");
                let _ = format::first_bad_chunk(&data[..len.min(data.len())], crcs);
            }
        }
    }
    // A byte stream as a daemon reads it: the frame assembler, a few bytes at a time.
    let mut assembler = protocol::FrameAssembler::new(protocol::MAX_HELLO);
    let mut stream = Trickle { bytes, at: 0 };
    for _ in 0..bytes.len() + 2 {
        match assembler.poll(&mut stream) {
            Ok(Some(payload)) => {
                let _ = protocol::decode::<Hello>(&payload);
                break;
            }
            Ok(None) => {}
            Err(_) => break,
        }
    }
    if let Some(&[a, b, c, d]) = bytes.get(..4) {
        let _ = protocol::frame_len([a, b, c, d], protocol::MAX_FRAME);
    }
    // Configuration files.
    if let Ok(text) = std::str::from_utf8(bytes) {
        let _ = StaticConfig::from_text(Path::new("fuzz.toml"), text);
        let _ = DynamicConfig::parse(Path::new("fuzz-dynamic.toml"), text);
    }
}

/// A non-blocking reader that hands out three bytes per call, then
/// "would block" once, as a socket does.
struct Trickle<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl std::io::Read for Trickle<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.at >= self.bytes.len() {
            return Ok(0);
        }
        let n = out.len().min(3).min(self.bytes.len() - self.at);
        out[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// One mutation of a seed: overwrite bytes, cut, extend.
#[derive(Debug, Clone)]
struct Mutation {
    seed: usize,
    edits: Vec<(usize, u8)>,
    cut: Option<usize>,
    tail: Vec<u8>,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    (
        0..seeds().len(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        proptest::option::of(any::<usize>()),
        proptest::collection::vec(any::<u8>(), 0..16),
    )
        .prop_map(|(seed, edits, cut, tail)| Mutation { seed, edits, cut, tail })
}

fn apply(mutation: &Mutation) -> Vec<u8> {
    let mut bytes = seeds()[mutation.seed].1.clone();
    for (at, byte) in &mutation.edits {
        if !bytes.is_empty() {
            let len = bytes.len();
            bytes[at % len] = *byte;
        }
    }
    if let Some(cut) = mutation.cut {
        bytes.truncate(cut % (bytes.len() + 1));
    }
    bytes.extend_from_slice(&mutation.tail);
    bytes
}

/// Cases per property in CI (`PROPTEST_CASES` overrides it for long runs).
fn config(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(default);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(500))]

    #[test]
    fn random_bytes_never_panic_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        feed(&bytes);
    }

    #[test]
    fn mutated_valid_inputs_never_panic_a_decoder(mutation in mutation()) {
        feed(&apply(&mutation));
    }
}

/// A PFS level with one version of one rank written the real way, in a
/// directory of its own.
struct Pfs {
    dir: PathBuf,
    store: PfsStore,
}

impl Pfs {
    fn new(case: u64) -> Pfs {
        let dir = std::env::temp_dir().join(format!("icheck-fuzz-pfs-{}-{case}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = PfsStore::new(&dir);
        let data = vec![7u8; 128];
        let entry = store.write_rank(&manifest(), &data, Compression::Zstd { level: 1 }).expect("writes").0;
        store.complete("app", 1, 2, "agents", icheck_core::protocol::TransferMode::Mr, vec![entry]).expect("completes");
        Pfs { dir, store }
    }
}

impl Drop for Pfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

proptest! {
    #![proptest_config(config(100))]

    /// The PFS level's files as a restart reads them back: a damaged
    /// MANIFEST or rank file is a typed error, never a panic or a wrong answer.
    #[test]
    fn damaged_pfs_files_are_refused_not_trusted(
        which in 0usize..2,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        cut in proptest::option::of(any::<usize>()),
        case in any::<u64>(),
    ) {
        let pfs = Pfs::new(case);
        let version_dir = pfs.store.version_dir("app", 1).expect("a plain name");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&version_dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        let target = if which == 0 {
            version_dir.join("MANIFEST")
        } else {
            files.iter().find(|p| p.file_name().is_some_and(|n| n != "MANIFEST")).cloned().expect("a rank file")
        };
        let mut bytes = std::fs::read(&target).unwrap();
        let original = bytes.clone();
        for (at, byte) in &edits {
            let len = bytes.len();
            bytes[at % len] = *byte;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut % (bytes.len() + 1));
        }
        std::fs::write(&target, &bytes).unwrap();
        let read = pfs.store.manifest("app", 1).and_then(|m| pfs.store.read_rank(&m, 0));
        if let Ok((manifest, data)) = read {
            // Whatever is accepted is what was written.
            prop_assert!(bytes == original || data == vec![7u8; 128], "damaged data was accepted: {manifest:?}");
        }
    }
}

#[test]
fn oversized_announcements_are_refused_before_allocation() {
    let prefix = u32::MAX.to_le_bytes();
    assert!(protocol::frame_len(prefix, protocol::MAX_FRAME).is_err());
    // A length field inside a payload that claims 2^60 elements: the codec's
    // limit refuses it instead of reserving memory.
    let mut bytes = vec![0u8; 4];
    bytes.extend_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(protocol::decode::<ClientReply>(&bytes).is_err());
    assert!(format::decode_stored::<Manifest>(&bytes).is_err());
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

#[test]
fn the_committed_corpus_decodes_without_a_panic() {
    if std::env::var_os("ICHECK_WRITE_CORPUS").is_some() {
        write_corpus();
    }
    let mut files = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("tests/corpus exists") {
        let path = entry.unwrap().path();
        feed(&std::fs::read(&path).unwrap());
        files += 1;
    }
    assert!(files >= seeds().len(), "the corpus holds {files} files");
}

/// The corpus: every seed, each cut at a few places, and inputs that once
/// mattered (a 4 GiB announcement, a Vec length of 2^60, empty input).
fn write_corpus() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let mut inputs: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, (kind, bytes)) in seeds().into_iter().enumerate() {
        for cut in [bytes.len(), bytes.len() / 2, 5.min(bytes.len())] {
            inputs.push((format!("{kind}-{i}-{cut}"), bytes[..cut].to_vec()));
        }
    }
    inputs.push(("oversized-frame".into(), u32::MAX.to_le_bytes().to_vec()));
    let mut huge_vec = vec![0u8; 4];
    huge_vec.extend_from_slice(&(1u64 << 60).to_le_bytes());
    inputs.push(("huge-length".into(), huge_vec));
    inputs.push(("empty".into(), Vec::new()));
    for (name, bytes) in inputs {
        std::fs::write(dir.join(format!("{name}.bin")), bytes).unwrap();
    }
}
