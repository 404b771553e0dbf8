//! Failpoints for fault injection in multi-process tests (after TiKV's
//! fail-rs, reduced to what icheck's tests need).
//!
//! `ICHECK_FAILPOINTS="name=[N*]action[ xM];name2=..."` arms failpoints
//! in a process: the first N hits pass, later hits run the action:
//! `sleep(MS)`, `exit(CODE)`, `abort`, or `error` (the code at the
//! failpoint fails the operation, where it asks with [`fails`]). With
//! `xM` the action runs on M hits only, and later hits pass again (a
//! fault that goes away: `error x1` fails the first try, not the retry).
//! Unset, a failpoint costs one atomic load.
//!
//! Why not the `fail` crate itself: its `N*` means "at most N times", the
//! opposite of what these tests need (let N versions through, then stall
//! the next); it has no `exit(CODE)` or `abort`, which the multi-process
//! tests use to kill a daemon at an exact step; it takes a lock on every
//! hit, and it would bring `rand` and `log` into libicheck, which links
//! this crate. What it does that this does not (probabilities, `pause`,
//! runtime reconfiguration) no test here needs.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// Environment variable holding the failpoint specification.
pub const FAILPOINTS_ENV: &str = "ICHECK_FAILPOINTS";

#[derive(Debug, PartialEq)]
enum Action {
    Sleep(Duration),
    Exit(i32),
    Abort,
    Error,
}

#[derive(Debug)]
struct Point {
    skip: u64,
    /// Hits after the skipped ones that run the action (`u64::MAX`: all).
    times: u64,
    action: Action,
    hits: AtomicU64,
}

fn parse(spec: &str) -> Result<HashMap<String, Point>, String> {
    let mut points = HashMap::new();
    for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, rest) = item.split_once('=').ok_or_else(|| format!("{item:?}: expected name=action"))?;
        let (skip, action) = match rest.split_once('*') {
            Some((n, action)) => (n.trim().parse().map_err(|_| format!("{item:?}: bad count {n:?}"))?, action),
            None => (0, rest),
        };
        let (action, times) = match action.trim_end().rsplit_once('x') {
            Some((action, m)) if !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()) => {
                (action.trim_end(), m.parse().map_err(|_| format!("{item:?}: bad count x{m}"))?)
            }
            _ => (action, u64::MAX),
        };
        let arg = |prefix: &str| action.strip_prefix(prefix).and_then(|a| a.strip_suffix(')'));
        let action = if let Some(ms) = arg("sleep(") {
            Action::Sleep(Duration::from_millis(ms.parse().map_err(|_| format!("{item:?}: bad sleep"))?))
        } else if let Some(code) = arg("exit(") {
            Action::Exit(code.parse().map_err(|_| format!("{item:?}: bad exit code"))?)
        } else if action == "abort" {
            Action::Abort
        } else if action == "error" {
            Action::Error
        } else {
            return Err(format!("{item:?}: unknown action (sleep(MS), exit(CODE), abort, error)"));
        };
        points.insert(name.trim().to_string(), Point { skip, times, action, hits: AtomicU64::new(0) });
    }
    Ok(points)
}

fn points() -> &'static HashMap<String, Point> {
    static POINTS: OnceLock<HashMap<String, Point>> = OnceLock::new();
    POINTS.get_or_init(|| match std::env::var(FAILPOINTS_ENV) {
        Ok(spec) => parse(&spec).unwrap_or_else(|err| {
            eprintln!("icheck: ignoring {FAILPOINTS_ENV}: {err}");
            HashMap::new()
        }),
        Err(_) => HashMap::new(),
    })
}

/// Passes failpoint `name`, running its action if it is armed and due.
pub fn hit(name: &str) {
    let _ = fails(name);
}

/// [`hit`], and whether the operation at the failpoint must fail (the
/// `error` action is armed and due).
pub fn fails(name: &str) -> bool {
    fails_in(points(), name)
}

fn fails_in(points: &HashMap<String, Point>, name: &str) -> bool {
    if points.is_empty() {
        return false;
    }
    let Some(point) = points.get(name) else { return false };
    let hit = point.hits.fetch_add(1, Ordering::Relaxed);
    if hit < point.skip || hit - point.skip >= point.times {
        return false;
    }
    tracing::warn!(failpoint = name, action = ?point.action, "failpoint triggered");
    match point.action {
        Action::Sleep(pause) => std::thread::sleep(pause),
        Action::Exit(code) => std::process::exit(code),
        Action::Abort => std::process::abort(),
        Action::Error => return true,
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_name_the_bad_item() {
        let points = parse("a=sleep(5); b=2*exit(3);c=abort").unwrap();
        assert_eq!(points["a"].action, Action::Sleep(Duration::from_millis(5)));
        assert_eq!((points["b"].skip, &points["b"].action), (2, &Action::Exit(3)));
        assert_eq!(points["c"].action, Action::Abort);
        assert_eq!(parse("d=error").unwrap()["d"].action, Action::Error);
        assert!(parse("x=explode").unwrap_err().contains("\"x=explode\""));
        assert!(parse("x").is_err());
        assert!(parse("x=z*sleep(1)").is_err());
        let limited = parse("e=1*error x2;f=exit(3)x1").unwrap();
        assert_eq!((limited["e"].skip, limited["e"].times, &limited["e"].action), (1, 2, &Action::Error));
        assert_eq!((limited["f"].times, &limited["f"].action), (1, &Action::Exit(3)));
        assert_eq!(points["a"].times, u64::MAX);
    }

    #[test]
    fn a_limited_failpoint_acts_on_its_hits_only() {
        let point = Point { skip: 1, times: 2, action: Action::Error, hits: AtomicU64::new(0) };
        let points = HashMap::from([("p".to_string(), point)]);
        let acted: Vec<bool> = (0..5).map(|_| fails_in(&points, "p")).collect();
        assert_eq!(acted, [false, true, true, false, false]);
    }
}
