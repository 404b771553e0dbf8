//! Horizontal scaling decisions (thesis §7.3.1): when the controller asks
//! the resource manager for another checkpoint node (Algorithm 8, the
//! proactive scaler) and which nodes it gives back when asked (Algorithm
//! 9's choice of removal candidates). Pure functions over a monitoring
//! snapshot: no I/O, no clock, so that every branch is a table test.
//!
//! Architecture invariant: these functions only decide. Starting managers,
//! moving agents' versions away and releasing allocations belong to the
//! controller and the resource-manager backends, which act on what is
//! decided here.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

/// What the scalers read of one checkpoint node (from its manager's
/// status and the controller's trend, §6.3).
#[derive(Clone, Debug, PartialEq)]
pub struct NodeLoad {
    /// The node's name.
    pub node: String,
    /// MemTotal, bytes.
    pub mem_total: u64,
    /// MemAvailable, bytes.
    pub mem_available: u64,
    /// Rate available memory shrinks, bytes/s (eq. 6.5), once known.
    pub depletion_rate: Option<f64>,
    /// Bytes per second the node's agents moved over the last interval.
    pub bandwidth: f64,
    /// Checkpoint operations per minute.
    pub cops_per_min: f64,
    /// Agents running there.
    pub agents: u32,
}

impl NodeLoad {
    fn used_fraction(&self) -> f64 {
        if self.mem_total == 0 {
            return 0.0;
        }
        self.mem_total.saturating_sub(self.mem_available) as f64 / self.mem_total as f64
    }
}

/// The thresholds of Algorithm 8 (dynamic configuration keys
/// `lower_threshold`, `upper_threshold`, `depletion_threshold`,
/// `bw_threshold`, `cp_threshold`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalingThresholds {
    /// Fraction of a node's memory in use above which it is flagged
    /// (LOWER_THRESHOLD; the thesis's example: 0.8).
    pub lower: f64,
    /// Fraction in use above which a flagged node that keeps filling needs
    /// a new node (UPPER_THRESHOLD; 0.9).
    pub upper: f64,
    /// Depletion rate (bytes/s) that counts as filling fast.
    pub depletion: f64,
    /// Bytes per second moved by a node's agents above which its network
    /// is saturated. The thesis compares the bandwidth *left* with
    /// BW_THRESHOLD; the monitor measures bandwidth *used*, so a node is
    /// flagged when what it moves exceeds this.
    pub bandwidth: f64,
    /// Checkpoint operations per minute above which a node is busy
    /// (CP_THRESHOLD).
    pub cops_per_min: f64,
}

/// How urgently a node is wanted (the Resource Request Message's urgency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Priority {
    /// Versions will not fit without it.
    High,
    /// The service would serve better with it.
    Low,
}

/// What one pass of the proactive scaler does.
#[derive(Clone, Debug, PartialEq)]
pub enum ProactiveAction {
    /// Nothing to ask for.
    Nothing,
    /// Ask the resource manager for a node; `because` names the node(s)
    /// and the measure that decided it.
    Request {
        /// Urgency.
        priority: Priority,
        /// Why, for the log and `icheck status`.
        because: String,
    },
    /// Ask the resource manager whether idle nodes exist (the answer is
    /// read at the next pass: [`ScalerState::idle_nodes`]).
    Query {
        /// Why.
        because: String,
    },
}

/// What the proactive scaler remembers between passes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScalerState {
    /// A Query Message is out (Algorithm 8's `pending_query_request`).
    pub pending_query: bool,
    /// Idle nodes the resource manager reported in answer to the query
    /// (`irm_idle_node_count`).
    pub idle_nodes: u32,
}

/// One pass of Algorithm 8 over `nodes`.
///
/// Memory first: nodes using more than `lower` of their memory are
/// flagged, the others' available memory is pooled. A flagged node above
/// `upper` that is still filling faster than `depletion` needs room: HIGH
/// priority when the pool cannot take the node's *whole* memory (the
/// thesis's conservative estimate: its total, not its used memory), LOW
/// when it could. A flagged node not in that state reserves its total
/// memory from the pool for the next flagged node.
///
/// Then bandwidth: nodes that move more than `bandwidth` while serving more
/// than `cops_per_min` are flagged; with a query pending and idle nodes
/// reported, a LOW request goes out; otherwise a query does.
pub fn proactive(nodes: &[NodeLoad], thresholds: &ScalingThresholds, state: &mut ScalerState) -> ProactiveAction {
    let mut pool: f64 = 0.0;
    let mut flagged = Vec::new();
    for node in nodes {
        if node.used_fraction() > thresholds.lower {
            flagged.push(node);
        } else {
            pool += node.mem_available as f64;
        }
    }
    for node in flagged {
        let filling = node.depletion_rate.is_some_and(|rate| rate > thresholds.depletion);
        if node.used_fraction() > thresholds.upper && filling {
            let priority = if pool < node.mem_total as f64 { Priority::High } else { Priority::Low };
            return ProactiveAction::Request {
                priority,
                because: format!(
                    "{} uses {:.0}% of its memory and fills at {:.1} MB/s; the other nodes have {:.1} GB free for its {:.1} GB",
                    node.node,
                    node.used_fraction() * 100.0,
                    node.depletion_rate.unwrap_or(0.0) / 1e6,
                    pool / 1e9,
                    node.mem_total as f64 / 1e9
                ),
            };
        }
        pool -= node.mem_total as f64;
    }
    let busy: Vec<&NodeLoad> = nodes
        .iter()
        .filter(|n| n.bandwidth > thresholds.bandwidth && n.cops_per_min > thresholds.cops_per_min)
        .collect();
    if busy.is_empty() {
        return ProactiveAction::Nothing;
    }
    let names = busy.iter().map(|n| n.node.as_str()).collect::<Vec<_>>().join(", ");
    if state.pending_query && state.idle_nodes >= 1 {
        state.pending_query = false;
        state.idle_nodes = 0;
        return ProactiveAction::Request {
            priority: Priority::Low,
            because: format!("bandwidth saturated on {names}, and the resource manager has idle nodes"),
        };
    }
    state.pending_query = true;
    ProactiveAction::Query { because: format!("bandwidth saturated on {names}") }
}

/// Algorithm 9's removal candidates: `count` nodes to give back.
///
/// The thesis prefers nodes with the most available memory (the least
/// checkpoint data to move away) and the fewest agents (the fewest
/// applications to move): the first `count` of each order are intersected
/// and taken first, the rest of the places go by available memory. Ties
/// keep the name order, so the choice is deterministic.
pub fn removal_candidates(nodes: &[NodeLoad], count: usize) -> Vec<String> {
    let count = count.min(nodes.len());
    let mut by_memory: Vec<&NodeLoad> = nodes.iter().collect();
    by_memory
        .sort_by(|a, b| b.mem_available.cmp(&a.mem_available).then(a.agents.cmp(&b.agents)).then(a.node.cmp(&b.node)));
    let mut by_agents: Vec<&NodeLoad> = nodes.iter().collect();
    by_agents
        .sort_by(|a, b| a.agents.cmp(&b.agents).then(b.mem_available.cmp(&a.mem_available)).then(a.node.cmp(&b.node)));
    let few_agents: Vec<&str> = by_agents[..count].iter().map(|n| n.node.as_str()).collect();
    let mut chosen: Vec<String> =
        by_memory[..count].iter().filter(|n| few_agents.contains(&n.node.as_str())).map(|n| n.node.clone()).collect();
    for node in &by_memory {
        if chosen.len() == count {
            break;
        }
        if !chosen.contains(&node.node) {
            chosen.push(node.node.clone());
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn node(name: &str, total_gb: u64, available_gb: u64, depletion: Option<f64>) -> NodeLoad {
        NodeLoad {
            node: name.into(),
            mem_total: total_gb * GB,
            mem_available: available_gb * GB,
            depletion_rate: depletion,
            bandwidth: 0.0,
            cops_per_min: 0.0,
            agents: 1,
        }
    }

    fn thresholds() -> ScalingThresholds {
        ScalingThresholds { lower: 0.8, upper: 0.9, depletion: 10e6, bandwidth: 1e9, cops_per_min: 30.0 }
    }

    fn decide(nodes: &[NodeLoad], state: &mut ScalerState) -> ProactiveAction {
        proactive(nodes, &thresholds(), state)
    }

    fn priority(action: &ProactiveAction) -> Option<Priority> {
        match action {
            ProactiveAction::Request { priority, .. } => Some(*priority),
            _ => None,
        }
    }

    #[test]
    fn memory_pressure_table() {
        let fast = Some(50e6);
        let slow = Some(1e6);
        // (nodes, expected request)
        let cases: Vec<(Vec<NodeLoad>, Option<Priority>, &str)> = vec![
            (vec![node("a", 100, 50, fast), node("b", 100, 60, fast)], None, "no node above LOWER"),
            (vec![node("a", 100, 15, slow), node("b", 100, 90, None)], None, "above UPPER but not filling fast"),
            (vec![node("a", 100, 15, None), node("b", 100, 90, None)], None, "no depletion rate measured yet"),
            (
                vec![node("a", 100, 15, fast), node("b", 100, 20, None)],
                None,
                "between LOWER and UPPER: flagged, no request",
            ),
            (
                vec![node("a", 100, 5, fast), node("b", 100, 90, None)],
                Some(Priority::High),
                "pool 90 GB < the node's 100 GB",
            ),
            (
                vec![node("a", 100, 5, fast), node("b", 100, 90, None), node("c", 100, 95, None)],
                Some(Priority::Low),
                "pool 185 GB can take the node's whole 100 GB",
            ),
            (
                vec![
                    node("a", 100, 15, None),
                    node("b", 100, 5, fast),
                    node("c", 100, 95, None),
                    node("d", 100, 90, None),
                ],
                Some(Priority::High),
                "a flagged node first reserves its total: 185 - 100 = 85 GB < 100 GB",
            ),
        ];
        for (nodes, expected, why) in cases {
            let action = decide(&nodes, &mut ScalerState::default());
            assert_eq!(priority(&action), expected, "{why}: {action:?}");
        }
    }

    #[test]
    fn the_conservative_estimate_compares_the_pool_with_total_not_used_memory() {
        // The node uses 95 GB of 100; the others have 98 GB free: enough
        // for what it holds, not for its whole memory: HIGH.
        let nodes = [node("full", 100, 5, Some(50e6)), node("spare", 100, 98, None)];
        let action = decide(&nodes, &mut ScalerState::default());
        assert_eq!(priority(&action), Some(Priority::High), "{action:?}");
        let ProactiveAction::Request { because, .. } = action else { unreachable!() };
        assert!(because.contains("full uses 95%") && because.contains("98.0 GB free for its 100.0 GB"), "{because}");
    }

    #[test]
    fn saturated_bandwidth_queries_first_and_requests_once_idle_nodes_are_reported() {
        let mut busy = node("a", 100, 80, None);
        busy.bandwidth = 2e9;
        busy.cops_per_min = 60.0;
        let quiet = node("b", 100, 80, None);
        let nodes = [busy.clone(), quiet];
        let mut state = ScalerState::default();
        // First pass: a query, no request.
        assert!(matches!(decide(&nodes, &mut state), ProactiveAction::Query { .. }));
        assert!(state.pending_query);
        // The resource manager has no idle node: ask again.
        assert!(matches!(decide(&nodes, &mut state), ProactiveAction::Query { .. }));
        // It reports one: a LOW request, and the query is answered.
        state.idle_nodes = 2;
        assert_eq!(priority(&decide(&nodes, &mut state)), Some(Priority::Low));
        assert_eq!(state, ScalerState::default());
        // Busy by bandwidth alone, or by operations alone: not saturated.
        let mut moving = busy.clone();
        moving.cops_per_min = 10.0;
        let mut frequent = busy;
        frequent.bandwidth = 1e8;
        for node in [moving, frequent] {
            assert_eq!(decide(&[node], &mut ScalerState::default()), ProactiveAction::Nothing);
        }
    }

    #[test]
    fn memory_pressure_wins_over_a_pending_bandwidth_query() {
        let mut state = ScalerState { pending_query: true, idle_nodes: 1 };
        let mut full = node("a", 100, 5, Some(50e6));
        full.bandwidth = 2e9;
        full.cops_per_min = 60.0;
        assert_eq!(priority(&decide(&[full], &mut state)), Some(Priority::High));
        assert!(state.pending_query, "the query stays pending");
    }

    #[test]
    fn removal_takes_nodes_with_the_most_free_memory_and_the_fewest_agents() {
        let with = |name: &str, available: u64, agents: u32| NodeLoad { agents, ..node(name, 100, available, None) };
        let nodes = [with("a", 90, 4), with("b", 80, 0), with("c", 95, 1), with("d", 20, 0), with("e", 80, 2)];
        // Top 2 by free memory: c, a; by agents: b, d. No overlap: by free memory.
        assert_eq!(removal_candidates(&nodes, 2), ["c", "a"]);
        // Top 3: c, a, b / b, d, c: both lists have b and c, taken first (in
        // free-memory order), then a.
        assert_eq!(removal_candidates(&nodes, 3), ["c", "b", "a"]);
        assert_eq!(removal_candidates(&nodes, 9).len(), 5, "never more than there are");
        assert!(removal_candidates(&nodes, 0).is_empty());
        // Equal memory: fewer agents first.
        let tied = [with("x", 50, 3), with("y", 50, 1)];
        assert_eq!(removal_candidates(&tied, 1), ["y"]);
    }
}
