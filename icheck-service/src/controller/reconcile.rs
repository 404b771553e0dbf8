//! Reconciliation of the journal with the stores, as a function without
//! I/O: which journaled version of an application is still restorable from
//! agent memory, given what the managers announced their stores hold.
//!
//! The rule (all-or-nothing): a version counts as complete only if the
//! journal says so *and* every one of its files (one per writer) is
//! present and verified in a store that reported. The newest such version
//! wins; every newer journaled version is dropped with the reason.
//!
//! Architecture invariant: nothing here reads a clock, a file or a socket;
//! the announcements come in as data, which is what lets the tests below
//! cover every disagreement between journal and stores.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use icheck_core::decide;
use icheck_core::protocol::{StoredVersion, VersionRecord};

use super::journal::JournaledVersion;

/// What the managers announced, by node.
pub(super) type Holdings = BTreeMap<String, Vec<StoredVersion>>;

/// The outcome for one application.
#[derive(Debug, PartialEq)]
pub(super) struct Reconciled {
    /// The newest version every store agrees is whole, if any.
    pub(super) latest: Option<VersionRecord>,
    /// Journaled versions newer than that one, each with why it was dropped.
    pub(super) dropped: Vec<String>,
    /// `latest` is not whole: its missing ranks are to be rebuilt from its
    /// redundancy (see [`reconcile_or_rebuild`]).
    pub(super) rebuild: bool,
}

/// Why `version` of `app` is not restorable from the stores: rank
/// `writer`'s file, which [`missing_ranks`] found missing, is damaged or
/// nowhere.
fn missing_reason(app: &str, version: &JournaledVersion, writer: u32, holdings: &Holdings) -> String {
    let number = version.record.version;
    match files_of(app, version, writer, holdings).first() {
        Some((node, stored)) => format!(
            "version {number}: the file of rank {writer} on node {node} is damaged ({})",
            stored.damage.as_deref().unwrap_or("written by another number of processes")
        ),
        None => {
            let nodes: Vec<&str> = holdings.keys().map(String::as_str).collect();
            format!(
                "version {number}: no store holds rank {writer} (nodes that reported: {})",
                if nodes.is_empty() { "none".to_string() } else { nodes.join(", ") }
            )
        }
    }
}

/// The files of rank `writer` of `version` that the stores announced, by node.
fn files_of<'a>(
    app: &str,
    version: &JournaledVersion,
    writer: u32,
    holdings: &'a Holdings,
) -> Vec<(&'a String, &'a StoredVersion)> {
    let number = version.record.version;
    holdings
        .iter()
        .flat_map(|(node, stored)| stored.iter().map(move |s| (node, s)))
        .filter(|(_, s)| s.app == app && s.rank == writer && s.version == number)
        .collect()
}

/// The ranks (writers) of `version` that no store holds whole and verified.
pub(super) fn missing_ranks(app: &str, version: &JournaledVersion, holdings: &Holdings) -> Vec<u32> {
    (0..version.writers)
        .filter(|writer| {
            !files_of(app, version, *writer, holdings)
                .iter()
                .any(|(_, s)| s.damage.is_none() && s.writers == version.writers)
        })
        .collect()
}

/// The newest journaled version of `app` (`versions` oldest first) that
/// the stores in `holdings` hold whole and verified.
#[cfg(test)]
pub(super) fn reconcile(app: &str, versions: &[JournaledVersion], holdings: &Holdings) -> Reconciled {
    reconcile_or_rebuild(app, versions, holdings, |_, _| false)
}

/// The newest journaled version of `app` (`versions` oldest first) that
/// the stores in `holdings` hold whole and verified, or that
/// `rebuildable(version, missing ranks)` says its redundancy can complete
/// (`Reconciled::rebuild`) although the stores do not hold it whole.
pub(super) fn reconcile_or_rebuild(
    app: &str,
    versions: &[JournaledVersion],
    holdings: &Holdings,
    mut rebuildable: impl FnMut(&JournaledVersion, &[u32]) -> bool,
) -> Reconciled {
    let mut dropped = Vec::new();
    for version in versions.iter().rev() {
        let missing = missing_ranks(app, version, holdings);
        let Some(first) = missing.first() else {
            return Reconciled { latest: Some(version.record.clone()), dropped, rebuild: false };
        };
        if rebuildable(version, &missing) {
            return Reconciled { latest: Some(version.record.clone()), dropped, rebuild: true };
        }
        dropped.push(missing_reason(app, version, *first, holdings));
    }
    Reconciled { latest: None, dropped, rebuild: false }
}

/// A manager registered `node` again (restarted, relaunched): why the
/// application's newest complete `version` (written as `writers` files,
/// placed over the agent slots `homes`) is no longer whole on it, or
/// `None` when every file the mapping puts on `node` is there, verified.
pub(super) fn check_node(
    app: &str,
    version: u64,
    writers: u32,
    homes: &[String],
    node: &str,
    stored: &[StoredVersion],
) -> Option<String> {
    let slots = u32::try_from(homes.len()).ok().filter(|s| *s > 0)?;
    let on_node = (0..writers).filter(|r| homes[decide::agent_for_rank(*r, writers, slots) as usize] == node);
    for rank in on_node {
        let file = stored.iter().find(|s| s.app == app && s.rank == rank && s.version == version);
        match file {
            Some(file) if file.damage.is_none() => continue,
            Some(file) => {
                return Some(format!(
                    "version {version}: the file of rank {rank} on node {node} is damaged ({})",
                    file.damage.as_deref().unwrap_or_default()
                ))
            }
            None => {
                return Some(format!(
                    "version {version}: node {node} came back without the file of rank {rank} (its store lost it)"
                ))
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journaled(version: u64, writers: u32) -> JournaledVersion {
        JournaledVersion {
            record: VersionRecord {
                version,
                ranks: writers,
                epoch: 0,
                bytes: 0,
                commit_secs: 0.0,
                completed_unix_ms: 0,
            },
            writers,
        }
    }

    fn stored(rank: u32, version: u64, damage: Option<&str>) -> StoredVersion {
        StoredVersion {
            app: "a".into(),
            rank,
            version,
            writers: 4,
            manifest_crc: 1,
            damage: damage.map(str::to_string),
        }
    }

    fn holdings(nodes: &[(&str, Vec<StoredVersion>)]) -> Holdings {
        nodes.iter().map(|(n, s)| (n.to_string(), s.clone())).collect()
    }

    #[test]
    fn the_newest_journaled_version_held_whole_wins() {
        let versions = [journaled(1, 4), journaled(2, 4)];
        let held = holdings(&[
            ("n1", vec![stored(0, 2, None), stored(1, 2, None), stored(0, 1, None)]),
            ("n2", vec![stored(2, 2, None), stored(3, 2, None)]),
        ]);
        let outcome = reconcile("a", &versions, &held);
        assert_eq!(outcome.latest.map(|l| l.version), Some(2));
        assert!(outcome.dropped.is_empty());
    }

    #[test]
    fn a_version_the_journal_never_recorded_does_not_count_although_every_store_holds_it() {
        let versions = [journaled(1, 4)];
        let all = |v| (0..4).map(|r| stored(r, v, None)).collect::<Vec<_>>();
        let held = holdings(&[("n1", [all(1), all(2)].concat())]);
        assert_eq!(reconcile("a", &versions, &held).latest.map(|l| l.version), Some(1));
    }

    #[test]
    fn a_missing_or_damaged_rank_drops_the_version_and_an_older_whole_one_is_used() {
        let versions = [journaled(1, 4), journaled(2, 4)];
        let mut held = holdings(&[("n1", (0..4).map(|r| stored(r, 1, None)).collect())]);
        held.get_mut("n1").unwrap().extend([stored(0, 2, None), stored(1, 2, None), stored(2, 2, None)]);
        let outcome = reconcile("a", &versions, &held);
        assert_eq!(outcome.latest.map(|l| l.version), Some(1));
        assert_eq!(outcome.dropped, vec!["version 2: no store holds rank 3 (nodes that reported: n1)".to_string()]);

        held.get_mut("n1").unwrap().push(stored(3, 2, Some("label \"x\": chunk 0 does not match")));
        let outcome = reconcile("a", &versions, &held);
        assert_eq!(outcome.latest.map(|l| l.version), Some(1));
        assert!(outcome.dropped[0].contains("rank 3 on node n1 is damaged"), "{:?}", outcome.dropped);
    }

    #[test]
    fn a_version_missing_ranks_wins_only_when_its_redundancy_can_rebuild_them() {
        let versions = [journaled(1, 4), journaled(2, 4)];
        let mut held = holdings(&[("n1", (0..4).map(|r| stored(r, 1, None)).collect())]);
        held.get_mut("n1").unwrap().extend([stored(0, 2, None), stored(2, 2, None)]);
        let asked = std::cell::RefCell::new(Vec::new());
        let outcome = reconcile_or_rebuild("a", &versions, &held, |version, missing| {
            asked.borrow_mut().push((version.record.version, missing.to_vec()));
            version.record.version == 2
        });
        assert_eq!((outcome.latest.map(|l| l.version), outcome.rebuild), (Some(2), true));
        assert!(outcome.dropped.is_empty(), "{:?}", outcome.dropped);
        assert_eq!(asked.into_inner(), vec![(2, vec![1, 3])], "asked once, with every missing rank");
        // Not rebuildable: the older whole version, and why the newer went.
        let outcome = reconcile_or_rebuild("a", &versions, &held, |_, _| false);
        assert_eq!((outcome.latest.map(|l| l.version), outcome.rebuild), (Some(1), false));
        assert_eq!(outcome.dropped, vec!["version 2: no store holds rank 1 (nodes that reported: n1)".to_string()]);
    }

    #[test]
    fn a_node_that_comes_back_must_still_hold_its_ranks_of_the_newest_version() {
        let homes = ["n1".to_string(), "n2".to_string()];
        let all: Vec<StoredVersion> = (0..4).map(|r| stored(r, 7, None)).collect();
        // Ranks 2 and 3 map to n2: n2's files of them decide, n1's do not matter.
        assert_eq!(check_node("a", 7, 4, &homes, "n2", &all[2..]), None);
        let reason = check_node("a", 7, 4, &homes, "n2", &all[..3]).expect("rank 3 is missing");
        assert!(reason.contains("without the file of rank 3"), "{reason}");
        let damaged = [stored(2, 7, None), stored(3, 7, Some("chunk 1 does not match"))];
        let reason = check_node("a", 7, 4, &homes, "n2", &damaged).expect("rank 3 is damaged");
        assert!(reason.contains("rank 3 on node n2 is damaged (chunk 1"), "{reason}");
        assert_eq!(check_node("a", 7, 4, &homes, "n3", &[]), None, "nothing of it maps to n3");
    }

    #[test]
    fn a_verified_copy_elsewhere_outweighs_a_damaged_one() {
        let versions = [journaled(1, 1)];
        let one = |damage| StoredVersion { writers: 1, ..stored(0, 1, damage) };
        let held = holdings(&[("n1", vec![one(Some("bad"))]), ("n2", vec![one(None)])]);
        assert_eq!(reconcile("a", &versions, &held).latest.map(|l| l.version), Some(1));
    }

    #[test]
    fn nothing_held_means_no_version_and_every_one_dropped_with_its_reason() {
        let versions = [journaled(3, 2), journaled(4, 2)];
        let outcome = reconcile("a", &versions, &Holdings::new());
        assert_eq!(outcome.latest, None);
        assert_eq!(
            outcome.dropped,
            vec![
                "version 4: no store holds rank 0 (nodes that reported: none)".to_string(),
                "version 3: no store holds rank 0 (nodes that reported: none)".to_string()
            ]
        );
    }
}
