//! `ICHECK_LOG` for C and Fortran applications: a small `tracing`
//! subscriber that writes to stderr.
//!
//! The library does not link `tracing-subscriber` (see ARCHITECTURE.md: the
//! client library does not carry the service's dependencies), so this is the
//! part of it an application needs: comma-separated directives, each `level`
//! or `target=level` (`ICHECK_LOG=debug`, `ICHECK_LOG=warn,icheck_lib=debug`);
//! the longest matching target wins. Lines name the level, the target and
//! the spans the event is in (application, rank, version).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Installs the logger unless the process has a global subscriber already
/// (a Rust application that installed its own).
pub fn init_from_env() {
    let spec = std::env::var("ICHECK_LOG").unwrap_or_default();
    let _ = tracing::subscriber::set_global_default(StderrLogger::parse(&spec));
}

/// The subscriber.
struct StderrLogger {
    /// Level for targets no directive names.
    default: LevelFilter,
    /// `(target prefix, level)`, longest prefix first.
    targets: Vec<(String, LevelFilter)>,
    next_id: AtomicU64,
    /// Open spans: their text (`name{fields}`) and reference count.
    spans: Mutex<HashMap<u64, (String, usize)>>,
}

thread_local! {
    /// Spans entered on this thread, innermost last.
    static ENTERED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

impl StderrLogger {
    /// Parses directives; a directive that does not parse is ignored with a
    /// note on stderr (a bad ICHECK_LOG must not stop the application).
    fn parse(spec: &str) -> StderrLogger {
        let mut default = LevelFilter::WARN;
        let mut targets = Vec::new();
        for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let (target, level) = match directive.split_once('=') {
                Some((target, level)) => (Some(target.trim()), level.trim()),
                None => (None, directive),
            };
            match (target, level.parse::<LevelFilter>()) {
                (None, Ok(level)) => default = level,
                (Some(target), Ok(level)) => targets.push((target.to_string(), level)),
                (_, Err(_)) => eprintln!("icheck: ICHECK_LOG: ignoring {directive:?} (want level or target=level)"),
            }
        }
        targets.sort_by_key(|(target, _)| std::cmp::Reverse(target.len()));
        StderrLogger { default, targets, next_id: AtomicU64::new(1), spans: Mutex::new(HashMap::new()) }
    }

    fn level_for(&self, target: &str) -> LevelFilter {
        self.targets.iter().find(|(prefix, _)| target.starts_with(prefix.as_str())).map_or(self.default, |(_, l)| *l)
    }

    fn spans(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (String, usize)>> {
        self.spans.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Writes fields as ` name=value`, the message first and bare.
struct FieldWriter<'a>(&'a mut String);

impl Visit for FieldWriter<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl Subscriber for StderrLogger {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.level_for(metadata.target()) >= *metadata.level()
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.targets.iter().map(|(_, level)| *level).fold(self.default, std::cmp::max))
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut fields = String::new();
        span.record(&mut FieldWriter(&mut fields));
        let text = format!("{}{{{}}}", span.metadata().name(), fields.trim_start());
        self.spans().insert(id, (text, 1));
        Id::from_u64(id)
    }

    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((text, _)) = self.spans().get_mut(&span.into_u64()) {
            let mut fields = String::new();
            values.record(&mut FieldWriter(&mut fields));
            if let Some(open) = text.pop() {
                text.push_str(&fields);
                text.push(open);
            }
        }
    }

    fn record_follows_from(&self, _span: &Id, _follows: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut line = String::new();
        let _ = write!(line, "{:>5} {}:", event.metadata().level(), event.metadata().target());
        let spans = self.spans();
        ENTERED.with(|entered| {
            for id in entered.borrow().iter() {
                if let Some((text, _)) = spans.get(id) {
                    let _ = write!(line, " {text}:");
                }
            }
        });
        drop(spans);
        event.record(&mut FieldWriter(&mut line));
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn enter(&self, span: &Id) {
        ENTERED.with(|entered| entered.borrow_mut().push(span.into_u64()));
    }

    fn exit(&self, span: &Id) {
        ENTERED.with(|entered| {
            let mut entered = entered.borrow_mut();
            if let Some(at) = entered.iter().rposition(|id| *id == span.into_u64()) {
                entered.remove(at);
            }
        });
    }

    fn clone_span(&self, span: &Id) -> Id {
        if let Some((_, refs)) = self.spans().get_mut(&span.into_u64()) {
            *refs += 1;
        }
        span.clone()
    }

    fn try_close(&self, span: Id) -> bool {
        let mut spans = self.spans();
        let id = span.into_u64();
        let closed = match spans.get_mut(&id) {
            Some((_, refs)) if *refs > 1 => {
                *refs -= 1;
                false
            }
            Some(_) => true,
            None => false,
        };
        if closed {
            spans.remove(&id);
        }
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn directives_choose_the_longest_matching_target() {
        let logger = StderrLogger::parse("info, icheck_lib=debug ,icheck_lib::client=error,bogus=loud");
        assert_eq!(logger.default, LevelFilter::INFO);
        assert_eq!(logger.level_for("icheck_lib::client"), LevelFilter::ERROR);
        assert_eq!(logger.level_for("icheck_lib::region"), LevelFilter::DEBUG);
        assert_eq!(logger.level_for("icheck_core::fabric"), LevelFilter::INFO);
        assert_eq!(logger.max_level_hint(), Some(LevelFilter::DEBUG));
        assert!(logger.level_for("icheck_lib") >= Level::DEBUG);
        assert!(logger.level_for("other") < Level::DEBUG);
    }

    #[test]
    fn an_empty_spec_means_warnings() {
        assert_eq!(StderrLogger::parse("").default, LevelFilter::WARN);
    }

    #[test]
    fn spans_close_when_their_last_handle_does() {
        let logger = StderrLogger::parse("trace");
        let id = Id::from_u64(1);
        logger.spans().insert(id.into_u64(), ("s{}".into(), 1));
        let second = logger.clone_span(&id);
        assert!(!logger.try_close(second));
        assert!(logger.try_close(id));
        assert!(logger.spans().is_empty());
    }
}
