//! What the application can learn of its versions' redundancy across
//! checkpoint nodes: which version is protected (its copies or parity
//! shards in place), and waiting until a version is.

use super::*;

/// The redundancy of the application's versions, as the controller reports it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Protection {
    /// The policy in force: `none`, `partner:C` or `rs:K+M`.
    pub policy: String,
    /// Newest version whose redundancy is in place.
    pub protected: Option<u64>,
    /// The version whose redundancy is being built.
    pub protecting: Option<u64>,
    /// A rebuild after a lost checkpoint node is under way.
    pub rebuilding: bool,
    /// Why the newest version is not protected, if it is not.
    pub problem: Option<String>,
    /// Probability that the newest version is lost (the service's data-loss
    /// model, with its configured per-node failure probability).
    pub exposure: Option<f64>,
}

/// How often [`Icheck::wait_protected`] asks.
const PROTECTION_POLL: Duration = Duration::from_millis(10);

impl Icheck {
    /// The redundancy of this application's versions (*collective*: rank 0
    /// asks the controller, every rank gets the answer).
    pub fn protection(&mut self) -> Result<Protection> {
        self.check_open()?;
        let mut answer = Vec::new();
        if self.comm.rank() == 0 {
            let asked = self.ask_protection();
            answer = protocol::encode(&asked.map_err(|e| e.to_string())).unwrap_or_default();
        }
        let answer = self.comm.broadcast_from_root(answer);
        let decoded: std::result::Result<Protection, String> =
            protocol::decode(&answer).map_err(|e| Error::Unsupported(format!("protection answer: {e}")))?;
        decoded.map_err(|message| self.controller_error(message))
    }

    fn ask_protection(&mut self) -> Result<Protection> {
        let request = ClientRequest::AppStatus { name: self.app.clone(), capability: self.access.capability.clone() };
        let controller = self.controller.as_mut().ok_or(Error::Order("no controller connection (rank 0 only)"))?;
        let reply = controller
            .request(&request)
            .map_err(|error| Error::Controller { peer: self.controller_peer.clone(), error })?;
        let report = match reply {
            ClientReply::AppStatus(Some(report)) => report,
            ClientReply::AppStatus(None) => {
                return Err(self.controller_error("the application is not registered".into()))
            }
            other => return Err(self.controller_error(format!("unexpected answer to AppStatus: {other:?}"))),
        };
        Ok(Protection {
            policy: report.redundancy.to_string(),
            protected: report.protected,
            protecting: report.protecting,
            rebuilding: report.rebuilding,
            problem: report.protection_problem,
            exposure: report.exposure,
        })
    }

    /// Waits until `version` (or a newer one) is protected, at most
    /// `timeout` (*collective*). A version that cannot be protected (the
    /// policy cannot be placed, a piece failed) is an error saying why.
    pub fn wait_protected(&mut self, version: u64, timeout: Duration) -> Result<Protection> {
        let started = Instant::now();
        loop {
            let protection = self.protection()?;
            if protection.protected.is_some_and(|p| p >= version) {
                return Ok(protection);
            }
            let building = protection.protecting.is_some_and(|p| p >= version) || protection.rebuilding;
            if let (false, Some(problem)) = (building, &protection.problem) {
                return Err(self.controller_error(format!("version {version} is not protected: {problem}")));
            }
            if protection.policy == "none" {
                return Err(Error::Order("the application's redundancy is \"none\": no version is ever protected"));
            }
            // Every rank decides alike: they all saw the same answer; the
            // clock is rank 0's.
            let expired = self.comm.broadcast_from_root(vec![u8::from(started.elapsed() >= timeout)]) == [1];
            if expired {
                return Err(self.controller_error(format!("version {version} is not protected after {timeout:?}")));
            }
            std::thread::sleep(PROTECTION_POLL);
        }
    }
}
