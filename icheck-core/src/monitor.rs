//! Monitoring (thesis §6.3): what managers measure on their node and what
//! the controller derives from a node's successive reports. Pure state
//! machines fed with samples and times, so every formula is unit-tested;
//! the only I/O is [`read_rapl_energy`].
//!
//! Architecture invariant: nothing here invents a value. A metric that
//! cannot be computed yet (one sample only) or at all (no RAPL counters) is
//! `None`, and the status API and `/metrics` show it as unavailable.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::path::Path;

/// Window of checkpoint operations counted for ncops/min.
const COPS_WINDOW_SECS: f64 = 60.0;
/// Memory samples kept for the depletion rate and the forecast.
const MEM_SAMPLES: usize = 30;

/// A node's checkpoint activity, as the manager measures it from its agents'
/// counters: ncops (eq. 6.6), Δcop (eq. 6.7), ncops/min, and the aggregate
/// bandwidth of the last interval (eq. 6.9).
#[derive(Debug, Default)]
pub struct NodeActivity {
    /// (time, total operations) samples within the last minute.
    ops: VecDeque<(f64, u64)>,
    /// Time of the last sample with new operations, and the one before.
    last_op_at: Option<f64>,
    cop_interval: Option<f64>,
    /// (time, total bytes moved) of the previous sample.
    previous_bytes: Option<(f64, u64)>,
    bandwidth: f64,
    /// Operations counted by agents that have stopped since: the totals
    /// are sums over the running agents, so they drop when one stops; added
    /// back, the node's count never goes down.
    ops_of_stopped_agents: u64,
    /// Each running agent's (operations, bytes moved) at the last
    /// [`sample_agents`](Self::sample_agents), by agent id.
    running: std::collections::BTreeMap<u64, (u64, u64)>,
    /// What agents that have stopped had counted: (operations, bytes).
    retired: (u64, u64),
}

/// One agent's counters as its manager reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentCounts {
    /// The agent's id (unique on the node for the manager's life).
    pub agent: u64,
    /// Versions it sealed.
    pub operations: u64,
    /// Bytes it moved.
    pub bytes: u64,
}

impl NodeActivity {
    /// Feeds the counters of the agents running at `now`. The node's totals
    /// count every agent it ever ran: an agent that stopped (absent here)
    /// keeps its last counts, so the totals are monotonic counters even
    /// when one agent ends while another works in the same interval.
    pub fn sample_agents(&mut self, now: f64, agents: &[AgentCounts]) {
        let mut running = std::collections::BTreeMap::new();
        for counts in agents {
            let now_counts = (counts.operations, counts.bytes);
            // A counter that went back belongs to a new life: the old one retires.
            if let Some(&before) = self.running.get(&counts.agent) {
                if now_counts.0 < before.0 || now_counts.1 < before.1 {
                    self.retire(before);
                }
            }
            running.insert(counts.agent, now_counts);
        }
        let stopped: Vec<(u64, u64)> =
            self.running.iter().filter(|(id, _)| !running.contains_key(id)).map(|(_, c)| *c).collect();
        for counts in stopped {
            self.retire(counts);
        }
        self.running = running;
        let (ops, bytes) = self.running.values().fold(self.retired, |(o, b), (ao, ab)| (o + ao, b + ab));
        self.sample(now, ops, bytes);
    }

    fn retire(&mut self, (operations, bytes): (u64, u64)) {
        self.retired.0 += operations;
        self.retired.1 += bytes;
    }

    /// Checkpoint bytes that arrived at the node's agents since the
    /// manager started (an incremental version counts its changed blocks
    /// only), as of the last [`Self::sample_agents`].
    pub fn total_bytes(&self) -> u64 {
        self.running.values().fold(self.retired.1, |total, (_, bytes)| total + bytes)
    }

    /// Checkpoint operations the node's agents served since the manager
    /// started: never lower than an earlier value.
    pub fn total_operations(&self) -> u64 {
        self.ops.back().map_or(0, |(_, ops)| *ops)
    }

    /// Feeds the totals read at `now` (seconds on any monotonic clock).
    pub fn sample(&mut self, now: f64, total_ops: u64, total_bytes: u64) {
        let mut total_ops = total_ops + self.ops_of_stopped_agents;
        if let Some(&(_, last)) = self.ops.back() {
            if total_ops < last {
                self.ops_of_stopped_agents += last - total_ops;
                total_ops = last;
            }
        }
        if self.ops.back().is_some_and(|(_, ops)| total_ops > *ops) {
            if let Some(last) = self.last_op_at {
                self.cop_interval = Some(now - last);
            }
            self.last_op_at = Some(now);
        }
        self.ops.push_back((now, total_ops));
        while self.ops.len() > 1 && self.ops.front().is_some_and(|(t, _)| now - t > COPS_WINDOW_SECS) {
            self.ops.pop_front();
        }
        if let Some((then, bytes)) = self.previous_bytes {
            let dt = now - then;
            if dt > 0.0 {
                self.bandwidth = total_bytes.saturating_sub(bytes) as f64 / dt;
            }
        }
        self.previous_bytes = Some((now, total_bytes));
    }

    /// Checkpoint operations per minute over the window (0 with one sample).
    pub fn cops_per_min(&self) -> f64 {
        match (self.ops.front(), self.ops.back()) {
            (Some((t0, n0)), Some((t1, n1))) if t1 > t0 => n1.saturating_sub(*n0) as f64 * 60.0 / (t1 - t0),
            _ => 0.0,
        }
    }

    /// Seconds between the last two samples that saw new operations (Δcop).
    pub fn cop_interval(&self) -> Option<f64> {
        self.cop_interval
    }

    /// Bytes per second moved by all agents since the previous sample.
    pub fn bandwidth(&self) -> f64 {
        self.bandwidth
    }
}

/// Power from RAPL package energy counters: watts between two readings,
/// handling the counter's wrap-around.
#[derive(Debug, Default)]
pub struct PowerMeter {
    previous: Option<(f64, EnergyReading)>,
    watts: Option<f64>,
}

/// Summed RAPL package energy and the counters' wrap range, in µJ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnergyReading {
    /// Energy counted, µJ.
    pub energy_uj: u64,
    /// The value at which the counters wrap, µJ.
    pub max_uj: u64,
}

impl PowerMeter {
    /// Feeds a reading taken at `now` (None: the OS exposes no counters).
    pub fn sample(&mut self, now: f64, reading: Option<EnergyReading>) {
        let Some(reading) = reading else {
            self.previous = None;
            self.watts = None;
            return;
        };
        if let Some((then, before)) = self.previous {
            let dt = now - then;
            let used = if reading.energy_uj >= before.energy_uj {
                reading.energy_uj - before.energy_uj
            } else {
                reading.max_uj.saturating_sub(before.energy_uj) + reading.energy_uj
            };
            if dt > 0.0 {
                self.watts = Some(used as f64 / 1e6 / dt);
            }
        }
        self.previous = Some((now, reading));
    }

    /// Watts over the last interval, if measurable.
    pub fn watts(&self) -> Option<f64> {
        self.watts
    }
}

/// Reads the package-level RAPL counters under `powercap` (normally
/// /sys/class/powercap): `intel-rapl:N/energy_uj` summed over packages.
/// None when there are none or they are not readable (VMs, non-root).
pub fn read_rapl_energy(powercap: &Path) -> Option<EnergyReading> {
    let mut total = EnergyReading { energy_uj: 0, max_uj: 0 };
    let mut found = false;
    for entry in std::fs::read_dir(powercap).ok()?.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        // Packages only ("intel-rapl:0"), not their subzones ("intel-rapl:0:0").
        if !name.starts_with("intel-rapl:") || name.matches(':').count() != 1 {
            continue;
        }
        let read =
            |file: &str| -> Option<u64> { std::fs::read_to_string(entry.path().join(file)).ok()?.trim().parse().ok() };
        if let (Some(energy), Some(max)) = (read("energy_uj"), read("max_energy_range_uj")) {
            total.energy_uj += energy;
            total.max_uj += max;
            found = true;
        }
    }
    found.then_some(total)
}

/// What the controller derives from a node's successive reports: the memory
/// depletion rate (eq. 6.5), a short-horizon min/max forecast of available
/// memory, and the agent filling rate (eq. 6.10).
#[derive(Debug, Default)]
pub struct NodeTrend {
    /// (time, available bytes, agents).
    samples: VecDeque<(f64, u64, u32)>,
    /// The node's memory, as last reported: no forecast exceeds it.
    mem_total: Option<u64>,
}

/// The derived metrics of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrendReport {
    /// Bytes per second available memory shrinks (negative: it grows), eq. 6.5.
    pub mem_depletion_rate: Option<f64>,
    /// Lowest and highest available memory expected `horizon` seconds ahead.
    pub mem_forecast: Option<(u64, u64)>,
    /// The forecast's horizon in seconds.
    pub horizon_secs: f64,
    /// Agents started per second over the window (negative: stopped), eq. 6.10.
    pub agent_fill_rate: Option<f64>,
}

impl NodeTrend {
    /// Records a report received at `now`.
    pub fn sample(&mut self, now: f64, mem_available: u64, agents: u32) {
        self.sample_with_total(now, mem_available, None, agents);
    }

    /// Records a report received at `now` from a node with `mem_total`
    /// bytes of memory (None: unknown), which bounds every forecast.
    pub fn sample_with_total(&mut self, now: f64, mem_available: u64, mem_total: Option<u64>, agents: u32) {
        if let Some(total) = mem_total.filter(|t| *t > 0) {
            self.mem_total = Some(total);
        }
        self.samples.push_back((now, mem_available, agents));
        while self.samples.len() > MEM_SAMPLES {
            self.samples.pop_front();
        }
    }

    /// The derived metrics, forecasting `horizon` seconds ahead: a least-
    /// squares line through the window, widened by the largest deviation
    /// from it that the window saw.
    pub fn report(&self, horizon: f64) -> TrendReport {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return TrendReport { horizon_secs: horizon, ..TrendReport::default() };
        };
        let span = last.0 - first.0;
        if self.samples.len() < 2 || span <= 0.0 {
            return TrendReport { horizon_secs: horizon, ..TrendReport::default() };
        }
        let depletion = (first.1 as f64 - last.1 as f64) / span;
        let fill = (f64::from(last.2) - f64::from(first.2)) / span;
        let n = self.samples.len() as f64;
        let mean_t = self.samples.iter().map(|s| s.0).sum::<f64>() / n;
        let mean_m = self.samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
        let var_t: f64 = self.samples.iter().map(|s| (s.0 - mean_t).powi(2)).sum();
        let cov: f64 = self.samples.iter().map(|s| (s.0 - mean_t) * (s.1 as f64 - mean_m)).sum();
        let slope = if var_t > 0.0 { cov / var_t } else { 0.0 };
        let at = |t: f64| mean_m + slope * (t - mean_t);
        let spread = self.samples.iter().map(|s| (s.1 as f64 - at(s.0)).abs()).fold(0.0, f64::max);
        let ahead = at(last.0 + horizon);
        // Available memory is never below zero nor above the node's memory.
        let ceiling = self.mem_total.map_or(f64::MAX, |t| t as f64);
        let clamp = |x: f64| x.clamp(0.0, ceiling) as u64;
        TrendReport {
            mem_depletion_rate: Some(depletion),
            mem_forecast: Some((clamp(ahead - spread), clamp(ahead + spread))),
            horizon_secs: horizon,
            agent_fill_rate: Some(fill),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The totals are sums over running agents: one stopping makes them
    /// drop. That used to underflow (and, in a debug build, panic the
    /// manager's heartbeat task, leaving its node silent with its
    /// connection open).
    #[test]
    fn an_agent_stopping_does_not_make_the_operation_count_go_back() {
        let mut activity = NodeActivity::default();
        activity.sample(0.0, 10, 1000);
        activity.sample(1.0, 12, 2000);
        activity.sample(2.0, 3, 500); // an agent with 9 operations stopped
        activity.sample(3.0, 5, 900);
        // 10 -> 14 operations over 3 s; the drop at 2 s is no operation.
        assert!((activity.cops_per_min() - 4.0 * 60.0 / 3.0).abs() < 1e-9, "{}", activity.cops_per_min());
        assert_eq!(activity.cop_interval(), Some(2.0));
    }

    #[test]
    fn node_totals_are_monotonic_counters_across_agents_lives() {
        let counts = |agent, operations, bytes| AgentCounts { agent, operations, bytes };
        let mut activity = NodeActivity::default();
        activity.sample_agents(0.0, &[counts(1, 10, 1000), counts(2, 5, 500)]);
        assert_eq!(activity.total_operations(), 15);
        // Agent 1 ends while agent 2 seals more in the same interval: the
        // running sum (20) would hide the 10 operations that left with it.
        activity.sample_agents(1.0, &[counts(2, 20, 2000)]);
        assert_eq!(activity.total_operations(), 30);
        assert!((activity.bandwidth() - 1500.0).abs() < 1e-9, "{}", activity.bandwidth());
        // Every agent ends: nothing goes back, and the rate stays sane.
        activity.sample_agents(2.0, &[]);
        assert_eq!(activity.total_operations(), 30);
        assert_eq!(activity.bandwidth(), 0.0);
        assert!((activity.cops_per_min() - 15.0 * 60.0 / 2.0).abs() < 1e-9, "{}", activity.cops_per_min());
        // A new agent starts from zero; a reused id whose counter went back
        // is a new life, not negative work.
        activity.sample_agents(3.0, &[counts(3, 2, 100), counts(2, 1, 10)]);
        assert_eq!(activity.total_operations(), 33);
        assert!(activity.cops_per_min() >= 0.0 && activity.cops_per_min() < 1e6);
    }

    #[test]
    fn activity_counts_operations_intervals_and_bandwidth() {
        let mut activity = NodeActivity::default();
        activity.sample(0.0, 0, 0);
        assert_eq!((activity.cops_per_min(), activity.cop_interval()), (0.0, None));
        activity.sample(10.0, 2, 2_000_000_000); // two commits, 2 GB in 10 s
        assert_eq!(activity.bandwidth(), 2e8);
        assert_eq!(activity.cop_interval(), None, "one interval needs two operations");
        activity.sample(20.0, 2, 2_000_000_000);
        assert_eq!(activity.bandwidth(), 0.0);
        activity.sample(30.0, 5, 2_500_000_000);
        assert_eq!(activity.cop_interval(), Some(20.0));
        assert_eq!(activity.cops_per_min(), 10.0); // 5 operations in 30 s
                                                   // Old samples leave the one-minute window.
        activity.sample(100.0, 5, 2_500_000_000);
        assert_eq!(activity.cops_per_min(), 0.0);
    }

    #[test]
    fn power_handles_wrap_and_absence() {
        let mut meter = PowerMeter::default();
        meter.sample(0.0, Some(EnergyReading { energy_uj: 1_000_000, max_uj: 10_000_000 }));
        assert_eq!(meter.watts(), None);
        meter.sample(2.0, Some(EnergyReading { energy_uj: 3_000_000, max_uj: 10_000_000 }));
        assert_eq!(meter.watts(), Some(1.0), "2 J in 2 s");
        meter.sample(4.0, Some(EnergyReading { energy_uj: 1_000_000, max_uj: 10_000_000 }));
        // 3 J -> wrapped at 10 J -> 1 J: 8 J in 2 s.
        assert_eq!(meter.watts(), Some(4.0));
        meter.sample(3.0, None);
        assert_eq!(meter.watts(), None, "no counters: unavailable, not zero");
    }

    #[test]
    fn rapl_counters_are_read_from_package_zones_only() {
        let dir = std::env::temp_dir().join(format!("icheck-rapl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (zone, energy) in [("intel-rapl:0", 100), ("intel-rapl:1", 50), ("intel-rapl:0:0", 7)] {
            std::fs::create_dir_all(dir.join(zone)).unwrap();
            std::fs::write(dir.join(zone).join("energy_uj"), format!("{energy}\n")).unwrap();
            std::fs::write(dir.join(zone).join("max_energy_range_uj"), "1000\n").unwrap();
        }
        assert_eq!(read_rapl_energy(&dir), Some(EnergyReading { energy_uj: 150, max_uj: 2000 }));
        assert_eq!(read_rapl_energy(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn trend_gives_depletion_forecast_and_agent_fill() {
        let mut trend = NodeTrend::default();
        assert_eq!(trend.report(10.0).mem_depletion_rate, None);
        // 1000 bytes/s consumed, one agent every 5 s.
        for i in 0..=10u32 {
            trend.sample(f64::from(i), 100_000 - 1000 * u64::from(i), i / 5);
        }
        let report = trend.report(10.0);
        assert_eq!(report.mem_depletion_rate, Some(1000.0));
        assert_eq!(report.mem_forecast, Some((80_000, 80_000)), "a straight line forecasts exactly");
        assert_eq!(report.agent_fill_rate, Some(0.2));
        // Noise widens the forecast band around the trend.
        trend.sample(11.0, 95_000, 2);
        let (low, high) = trend.report(10.0).mem_forecast.unwrap();
        assert!(low < high, "{low} {high}");
    }

    #[test]
    fn no_forecast_exceeds_the_nodes_memory() {
        // Memory freed fast (an application ended): the line points above
        // what the node has.
        let mut trend = NodeTrend::default();
        for i in 0..=10u32 {
            trend.sample_with_total(f64::from(i), 50_000 + 5000 * u64::from(i), Some(100_000), 1);
        }
        let (low, high) = trend.report(60.0).mem_forecast.unwrap();
        assert_eq!(high, 100_000, "forecast {low}..{high} over a 100000-byte node");
        assert!(low <= high);
    }
}
