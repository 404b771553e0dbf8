//! Which provider a service uses when nobody named one (`--provider auto`).
//!
//! Pure logic over the provider names libfabric lists, best first
//! ([`super::list_providers`]): no libfabric call here, so the rule is
//! tested without a fabric.
//!
//! * Every daemon and every application on **one host** (`icheck up`
//!   without a resource manager): `shm` where libfabric offers it. It moves
//!   a read with one `process_vm_readv` copy where tcp crosses the loopback
//!   (a send and a receive copy and the protocol around them);
//!   `commit-bench` measured it faster than tcp in every commit row and in
//!   the fabric restarts on this project's machine kind (README,
//!   "Performance"). Without `shm`: `tcp`.
//! * Checkpoint nodes on **other hosts** (a resource manager places them):
//!   libfabric's own first choice, skipping `shm`, which cannot leave a
//!   host. libfabric lists providers by its priority (verbs, cxi, efa, psm
//!   before tcp), which is what "the best the cluster offers" means.

/// Where the service's daemons and applications run, as far as the
/// provider is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Everything on this host.
    OneHost,
    /// Checkpoint nodes (and applications) on other hosts.
    Hosts,
}

/// The provider chosen, and why, in words for the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderChoice {
    /// A provider name as libfabric lists it (`shm`, `tcp;ofi_rxm`, ...).
    pub provider: String,
    /// Why this one.
    pub reason: String,
}

/// The provider without its utility layer: `tcp` of `tcp;ofi_rxm`.
fn core_name(provider: &str) -> &str {
    provider.split(';').next().unwrap_or(provider)
}

/// Chooses among `offered` (libfabric's list, best first; duplicates
/// allowed) for a service whose daemons run as `reach` says. `None`: no
/// provider fits (nothing offered, or only `shm` for other hosts).
pub fn choose_provider<S: AsRef<str>>(offered: &[S], reach: Reach) -> Option<ProviderChoice> {
    let names = || offered.iter().map(AsRef::as_ref);
    match reach {
        Reach::OneHost => {
            if let Some(shm) = names().find(|p| *p == "shm") {
                return Some(ProviderChoice {
                    provider: shm.to_string(),
                    reason: "every daemon runs on this host, and shared memory moves the bytes with one copy \
                             where tcp crosses the loopback (faster in every commit of commit-bench here)"
                        .into(),
                });
            }
            let tcp = names().find(|p| core_name(p) == "tcp").or_else(|| names().next())?;
            Some(ProviderChoice {
                provider: tcp.to_string(),
                reason: "every daemon runs on this host, and libfabric offers no shm provider here".into(),
            })
        }
        Reach::Hosts => {
            let best = names().find(|p| core_name(p) != "shm")?;
            Some(ProviderChoice {
                provider: best.to_string(),
                reason: "the checkpoint nodes are other hosts: libfabric's first choice that leaves the host \
                         (shm cannot)"
                    .into(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_takes_shm_wherever_libfabric_lists_it() {
        let offered = ["tcp;ofi_rxm", "tcp;ofi_rxm", "net", "shm", "sockets"];
        let choice = choose_provider(&offered, Reach::OneHost).unwrap();
        assert_eq!(choice.provider, "shm");
        assert!(choice.reason.contains("this host"), "{}", choice.reason);
    }

    #[test]
    fn one_host_without_shm_takes_tcp_then_the_first() {
        let choice = choose_provider(&["net", "tcp;ofi_rxm", "sockets"], Reach::OneHost).unwrap();
        assert_eq!(choice.provider, "tcp;ofi_rxm");
        assert!(choice.reason.contains("no shm"), "{}", choice.reason);
        assert_eq!(choose_provider(&["sockets", "udp;ofi_rxd"], Reach::OneHost).unwrap().provider, "sockets");
    }

    #[test]
    fn other_hosts_take_libfabrics_first_that_leaves_the_host() {
        let offered = ["shm", "verbs;ofi_rxm", "tcp;ofi_rxm"];
        assert_eq!(choose_provider(&offered, Reach::Hosts).unwrap().provider, "verbs;ofi_rxm");
        assert_eq!(choose_provider(&["tcp;ofi_rxm", "shm"], Reach::Hosts).unwrap().provider, "tcp;ofi_rxm");
    }

    #[test]
    fn nothing_fits_when_nothing_can_reach() {
        assert_eq!(choose_provider::<&str>(&[], Reach::OneHost), None);
        assert_eq!(choose_provider(&["shm"], Reach::Hosts), None);
    }
}
