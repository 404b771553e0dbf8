//! The node segment of SHMR mode: one shared-memory file per node that the
//! node's processes map and copy their labels into; only the node leader
//! registers it and moves it to the agent.
//!
//! The leader creates the file under /dev/shm, the others open it, and once
//! all have it open the leader unlinks the name: the memory lives as long as
//! the processes' descriptors and mappings, so a killed job leaves nothing
//! behind.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

/// One process's view of its node's segment.
pub(crate) struct NodeSegment {
    file: File,
    map: Option<MmapMut>,
}

impl NodeSegment {
    /// A unique name for a new segment of `app` on node `node`.
    pub fn path_for(app: &str, node: u32) -> PathBuf {
        PathBuf::from(format!("/dev/shm/icheck-shmr-{app}-n{node}-{}", std::process::id()))
    }

    /// Creates the segment file (the node leader).
    pub fn create(path: &Path) -> std::io::Result<NodeSegment> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(path)?;
        Ok(NodeSegment { file, map: None })
    }

    /// Opens the leader's segment file (the other processes of the node).
    pub fn open(path: &Path) -> std::io::Result<NodeSegment> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(NodeSegment { file, map: None })
    }

    /// Bytes mapped now.
    pub fn len(&self) -> usize {
        self.map.as_ref().map_or(0, |m| m.len())
    }

    /// Leader: grows the file to `len` bytes.
    pub fn grow_file(&self, len: usize) -> std::io::Result<()> {
        if (self.file.metadata()?.len() as usize) < len {
            self.file.set_len(len as u64)?;
        }
        Ok(())
    }

    /// Maps the file's current size (after the leader grew it).
    pub fn remap(&mut self) -> std::io::Result<()> {
        self.map = None;
        if self.file.metadata()?.len() == 0 {
            return Ok(());
        }
        // SAFETY: the file is private to this job's processes, which only
        // grow it (never truncate it) and remap after every growth, so the
        // mapping never extends past the end of the file.
        self.map = Some(unsafe { MmapMut::map_mut(&self.file)? });
        Ok(())
    }

    /// The start of the mapping, for registration and copies.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.map.as_mut().map_or(std::ptr::null_mut(), |m| m.as_mut_ptr())
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}
