//! Requests sent to managers whose answers a controller task awaits (an
//! agent's start, a rank's take-over or rebuild), each bound to the node
//! whose manager answers it.
//!
//! Architecture Invariant: a request never outlives its node. When a node
//! is lost, every request still waiting on it is answered at once with
//! why ([`Awaiting::node_lost`]): its manager will not answer, and a task
//! waiting out its bound (minutes for a take-over) held an agent change or
//! a rebuild that long, and with it the application's probe, which gives
//! up first. No I/O here.

use std::collections::HashMap;
use std::hash::Hash;

use tokio::sync::oneshot;

/// Where an awaited request's answer arrives: what it yields, or why not.
pub(super) type Answer<T> = oneshot::Receiver<Result<T, String>>;

/// One take-over or rebuild asked of an agent ([`RankRequests`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct RankRequest {
    /// The agent asked.
    pub(super) agent: u64,
    /// Rank (MR) or node index (SHMR).
    pub(super) rank: u32,
    /// The controller's number for the request, echoed in the answer.
    pub(super) request: u64,
}

/// Take-overs and rebuilds of ranks awaiting their agents' answers (bytes
/// moved). Every request gets a new number, which its answer echoes
/// (`TookOver::request`): a controller that stopped waiting for an answer
/// (the job outlived its bound) and asks the same agent for the same rank
/// again must not take the late answer to the first request for the
/// answer to the second.
#[derive(Default)]
pub(super) struct RankRequests {
    /// The number of the last request.
    last: u64,
    awaiting: Awaiting<RankRequest, u64>,
}

impl RankRequests {
    /// Records a new request to `agent` on `node` for `rank`.
    pub(super) fn ask(&mut self, agent: u64, rank: u32, node: &str) -> (RankRequest, Answer<u64>) {
        self.last += 1;
        let key = RankRequest { agent, rank, request: self.last };
        (key, self.awaiting.ask(key, node))
    }

    /// See [`Awaiting::answer`].
    pub(super) fn answer(&mut self, key: &RankRequest, result: Result<u64, String>) -> bool {
        self.awaiting.answer(key, result)
    }

    /// See [`Awaiting::forget`].
    pub(super) fn forget(&mut self, key: &RankRequest) -> bool {
        self.awaiting.forget(key)
    }

    /// See [`Awaiting::node_lost`].
    pub(super) fn node_lost(&mut self, node: &str, why: impl Fn(&RankRequest) -> String) -> Vec<RankRequest> {
        self.awaiting.node_lost(node, why)
    }
}

/// Requests awaiting a manager's answer, by key.
pub(super) struct Awaiting<K, T> {
    waiting: HashMap<K, (String, oneshot::Sender<Result<T, String>>)>,
}

impl<K: Eq + Hash + Clone, T> Default for Awaiting<K, T> {
    fn default() -> Self {
        Self { waiting: HashMap::new() }
    }
}

impl<K: Eq + Hash + Clone, T> Awaiting<K, T> {
    /// Records a request under `key` that `node`'s manager answers; the
    /// answer arrives on the returned receiver. A request already waiting
    /// under `key` is replaced (its waiter sees the sender dropped).
    pub(super) fn ask(&mut self, key: K, node: &str) -> Answer<T> {
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(key, (node.to_string(), tx));
        rx
    }

    /// Delivers `result` to the request under `key`; false when none waits
    /// (answered already, given up, or never asked).
    pub(super) fn answer(&mut self, key: &K, result: Result<T, String>) -> bool {
        match self.waiting.remove(key) {
            Some((_, tx)) => {
                // The waiter may have given up meanwhile: nothing to tell.
                let _ = tx.send(result);
                true
            }
            None => false,
        }
    }

    /// Forgets the request under `key` (its waiter gave up); true if it
    /// was waiting.
    pub(super) fn forget(&mut self, key: &K) -> bool {
        self.waiting.remove(key).is_some()
    }

    /// Whether a request under `key` waits.
    pub(super) fn contains(&self, key: &K) -> bool {
        self.waiting.contains_key(key)
    }

    /// `node` was lost: every request waiting on its manager is answered
    /// with `why(key)`. Returns their keys.
    pub(super) fn node_lost(&mut self, node: &str, why: impl Fn(&K) -> String) -> Vec<K> {
        let keys: Vec<K> =
            (self.waiting.iter()).filter(|(_, (at, _))| at == node).map(|(key, _)| key.clone()).collect();
        for key in &keys {
            self.answer(key, Err(why(key)));
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_reaches_its_waiter_once() {
        let mut awaiting: Awaiting<(u64, u32), u64> = Awaiting::default();
        let mut rx = awaiting.ask((7, 1), "node-a");
        assert!(awaiting.contains(&(7, 1)));
        assert!(awaiting.answer(&(7, 1), Ok(42)));
        assert_eq!(rx.try_recv().unwrap(), Ok(42));
        assert!(!awaiting.answer(&(7, 1), Ok(43)), "answered twice");
        assert!(!awaiting.contains(&(7, 1)));
    }

    #[test]
    fn a_lost_node_answers_only_its_own_requests_with_why() {
        let mut awaiting: Awaiting<(u64, u32), u64> = Awaiting::default();
        let mut on_a = [awaiting.ask((1, 0), "node-a"), awaiting.ask((1, 1), "node-a")];
        let mut on_b = awaiting.ask((2, 0), "node-b");
        let mut lost = awaiting.node_lost("node-a", |(agent, rank)| format!("agent {agent} rank {rank}: node-a lost"));
        lost.sort();
        assert_eq!(lost, [(1, 0), (1, 1)]);
        assert_eq!(on_a[0].try_recv().unwrap(), Err("agent 1 rank 0: node-a lost".to_string()));
        assert_eq!(on_a[1].try_recv().unwrap(), Err("agent 1 rank 1: node-a lost".to_string()));
        assert!(on_b.try_recv().is_err(), "node-b's request is still waiting");
        assert!(awaiting.contains(&(2, 0)));
        assert!(awaiting.node_lost("node-a", |_| String::new()).is_empty(), "nothing waits on node-a any more");
    }

    #[test]
    fn a_late_answer_to_an_earlier_request_for_the_same_rank_answers_nothing_else() {
        let mut requests = RankRequests::default();
        // The first rebuild of rank 3 at agent 7 outlives its bound: the
        // controller forgets it and asks again.
        let (first, first_rx) = requests.ask(7, 3, "node-a");
        drop(first_rx);
        assert!(requests.forget(&first));
        let (second, mut second_rx) = requests.ask(7, 3, "node-a");
        assert_ne!(first, second);
        // The first job ends now, successfully: that is not the second's
        // answer, which is still awaited.
        assert!(!requests.answer(&first, Ok(1 << 20)));
        assert!(second_rx.try_recv().is_err(), "the second request took the first one's answer");
        assert!(requests.answer(&second, Err("source gone".into())));
        assert_eq!(second_rx.try_recv().unwrap(), Err("source gone".to_string()));
    }

    #[test]
    fn a_forgotten_request_takes_no_answer() {
        let mut awaiting: Awaiting<u64, ()> = Awaiting::default();
        let rx = awaiting.ask(5, "node-a");
        drop(rx);
        assert!(awaiting.forget(&5));
        assert!(!awaiting.answer(&5, Ok(())));
        assert!(awaiting.node_lost("node-a", |_| String::new()).is_empty());
    }
}
