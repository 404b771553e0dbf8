//! Reed-Solomon coders on this machine, from one run: the agents' own
//! (`icheck_core::redundancy`, over `rusty_erasure`'s GF(2^8) kernels,
//! coding into the caller's memory) against `reed-solomon-simd` (what the
//! agents used before) and `reed-solomon-erasure` (pure Rust, as built by
//! default), encoding K data shards into M parity shards and rebuilding M
//! lost data shards, a 1 MiB stripe at a time as the agents do, next to
//! memcpy of the same bytes.
//!
//! ```text
//! cargo build --release -p icheck-benches
//! target/release/coding-bench --data 256MiB
//! ```

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use icheck_core::units::ByteSize;

#[derive(Parser)]
#[command(
    about = "Reed-Solomon encode and decode throughput: the agents' coder against reed-solomon-simd and reed-solomon-erasure"
)]
struct Cli {
    /// Bytes of data per group (split over its K data shards).
    #[arg(long, default_value = "256MiB")]
    data: ByteSize,
    /// Bytes of each shard coded at once (the agents' stripe).
    #[arg(long, default_value = "1MiB")]
    stripe: ByteSize,
}

/// Seconds to run `f` over every stripe of `k` shards of `shard` bytes.
fn timed(stripes: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let started = Instant::now();
    for s in 0..stripes {
        f(s)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let stripe = usize::try_from(cli.stripe.0)?;
    let data = usize::try_from(cli.data.0)?;
    let mut rows = Vec::new();
    let src: Vec<u8> = (0..data).map(|i| (i as u8).wrapping_mul(151) ^ (i >> 13) as u8).collect();
    let mut dst = vec![1u8; data];
    // Touched before it is timed, like the shards the coders write.
    std::hint::black_box(&mut dst);
    let started = Instant::now();
    dst.copy_from_slice(&src);
    let memcpy = started.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    for (k, m) in [(2usize, 1usize), (4, 2), (8, 2)] {
        let shard = data / k;
        let stripes = shard / stripe;
        let piece = |s: usize, i: usize| &src[i * shard + s * stripe..i * shard + (s + 1) * stripe];
        // The agents' coder: parity straight into memory of the caller's.
        let mut encoder = icheck_core::redundancy::StripeEncoder::default();
        let mut parity_ours = vec![vec![0u8; stripe]; m];
        let mut first_ours: Vec<Vec<u8>> = Vec::new();
        let enc_ours = timed(stripes, |s| {
            let originals: Vec<&[u8]> = (0..k).map(|i| piece(s, i)).collect();
            let mut out: Vec<&mut [u8]> = parity_ours.iter_mut().map(Vec::as_mut_slice).collect();
            encoder.encode_into(&originals, &mut out)?;
            if s == 0 {
                first_ours = parity_ours.clone();
            }
            Ok(())
        })?;
        let mut decoder = icheck_core::redundancy::StripeDecoder::default();
        let dec_ours = timed(stripes, |s| {
            let originals: Vec<Option<&[u8]>> = (0..k).map(|i| (i >= m).then(|| piece(s, i))).collect();
            let parity: Vec<Option<&[u8]>> = first_ours.iter().map(|p| Some(p.as_slice())).collect();
            let mut right = true;
            // Only stripe 0's parity was kept: check that one.
            decoder.decode(&originals, &parity, |i, shard| right &= s != 0 || shard == piece(0, i))?;
            anyhow::ensure!(right, "the agents' decode differs");
            Ok(())
        })?;
        // reed-solomon-simd
        let mut parity_simd = Vec::new();
        let enc_simd = timed(stripes, |s| {
            let originals: Vec<&[u8]> = (0..k).map(|i| piece(s, i)).collect();
            let parity = reed_solomon_simd::encode(k, m, &originals)?;
            if s == 0 {
                parity_simd = parity;
            }
            Ok(())
        })?;
        let dec_simd = timed(stripes, |s| {
            let kept = (m..k).map(|i| (i, piece(s, i)));
            let recovery = parity_simd.iter().enumerate().map(|(i, p)| (i, p.as_slice()));
            let restored = reed_solomon_simd::decode(k, m, kept, recovery)?;
            // Only stripe 0's parity was kept: check that one.
            if s == 0 {
                for i in 0..m {
                    anyhow::ensure!(restored.get(&i).map(Vec::as_slice) == Some(piece(0, i)), "simd decode differs");
                }
            }
            Ok(())
        })?;
        // reed-solomon-erasure
        let coder = reed_solomon_erasure::galois_8::ReedSolomon::new(k, m).context("reed-solomon-erasure")?;
        let mut first: Vec<Vec<u8>> = Vec::new();
        let enc_erasure = timed(stripes, |s| {
            let mut shards: Vec<Vec<u8>> = (0..k).map(|i| piece(s, i).to_vec()).collect();
            shards.extend((0..m).map(|_| vec![0u8; stripe]));
            coder.encode(&mut shards)?;
            if s == 0 {
                first = shards;
            }
            Ok(())
        })?;
        let dec_erasure = timed(stripes, |s| {
            let mut shards: Vec<Option<Vec<u8>>> = first.iter().cloned().map(Some).collect();
            for lost in shards.iter_mut().take(m) {
                *lost = None;
            }
            // Stripe 0's shards are decoded every time: the same work per stripe.
            std::hint::black_box(s);
            coder.reconstruct_data(&mut shards)?;
            for (i, shard) in shards.iter().enumerate().take(m) {
                anyhow::ensure!(shard.as_deref() == Some(piece(0, i)), "erasure decode differs");
            }
            Ok(())
        })?;
        let gbs = |secs: f64| (stripes * stripe * k) as f64 / secs / 1e9;
        rows.push(format!(
            "| {k}+{m} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} |",
            gbs(enc_ours),
            gbs(enc_simd),
            gbs(enc_erasure),
            gbs(dec_ours),
            gbs(dec_simd),
            gbs(dec_erasure),
            enc_simd / enc_ours,
            dec_simd / dec_ours
        ));
    }
    println!(
        "Reed-Solomon over {} of data per group, {} stripes; memcpy of the same bytes: {:.2} GB/s (one run)",
        cli.data,
        cli.stripe,
        data as f64 / memcpy / 1e9
    );
    println!();
    println!(
        "| K+M | agents' encode GB/s | simd encode GB/s | erasure encode GB/s | agents' decode (M lost) GB/s | simd decode GB/s | erasure decode GB/s | encode time: simd ÷ agents' | decode time: simd ÷ agents' |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        println!("{row}");
    }
    Ok(())
}
