//! The module layering of icheck-core, as a test: each module may name only
//! the modules below it (ARCHITECTURE.md, "Crates"). The stored format is a
//! leaf (beside the pure malleability metadata), the PFS level and the
//! protocol build on it, and nothing imports upwards into a layer that
//! imports it back: a circle here is a failing test, not a review comment.
//! (That the service is above all of icheck-core is Cargo's to enforce:
//! icheck-core does not depend on icheck-service.)

use std::collections::BTreeSet;
use std::path::Path;

/// Module → the `crate::` modules it may use.
const ALLOWED: &[(&str, &[&str])] = &[
    ("fabric", &[]),
    ("distribution", &[]),
    ("failpoint", &[]),
    ("monitor", &[]),
    ("pattern", &[]),
    ("pages", &[]),
    ("units", &[]),
    ("credentials", &[]),
    ("handoff", &[]),
    ("kernel_copy", &[]),
    ("cipher", &[]),
    ("scaling", &[]),
    ("redundancy", &["distribution"]),
    ("format", &["distribution"]),
    ("delta", &["format"]),
    ("verified", &["fabric", "format", "kernel_copy"]),
    ("pfs", &["cipher", "credentials", "distribution", "failpoint", "format", "kernel_copy"]),
    (
        "protocol",
        &["credentials", "delta", "distribution", "fabric", "format", "handoff", "monitor", "pfs", "redundancy"],
    ),
    ("config", &["credentials", "fabric", "handoff", "pfs", "protocol", "redundancy", "scaling", "units"]),
    ("control", &["config", "credentials", "fabric", "protocol"]),
    ("decide", &["config", "distribution", "pfs", "protocol"]),
];

/// The `crate::<module>` names a source text uses.
fn uses(text: &str) -> BTreeSet<String> {
    text.match_indices("crate::")
        .map(|(at, _)| {
            let rest = &text[at + "crate::".len()..];
            rest.chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .collect()
}

/// The source of module `name`: `src/name.rs`, or every file of `src/name/`.
fn source(src: &Path, name: &str) -> String {
    let file = src.join(format!("{name}.rs"));
    if file.is_file() {
        return std::fs::read_to_string(file).unwrap();
    }
    let mut text = String::new();
    for entry in std::fs::read_dir(src.join(name)).unwrap() {
        text += &std::fs::read_to_string(entry.unwrap().path()).unwrap();
    }
    text
}

#[test]
fn modules_import_only_the_layers_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut listed: BTreeSet<&str> = BTreeSet::new();
    for (module, allowed) in ALLOWED {
        listed.insert(module);
        let used = uses(&source(&src, module));
        let extra: Vec<&String> =
            used.iter().filter(|u| u.as_str() != *module && !allowed.contains(&u.as_str())).collect();
        assert!(extra.is_empty(), "{module} uses {extra:?}, outside its layer (allowed: {allowed:?})");
    }
    // Every module of the crate has a place in the layering.
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    for line in lib.lines() {
        if let Some(name) = line.strip_prefix("pub mod ").and_then(|rest| rest.strip_suffix(';')) {
            assert!(listed.contains(name), "module {name} is missing from the layering");
        }
    }
}

#[test]
fn the_layering_has_no_circle() {
    // Depth-first over ALLOWED: a module must never reach itself.
    fn reaches(from: &str, target: &str, seen: &mut BTreeSet<String>) -> bool {
        let Some((_, below)) = ALLOWED.iter().find(|(m, _)| *m == from) else { return false };
        below.iter().any(|b| *b == target || (seen.insert(b.to_string()) && reaches(b, target, seen)))
    }
    for (module, _) in ALLOWED {
        assert!(!reaches(module, module, &mut BTreeSet::new()), "{module} reaches itself");
    }
}
