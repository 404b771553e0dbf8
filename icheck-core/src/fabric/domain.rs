//! Provider selection and the opened fabric + domain.

use std::ffi::{CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use libfabric_sys as sys;
use serde::{Deserialize, Serialize};

use super::{FabricError, Result};

/// Which provider and domain to open. Parsed from the `[fabric]` table of the
/// icheck configuration; every field is optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricConfig {
    /// libfabric provider name: `tcp`, `shm`, `sockets`, `verbs;ofi_rxm`,
    /// `psm2`, `opx`, `cxi`, `efa`, ... `None` or `"auto"` takes libfabric's
    /// first match. The `FI_PROVIDER` environment variable, when set, wins over
    /// this value, so a job script can switch provider without editing files.
    pub provider: Option<String>,
    /// Domain (for socket providers: the interface, e.g. `lo`, `eth0`).
    /// `None` takes the first domain the provider lists.
    pub domain: Option<String>,
}

impl FabricConfig {
    /// A configuration for one named provider on any domain.
    pub fn provider(name: &str) -> Self {
        FabricConfig { provider: Some(name.to_string()), domain: None }
    }

    /// The provider actually requested, after `FI_PROVIDER` and `auto`.
    fn effective_provider(&self) -> Option<String> {
        if std::env::var_os("FI_PROVIDER").is_some() {
            // libfabric applies FI_PROVIDER as a filter itself; asking for a
            // different name as well would match nothing.
            return None;
        }
        self.provider.clone().filter(|p| !p.is_empty() && p != "auto")
    }

    fn describe_provider(&self) -> String {
        match std::env::var("FI_PROVIDER") {
            Ok(env) => format!("{env} (from FI_PROVIDER)"),
            Err(_) => self.effective_provider().unwrap_or_else(|| "auto".to_string()),
        }
    }
}

/// The memory-registration rules a provider imposes (`fi_domain_attr::mr_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MrMode {
    /// Local buffers passed to data-transfer calls need a registration descriptor.
    pub local: bool,
    /// Remote addresses are virtual addresses; otherwise they are offsets into the region.
    pub virt_addr: bool,
    /// Registered memory must be backed by allocated pages.
    pub allocated: bool,
    /// The provider chooses keys; otherwise the application picks unique ones.
    pub prov_key: bool,
    /// Regions are bound to an endpoint and enabled before use.
    pub endpoint: bool,
}

impl MrMode {
    const OFFERED: u32 =
        sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_PROV_KEY | sys::FI_MR_ENDPOINT;

    fn from_bits(bits: i32) -> Self {
        let bits = bits as u32;
        MrMode {
            local: bits & sys::FI_MR_LOCAL != 0,
            virt_addr: bits & sys::FI_MR_VIRT_ADDR != 0,
            allocated: bits & sys::FI_MR_ALLOCATED != 0,
            prov_key: bits & sys::FI_MR_PROV_KEY != 0,
            endpoint: bits & sys::FI_MR_ENDPOINT != 0,
        }
    }
}

/// What `fi_getinfo` returned for one candidate, in printable form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderInfo {
    /// Provider name, e.g. `tcp;ofi_rxm`.
    pub provider: String,
    /// Fabric name, e.g. `127.0.0.1/32`.
    pub fabric: String,
    /// Domain name, e.g. `lo`.
    pub domain: String,
    /// Registration rules.
    pub mr_mode: MrMode,
    /// Largest single message or RMA the endpoint accepts.
    pub max_msg_size: u64,
    /// Transmit queue depth.
    pub tx_size: usize,
    /// Bytes of a memory key (`fi_domain_attr::mr_key_size`).
    pub mr_key_size: usize,
    /// Whether data moves only when the application calls into the
    /// provider (`FI_PROGRESS_MANUAL`), as with tcp;ofi_rxm and shm: an
    /// endpoint nobody polls again can then never touch local memory.
    #[serde(default)]
    pub manual_progress: bool,
}

/// Which libfabric API icheck was compiled against and which library it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibfabricVersion {
    /// `FI_MAJOR_VERSION.FI_MINOR_VERSION` of the headers the bindings came from;
    /// also the API version icheck asks `fi_getinfo` for.
    pub headers: (u32, u32),
    /// What the loaded `libfabric.so` reports (`fi_version()`).
    pub library: (u32, u32),
}

impl std::fmt::Display for LibfabricVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "libfabric {}.{} (built against {}.{} headers)",
            self.library.0, self.library.1, self.headers.0, self.headers.1
        )
    }
}

/// Reports the libfabric version of the headers and of the loaded library.
pub fn libfabric_version() -> LibfabricVersion {
    // FI_VERSION packs the major number in the upper 16 bits, the minor in the lower.
    let split = |v: u32| (v >> 16, v & 0xffff);
    // SAFETY: both functions take no arguments and only return a number.
    let (headers, library) = unsafe { (sys::icheck_fi_header_version(), sys::fi_version()) };
    LibfabricVersion { headers: split(headers), library: split(library) }
}

/// Returns libfabric's text for a positive error number.
pub(crate) fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror accepts any integer and returns a pointer to a static
    // NUL-terminated string (or NULL, which is checked).
    let text = unsafe { sys::fi_strerror(code) };
    if text.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null, NUL-terminated and static (see above).
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// Reads a possibly-NULL C string owned by libfabric.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string that outlives the call.
unsafe fn c_string(ptr: *const std::os::raw::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// An owned `fi_info` list, freed on drop.
struct InfoList(*mut sys::fi_info);

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the list came from fi_getinfo/fi_dupinfo and is freed once.
            unsafe { sys::fi_freeinfo(self.0) };
        }
    }
}

/// Runs `fi_getinfo` with icheck's hints: RDM endpoints with RMA in both
/// directions, every mr_mode bit offered, thread-safe domains.
fn get_info(config: &FabricConfig) -> Result<InfoList> {
    // SAFETY: fi_dupinfo(NULL) is fi_allocinfo(): a zeroed fi_info with all
    // attribute structs allocated, or NULL on allocation failure.
    let hints = InfoList(unsafe { sys::fi_dupinfo(ptr::null()) });
    if hints.0.is_null() {
        return Err(FabricError::Config("fi_allocinfo returned NULL (out of memory)".into()));
    }
    let provider = config.effective_provider();
    let to_c = |what: &str, value: &str| {
        CString::new(value).map_err(|_| FabricError::Config(format!("{what} {value:?} contains a NUL byte")))
    };
    // SAFETY: `hints` and its attribute structs were allocated by fi_allocinfo
    // and are exclusively ours. Strings are strdup'ed because fi_freeinfo
    // frees them with free().
    unsafe {
        let h = &mut *hints.0;
        h.caps = (sys::FI_RMA | sys::FI_READ | sys::FI_WRITE | sys::FI_REMOTE_READ | sys::FI_REMOTE_WRITE) as u64;
        h.mode = (sys::FI_CONTEXT | sys::FI_CONTEXT2) as u64;
        (*h.ep_attr).type_ = sys::fi_ep_type_FI_EP_RDM;
        (*h.domain_attr).mr_mode = MrMode::OFFERED as i32;
        (*h.domain_attr).threading = sys::fi_threading_FI_THREAD_SAFE;
        if let Some(name) = &provider {
            let c = to_c("provider", name)?;
            (*h.fabric_attr).prov_name = sys::icheck_strdup(c.as_ptr());
        }
        if let Some(name) = &config.domain {
            let c = to_c("domain", name)?;
            (*h.domain_attr).name = sys::icheck_strdup(c.as_ptr());
        }
    }
    let mut info: *mut sys::fi_info = ptr::null_mut();
    // SAFETY: hints is a valid fi_info; `info` receives a list we own and free
    // through InfoList.
    let ret =
        unsafe { sys::fi_getinfo(sys::icheck_fi_header_version(), ptr::null(), ptr::null(), 0, hints.0, &mut info) };
    if ret != 0 || info.is_null() {
        return Err(FabricError::NoProvider {
            requested: config.describe_provider(),
            domain: config.domain.clone().unwrap_or_else(|| "any".into()),
            detail: strerror(ret.unsigned_abs() as i32),
        });
    }
    Ok(InfoList(info))
}

/// Describes one `fi_info` entry.
///
/// # Safety
/// `info` must point to a valid fi_info with its attribute structs.
unsafe fn describe(info: *const sys::fi_info) -> ProviderInfo {
    // SAFETY: guaranteed by the caller; strings are NUL-terminated or NULL.
    unsafe {
        let i = &*info;
        ProviderInfo {
            provider: c_string((*i.fabric_attr).prov_name),
            fabric: c_string((*i.fabric_attr).name),
            domain: c_string((*i.domain_attr).name),
            mr_mode: MrMode::from_bits((*i.domain_attr).mr_mode),
            max_msg_size: (*i.ep_attr).max_msg_size as u64,
            tx_size: (*i.tx_attr).size,
            mr_key_size: (*i.domain_attr).mr_key_size,
            manual_progress: sys::icheck_fi_manual_data_progress(i.domain_attr) != 0,
        }
    }
}

/// Lists every provider/domain pair that satisfies icheck's needs under `config`.
pub fn list_providers(config: &FabricConfig) -> Result<Vec<ProviderInfo>> {
    let list = get_info(config)?;
    let mut out = Vec::new();
    let mut cur = list.0;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list returned by fi_getinfo, which stays
        // alive until `list` drops at the end of this function.
        unsafe {
            out.push(describe(cur));
            cur = (*cur).next;
        }
    }
    Ok(out)
}

/// Checks that `config` names a provider this machine offers with what
/// icheck needs; the error lists the providers that would work, so a typo
/// in a configuration fails at start and not at an application's init.
pub fn check_provider(config: &FabricConfig) -> Result<ProviderInfo> {
    match list_providers(config) {
        Ok(mut found) if !found.is_empty() => Ok(found.swap_remove(0)),
        Ok(_) | Err(FabricError::NoProvider { .. }) => {
            let mut available: Vec<String> = Vec::new();
            for offered in list_providers(&FabricConfig::default()).unwrap_or_default() {
                if !available.contains(&offered.provider) {
                    available.push(offered.provider);
                }
            }
            let available = if available.is_empty() { "none".to_string() } else { available.join(", ") };
            Err(FabricError::Config(format!(
                "provider {} (domain {}) offers no reliable-datagram endpoint with RMA on this machine; \
                 available here: {available}",
                config.describe_provider(),
                config.domain.as_deref().unwrap_or("any"),
            )))
        }
        Err(err) => Err(err),
    }
}

pub(crate) struct DomainInner {
    /// The chosen fi_info (a single entry duplicated from the getinfo list).
    pub(crate) info: *mut sys::fi_info,
    fabric: *mut sys::fid_fabric,
    pub(crate) domain: *mut sys::fid_domain,
    pub(crate) mr_mode: MrMode,
    pub(crate) description: ProviderInfo,
    next_key: AtomicU64,
}

// SAFETY: the domain is opened with FI_THREAD_SAFE, so libfabric allows its
// objects to be used from any thread; the raw pointers are only freed in Drop,
// which runs once, after every Arc holder is gone.
unsafe impl Send for DomainInner {}
// SAFETY: see Send; shared use goes through libfabric's own locking.
unsafe impl Sync for DomainInner {}

impl DomainInner {
    /// A key no other region of this domain uses (for providers without
    /// PROV_KEY): a random start drawn when the domain opened, counted up,
    /// within the provider's key size. A peer cannot guess another
    /// region's key from its own (on providers that check keys).
    pub(crate) fn unique_key(&self) -> u64 {
        let mask = match self.description.mr_key_size {
            0 | 8.. => u64::MAX,
            bytes => (1u64 << (8 * bytes)) - 1,
        };
        self.next_key.fetch_add(1, Ordering::Relaxed) & mask
    }
}

/// Where a domain's keys start: random (a counter from 1 where the
/// operating system's random source fails, which only makes keys guessable).
fn random_key_start() -> u64 {
    let mut bytes = [0u8; 8];
    match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => 1,
    }
}

impl Drop for DomainInner {
    fn drop(&mut self) {
        // SAFETY: each object was opened in Domain::open and is closed exactly
        // once, children before parents; endpoints and MRs hold an Arc to this
        // struct, so they are already closed.
        unsafe {
            if !self.domain.is_null() {
                sys::icheck_fi_close(&mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                sys::icheck_fi_close(&mut (*self.fabric).fid);
            }
            sys::fi_freeinfo(self.info);
        }
    }
}

/// An opened fabric and domain of one provider. Cheap to clone.
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Domain").field("provider", &self.inner.description).finish()
    }
}

/// The shm provider names an endpoint's shared-memory region after the
/// process id (`/dev/shm/<pid>:<n>:<m>`) and refuses to enable an endpoint
/// whose name exists (EBUSY). A process killed before closing its endpoints
/// leaves its regions behind, so a later process that is given the same pid
/// would fail. Regions named after this process's pid that exist before it
/// opened its first shm domain can only be such leftovers: remove them, once.
fn sweep_stale_shm_regions() {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(|| {
        // Nothing of this process exists yet, so these are a dead process's.
        remove_shm_regions_of(std::process::id());
    });
}

/// Removes `/dev/shm/<pid>:*`, the shm provider's regions of a process that
/// died without closing its endpoints. Call it only for a dead (reaped)
/// process, or for this one before it opened an shm endpoint.
pub fn remove_shm_regions_of(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return };
    for entry in entries.filter_map(|e| e.ok()) {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The shm provider's region behind a peer's printable address
/// (`fi_shm://<pid>:<n>:<m>`, [`super::Peer::name`]): the owner's process
/// id and the region's file name under `/dev/shm`. `None` for any other
/// provider's address, or one that does not have exactly that shape.
pub fn shm_region_of(peer_name: &str) -> Option<(u32, String)> {
    let name = peer_name.strip_prefix("fi_shm://")?.trim_end_matches('\0');
    Some((region_owner(name)?, name.to_string()))
}

/// The process id an shm region's file name (`<pid>:<n>:<m>`, three runs
/// of digits) starts with; `None` for any other name.
fn region_owner(name: &str) -> Option<u32> {
    let parts: Vec<&str> = name.split(':').collect();
    let numeric = |p: &&str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if parts.len() != 3 || !parts.iter().all(numeric) {
        return None;
    }
    parts[0].parse().ok()
}

/// Whether process `pid` has ended: no such process here, or a zombie
/// (killed, not yet reaped by its parent; it runs nothing any more).
pub(crate) fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// Removes the shm region of a peer (`peer_name`, see [`shm_region_of`])
/// once its process has ended, waiting up to `patience` for that: a
/// killed process stays a zombie until its parent reaps it. Touches only
/// a region owned by the Unix user `owner` (the peer's user, as its
/// socket showed it). Returns whether it removed one.
///
/// A killed rank leaves its region behind (16 MiB of tmpfs, ~4 MiB of it
/// touched), and nobody else frees it. Only a party that talked to the
/// peer over shm on this host may call this: that the id names no process
/// here then means the process is gone, which a scan of every region
/// could not know where several pid namespaces share `/dev/shm`.
pub fn remove_dead_peer_region(peer_name: &str, owner: u32, patience: std::time::Duration) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some((pid, name)) = shm_region_of(peer_name) else { return false };
    let region = std::path::Path::new("/dev/shm").join(name);
    let deadline = std::time::Instant::now() + patience;
    loop {
        match std::fs::symlink_metadata(&region) {
            Ok(meta) if meta.is_file() && meta.uid() == owner => {}
            // Gone already (the process closed its endpoint), or not the peer's.
            _ => return false,
        }
        if process_gone(pid) {
            return std::fs::remove_file(&region).is_ok();
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Removes the shm provider's regions (`/dev/shm/<pid>:*`) of every
/// process of this user that no longer exists, and returns how many files
/// and bytes went. Each is 16 MiB of memory on tmpfs that nobody frees
/// otherwise: test suites and benchmarks SIGKILL daemons on purpose.
///
/// A process id that names no process here is taken as dead, which is
/// wrong only where several pid namespaces share one `/dev/shm`; so this
/// is for the test harness, which knows it runs in one, and not for the
/// daemons.
pub fn reclaim_dead_processes_shm_regions() -> (usize, u64) {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return (0, 0) };
    let mut reclaimed = (0, 0);
    for entry in entries.filter_map(|e| e.ok()) {
        let Some(pid) = region_owner(&entry.file_name().to_string_lossy()) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        if meta.uid() != me || std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            reclaimed.0 += 1;
            reclaimed.1 += meta.blocks() * 512;
        }
    }
    reclaimed
}

impl Domain {
    /// Opens the first provider/domain that matches `config`.
    pub fn open(config: &FabricConfig) -> Result<Domain> {
        let list = get_info(config)?;
        // SAFETY: list.0 is a valid, non-empty list; fi_dupinfo copies its
        // first entry (and only that entry: `next` is not followed).
        let info = unsafe { sys::fi_dupinfo(list.0) };
        if info.is_null() {
            return Err(FabricError::Config("fi_dupinfo returned NULL (out of memory)".into()));
        }
        // SAFETY: `info` is a valid fi_info owned by us.
        let description = unsafe { describe(info) };
        let mut inner = DomainInner {
            info,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            mr_mode: description.mr_mode,
            description,
            next_key: AtomicU64::new(random_key_start()),
        };
        // SAFETY: fabric_attr is valid; `inner.fabric` receives the new object,
        // which DomainInner::drop closes (also on the error path below).
        let ret = unsafe { sys::fi_fabric((*info).fabric_attr, &mut inner.fabric, ptr::null_mut()) };
        if ret != 0 {
            return Err(FabricError::call("fi_fabric", ret.into()));
        }
        // SAFETY: fabric and info are valid; the domain is closed in drop.
        let ret = unsafe { sys::icheck_fi_domain(inner.fabric, info, &mut inner.domain, ptr::null_mut()) };
        if ret != 0 {
            return Err(FabricError::call("fi_domain", ret.into()));
        }
        tracing::debug!(provider = %inner.description.provider, domain = %inner.description.domain,
            mr_mode = ?inner.mr_mode, "opened fabric domain");
        if inner.description.provider.split(';').any(|p| p == "shm") {
            sweep_stale_shm_regions();
        }
        Ok(Domain { inner: Arc::new(inner) })
    }

    /// What was opened: provider, fabric, domain and registration rules.
    pub fn info(&self) -> &ProviderInfo {
        &self.inner.description
    }

    /// The registration rules in force.
    pub fn mr_mode(&self) -> MrMode {
        self.inner.mr_mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_addresses_name_their_region() {
        assert_eq!(shm_region_of("fi_shm://15841:0:0"), Some((15841, "15841:0:0".into())));
        assert_eq!(shm_region_of("fi_shm://7:1:2\0"), Some((7, "7:1:2".into())));
        for other in [
            "fi_sockaddr_in://127.0.0.1:40211",
            "fi_shm://../etc:0:0",
            "fi_shm://1:2",
            "fi_shm://1:2:3:4",
            "fi_shm://1::3",
        ] {
            assert_eq!(shm_region_of(other), None, "{other}");
        }
    }

    /// The tests that make dead processes' regions: the reclaiming one
    /// would take the others' too. (This serializes them under `cargo
    /// test`; under nextest, where each test is a process of its own and a
    /// test service's clean-up reclaims such regions too, they run alone:
    /// `.config/nextest.toml`.)
    static DEAD_REGIONS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Serializes with the other tests of dead regions; returns the process
    /// id of a child that has ended (and been reaped) and this process's.
    fn dead_and_alive() -> (std::sync::MutexGuard<'static, ()>, u32, u32) {
        let serial = DEAD_REGIONS.lock().unwrap_or_else(|p| p.into_inner());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        (serial, dead, std::process::id())
    }

    #[test]
    fn a_dead_peers_region_goes_and_a_live_or_foreign_one_stays() {
        use std::time::Duration;
        let (_serial, dead, alive) = dead_and_alive();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let region = |pid: u32| std::path::PathBuf::from("/dev/shm").join(format!("{pid}:9:77"));
        for pid in [dead, alive] {
            std::fs::write(region(pid), [0u8; 4096]).unwrap();
        }
        let address = |pid: u32| format!("fi_shm://{pid}:9:77");
        assert!(!remove_dead_peer_region(&address(dead), me + 1, Duration::ZERO), "another user's region went");
        assert!(region(dead).exists());
        assert!(!remove_dead_peer_region(&address(alive), me, Duration::from_millis(250)), "a live peer's region went");
        assert!(region(alive).exists());
        assert!(remove_dead_peer_region(&address(dead), me, Duration::ZERO));
        assert!(!region(dead).exists(), "a dead peer's region stays");
        assert!(!remove_dead_peer_region(&address(dead), me, Duration::ZERO), "removed twice");
        std::fs::remove_file(region(alive)).unwrap();
    }

    #[test]
    fn only_dead_processes_regions_are_reclaimed() {
        let (_serial, dead, alive) = dead_and_alive();
        let path = |name: String| std::path::PathBuf::from("/dev/shm").join(name);
        let (dead_region, live_region, other) =
            (path(format!("{dead}:0:77")), path(format!("{alive}:0:77")), path(format!("icheck-test-{alive}:1:2")));
        for file in [&dead_region, &live_region, &other] {
            std::fs::write(file, [0u8; 4096]).unwrap();
        }
        let (files, _) = reclaim_dead_processes_shm_regions();
        assert!(files >= 1);
        assert!(!dead_region.exists(), "a dead process's region stays");
        assert!(live_region.exists() && other.exists(), "a live process's region or another file went");
        for file in [&live_region, &other] {
            std::fs::remove_file(file).unwrap();
        }
    }
}
