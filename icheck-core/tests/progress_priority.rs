//! `ProgressThread::serving_reads` spins at the lowest priority where the
//! reader copies the bytes itself (shm) and at full priority where this
//! side's progress moves them (tcp); `serving_background_reads` runs under
//! `SCHED_IDLE` where the reader copies, and at nice 19 elsewhere. Its own
//! binary: no other test's progress threads run beside it.

use icheck_core::fabric::{Domain, Endpoint, FabricConfig, ProgressThread};

/// Nice values of this process's fabric progress threads.
fn progress_thread_nice() -> Vec<i64> {
    progress_thread_stat(19)
}

/// Scheduling policies of this process's fabric progress threads (5 is
/// `SCHED_IDLE`, 0 `SCHED_OTHER`).
fn progress_thread_policy() -> Vec<i64> {
    progress_thread_stat(41)
}

/// Field `field` (as `proc(5)` numbers them) of the `stat` of each of this
/// process's fabric progress threads.
fn progress_thread_stat(field: usize) -> Vec<i64> {
    let mut nice = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        // "icheck-fabric-progress", cut to the kernel's 15 characters.
        if !comm.starts_with("icheck-fabric-p") {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap();
        // Fields after the command's closing parenthesis; nice is field 19.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        nice.push(fields[field - 3].parse().unwrap());
    }
    nice
}

#[test]
fn read_serving_progress_yields_to_the_reader_only_where_the_reader_copies() {
    for (provider, expected) in [("shm", 19), ("tcp", 0)] {
        let domain = Domain::open(&FabricConfig::provider(provider)).unwrap();
        let endpoint = Endpoint::new(&domain).unwrap();
        let progress = ProgressThread::serving_reads(&endpoint).unwrap();
        let mut seen = Vec::new();
        for _ in 0..100 {
            seen = progress_thread_nice();
            if !seen.is_empty() && seen.iter().all(|n| *n == expected) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(seen, vec![expected], "{provider}");
        progress.stop();
        // The join returns once the thread has finished, but the kernel may
        // list its task for a moment longer while it is torn down.
        let mut left = progress_thread_nice();
        for _ in 0..100 {
            if left.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            left = progress_thread_nice();
        }
        assert!(left.is_empty(), "{provider}: the thread stopped, yet {left:?} remain");
    }
    background_read_serving_idles_only_where_the_reader_copies();
}

/// Part of the one test above: the threads of two tests would run in one
/// process at once, and each looks at every progress thread.
fn background_read_serving_idles_only_where_the_reader_copies() {
    const SCHED_IDLE: i64 = 5;
    for (provider, policy) in [("shm", SCHED_IDLE), ("tcp", 0)] {
        let domain = Domain::open(&FabricConfig::provider(provider)).unwrap();
        let endpoint = Endpoint::new(&domain).unwrap();
        let progress = ProgressThread::serving_background_reads(&endpoint).unwrap();
        let mut seen = (Vec::new(), Vec::new());
        for _ in 0..100 {
            seen = (progress_thread_policy(), progress_thread_nice());
            if seen == (vec![policy], vec![19]) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(seen, (vec![policy], vec![19]), "{provider}: (policy, nice)");
        progress.stop();
        for _ in 0..100 {
            if progress_thread_nice().is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
