//! The PFS fallback: while the service is unreachable, versions go straight
//! to the PFS level in the agents' format, and the service is tried again
//! every `T_wait`.

use super::*;

impl Icheck {
    /// Fallback commit (*collective*): one writer per node (thesis §9.4.1.4)
    /// writes that node's files to the PFS partial version, then rank 0
    /// completes it from the entries.
    pub(super) fn commit_fallback(&mut self, version: u64) -> Result<()> {
        let pfs = self.fallback.clone().expect("fallback mode");
        let (rank, ranks) = (self.comm.rank(), self.comm.size());
        let fail = |e: icheck_core::pfs::PfsError| Error::Unsupported(format!("fallback write to the PFS: {e}"));
        let started = Instant::now();
        let written = self.write_node_to_pfs(&pfs, version);
        let write_ms = started.elapsed().as_secs_f64() * 1e3;
        if !self.comm.all_true(written.is_ok()) {
            written?;
            return Err(self.incomplete(version, "another rank could not write its data to the PFS".into()));
        }
        let completed = if rank == 0 {
            // A file per process, or per node in SHMR mode (as its agents
            // would have stored it).
            let files = match self.mode {
                TransferMode::Mr => ranks,
                TransferMode::Shmr => self.comm.node_counts().0,
            };
            let completed = pfs
                .partial_entries(&self.app, version, files)
                .and_then(|entries| pfs.complete(&self.app, version, ranks, "library", self.mode, entries))
                .map_err(fail);
            if completed.is_ok() {
                // This job is the only writer now: older partial versions
                // (a killed run's, a failed copy's) can never complete.
                if let Err(err) = pfs.remove_stale_partials(&self.app, version, &Default::default()) {
                    tracing::warn!(%err, "cannot remove abandoned partial PFS versions");
                }
            }
            completed
        } else {
            Ok(())
        };
        if !self.comm.all_true(completed.is_ok()) {
            completed?;
            return Err(self.incomplete(version, "rank 0 could not complete the version on the PFS".into()));
        }
        let epoch = self.epoch;
        self.latest = Some(VersionRecord { version, ranks, epoch, bytes: 0, commit_secs: 0.0, completed_unix_ms: 0 });
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(version, write_ms, total_ms, "version written directly to the PFS");
        Ok(())
    }

    /// The node's processes stage their labels in the node segment, and the
    /// node leader writes the node's files from there (fewer writers contend
    /// for the PFS) in the agents' format of the mode: one file per process
    /// (MR), or the node's one file with its processes' labels named
    /// `<rank>/<label>` (SHMR), so that the service's agents restart either.
    pub(super) fn write_node_to_pfs(&mut self, pfs: &icheck_core::pfs::PfsStore, version: u64) -> Result<()> {
        let staging = Instant::now();
        let (staged, _) = self.stage_in_segment()?;
        tracing::debug!(stage_ms = staging.elapsed().as_secs_f64() * 1e3, "staged in the node segment");
        if self.comm.node_rank() != 0 {
            return Ok(());
        }
        let segment = self.segment.as_ref().expect("staged");
        let bytes = segment.as_slice();
        // Each file as (its "rank", of how many, its labels in the segment).
        let files: Vec<(u32, u32, Vec<LabelLayout>)> = match self.mode {
            TransferMode::Mr => staged.into_iter().map(|(who, labels)| (who, self.comm.size(), labels)).collect(),
            TransferMode::Shmr => vec![(self.comm.node_index(), self.comm.node_counts().0, node_layout(staged))],
        };
        for (rank, ranks, labels) in files {
            let parts: Vec<&[u8]> =
                labels.iter().map(|l| &bytes[l.offset as usize..(l.offset + l.len) as usize]).collect();
            let base = labels.first().map_or(0, |l| l.offset);
            let manifest = Manifest {
                app: self.app.clone(),
                rank,
                ranks,
                epoch: self.epoch,
                version,
                total_len: parts.iter().map(|p| p.len() as u64).sum(),
                chunk_size: CHUNK_SIZE,
                crcs: label_crcs(&parts),
                labels: labels.into_iter().map(|l| LabelLayout { offset: l.offset - base, ..l }).collect(),
                sealed_unix_ms: 0,
            };
            pfs.write_rank_parts(&manifest, &parts)
                .map_err(|e| Error::Unsupported(format!("fallback write to the PFS: {e}")))?;
        }
        Ok(())
    }

    /// Opens this process's session with its agent among `agents`, on a
    /// new endpoint if a stalled transfer gave the old one up.
    pub(super) fn open_own_link(&mut self, agents: &[AgentInfo]) -> Result<Option<AgentLink>> {
        self.renew_endpoint_if_closed();
        open_link(self.comm.as_ref(), self.mode, &self.endpoint, agents, &self.access, &self.app, self.waits())
    }

    /// A transfer that had no completion within its stall bound (a pushed
    /// version's writes to an agent behind a cut) closes this process's
    /// endpoint, so that no late completion can touch memory reused since.
    /// Sessions with new agents need a live one: a new endpoint opens on
    /// the same domain, where registrations stay valid (they are
    /// domain-wide on tcp and shm; where a provider binds them to an
    /// endpoint, the closed one stays, and sessions fail naming it).
    /// Before, every later session of the process failed ("the fabric
    /// endpoint was closed after an earlier timeout") and the job wrote to
    /// the PFS for the rest of its run.
    fn renew_endpoint_if_closed(&mut self) {
        if !self.endpoint.is_closed() {
            return;
        }
        if !self.endpoint.registrations_are_domain_wide() {
            tracing::warn!("the fabric endpoint was closed after a stalled transfer, and this provider binds registrations to it: not opening another");
            return;
        }
        match self.endpoint.sibling() {
            Ok(endpoint) => {
                tracing::warn!("the fabric endpoint was closed after a stalled transfer; opened a new one");
                self.endpoint = endpoint;
            }
            Err(err) => tracing::warn!(%err, "cannot open a new fabric endpoint after a stalled transfer"),
        }
    }

    /// Fallback (*collective*): tries to register with the service again;
    /// when it answers with agents, every rank opens its session and the
    /// library is back on RDMA (the service restarts from the PFS versions
    /// written meanwhile, which use the agents' format).
    pub(super) fn try_service_again(&mut self) {
        self.fallback_tried = Instant::now();
        let mut answer = Vec::new();
        let mut connection = None;
        if self.comm.rank() == 0 {
            let mut link =
                ControllerLink::new(&self.config, &self.access.token, self.connect_timeout, CONTROLLER_TIMEOUT);
            let request = ClientRequest::RegisterApp {
                registration: self.registration.clone(),
                capability: self.access.presented(),
                uid: icheck_core::credentials::current_uid(),
            };
            let mut result: std::result::Result<ClientReply, String> =
                link.request(&request).map_err(|e| e.to_string());
            if let Ok(ClientReply::Registered { capability, .. }) = &result {
                if let Err(err) = self.keep_capability(capability) {
                    result = Err(err.to_string());
                }
            }
            if result.is_ok() {
                connection = Some(link);
            }
            answer = protocol::encode(&result).unwrap_or_default();
        }
        let answer = self.comm.broadcast_from_root(answer);
        let agents = match protocol::decode::<std::result::Result<ClientReply, String>>(&answer) {
            Ok(Ok(ClientReply::Registered { agents, capability, .. })) if !agents.is_empty() => {
                self.access.capability = capability;
                agents
            }
            Ok(Err(refused)) if refused.contains("capability") => {
                tracing::error!(%refused, "the service refused this application; staying on the PFS");
                return;
            }
            _ => return, // still unreachable: keep writing to the PFS
        };
        let link = self.open_own_link(&agents);
        if !self.comm.all_true(link.is_ok()) {
            tracing::warn!("the service answered but not every rank reached its agent; staying on the PFS");
            return;
        }
        tracing::warn!("the service is reachable again: checkpoints go to its agents");
        self.link = link.ok().flatten();
        self.agents = agents;
        self.controller = connection;
        self.fallback = None;
    }

    /// Fallback restart: this rank's data, verified, from the PFS.
    /// In SHMR mode the node leader reads the node's file into the node
    /// segment, and the node's processes restore from there.
    pub(super) fn fetch_fallback(&mut self, version: u64) -> Result<u64> {
        let pfs = self.fallback.clone().expect("fallback mode");
        let fail = |e: icheck_core::pfs::PfsError| Error::Unsupported(format!("restart from the PFS: {e}"));
        let manifest = pfs.manifest(&self.app, version).map_err(fail)?;
        if let Some(written) = manifest.mode.filter(|written| *written != self.mode) {
            let place = format!("the PFS at {}", pfs.root().display());
            return Err(Error::Unsupported(written.cannot_restore_in(self.mode, &self.app, version, &place)));
        }
        if self.mode == TransferMode::Mr {
            let (rank_manifest, data) = pfs.read_rank(&manifest, self.comm.rank()).map_err(fail)?;
            self.restored = Some(Restored { manifest: rank_manifest, data: RestoredData::Local(data) });
            return Ok(version);
        }
        let read = (self.comm.node_rank() == 0).then(|| pfs.read_rank(&manifest, self.comm.node_index()));
        let answer: std::result::Result<Manifest, String> = match &read {
            Some(Ok((node_manifest, _))) => Ok(node_manifest.clone()),
            Some(Err(err)) => Err(err.to_string()),
            None => Err(String::new()),
        };
        let node_manifest = self.node_leaders_answer(answer, "SHMR restart from the PFS, node leader")?;
        self.ensure_segment(node_manifest.total_len as usize)?;
        if let Some(Ok((_, data))) = read {
            let segment = self.segment.as_mut().expect("ensured");
            // SAFETY: the segment maps at least `total_len` bytes, which
            // `read_rank` checked `data` holds; the node's other processes
            // wait at the barrier below and only read the segment after it.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), segment.as_mut_ptr(), data.len()) };
        }
        self.comm.node_barrier();
        self.restored = Some(Restored { manifest: node_manifest, data: RestoredData::Segment });
        Ok(version)
    }
}
