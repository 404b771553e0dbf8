//! Fabric benchmark: moves a buffer between two processes with fi_read and
//! fi_write over each provider and chunk size, and prints GB/s next to two
//! baselines measured in the same run: a memcpy of the same bytes, and the
//! same bytes through one plain TCP stream over loopback (the kernel path the
//! socket providers ride on, so the ceiling for `tcp` and `sockets`).
//!
//! ```text
//! cargo run --release -p icheck-benches --bin fabric-bench -- --size 1GiB
//! ```

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use icheck_core::fabric::{
    libfabric_version, Access, AlignedBuffer, Domain, Endpoint, FabricConfig, RmaOp, TransferOptions,
};
use icheck_core::units::ByteSize;
use icheck_service::selftest::{fill_pattern, verify_pattern, Target, TargetProcess};

/// Benchmark RMA throughput of the fabric layer against memcpy.
#[derive(Parser)]
struct Cli {
    /// Bytes moved per measurement.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Providers to measure, comma-separated.
    #[arg(long, default_value = "shm,tcp", value_delimiter = ',')]
    providers: Vec<String>,
    /// Chunk sizes (one RMA operation each), comma-separated.
    #[arg(long, default_value = "1MiB,4MiB,16MiB", value_delimiter = ',')]
    chunks: Vec<ByteSize>,
    /// Operations in flight.
    #[arg(long, default_value_t = 8)]
    inflight: usize,
    /// Timed repetitions per cell; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Bytes past a page boundary where the local buffer starts: 0 is
    /// page-aligned; 16 is where a large `malloc` (a `Vec`, an
    /// application's array) puts its memory.
    #[arg(long, default_value_t = 0)]
    local_offset: usize,
    /// Internal: serve as the target process for one provider.
    #[arg(long, hide = true)]
    serve_target: Option<String>,
    /// Internal: send `--size` bytes to this address, for the TCP baseline.
    #[arg(long, hide = true)]
    tcp_sender: Option<std::net::SocketAddr>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// Starts this binary as the target process for `provider`.
fn start_target(provider: &str, size: usize, seed: u64) -> Result<TargetProcess> {
    let mut command = Command::new(std::env::current_exe()?);
    command.args(["--serve-target", provider, "--size", &size.to_string()]).env("ICHECK_BENCH_SEED", seed.to_string());
    TargetProcess::spawn(command).with_context(|| format!("starting the {provider} target"))
}

struct Row {
    provider: String,
    op: &'static str,
    chunk: ByteSize,
    gbps: f64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let size = usize::try_from(cli.size.0)?;
    if let Some(provider) = &cli.serve_target {
        let seed = std::env::var("ICHECK_BENCH_SEED")?.parse()?;
        let target = Target::start(&FabricConfig::provider(provider), size, seed)?;
        target.serve(std::io::stdin().lock(), std::io::stdout().lock())?;
        return Ok(());
    }
    if let Some(address) = cli.tcp_sender {
        return send_tcp_stream(address, size);
    }
    let runs = cli.runs.max(1);

    // Baseline: memcpy of the same bytes between two touched buffers.
    let mut src = AlignedBuffer::zeroed(size);
    fill_pattern(src.as_mut_slice(), 7);
    let mut dst = AlignedBuffer::zeroed(size);
    dst.as_mut_slice().fill(1);
    let memcpy = median(
        (0..runs)
            .map(|_| {
                let start = Instant::now();
                dst.as_mut_slice().copy_from_slice(src.as_slice());
                gbps(size, start.elapsed())
            })
            .collect(),
    );
    drop((src, dst));
    eprintln!("memcpy: {memcpy:.2} GB/s");
    let tcp_stream = median((0..runs).map(|_| tcp_stream_gbps(size)).collect::<Result<_>>()?);
    eprintln!("TCP stream over loopback: {tcp_stream:.2} GB/s");

    let mut rows = Vec::new();
    for provider in &cli.providers {
        let read_seed = 11;
        let mut target = start_target(provider, size, read_seed)?;
        let domain = Domain::open(&FabricConfig::provider(provider))?;
        let endpoint = Endpoint::new(&domain)?;
        let peer = endpoint.insert_peer(&target.announcement().address)?;
        let mut local = endpoint.register(AlignedBuffer::zeroed(size + cli.local_offset), Access::LOCAL)?;
        local.as_mut_slice().fill(0); // touch every page before timing
        let whole = [RmaOp {
            local_offset: cli.local_offset,
            remote: target.announcement().region,
            remote_offset: 0,
            len: size,
        }];
        for &chunk in &cli.chunks {
            let options = TransferOptions {
                chunk_size: usize::try_from(chunk.0)?,
                inflight: cli.inflight,
                timeout: Duration::from_secs(30),
                delivery_complete: true,
            };
            // Read: warm up, verify, then time.
            local.as_mut_slice().fill(0);
            endpoint.read(&peer, local.target(), &whole, &options)?;
            verify_pattern(&local.as_slice()[cli.local_offset..], read_seed)
                .map_err(|reason| anyhow::anyhow!("{provider} fi_read delivered wrong data: {reason}"))?;
            let read = median(
                (0..runs)
                    .map(|_| endpoint.read(&peer, local.target(), &whole, &options).map(|s| s.gb_per_s()))
                    .collect::<Result<_, _>>()?,
            );
            // Write: a new pattern, verified by the target, then timed.
            let write_seed = 100 + chunk.0;
            fill_pattern(&mut local.as_mut_slice()[cli.local_offset..], write_seed);
            endpoint.write(&peer, local.source(), &whole, &options)?;
            target.verify(write_seed).with_context(|| format!("{provider} fi_write delivered wrong data"))?;
            let write = median(
                (0..runs)
                    .map(|_| endpoint.write(&peer, local.source(), &whole, &options).map(|s| s.gb_per_s()))
                    .collect::<Result<_, _>>()?,
            );
            // Restore the read pattern for the next chunk size.
            fill_pattern(&mut local.as_mut_slice()[cli.local_offset..], read_seed);
            endpoint.write(&peer, local.source(), &whole, &options)?;
            eprintln!("{provider} chunk {chunk}: fi_read {read:.2} GB/s, fi_write {write:.2} GB/s");
            rows.push(Row { provider: target.announcement().provider.clone(), op: "fi_read", chunk, gbps: read });
            rows.push(Row { provider: target.announcement().provider.clone(), op: "fi_write", chunk, gbps: write });
        }
    }

    println!(
        "Fabric RMA between two processes: {} per transfer, {} in flight, median of {runs}; {}",
        cli.size,
        cli.inflight,
        libfabric_version()
    );
    println!();
    println!("| provider | operation | chunk | GB/s | × memcpy | × TCP stream |");
    println!("|---|---|---|---:|---:|---:|");
    println!("| (baseline) | memcpy | - | {memcpy:.2} | 1.00 | - |");
    println!("| (baseline) | TCP stream, loopback | 4MiB | {tcp_stream:.2} | {:.2} | 1.00 |", tcp_stream / memcpy);
    for row in rows {
        // Only the socket providers move bytes through the kernel's TCP.
        let over_tcp = if row.provider.starts_with("tcp") || row.provider.starts_with("sockets") {
            format!("{:.2}", row.gbps / tcp_stream)
        } else {
            "-".to_string()
        };
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {over_tcp} |",
            row.provider,
            row.op,
            row.chunk,
            row.gbps,
            row.gbps / memcpy
        );
    }
    Ok(())
}

/// Bytes per `write`/`read` call of the TCP baseline.
const TCP_BLOCK: usize = 4 << 20;

/// The TCP baseline: a second process (this binary with `--tcp-sender`)
/// sends `size` bytes through one TCP connection over loopback in 4 MiB
/// writes, as the fabric targets are second processes too; returns the
/// receiver's GB/s from its first byte to its last.
fn tcp_stream_gbps(size: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the TCP baseline's listener")?;
    let mut sender = Command::new(std::env::current_exe()?)
        .args(["--tcp-sender", &listener.local_addr()?.to_string(), "--size", &size.to_string()])
        .spawn()
        .context("starting the TCP baseline's sender")?;
    let (mut stream, _) = listener.accept()?;
    let mut block = vec![0u8; TCP_BLOCK];
    // The clock starts at the first byte, so the rate covers only what
    // arrives after that first read.
    let first = stream.read(&mut block)?;
    let start = Instant::now();
    let mut received = first;
    while received < size {
        match stream.read(&mut block)? {
            0 => break,
            n => received += n,
        }
    }
    let elapsed = start.elapsed();
    let status = sender.wait()?;
    anyhow::ensure!(
        status.success() && received == size,
        "TCP baseline: received {received} of {size} bytes ({status})"
    );
    Ok(gbps(size - first, elapsed))
}

/// The sending side of the TCP baseline.
fn send_tcp_stream(address: std::net::SocketAddr, size: usize) -> Result<()> {
    let mut stream = TcpStream::connect(address).with_context(|| format!("TCP baseline: connecting to {address}"))?;
    let block = vec![0x5au8; TCP_BLOCK];
    let mut left = size;
    while left > 0 {
        let n = left.min(TCP_BLOCK);
        stream.write_all(&block[..n])?;
        left -= n;
    }
    Ok(())
}
