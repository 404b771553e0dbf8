//! The workspace's programs the benchmarks start, found beside the
//! running benchmark (the same profile's target directory).

use anyhow::{bail, Result};
use std::path::PathBuf;

/// The program `name` built beside this benchmark, or an error naming it
/// and saying how to build it.
pub fn sibling_binary(name: &str) -> Result<PathBuf> {
    let path = std::env::current_exe()?.with_file_name(name);
    if !path.exists() {
        bail!("{} is missing: build the workspace first (cargo build --release --workspace)", path.display());
    }
    Ok(path)
}
