//! The fault campaign, short and seeded, as a test: real daemons and real
//! `mpirun` jobs, one fault per round; it must lose no version and never
//! hang. `fault-campaign --faults 200` is the long run (README).

use std::process::Command;

#[test]
fn a_short_seeded_fault_campaign_loses_no_version_and_never_hangs() {
    let out = Command::new(env!("CARGO_BIN_EXE_fault-campaign"))
        .args(["--faults", "10", "--seed", "11"])
        .output()
        .expect("run fault-campaign");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("| rounds (one fault each) | 10 |"), "{stdout}");
    assert!(stdout.contains("| versions lost (must be 0) | 0 |"), "{stdout}");
    assert!(stdout.contains("| hangs (must be 0) | 0 |"), "{stdout}");
    assert!(stdout.contains("| status not matching what runs, after healing (must be 0) | 0 |"), "{stdout}");
    let verified: u32 = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("| versions verified bit-exact after a fault | ")?.strip_suffix(" |")?.parse().ok()
        })
        .expect("the table counts verified versions");
    assert!(verified >= 5, "too few restarts were checked:\n{stdout}");
}
