//! Installed icheck as users meet it: `make install-files` into a
//! temporary prefix, programs compiled against it, `mpirun` jobs of them
//! against a real local service, killed and restarted.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use icheck_service::testkit::{icheck_in_target, LocalService};

/// An installed icheck under a temporary prefix, with compiled examples.
pub struct Installed {
    /// The installation prefix (removed on drop).
    pub prefix: PathBuf,
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.prefix);
    }
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Runs `command`, failing the test with its output unless it succeeds.
pub fn run(command: &mut Command) -> Output {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Installs the debug build (the one `cargo test` just built) under a
/// fresh prefix with the Makefile's own install rule.
pub fn install(name: &str) -> Installed {
    let icheck = icheck_in_target();
    let out_dir = icheck.parent().unwrap().to_path_buf();
    assert!(out_dir.join("libicheck.so").exists(), "build the workspace first (cargo build --workspace)");
    let prefix = std::env::temp_dir().join(format!("icheck-prefix-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    run(Command::new("make")
        .current_dir(repo())
        .arg("install-files")
        .arg(format!("PREFIX={}", prefix.display()))
        .arg(format!("OUT={}", out_dir.display())));
    Installed { prefix }
}

impl Installed {
    /// Compiles `source` with `compiler` and the flags pkg-config gives.
    pub fn compile(&self, compiler: &str, source: &str, extra: &[&str]) -> PathBuf {
        let exe = self.prefix.join(Path::new(source).file_stem().unwrap());
        let flags = run(Command::new("pkg-config")
            .args(["--cflags", "--libs", "icheck"])
            .env("PKG_CONFIG_PATH", self.prefix.join("lib/pkgconfig")));
        let flags = String::from_utf8(flags.stdout).unwrap();
        run(Command::new(compiler)
            .args(extra)
            .arg(repo().join(source))
            .arg("-o")
            .arg(&exe)
            .args(flags.split_whitespace()));
        exe
    }
}

/// `mpirun -np 4` of `exe` against the service of `config`.
pub fn mpirun(config: &Path, shm_dir: &Path, exe: &Path, args: &[&str]) -> Output {
    mpirun_with(config, shm_dir, exe, args, &[])
}

/// [`mpirun`] with extra environment variables.
pub fn mpirun_with(config: &Path, shm_dir: &Path, exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    mpirun_np(4, config, shm_dir, exe, args, env)
}

/// `mpirun -np NP` of `exe`; Open MPI's shared-memory files go to `shm_dir`.
pub fn mpirun_np(np: u32, config: &Path, shm_dir: &Path, exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let _ = std::fs::create_dir_all(shm_dir);
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", &np.to_string()])
        .arg(exe)
        .args(args)
        .env("ICHECK_CONFIG", config)
        .env("OMPI_MCA_btl_vader_backing_directory", shm_dir)
        .envs(env.iter().copied())
        .output()
        .expect("mpirun runs")
}

/// The value of the `CHECKSUM` line a run printed.
pub fn checksum(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("CHECKSUM "))
        .unwrap_or_else(|| panic!("no checksum in:\n{text}\n{}", String::from_utf8_lossy(&out.stderr)))
        .trim()
        .to_string()
}

/// Fault-free run, a run killed by its fault injection, and the rerun that
/// restarts: the rerun's checksum must equal the fault-free one.
pub fn kill_and_restart(
    exe: &Path,
    service: &LocalService,
    fault_free: &[&str],
    faulty: &[&str],
    restart: &[&str],
    env: &[(&str, &str)],
) -> String {
    let shm_dir = service.dir.join("mpi-shm");
    let config = service.config_path();
    let mpirun =
        |config: &Path, shm_dir: &Path, exe: &Path, args: &[&str]| mpirun_with(config, shm_dir, exe, args, env);
    let clean = mpirun(&config, &shm_dir, exe, fault_free);
    assert!(clean.status.success(), "{}", String::from_utf8_lossy(&clean.stderr));
    let expected = checksum(&clean);
    let killed = mpirun(&config, &shm_dir, exe, faulty);
    assert!(!killed.status.success(), "the fault must kill the job:\n{}", String::from_utf8_lossy(&killed.stdout));
    assert!(String::from_utf8_lossy(&killed.stdout).contains("FAULT injected"));
    let again = mpirun(&config, &shm_dir, exe, restart);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stdout).contains("RESTARTED at iteration"), "{again:?}");
    assert_eq!(checksum(&again), expected, "restarted run differs from the fault-free one");
    let _ = std::fs::remove_dir_all(shm_dir);
    String::from_utf8_lossy(&killed.stdout).into_owned()
}

/// stdout of a successful run.
pub fn succeeded(out: Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}
