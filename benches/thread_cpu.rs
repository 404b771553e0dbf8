//! CPU time per thread of running processes, from `/proc`: what the
//! benchmarks use to say which thread of the service spent a core.

use std::collections::HashMap;

/// CPU nanoseconds of every thread of `pids` so far, keyed by the thread's
/// `/proc` path and name (`schedstat`: time on the CPU, exact where the
/// tick-sampled `stat` is not).
pub fn thread_cpu(pids: &[u32]) -> HashMap<String, u64> {
    let mut threads = HashMap::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
        for task in tasks.filter_map(|t| t.ok()) {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
            let nanos = stat.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            threads.insert(format!("{} {}", task.path().display(), name.trim()), nanos);
        }
    }
    threads
}

/// The CPU nanoseconds each thread used between two [`thread_cpu`]
/// snapshots, busiest first: threads started in between count from zero;
/// one that ended in between is lost (the service's threads live as long
/// as their agents and sessions).
pub fn used_between<'a>(before: &HashMap<String, u64>, after: &'a HashMap<String, u64>) -> Vec<(u64, &'a str)> {
    let mut used: Vec<(u64, &str)> = after
        .iter()
        .map(|(thread, now)| (now.saturating_sub(*before.get(thread).unwrap_or(&0)), thread.as_str()))
        .collect();
    used.sort_unstable_by(|a, b| b.cmp(a));
    used
}
