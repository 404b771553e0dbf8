//! SHMR mode: the node's processes stage their labels in one shared
//! segment and the node leader alone commits and fetches it.

use super::*;

/// One process of a node and its labels' places in the node segment.
pub(super) type NodeProcessLabels = (u32, Vec<LabelLayout>);

/// The node segment's labels as one "rank" of the node holds them (its
/// agent's file, its PFS file): every process's labels, at their places in
/// the segment, named `<rank>/<label>`.
pub(super) fn node_layout(staged: Vec<NodeProcessLabels>) -> Vec<LabelLayout> {
    staged
        .into_iter()
        .flat_map(|(who, labels)| {
            labels.into_iter().map(move |l| LabelLayout { label: format!("{who}/{}", l.label), ..l })
        })
        .collect()
}

impl Icheck {
    /// The node leader's `answer` on every process of the node (collective
    /// on the node; the others' answers are not used): its value, or its
    /// error prefixed with `context`.
    pub(super) fn node_leaders_answer<T: serde::Serialize + serde::de::DeserializeOwned>(
        &self,
        answer: std::result::Result<T, String>,
        context: &str,
    ) -> Result<T> {
        let shared = self.comm.node_broadcast(protocol::encode(&answer).unwrap_or_default());
        protocol::decode::<std::result::Result<T, String>>(&shared)
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|message| Error::Unsupported(format!("{context}: {message}")))
    }

    /// SHMR: makes every process of this node map a segment of at least
    /// `len` bytes (collective on the node; `len` is the same on all).
    pub(super) fn ensure_segment(&mut self, len: usize) -> Result<()> {
        let leader = self.comm.node_rank() == 0;
        let shmr_error = |what: &str, err: std::io::Error| Error::Unsupported(format!("SHMR segment: {what}: {err}"));
        if self.segment.is_none() {
            let path = NodeSegment::path_for(&self.app, self.comm.node_index());
            let created = if leader { Some(NodeSegment::create(&path)) } else { None };
            let name = match &created {
                Some(Ok(_)) => path.to_string_lossy().into_owned().into_bytes(),
                _ => Vec::new(),
            };
            let name = self.comm.node_broadcast(name);
            let opened = match created {
                Some(result) => result.map_err(|e| shmr_error(&format!("cannot create {}", path.display()), e)),
                None if name.is_empty() => {
                    Err(Error::Unsupported("SHMR segment: the node leader could not create it".into()))
                }
                None => {
                    let name = String::from_utf8_lossy(&name).into_owned();
                    NodeSegment::open(Path::new(&name)).map_err(|e| shmr_error(&format!("cannot open {name}"), e))
                }
            };
            let statuses = self.comm.node_all_gather(vec![u8::from(opened.is_ok())]);
            if leader && !name.is_empty() {
                // Everyone has it open: drop the name so nothing outlives the job.
                let _ = std::fs::remove_file(&path);
            }
            let segment = opened?;
            if statuses.iter().any(|s| s.as_slice() != [1]) {
                return Err(Error::Unsupported("SHMR segment: a process of this node could not open it".into()));
            }
            self.segment = Some(segment);
        }
        let segment = self.segment.as_mut().expect("set above");
        if segment.len() >= len {
            return Ok(());
        }
        let grown = if leader { segment.grow_file(len) } else { Ok(()) };
        let all_grown = self.comm.node_broadcast(vec![u8::from(grown.is_ok())]) == [1];
        grown.map_err(|e| shmr_error("cannot grow", e))?;
        if !all_grown {
            return Err(Error::Unsupported("SHMR segment: the node leader could not grow it".into()));
        }
        segment.remap().map_err(|e| shmr_error("cannot map", e))
    }

    /// Registers the first `len` bytes of the node segment for one commit
    /// (node leader): the agent reads them (pull), or the leader writes
    /// from them (push). Peers never write into the segment. Dropping the
    /// region ends its exposure to the fabric, so the node's data is
    /// reachable only while a commit moves it.
    fn register_segment(&mut self, len: usize) -> Result<Option<MemoryRegion>> {
        let segment = self.segment.as_mut().ok_or(Error::Order("the SHMR segment is gone"))?;
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: `ensure_segment` mapped at least `len` bytes, and the
        // mapping stays in place while the region lives: only
        // `ensure_segment` remaps it, and every caller of that (commit,
        // restart, finalize) first waits for the commit holding the region;
        // `Icheck`'s drop waits for it too.
        let region = unsafe { self.endpoint.register_raw(segment.as_mut_ptr(), len, Access::REMOTE_READ)? };
        Ok(Some(region))
    }

    /// SHMR commit: every node process copies its labels into the node
    /// segment; the node leader moves the segment to the node's agent.
    pub(super) fn store_shmr(&mut self, version: u64, started: Instant) -> Result<u64> {
        let (staged, total) = self.stage_in_segment()?;
        let layout = node_layout(staged);
        let push = self.direction == TransferDirection::Push;
        let shape = self.shape(self.comm.node_counts().0);
        let Some(mut link) = self.link.take() else {
            // Not the node leader: nothing to move; async still completes in wait().
            if self.asynchronous {
                // Nothing of ours to store again on new agents either.
                let layout = Some(Vec::new());
                self.in_flight = Some(InFlight { version, started, bytes: 0, handle: None, layout });
            }
            return Ok(0);
        };
        let region = match self.register_segment(total as usize) {
            Ok(region) => region,
            Err(err) => {
                self.link = Some(link);
                return Err(err);
            }
        };
        let segment = self.segment.as_ref().expect("ensured");
        // The segment is neither remapped nor written until this version
        // completes: every later call that could do so waits first.
        let (base, len) = (segment.as_slice().as_ptr() as usize, total as usize);
        let endpoint = self.endpoint.clone();
        let kept_layout = layout.clone();
        let send = move |link: &mut AgentLink, region: Option<&MemoryRegion>| -> Result<()> {
            // SAFETY: see above; `len` <= the mapped length (ensure_segment).
            let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
            if region.is_none() && len > 0 {
                return Err(Error::Order("the SHMR segment is not registered"));
            }
            let registered = region.map(|r| (r.source(), r.remote()));
            commit_buffer(link, &endpoint, VersionHeader { version, shape, layout, push }, registered, bytes)
                .map(|_| ())
        };
        if !self.asynchronous {
            let result = send(&mut link, region.as_ref());
            self.link = Some(link);
            // The region is dropped here: the segment leaves the fabric.
            return result.map(|_| total);
        }
        let span = tracing::Span::current();
        let handle = std::thread::Builder::new()
            .name("icheck-async-commit".into())
            .spawn(move || {
                let _entered = span.enter();
                let result = send(&mut link, region.as_ref());
                // Deregistered before the commit counts as finished.
                drop(region);
                Background { link, staging: None, result, blocks: None }
            })
            .map_err(|e| Error::Unsupported(format!("cannot start the async commit thread: {e}")))?;
        let layout = Some(kept_layout);
        self.in_flight = Some(InFlight { version, started, bytes: total, handle: Some(handle), layout });
        Ok(total)
    }

    /// Async SHMR: the node leader stores the version again from the node
    /// segment (untouched until the version completes) through its (new)
    /// agent session; other node processes have nothing to move.
    pub(super) fn restore_segment(&mut self, version: u64, layout: Vec<LabelLayout>) -> Result<u64> {
        let push = self.direction == TransferDirection::Push;
        let shape = self.shape(self.comm.node_counts().0);
        if self.link.is_none() {
            return Ok(0);
        }
        let total: u64 = layout.iter().map(|l| l.len).sum();
        let region = self.register_segment(total as usize)?;
        let segment = self.segment.as_ref().ok_or(Error::Order("the SHMR segment is gone"))?;
        let bytes = &segment.as_slice()[..total as usize];
        let link = self.link.as_mut().expect("checked above");
        let registered = region.as_ref().map(|r| (r.source(), r.remote()));
        if registered.is_none() && total > 0 {
            return Err(Error::Order("the SHMR segment is not registered"));
        }
        commit_buffer(link, &self.endpoint, VersionHeader { version, shape, layout, push }, registered, bytes)
    }

    /// Copies every label of every process of this node into the node
    /// segment (*collective on the node*). Returns, per node process in rank
    /// order, its rank and its labels at their places in the segment, and
    /// the bytes staged in all.
    pub(super) fn stage_in_segment(&mut self) -> Result<(Vec<NodeProcessLabels>, u64)> {
        let rank = self.comm.rank();
        let mine: Vec<(String, DataKind, u64)> =
            self.labels.iter().map(|l| (l.name.clone(), l.source.kind(), l.source.bytes().len() as u64)).collect();
        let encoded = protocol::encode(&(rank, &mine)).map_err(|e| Error::Unsupported(e.to_string()))?;
        let mut staged = Vec::new();
        let mut my_offsets = Vec::new();
        let mut total = 0u64;
        for bytes in self.comm.node_all_gather(encoded) {
            let (who, labels): (u32, Vec<(String, DataKind, u64)>) =
                protocol::decode(&bytes).map_err(|e| Error::Unsupported(format!("node segment layout: {e}")))?;
            let mut placed = Vec::with_capacity(labels.len());
            for (name, kind, len) in labels {
                if who == rank {
                    my_offsets.push(total as usize);
                }
                placed.push(LabelLayout { label: name, kind, offset: total, len, adapt: None });
                total += len;
            }
            staged.push((who, placed));
        }
        self.ensure_segment(total as usize)?;
        let guards: Vec<_> = self.labels.iter().map(|l| l.source.bytes()).collect();
        // Another thread of the application may have resized a region since
        // the layout was agreed; its range in the segment is fixed now.
        if let Some(((name, _, len), guard)) = mine.iter().zip(&guards).find(|((_, _, len), g)| g.len() as u64 != *len)
        {
            return Err(Error::SizeMismatch { label: name.clone(), stored: *len, given: guard.len() as u64 });
        }
        {
            let segment = self.segment.as_mut().expect("ensured");
            let base = segment.as_mut_ptr();
            for (guard, offset) in guards.iter().zip(&my_offsets) {
                // SAFETY: offset..offset+len is this rank's own part of the
                // segment (offsets come from the node-wide layout, which
                // gives every label of every rank a disjoint range inside
                // `total` <= the mapped length); no other process writes it.
                unsafe { std::ptr::copy_nonoverlapping(guard.as_ptr(), base.add(*offset), guard.len()) };
            }
        }
        drop(guards);
        self.comm.node_barrier();
        Ok((staged, total))
    }

    /// SHMR restart: the node leader reads and verifies the node's data into
    /// the segment; every node process then restores from there.
    pub(super) fn fetch_shmr(&mut self, version: u64) -> Result<u64> {
        let wanted = FetchWanted { app: &self.app, rank: self.comm.node_index(), version };
        let bytes = self.version_bytes();
        let same_host = self.restore_same_host;
        let prefault = self.prefault;
        // The leader's answer: where it reads the node's data from (kept)
        // and the manifest (for every node process).
        let mut source = None;
        let fetched: std::result::Result<Manifest, String> = match self.link.as_mut() {
            Some(link) => {
                link.expect_bytes(bytes);
                match fetch_version(link, wanted, same_host) {
                    Ok((_, _, Some(damage))) => Err(damage),
                    Ok((manifest, from, None)) => {
                        source = Some(from);
                        Ok(manifest)
                    }
                    Err(err) => Err(err.to_string()),
                }
            }
            None => Err(String::new()),
        };
        let manifest = self.node_leaders_answer(fetched, "SHMR restart, node leader")?;
        self.ensure_segment(manifest.total_len as usize)?;
        let mut verified: std::result::Result<(), String> = Ok(());
        if let (Some(link), Some(source)) = (self.link.as_mut(), source) {
            let segment = self.segment.as_mut().expect("ensured");
            let base = segment.as_mut_ptr();
            // The leader reads alone while the node's processes wait.
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            for (index, label) in manifest.labels.iter().enumerate() {
                // SAFETY: the label's range lies inside the segment, sized
                // to the manifest's total; only the leader writes it now.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(base.add(label.offset as usize), label.len as usize) };
                let chunk = manifest.chunk_size as usize;
                let crcs = &manifest.crcs[index];
                // A restarted node's segment is new memory, as a rank's is.
                let read = prefault::ahead_of(out, prefault, |out| match &source {
                    ReadFrom::Fabric(region) => {
                        let staging = &self.restore_staging;
                        read_and_verify(
                            &self.endpoint,
                            link.read_peer(),
                            *region,
                            label.offset,
                            out,
                            chunk,
                            crcs,
                            staging,
                            threads > 1,
                        )
                    }
                    ReadFrom::Files(files) => read_files_and_verify(files, label.offset, out, chunk, crcs, threads),
                });
                match read {
                    Ok(None) => {}
                    Ok(Some(bad)) => {
                        verified =
                            Err(format!("label {:?} fails its checksum at bytes {}..", label.label, bad * chunk));
                        break;
                    }
                    Err(err) => {
                        verified = Err(err.to_string());
                        break;
                    }
                }
            }
            if let Err(err) = link.fetch_done() {
                tracing::warn!(%err, "agent did not acknowledge the end of a restart");
            }
        }
        self.node_leaders_answer(verified, "SHMR restart, node leader")?;
        let version = manifest.version;
        self.restored = Some(Restored { manifest, data: RestoredData::Segment });
        Ok(version)
    }
}
