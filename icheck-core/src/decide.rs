//! Decisions of the controller as pure functions over a snapshot: agent
//! count, node choice and liveness. No sockets, threads or clocks here;
//! the controller passes time in.

#![forbid(unsafe_code)]

use std::time::Duration;

use crate::config::{AgentCountRule, AgentSelection, DynamicConfig, InitAgentCount, NodeSelection};
use crate::protocol::{AppRegistration, TransferMode};

/// A checkpoint node as placement sees it (from its manager's last
/// measurements).
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
    /// Bytes per second its agents moved over the last interval (eq. 6.9).
    pub bandwidth: f64,
    /// Checkpoint operations per minute on the node.
    pub cops_per_min: f64,
    /// Power draw in watts, where the OS exposes it (RAPL).
    pub power_watts: Option<f64>,
    /// Checkpoint bytes its store holds.
    pub bytes_held: u64,
    /// Being drained by an operator: takes no new agents, and its agents
    /// move elsewhere on their applications' next probes.
    pub draining: bool,
}

impl NodeSnapshot {
    /// A live, idle node with `mem_available` bytes free and no measurements yet.
    pub fn idle(node: &str, mem_available: u64) -> NodeSnapshot {
        NodeSnapshot {
            node: node.into(),
            alive: true,
            agents: 0,
            mem_available,
            bandwidth: 0.0,
            cops_per_min: 0.0,
            power_watts: None,
            bytes_held: 0,
            draining: false,
        }
    }
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
    wanted.min(agent_limit(app, config)).max(1)
}

/// What the agent mapping spreads over agents: processes in MR mode, node
/// indices in SHMR mode (one session per node).
pub fn mapping_units(app: &AppRegistration) -> u32 {
    match app.mode {
        TransferMode::Mr => app.ranks,
        TransferMode::Shmr => app.nodes,
    }
}

/// Most agents an application may have (Algorithm 5): its processes (MR)
/// or nodes (SHMR), within `max_agents_app`, and at least 1.
pub fn agent_limit(app: &AppRegistration, config: &DynamicConfig) -> u32 {
    mapping_units(app).min(config.max_agents_app).max(1)
}

/// Algorithm 7, `get_agent_count`: agents after a malleable application
/// went from `before` to `now` mapping units (processes in MR, nodes in
/// SHMR) with `current` agents. MA-RA keeps them; MA-MA keeps the ratio
/// (1:1 stays 1:1, otherwise `current / before × now`, rounded, at least
/// one), within `limit`.
pub fn agents_after_resize(
    strategy: crate::config::AgentChangeStrategy,
    current: u32,
    before: u32,
    now: u32,
    limit: u32,
) -> u32 {
    match strategy {
        crate::config::AgentChangeStrategy::RigidAgents => current,
        crate::config::AgentChangeStrategy::MalleableAgents => {
            let wanted = if current == before {
                now
            } else {
                ((u64::from(current) * u64::from(now) + u64::from(before.max(1)) / 2) / u64::from(before.max(1))) as u32
            };
            wanted.clamp(1, limit.max(1))
        }
    }
}

/// Algorithm 6, `candidate_selection`: the live, undrained nodes with room
/// for an agent and a store below `mem_budget` bytes (0: no limit), best first by `strategy` (BW: least traffic; MEM: most available
/// memory; CP: fewest checkpoint operations per minute; POWER: lowest draw,
/// nodes without a power reading last). Ties go to the node with fewer
/// agents, then more memory, then the name, so the order is total.
pub fn rank_candidates(
    nodes: &[NodeSnapshot],
    strategy: AgentSelection,
    max_agents_node: u32,
    mem_budget: u64,
) -> Vec<&NodeSnapshot> {
    // Never beyond max_mem_node: a node whose store is full takes no agents
    // (its versions would all spill), and a draining node takes none.
    let open = |n: &&NodeSnapshot| {
        n.alive && !n.draining && n.agents < max_agents_node && (mem_budget == 0 || n.bytes_held < mem_budget)
    };
    let mut candidates: Vec<&NodeSnapshot> = nodes.iter().filter(open).collect();
    candidates.sort_by(|a, b| {
        let primary = match strategy {
            AgentSelection::Bandwidth => a.bandwidth.total_cmp(&b.bandwidth),
            AgentSelection::Memory => b.mem_available.cmp(&a.mem_available),
            AgentSelection::CheckpointFrequency => a.cops_per_min.total_cmp(&b.cops_per_min),
            AgentSelection::Power => match (a.power_watts, b.power_watts) {
                (Some(x), Some(y)) => x.total_cmp(&y),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => std::cmp::Ordering::Equal,
            },
        };
        primary.then(a.agents.cmp(&b.agents)).then(b.mem_available.cmp(&a.mem_available)).then(a.node.cmp(&b.node))
    });
    candidates
}

/// Algorithm 6, `agent_placement`: a node for each of `count` agents (in
/// agent order, which is rank-block order). The best `candidate_count`
/// candidates by `agent_selection` take the agents as `node_selection`
/// says; if they lack room, the next candidates are used. Never beyond
/// `max_agents_node`. Fill to completion (FTC) packs: nodes that already
/// run agents come first, so applications stack until a node is full.
pub fn choose_nodes(nodes: &[NodeSnapshot], count: u32, config: &DynamicConfig) -> Result<Vec<String>, PlacementError> {
    if !nodes.iter().any(|n| n.alive) {
        return Err(PlacementError::NoLiveNode);
    }
    let mut ranked =
        rank_candidates(nodes, config.agent_selection, config.max_agents_node, config.max_mem_node_bytes());
    if config.node_selection == NodeSelection::FillToCompletion {
        // Fill to completion packs: nodes already running agents (with room
        // left) are filled before an empty node is started on.
        ranked.sort_by_key(|n| n.agents == 0);
    }
    let room_of = |n: &NodeSnapshot| config.max_agents_node.saturating_sub(n.agents);
    let room: u32 = ranked.iter().map(|n| room_of(n)).sum();
    if room < count {
        return Err(PlacementError::NoCapacity { wanted: count, room });
    }
    // Enough of the best candidates to hold every agent, at least candidate_count.
    let mut take = (config.candidate_count.max(1) as usize).min(ranked.len());
    while ranked[..take].iter().map(|n| room_of(n)).sum::<u32>() < count {
        take += 1;
    }
    let mut slots: Vec<(String, u32, u32)> =
        ranked[..take].iter().map(|n| (n.node.clone(), n.agents, room_of(n))).collect();
    let mut chosen = Vec::with_capacity(count as usize);
    match config.node_selection {
        NodeSelection::RoundRobin => {
            let mut next = 0;
            while chosen.len() < count as usize {
                let slot = &mut slots[next % take];
                if slot.2 > 0 {
                    slot.2 -= 1;
                    chosen.push(slot.0.clone());
                }
                next += 1;
            }
        }
        NodeSelection::Block => {
            // Even blocks of consecutive agents, the first nodes taking one more.
            let per_node = count.div_ceil(take as u32);
            for slot in &mut slots {
                let here = per_node.min(slot.2).min(count - chosen.len() as u32);
                slot.2 -= here;
                chosen.extend(std::iter::repeat_n(slot.0.clone(), here as usize));
            }
            // Nodes short of room leave agents over: fill where room is left.
            for slot in &mut slots {
                let here = slot.2.min(count - chosen.len() as u32);
                slot.2 -= here;
                chosen.extend(std::iter::repeat_n(slot.0.clone(), here as usize));
            }
        }
        NodeSelection::FillToCompletion => {
            for slot in &mut slots {
                let here = slot.2.min(count - chosen.len() as u32);
                chosen.extend(std::iter::repeat_n(slot.0.clone(), here as usize));
            }
        }
        NodeSelection::Equal => {
            // One at a time to the candidate with the fewest agents so far.
            for _ in 0..count {
                let best = slots.iter_mut().filter(|s| s.2 > 0).min_by_key(|s| s.1).expect("room was checked above");
                best.1 += 1;
                best.2 -= 1;
                chosen.push(best.0.clone());
            }
        }
    }
    Ok(chosen)
}

/// Commits after a change of agents that do not count in Algorithm 5: the
/// first versions at new agents create and register their store files
/// (the thesis sees 5-10x slower first transfers, §9.3), later ones reuse
/// a pruned version's memory.
pub const WARM_UP_COMMITS: usize = 2;

/// How much faster (as a fraction) commits must get for a change to count
/// as helping: smaller differences are noise on a shared machine.
pub const MIN_GAIN: f64 = 0.10;

/// What Algorithm 5 remembers about an application between probes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScalingState {
    /// Commit seconds measured before the last change (`old_t_sync`).
    pub before_last_change: Option<f64>,
    /// A change did not help and was undone: no more changes.
    pub settled: bool,
}

/// Algorithm 5, `get_num_agents`, on a probe: the first change multiplies
/// the agents by `factor`; later ones keep going while commits got faster
/// (by at least [`MIN_GAIN`]) than before the last change, and undo the
/// last change (then stop) when they did not. Always at least 1 and at most `limit` (processes in MR,
/// nodes in SHMR, within `max_agents_app`).
pub fn next_agent_count(
    current: u32,
    t_sync: f64,
    state: ScalingState,
    factor: u32,
    limit: u32,
) -> (u32, ScalingState) {
    let factor = factor.max(2);
    let limit = limit.max(1);
    if state.settled {
        return (current, state);
    }
    let grow = |n: u32| n.saturating_mul(factor).min(limit);
    match state.before_last_change {
        Some(before) if t_sync > before * (1.0 - MIN_GAIN) => {
            let back = (current / factor).max(1);
            (back, ScalingState { before_last_change: Some(t_sync), settled: true })
        }
        _ => {
            let next = grow(current);
            let settled = next == current;
            (next, ScalingState { before_last_change: Some(t_sync), settled })
        }
    }
}

/// What a probe decides about an application's agent count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ScalingDecision {
    /// Too few commits since the last change to judge it.
    Wait,
    /// Keep the agents (the new state records why: settled or not).
    Keep(ScalingState),
    /// A change would not pay back before the application ends (eq. 6.11/6.12).
    NotWorthIt {
        /// The count Algorithm 5 wanted.
        wanted: u32,
    },
    /// Move to `to` agents.
    Change {
        /// New agent count.
        to: u32,
        /// State to keep once the change is made.
        state: ScalingState,
    },
}

/// A probe's decision (Algorithm 5 plus eq. 6.11/6.12): `since_change`
/// holds the commit seconds measured since the agents last changed, oldest
/// first; the first [`WARM_UP_COMMITS`] do not count and the rest are
/// averaged into `t_sync`. Growing is assumed to scale commit time with the
/// agent count (`t_new = t_sync * current / next`) and must pay back its
/// cost `t_probe` within the `remaining` commits; shrinking (undoing a
/// change that did not help) always goes ahead.
pub fn scaling_decision(
    since_change: &[f64],
    current: u32,
    state: ScalingState,
    factor: u32,
    limit: u32,
    t_probe: f64,
    remaining: u32,
) -> ScalingDecision {
    if state.settled {
        return ScalingDecision::Keep(state);
    }
    let measured = since_change.get(WARM_UP_COMMITS..).unwrap_or_default();
    if measured.is_empty() {
        return ScalingDecision::Wait;
    }
    let t_sync = measured.iter().sum::<f64>() / measured.len() as f64;
    let (next, new_state) = next_agent_count(current, t_sync, state, factor, limit);
    if next == current {
        return ScalingDecision::Keep(new_state);
    }
    if next > current {
        let t_new = t_sync * f64::from(current) / f64::from(next);
        if !change_pays_back(t_probe, t_sync, t_new, remaining) {
            return ScalingDecision::NotWorthIt { wanted: next };
        }
    }
    ScalingDecision::Change { to: next, state: new_state }
}

/// Eq. 6.11 and 6.12: whether moving to new agents pays back before the
/// application ends. A change costs `t_probe` during which `ncops` commits
/// still run at `t_old`; it pays from commit `n` on. With `remaining`
/// commits hinted (0: unknown, assume it pays), it pays if `remaining >= n`.
pub fn change_pays_back(t_probe: f64, t_old: f64, t_new: f64, remaining: u32) -> bool {
    if remaining == 0 || t_old <= 0.0 || t_new <= 0.0 {
        return true;
    }
    if t_new >= t_old {
        return false;
    }
    let ncops = (t_probe + t_new) / t_old - 1.0;
    let n = ncops * t_old / t_new + 1.0;
    f64::from(remaining) >= n
}

/// Whether a manager whose last heartbeat was `since_last` ago is alive.
pub fn is_alive(since_last: Duration, heartbeat: Duration, missed_allowed: u32) -> bool {
    since_last <= heartbeat * missed_allowed
}

pub use crate::distribution::agent_for_rank;

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
            encrypted: false,
            redundancy: None,
        }
    }

    fn node(name: &str, agents: u32, mem: u64) -> NodeSnapshot {
        NodeSnapshot { agents, ..NodeSnapshot::idle(name, mem) }
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

    fn config(agent: AgentSelection, node: NodeSelection, candidates: u32) -> DynamicConfig {
        DynamicConfig {
            agent_selection: agent,
            node_selection: node,
            candidate_count: candidates,
            max_agents_node: 3,
            ..DynamicConfig::default()
        }
    }

    /// Four nodes whose measurements each favour a different one.
    fn measured() -> Vec<NodeSnapshot> {
        let mut nodes = vec![node("a", 0, 10), node("b", 0, 40), node("c", 1, 20), node("d", 0, 30)];
        let metrics = [(9e9, 2.0, Some(50.0)), (5e9, 9.0, Some(80.0)), (1e9, 5.0, None), (7e9, 0.5, Some(20.0))];
        for (n, (bw, cops, power)) in nodes.iter_mut().zip(metrics) {
            n.bandwidth = bw;
            n.cops_per_min = cops;
            n.power_watts = power;
        }
        nodes
    }

    #[test]
    fn candidates_are_ranked_by_the_selection_strategy() {
        let nodes = measured();
        let order = |s| rank_candidates(&nodes, s, 3, 0).iter().map(|n| n.node.as_str()).collect::<String>();
        assert_eq!(order(AgentSelection::Bandwidth), "cbda");
        assert_eq!(order(AgentSelection::Memory), "bdca");
        assert_eq!(order(AgentSelection::CheckpointFrequency), "dacb");
        assert_eq!(order(AgentSelection::Power), "dabc", "nodes without a power reading come last");
        assert_eq!(rank_candidates(&nodes, AgentSelection::Memory, 1, 0).len(), 3, "full nodes are not candidates");
    }

    #[test]
    fn distribution_table() {
        use AgentSelection::*;
        use NodeSelection::*;
        let nodes = measured();
        let cases: [(AgentSelection, NodeSelection, u32, u32, &[&str]); 7] = [
            (Memory, RoundRobin, 2, 5, &["b", "d", "b", "d", "b"]),
            (Memory, Block, 2, 5, &["b", "b", "b", "d", "d"]),
            (Memory, FillToCompletion, 2, 4, &["c", "c", "b", "b"]), // c runs one already: filled first
            (Memory, Equal, 3, 3, &["b", "d", "b"]),                 // c already runs one
            (Bandwidth, RoundRobin, 1, 2, &["c", "c"]),
            (Bandwidth, RoundRobin, 1, 3, &["c", "b", "c"]), // c has room for 2: the next candidate joins the round
            (CheckpointFrequency, Block, 5, 4, &["d", "a", "c", "b"]),
        ];
        for (agent, node_selection, candidates, count, expected) in cases {
            let chosen = choose_nodes(&nodes, count, &config(agent, node_selection, candidates)).unwrap();
            assert_eq!(chosen, expected, "{agent:?} {node_selection:?} {candidates} candidates, {count} agents");
        }
    }

    #[test]
    fn agent_count_grows_while_it_helps_then_settles() {
        let mut state = ScalingState::default();
        let mut agents = 1;
        // Commit times as agents go 1 -> 2 -> 4 -> 8: faster, faster, slower.
        for (t_sync, expected) in [(8.0, 2), (4.0, 4), (2.5, 8), (3.0, 4), (1.0, 4)] {
            (agents, state) = next_agent_count(agents, t_sync, state, 2, 16);
            assert_eq!(agents, expected, "after a commit of {t_sync} s");
        }
        assert!(state.settled);
        // Bounds: never above the limit, never below 1; at the limit it settles.
        assert_eq!(next_agent_count(3, 1.0, ScalingState::default(), 2, 4).0, 4);
        let (n, s) = next_agent_count(4, 1.0, ScalingState { before_last_change: Some(2.0), settled: false }, 2, 4);
        assert_eq!((n, s.settled), (4, true));
        assert_eq!(next_agent_count(1, 5.0, ScalingState { before_last_change: Some(1.0), settled: false }, 2, 8).0, 1);
    }

    #[test]
    fn agents_after_a_resize_table() {
        use crate::config::AgentChangeStrategy::{MalleableAgents as MaMa, RigidAgents as MaRa};
        // (strategy, agents, before, now, limit) -> agents
        let table = [
            (MaRa, 2, 4, 8, 80, 2),
            (MaRa, 4, 4, 1, 80, 4),
            (MaMa, 4, 4, 8, 80, 8), // 1:1 stays 1:1
            (MaMa, 4, 4, 2, 80, 2),
            (MaMa, 2, 4, 8, 80, 4), // 2:1 stays 2:1
            (MaMa, 2, 8, 2, 80, 1), // 4:1 of 2 processes: one agent
            (MaMa, 2, 4, 1, 80, 1),
            (MaMa, 1, 1, 4, 80, 4),
            (MaMa, 4, 4, 16, 6, 6), // max_agents_app
            (MaMa, 3, 6, 5, 80, 3), // 2.5 rounds to 3
        ];
        for (strategy, current, before, now, limit, want) in table {
            assert_eq!(
                agents_after_resize(strategy, current, before, now, limit),
                want,
                "{strategy:?} {current} agents, {before} -> {now} units, limit {limit}"
            );
        }
    }

    #[test]
    fn probe_decisions_table() {
        use ScalingDecision::*;
        let fresh = ScalingState::default();
        let after_growth = ScalingState { before_last_change: Some(1.0), settled: false };
        let settled = ScalingState { before_last_change: Some(1.0), settled: true };
        // (commit times since the change, current agents, state, limit, remaining) -> decision
        let cases = [
            (vec![], 1, fresh, 8, 0, Wait),
            (vec![5.0, 5.0], 1, fresh, 8, 0, Wait), // warm-up commits only
            (
                vec![5.0, 5.0, 1.0, 1.2],
                1,
                fresh,
                8,
                0,
                Change { to: 2, state: ScalingState { before_last_change: Some(1.1), settled: false } },
            ),
            (
                vec![9.0, 9.0, 0.5],
                2,
                after_growth,
                8,
                0,
                Change { to: 4, state: ScalingState { before_last_change: Some(0.5), settled: false } },
            ),
            // 0.95 s is not 10 % faster than 1.0 s: undo to 1 and settle.
            (
                vec![9.0, 9.0, 0.95],
                2,
                after_growth,
                8,
                0,
                Change { to: 1, state: ScalingState { before_last_change: Some(0.95), settled: true } },
            ),
            (vec![9.0, 9.0, 0.5], 4, settled, 8, 0, Keep(settled)),
            // At the limit: keep and settle.
            (vec![1.0, 1.0, 1.0], 4, fresh, 4, 0, Keep(ScalingState { before_last_change: Some(1.0), settled: true })),
            // Probe costs 2.5 s, commits 1.0 s -> 0.5 s: pays from the 5th commit.
            (vec![1.0, 1.0, 1.0], 1, fresh, 8, 4, NotWorthIt { wanted: 2 }),
            (
                vec![1.0, 1.0, 1.0],
                1,
                fresh,
                8,
                5,
                Change { to: 2, state: ScalingState { before_last_change: Some(1.0), settled: false } },
            ),
        ];
        for (times, current, state, limit, remaining, expected) in cases {
            let got = scaling_decision(&times, current, state, 2, limit, 2.5, remaining);
            assert_eq!(got, expected, "{times:?} with {current} agents, {state:?}, limit {limit}, {remaining} left");
        }
    }

    #[test]
    fn a_change_pays_back_only_with_enough_commits_left() {
        // Probe 2.5 s, commits 1.0 s -> 0.5 s: ncops = 2, n = 5.
        assert!(!change_pays_back(2.5, 1.0, 0.5, 4));
        assert!(change_pays_back(2.5, 1.0, 0.5, 5));
        assert!(change_pays_back(2.5, 1.0, 0.5, 0), "unknown remaining commits: change");
        assert!(!change_pays_back(0.1, 1.0, 1.2, 100), "a slower configuration never pays");
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
    fn full_and_draining_nodes_take_no_agents() {
        let config = DynamicConfig { max_mem_node: 1.0, ..DynamicConfig::default() };
        let full = NodeSnapshot { bytes_held: 1 << 30, ..node("full", 0, 100) };
        let draining = NodeSnapshot { draining: true, ..node("draining", 0, 90) };
        let nodes = [full, draining, node("ok", 0, 10)];
        assert_eq!(choose_nodes(&nodes, 2, &config).unwrap(), ["ok", "ok"]);
    }

    #[test]
    fn liveness_allows_the_configured_misses() {
        let hb = Duration::from_secs(1);
        assert!(is_alive(Duration::from_millis(2900), hb, 3));
        assert!(!is_alive(Duration::from_millis(3100), hb, 3));
    }
}
