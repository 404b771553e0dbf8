//! A two-process RMA check: one process exposes a patterned buffer, the other
//! reads it, verifies every word, and writes a second pattern back, which the
//! first process verifies. `icheck fabric selftest` runs it as a demo; the
//! integration tests and the benchmark run its halves as separate processes.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};

use serde::{Deserialize, Serialize};

use icheck_core::fabric::{
    Access, AlignedBuffer, Domain, Endpoint, FabricAddress, FabricConfig, ProgressMode, ProgressThread,
    RegisteredBuffer, RemoteRegion, RmaOp, TransferOptions, TransferStats,
};

/// What the target publishes out of band so that an initiator can reach it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct TargetAnnouncement {
    /// Provider the target opened (e.g. `tcp;ofi_rxm`).
    pub provider: String,
    /// The target endpoint's address.
    pub address: FabricAddress,
    /// The exposed buffer.
    pub region: RemoteRegion,
}

pub use icheck_core::pattern::{fill_pattern, pattern_word, verify_pattern};

/// The exposing half: a registered, patterned buffer with a progress thread.
pub struct Target {
    buffer: RegisteredBuffer<AlignedBuffer>,
    progress: Option<ProgressThread>,
    endpoint: Endpoint,
}

impl Target {
    /// Opens an endpoint on `config`, registers `size` bytes filled with the
    /// pattern of `seed` for remote read and write, and starts progress.
    pub fn start(config: &FabricConfig, size: usize, seed: u64) -> icheck_core::fabric::Result<Target> {
        let domain = Domain::open(config)?;
        let endpoint = Endpoint::new(&domain)?;
        let mut buffer = AlignedBuffer::zeroed(size);
        fill_pattern(buffer.as_mut_slice(), seed);
        let buffer = endpoint.register(buffer, Access::REMOTE_READ_WRITE)?;
        let mut target = Target { buffer, progress: None, endpoint };
        target
            .resume()
            .map_err(|err| icheck_core::fabric::FabricError::Config(format!("cannot start progress thread: {err}")))?;
        Ok(target)
    }

    /// What an initiator needs.
    pub fn announcement(&self) -> TargetAnnouncement {
        TargetAnnouncement {
            provider: self.endpoint.provider().to_string(),
            address: self.endpoint.address().clone(),
            region: self.buffer.remote(),
        }
    }

    /// Verifies the buffer against the pattern of `seed`.
    pub fn verify(&self, seed: u64) -> Result<(), String> {
        verify_pattern(self.buffer.as_slice(), seed)
    }

    /// Stops polling until [`resume`](Self::resume): a target kept between
    /// measurements would otherwise keep a core busy spinning, taking it
    /// from whatever is measured meanwhile.
    pub fn pause(&mut self) {
        if let Some(progress) = self.progress.take() {
            progress.stop();
        }
    }

    /// Polls again after [`pause`](Self::pause).
    pub fn resume(&mut self) -> std::io::Result<()> {
        if self.progress.is_none() {
            self.progress = Some(ProgressThread::spawn(&self.endpoint, ProgressMode::Spin)?);
        }
        Ok(())
    }

    /// Serves the line protocol on stdin/stdout until `quit` or end of input:
    /// prints the announcement as one JSON line, then answers `verify SEED`
    /// with `ok` or `mismatch: ...`, and `pause` and `resume` (progress)
    /// with `ok`.
    pub fn serve(mut self, input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
        writeln!(output, "{}", serde_json::to_string(&self.announcement()).expect("announcement serializes"))?;
        output.flush()?;
        for line in input.lines() {
            let line = line?;
            let mut words = line.split_whitespace();
            match (words.next(), words.next().map(str::parse::<u64>)) {
                (Some("verify"), Some(Ok(seed))) => match self.verify(seed) {
                    Ok(()) => writeln!(output, "ok")?,
                    Err(reason) => writeln!(output, "mismatch: {reason}")?,
                },
                (Some("pause"), None) => {
                    self.pause();
                    writeln!(output, "ok")?
                }
                (Some("resume"), None) => match self.resume() {
                    Ok(()) => writeln!(output, "ok")?,
                    Err(err) => writeln!(output, "error: cannot start the progress thread: {err}")?,
                },
                (Some("quit"), _) => break,
                _ => writeln!(
                    output,
                    "error: unknown command {line:?} (expected `verify SEED`, `pause`, `resume` or `quit`)"
                )?,
            }
            output.flush()?;
        }
        self.pause();
        Ok(())
    }
}

/// Why the initiating half failed.
#[derive(Debug, thiserror::Error)]
pub enum SelftestError {
    /// The fabric layer failed.
    #[error(transparent)]
    Fabric(#[from] icheck_core::fabric::FabricError),
    /// The data read differs from the expected pattern.
    #[error("data read from {peer} is wrong: {reason}")]
    Mismatch {
        /// The target's printable address.
        peer: String,
        /// The first difference.
        reason: String,
    },
    /// Starting or talking to a target process failed.
    #[error("{0}")]
    Process(String),
    /// The region does not fit this process's address space.
    #[error("the target region of {0} bytes does not fit this address space")]
    TooLarge(u64),
}

/// Result of the initiating half.
#[derive(Clone, Copy, Debug)]
pub struct InitiatorReport {
    /// The first read of the whole region: it opens the connection and
    /// lands in memory never touched before, as an application's first
    /// restart does.
    pub read: TransferStats,
    /// The same read again, over the open connection into the memory the
    /// first one touched: the fabric's own rate.
    pub warm_read: TransferStats,
    /// The write of the whole region.
    pub write: TransferStats,
}

/// The initiating half: reads the target's whole region in chunks into new
/// memory, verifies it against `read_seed`, clears it and reads it again
/// (warm) and verifies again, then writes the pattern of `write_seed` back.
///
/// Why two reads: the first one's rate is mostly the connection's setup and
/// the kernel backing fresh pages (over loopback tcp on a two-core machine
/// here, 256 MiB: 0.28–1.33 GB/s cold against 2.56–3.61 GB/s warm), which
/// says little about the fabric.
pub fn run_initiator(
    config: &FabricConfig,
    target: &TargetAnnouncement,
    options: &TransferOptions,
    read_seed: u64,
    write_seed: u64,
) -> Result<InitiatorReport, SelftestError> {
    let domain = Domain::open(config)?;
    let endpoint = Endpoint::new(&domain)?;
    let peer = endpoint.insert_peer(&target.address)?;
    let len = usize::try_from(target.region.len).map_err(|_| SelftestError::TooLarge(target.region.len))?;
    let mut local = endpoint.register(AlignedBuffer::zeroed(len), Access::LOCAL)?;
    let whole = [RmaOp { local_offset: 0, remote: target.region, remote_offset: 0, len }];
    tracing::info!(bytes = len, peer = %peer.name(), "reading the target's buffer");
    // Tests wedge the read here, as a lock a killed peer held would.
    if icheck_core::failpoint::fails("initiator.fabric_wedged") {
        icheck_core::fabric::wedge_next_call();
    }
    let mismatch = |reason| SelftestError::Mismatch { peer: peer.name().to_string(), reason };
    let read = endpoint.read(&peer, local.target(), &whole, options)?;
    verify_pattern(local.as_slice(), read_seed).map_err(mismatch)?;
    // Cleared, so that the warm read's verification is not vacuous.
    local.as_mut_slice().fill(0);
    let warm_read = endpoint.read(&peer, local.target(), &whole, options)?;
    verify_pattern(local.as_slice(), read_seed).map_err(|reason| mismatch(format!("warm read: {reason}")))?;
    fill_pattern(local.as_mut_slice(), write_seed);
    let write = endpoint.write(&peer, local.source(), &whole, options)?;
    Ok(InitiatorReport { read, warm_read, write })
}

/// The client side of [`Target::serve`]: a target running in a child
/// process. It reads the announcement, sends commands, and kills and reaps
/// the child (by its own handle) on drop, so no target outlives its user.
pub struct TargetProcess {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
    announcement: TargetAnnouncement,
    announcement_json: String,
}

impl TargetProcess {
    /// Starts `command` (which must run [`Target::serve`]) with piped stdio
    /// and waits for its announcement line.
    pub fn spawn(mut command: Command) -> Result<TargetProcess, SelftestError> {
        let process = |what: &str, err: &dyn std::fmt::Display| SelftestError::Process(format!("{what}: {err}"));
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| process("cannot start the target process", &e))?;
        let pid = child.id();
        let (Some(input), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(SelftestError::Process("the target process has no piped stdio".into()));
        };
        // From here on, Drop kills and reaps the child on every error path.
        let mut target = TargetProcess {
            child,
            input,
            output: BufReader::new(stdout),
            announcement: TargetAnnouncement {
                provider: String::new(),
                address: FabricAddress(Vec::new()),
                region: RemoteRegion { addr: 0, key: 0, len: 0 },
            },
            announcement_json: String::new(),
        };
        let mut line = String::new();
        target.output.read_line(&mut line).map_err(|e| process("reading the target's announcement", &e))?;
        if line.trim().is_empty() {
            let status = target.child.wait().map_err(|e| process("waiting for the target", &e))?;
            return Err(SelftestError::Process(format!(
                "the target process (pid {pid}) exited ({status}) before announcing its buffer; see its error output"
            )));
        }
        target.announcement = serde_json::from_str(line.trim()).map_err(|e| {
            SelftestError::Process(format!("the target printed something other than its announcement ({e}): {line:?}"))
        })?;
        target.announcement_json = line.trim().to_string();
        Ok(target)
    }

    /// Where the target's buffer is.
    pub fn announcement(&self) -> &TargetAnnouncement {
        &self.announcement
    }

    /// The announcement exactly as the target printed it (JSON).
    pub fn announcement_json(&self) -> &str {
        &self.announcement_json
    }

    /// The target's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command line and returns the answer line, trimmed.
    pub fn command(&mut self, command: &str) -> std::io::Result<String> {
        writeln!(self.input, "{command}")?;
        self.input.flush()?;
        let mut answer = String::new();
        self.output.read_line(&mut answer)?;
        Ok(answer.trim().to_string())
    }

    /// Sends `command` and expects `ok`; any other answer is the error
    /// `refused(answer)` says.
    fn command_ok(&mut self, command: &str, refused: impl FnOnce(&str) -> String) -> Result<(), SelftestError> {
        let pid = self.pid();
        let answer = self
            .command(command)
            .map_err(|e| SelftestError::Process(format!("talking to the target (pid {pid}): {e}")))?;
        if answer != "ok" {
            return Err(SelftestError::Process(refused(&answer)));
        }
        Ok(())
    }

    /// Asks the target to verify its buffer against the pattern of `seed`.
    pub fn verify(&mut self, seed: u64) -> Result<(), SelftestError> {
        self.command_ok(&format!("verify {seed}"), |answer| format!("the target found wrong data: {answer}"))
    }

    /// Asks the target to stop polling (`pause`) or to poll again
    /// (`resume`), and waits until it has.
    pub fn set_progress(&mut self, on: bool) -> Result<(), SelftestError> {
        let command = if on { "resume" } else { "pause" };
        let pid = self.pid();
        self.command_ok(command, |answer| format!("the target (pid {pid}) refused `{command}`: {answer}"))
    }

    /// Asks the target to quit and waits for it to exit.
    pub fn quit(mut self) -> Result<ExitStatus, SelftestError> {
        // A target that already exited has closed its stdin: not an error here.
        let _ = writeln!(self.input, "quit").and_then(|_| self.input.flush());
        self.child.wait().map_err(|e| SelftestError::Process(format!("waiting for the target: {e}")))
    }

    /// Kills the target now (SIGKILL to this child), reaps it, and removes
    /// the shm provider's region files it could not close (named after its pid).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        if self.child.wait().is_ok() {
            icheck_core::fabric::remove_shm_regions_of(self.child.id());
        }
    }
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        // Ask politely first, so the target closes its endpoint itself.
        let _ = writeln!(self.input, "quit").and_then(|_| self.input.flush());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.kill();
    }
}

/// Which side of the RMA a [`churn`] run keeps alive while the other side
/// is killed in the middle of transfers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum ChurnRole {
    /// This process reads and writes (as an agent pulling from ranks);
    /// target processes are killed mid-batch.
    Initiator,
    /// This process exposes memory with a progress thread (as an agent
    /// while ranks push); initiator processes are killed mid-transfer.
    Target,
}

/// What a [`churn`] run saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChurnReport {
    /// Peers killed.
    pub rounds: u32,
    /// Transfers that completed before their peer died.
    pub completed: u32,
    /// Transfers that failed with an error completion or a refused post.
    pub failed: u32,
    /// Transfers that timed out, after which the endpoint was replaced.
    pub timed_out: u32,
    /// Whether a new peer could still complete a verified transfer with this
    /// process afterwards. (With `shm`, an initiator killed mid-transfer has
    /// been seen to leave the target unreachable for later peers under load:
    /// their posts never get a queue slot. That is recorded, not fatal.)
    pub reachable_after: bool,
}

/// How long a churn's last initiator may run before it is killed: its
/// transfer takes well under a second, and its own timeout is 20 s.
const LAST_INITIATOR_BOUND: std::time::Duration = std::time::Duration::from_secs(40);

/// Bytes moved per churn round: long enough that a kill lands mid-transfer.
const CHURN_BYTES: usize = 32 << 20;

/// The peer-death reproducer: `rounds` times, a peer process is started,
/// a transfer begins, and the peer is SIGKILLed after a pseudo-random delay
/// (`seed`) of up to 40 ms, while this process keeps one endpoint for as
/// long as it stays usable (as a manager's agent does). Afterwards one more
/// peer must complete a verified transfer. Returns what happened; a provider
/// fault in the error paths kills this process instead, which is what the
/// tests run it in a child for. `icheck` is the executable that serves the
/// other halves (`icheck fabric target` / `initiator`).
pub fn churn(
    icheck: &std::path::Path,
    config: &FabricConfig,
    role: ChurnRole,
    rounds: u32,
    seed: u64,
) -> Result<ChurnReport, SelftestError> {
    let provider = config.provider.clone().unwrap_or_else(|| "auto".into());
    let mut random = seed | 1;
    let mut delay = move || {
        random ^= random << 13;
        random ^= random >> 7;
        random ^= random << 17;
        std::time::Duration::from_micros(random % 40_000)
    };
    let kill_after = |pid: u32, after: std::time::Duration| {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
        })
    };
    let mut report = ChurnReport { rounds, ..ChurnReport::default() };
    match role {
        ChurnRole::Initiator => {
            let spawn_target = |seed: u64| {
                let mut command = Command::new(icheck);
                command.args(["fabric", "target", "--provider", &provider, "--size", &CHURN_BYTES.to_string()]);
                command.args(["--seed", &seed.to_string()]);
                TargetProcess::spawn(command)
            };
            let open = || -> Result<(Endpoint, RegisteredBuffer), SelftestError> {
                let endpoint = Endpoint::new(&Domain::open(config)?)?;
                let local = endpoint.register(AlignedBuffer::zeroed(CHURN_BYTES), Access::LOCAL)?;
                Ok((endpoint, local))
            };
            let (mut endpoint, mut local) = open()?;
            let options = TransferOptions { timeout: std::time::Duration::from_secs(1), ..TransferOptions::default() };
            for round in 0..rounds {
                let mut target = spawn_target(u64::from(round))?;
                let peer = endpoint.insert_peer(&target.announcement().address)?;
                let whole = [RmaOp {
                    local_offset: 0,
                    remote: target.announcement().region,
                    remote_offset: 0,
                    len: CHURN_BYTES,
                }];
                let killer = kill_after(target.pid(), delay());
                let moved = if round % 2 == 0 {
                    endpoint.read(&peer, local.target(), &whole, &options)
                } else {
                    endpoint.write(&peer, local.source(), &whole, &options)
                };
                let _ = killer.join();
                target.kill();
                match moved {
                    Ok(_) => report.completed += 1,
                    Err(icheck_core::fabric::FabricError::Timeout { .. }) => {
                        report.timed_out += 1;
                        (endpoint, local) = open()?;
                    }
                    Err(_) if endpoint.is_closed() => {
                        report.failed += 1;
                        (endpoint, local) = open()?;
                    }
                    Err(_) => report.failed += 1,
                }
            }
            // The endpoint that lived through it all still moves data.
            let target = spawn_target(7)?;
            let peer = endpoint.insert_peer(&target.announcement().address)?;
            let whole =
                [RmaOp { local_offset: 0, remote: target.announcement().region, remote_offset: 0, len: CHURN_BYTES }];
            endpoint.read(&peer, local.target(), &whole, &TransferOptions::default())?;
            verify_pattern(local.as_slice(), 7)
                .map_err(|reason| SelftestError::Mismatch { peer: peer.name().to_string(), reason })?;
            report.reachable_after = true;
        }
        ChurnRole::Target => {
            let target = Target::start(config, CHURN_BYTES, 1)?;
            let announcement = serde_json::to_string(&target.announcement()).expect("announcement serializes");
            let initiator = |timeout: &str| {
                let mut command = Command::new(icheck);
                command.args(["fabric", "initiator", "--provider", &provider, "--peer", &announcement]);
                // Writing the pattern it read keeps the target verifiable.
                command.args(["--read-seed", "1", "--write-seed", "1", "--timeout", timeout]);
                command.stdout(Stdio::null()).stderr(Stdio::null());
                command
            };
            let process = |what: &str, err: std::io::Error| SelftestError::Process(format!("{what}: {err}"));
            for _ in 0..rounds {
                let mut child = initiator("1").spawn().map_err(|e| process("cannot start an initiator", e))?;
                // Past the initiator's start-up (about 20 ms), into its transfer.
                std::thread::sleep(std::time::Duration::from_millis(20) + delay());
                let _ = child.kill();
                let status = child.wait().map_err(|e| process("waiting for an initiator", e))?;
                icheck_core::fabric::remove_shm_regions_of(child.id());
                if status.success() {
                    report.completed += 1;
                } else {
                    report.failed += 1;
                }
            }
            // The last one runs to the end (on a loaded machine too: a long
            // timeout), but not for ever: a post spinning on a lock a killed
            // initiator held is bounded by none of its timeouts. It ends
            // itself once its watchdog sees the spin; should that fail, it
            // is killed here at LAST_INITIATOR_BOUND, so that no initiator
            // outlives this run (one left spinning for minutes once did).
            let mut last = initiator("20")
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| process("cannot start the last initiator", e))?;
            let stderr = last.stderr.take().map(crate::testkit::read_in_background);
            let status = crate::testkit::wait_or_kill(&mut last, LAST_INITIATOR_BOUND);
            if status.is_none() {
                icheck_core::fabric::remove_shm_regions_of(last.id());
            }
            let stderr = stderr.and_then(|reader| reader.join().ok()).unwrap_or_default();
            report.reachable_after = status.is_some_and(|status| status.success());
            if !report.reachable_after {
                let status = status.map_or_else(|| format!("killed after {LAST_INITIATOR_BOUND:?}"), |s| s.to_string());
                tracing::warn!(
                    %status,
                    stderr = %stderr.trim(),
                    "after the churn, a new initiator could not reach this target"
                );
            }
            target.verify(1).map_err(|reason| SelftestError::Mismatch { peer: "this target".into(), reason })?;
        }
    }
    Ok(report)
}
