//! Decisions of the controller as pure functions over a snapshot: agent
//! count, node choice and liveness. No sockets, threads or clocks here;
//! the controller passes time in.

use std::time::Duration;

use crate::config::{AgentCountRule, DynamicConfig, InitAgentCount};
use crate::protocol::{AppRegistration, TransferMode};

/// A checkpoint node as placement sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSnapshot {
    /// Node name.
    pub node: String,
    /// Whether its manager is alive.
    pub alive: bool,
    /// Agents it runs now.
    pub agents: u32,
    /// Available memory in bytes.
    pub mem_available: u64,
}

/// Why no placement was possible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No live manager at all.
    #[error("no live checkpoint node (is any `icheck manager` running and connected?)")]
    NoLiveNode,
    /// Not enough agent slots.
    #[error("{wanted} agent(s) wanted but the live nodes have room for {room} (max_agents_node)")]
    NoCapacity {
        /// Agents wanted.
        wanted: u32,
        /// Free slots.
        room: u32,
    },
}

/// Agents an application gets at first registration (Algorithm 5, line 16):
/// `init_agent_count`, bounded by at least 1, at most the processes (MR) or
/// nodes (SHMR), and `max_agents_app`.
pub fn initial_agent_count(app: &AppRegistration, config: &DynamicConfig) -> u32 {
    let wanted = match config.init_agent_count {
        InitAgentCount::Fixed(n) => n,
        InitAgentCount::Named(AgentCountRule::NumNodes) => app.nodes,
    };
    let limit = match app.mode {
        TransferMode::Mr => app.ranks,
        TransferMode::Shmr => app.nodes,
    };
    wanted.min(limit).min(config.max_agents_app).max(1)
}

/// Picks a node for each of `count` agents: one at a time, always the live
/// node with the fewest agents (most available memory breaks ties, then the
/// name), never beyond `max_agents_node`. This is round-robin over the
/// least-loaded nodes.
pub fn choose_nodes(nodes: &[NodeSnapshot], count: u32, config: &DynamicConfig) -> Result<Vec<String>, PlacementError> {
    let mut live: Vec<NodeSnapshot> = nodes.iter().filter(|n| n.alive).cloned().collect();
    if live.is_empty() {
        return Err(PlacementError::NoLiveNode);
    }
    let room: u32 = live.iter().map(|n| config.max_agents_node.saturating_sub(n.agents)).sum();
    if room < count {
        return Err(PlacementError::NoCapacity { wanted: count, room });
    }
    let mut chosen = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let best = live
            .iter_mut()
            .filter(|n| n.agents < config.max_agents_node)
            .min_by(|a, b| {
                a.agents.cmp(&b.agents).then(b.mem_available.cmp(&a.mem_available)).then(a.node.cmp(&b.node))
            })
            .expect("room was checked above");
        best.agents += 1;
        chosen.push(best.node.clone());
    }
    Ok(chosen)
}

/// Whether a manager whose last heartbeat was `since_last` ago is alive.
pub fn is_alive(since_last: Duration, heartbeat: Duration, missed_allowed: u32) -> bool {
    since_last <= heartbeat * missed_allowed
}

/// Which of `agents` agents serves `rank` of `ranks` (§7.2.1): contiguous
/// blocks of ranks per agent, the first `ranks mod agents` agents taking one
/// rank more. With `ranks` nodes instead of processes this is the SHMR (N:M)
/// mapping.
pub fn agent_for_rank(rank: u32, ranks: u32, agents: u32) -> u32 {
    assert!(agents > 0 && rank < ranks, "agent_for_rank({rank}, {ranks}, {agents})");
    let (base, extra) = (ranks / agents, ranks % agents);
    // The first `extra` agents serve base+1 ranks each.
    let big = extra * (base + 1);
    if rank < big {
        rank / (base + 1)
    } else {
        extra + (rank - big) / base.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app(ranks: u32, nodes: u32, mode: TransferMode) -> AppRegistration {
        AppRegistration {
            name: "a".into(),
            ranks,
            nodes,
            ranks_per_node: ranks / nodes.max(1),
            mode,
            pfs_interval: 0,
            compression: crate::pfs::CompressionPolicy::Never,
        }
    }

    fn node(name: &str, agents: u32, mem: u64) -> NodeSnapshot {
        NodeSnapshot { node: name.into(), alive: true, agents, mem_available: mem }
    }

    #[test]
    fn ranks_spread_over_agents_in_blocks() {
        let map = |ranks, agents| (0..ranks).map(|r| agent_for_rank(r, ranks, agents)).collect::<Vec<_>>();
        assert_eq!(map(4, 2), vec![0, 0, 1, 1]);
        assert_eq!(map(5, 2), vec![0, 0, 0, 1, 1]);
        assert_eq!(map(7, 3), vec![0, 0, 0, 1, 1, 2, 2]);
        assert_eq!(map(2, 4), vec![0, 1]);
        assert_eq!(map(1, 1), vec![0]);
        for ranks in 1..40 {
            for agents in 1..10 {
                let m = map(ranks, agents);
                assert!(m.windows(2).all(|w| w[0] <= w[1] && w[1] - w[0] <= 1), "{ranks}:{agents} {m:?}");
                let used = agents.min(ranks);
                assert_eq!(*m.last().unwrap(), used - 1, "{ranks}:{agents}");
            }
        }
    }

    #[test]
    fn initial_count_table() {
        let default = DynamicConfig::default();
        let fixed = |n| DynamicConfig { init_agent_count: InitAgentCount::Fixed(n), ..DynamicConfig::default() };
        let capped = DynamicConfig { max_agents_app: 2, ..DynamicConfig::default() };
        let cases = [
            (app(8, 4, TransferMode::Mr), &default, 4),    // one per node
            (app(2, 4, TransferMode::Mr), &default, 2),    // never more than processes (MR)
            (app(8, 2, TransferMode::Shmr), &fixed(6), 2), // never more than nodes (SHMR)
            (app(8, 4, TransferMode::Mr), &fixed(6), 6),
            (app(8, 4, TransferMode::Mr), &capped, 2),  // max_agents_app
            (app(1, 0, TransferMode::Mr), &default, 1), // at least one
        ];
        for (app, config, expected) in cases {
            assert_eq!(initial_agent_count(&app, config), expected, "{app:?} {:?}", config.init_agent_count);
        }
    }

    #[test]
    fn placement_is_round_robin_over_least_loaded() {
        let config = DynamicConfig::default();
        let nodes = [node("n1", 0, 10), node("n2", 0, 20), node("n3", 1, 30)];
        // n2 first (more memory), then n1, then all three have one: n3 (most memory).
        assert_eq!(choose_nodes(&nodes, 4, &config).unwrap(), ["n2", "n1", "n3", "n2"]);
    }

    #[test]
    fn placement_skips_dead_and_full_nodes() {
        let config = DynamicConfig { max_agents_node: 2, ..DynamicConfig::default() };
        let mut dead = node("dead", 0, 100);
        dead.alive = false;
        let nodes = [dead, node("full", 2, 50), node("ok", 0, 10)];
        assert_eq!(choose_nodes(&nodes, 2, &config).unwrap(), ["ok", "ok"]);
        assert_eq!(choose_nodes(&nodes, 3, &config), Err(PlacementError::NoCapacity { wanted: 3, room: 2 }));
        assert_eq!(choose_nodes(&[], 1, &config), Err(PlacementError::NoLiveNode));
    }

    #[test]
    fn liveness_allows_the_configured_misses() {
        let hb = Duration::from_secs(1);
        assert!(is_alive(Duration::from_millis(2900), hb, 3));
        assert!(!is_alive(Duration::from_millis(3100), hb, 3));
    }
}
