//! The C and Fortran interfaces as users meet them: `make install-files`
//! into a temporary prefix, examples compiled with mpicc/mpifort and
//! `pkg-config --cflags --libs icheck`, run under `mpirun -np 4` against a
//! real local service, killed and restarted.

mod common;

use std::path::Path;
use std::process::Command;

use common::install::{install, kill_and_restart, mpirun, mpirun_np, run, succeeded};
use icheck_service::testkit::{icheck_in_target, LocalService};

#[test]
fn heat2d_in_c_restarts_to_the_fault_free_checksum() {
    let installed = install("heat2d");
    let exe = installed.compile("mpicc", "examples/heat2d/heat2d.c", &["-std=c99", "-Wall", "-Werror"]);
    let service = LocalService::up(&icheck_in_target(), "c-heat2d", 2, &["--provider", "tcp"]);
    let common = ["--n", "128", "--iters", "120", "--every", "20"];
    let with = |extra: &[&'static str]| -> Vec<&str> { common.iter().copied().chain(extra.iter().copied()).collect() };
    kill_and_restart(
        &exe,
        &service,
        &with(&["--app", "clean"]),
        &with(&["--app", "faulty", "--fail-at", "70"]),
        &with(&["--app", "faulty"]),
        &[],
    );
    // Probing through the C interface: after three commits (two warm-up,
    // one measured) the controller doubles the agents; the killed run's
    // newest version is then at the new agents, and the restart gets it.
    let probed = kill_and_restart(
        &exe,
        &service,
        &with(&["--app", "clean-probe"]),
        &with(&["--app", "faulty-probe", "--fail-at", "70", "--probe-every", "3"]),
        &with(&["--app", "faulty-probe", "--probe-every", "3"]),
        &[],
    );
    assert!(probed.contains("PROBE agents=2"), "{probed}");
    // SHMR through the C interface: the node's four ranks share one segment.
    kill_and_restart(
        &exe,
        &service,
        &with(&["--app", "clean-shmr"]),
        &with(&["--app", "faulty-shmr", "--fail-at", "70"]),
        &with(&["--app", "faulty-shmr"]),
        &[("ICHECK_MODE", "shmr")],
    );
}

#[test]
fn heat1d_in_fortran_restarts_to_the_fault_free_checksum() {
    let installed = install("heat1d");
    let exe = installed.compile("mpifort", "examples/fortran/heat1d.f90", &["-Wall"]);
    // The provider users get from `icheck up` (shm on one host); the C
    // tests run over tcp.
    let service = LocalService::up(&icheck_in_target(), "f-heat1d", 2, &["--provider", "auto"]);
    // The application name is fixed ("heat1d"); the clean run cleans up.
    kill_and_restart(&exe, &service, &["512", "120", "20"], &["512", "120", "20", "70"], &["512", "120", "20"], &[]);
}

#[test]
fn c_application_grows_and_shrinks_in_one_job_to_the_fixed_run_result() {
    let installed = install("resize");
    let exe = installed.compile("mpicc", "examples/malleable/resize.c", &["-std=c99", "-Wall", "-Werror"]);
    let service = LocalService::up(&icheck_in_target(), "c-resize", 2, &["--provider", "tcp"]);
    let config = service.config_path();
    let shm_dir = installed.prefix.join("shm");
    let run = |np: u32, args: &[&str]| succeeded(mpirun_np(np, &config, &shm_dir, &exe, args, &[]));
    // 2 -> 4 (MPI_Comm_spawn + MPI_Intercomm_merge) -> 2 (MPI_Comm_split)
    // processes, icheck_redistribute after each change.
    let resized = run(2, &["--app", "resize"]);
    for phase in ["PHASE procs=2 steps=0..20", "PHASE procs=4 steps=20..40", "PHASE procs=2 steps=40..60"] {
        assert!(resized.lines().any(|l| l == phase), "{phase}: {resized}");
    }
    let result = |text: &str| text.lines().find(|l| l.starts_with("RESULT ")).map(str::to_string);
    let fixed = run(2, &["--fixed"]);
    assert_eq!(result(&resized), result(&fixed), "{resized}\n{fixed}");
    assert!(result(&fixed).is_some(), "{fixed}");
    // The computation does not depend on the decomposition either.
    assert_eq!(result(&run(3, &["--fixed"])), result(&fixed));
}

#[test]
fn fortran_arrays_restore_with_another_process_count() {
    let installed = install("adapt");
    let exe = installed.compile("mpifort", "examples/fortran/adapt.f90", &["-Wall"]);
    let service = LocalService::up(&icheck_in_target(), "f-adapt", 1, &["--provider", "tcp"]);
    let config = service.config_path();
    let shm_dir = installed.prefix.join("shm");
    let written = succeeded(mpirun_np(4, &config, &shm_dir, &exe, &[], &[]));
    assert!(written.contains("FORTRAN COMMITTED ranks=4"), "{written}");
    let restored = succeeded(mpirun_np(3, &config, &shm_dir, &exe, &[], &[]));
    assert!(restored.contains("FORTRAN VERIFIED ranks=3"), "{restored}");
}

#[test]
fn every_c_error_path_returns_its_code() {
    let installed = install("errors");
    let exe = installed.compile("cc", "examples/c-tests/errors.c", &["-std=c99", "-pedantic", "-Wall", "-Werror"]);
    // The header also compiles as C++, with and without MPI.
    let probe = installed.prefix.join("probe.cpp");
    std::fs::write(&probe, "#include <icheck.h>\nint main() { int s; return icheck_init_serial(0, \"x\", &s); }\n")
        .unwrap();
    run(Command::new("g++")
        .args(["-std=c++11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(installed.prefix.join("include"))
        .arg(&probe));
    std::fs::write(&probe, "#include <mpi.h>\n#include <icheck.h>\nint main() { int s; return icheck_init(0, \"x\", MPI_COMM_WORLD, &s); }\n")
        .unwrap();
    run(Command::new("mpicxx")
        .args(["-std=c++11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(installed.prefix.join("include"))
        .arg(&probe));

    // A program without MPI does not load an MPI library through libicheck.
    let ldd = run(Command::new("ldd").arg(&exe));
    let libraries = String::from_utf8_lossy(&ldd.stdout);
    assert!(libraries.contains("libicheck.so") && !libraries.contains("libmpi"), "{libraries}");

    let service = LocalService::up(&icheck_in_target(), "c-errors", 1, &["--provider", "tcp"]);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let unreachable = installed.prefix.join("unreachable.toml");
    std::fs::write(&unreachable, format!("ControllerPort = {port}\n[client]\nconnect_timeout = 2.0\n")).unwrap();
    let out = Command::new(&exe).arg(&unreachable).env("ICHECK_CONFIG", service.config_path()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("ALL ERROR PATHS OK"), "{stdout}");
}

#[test]
fn synthetic_benchmark_compares_with_mpiio_and_restarts_after_a_fault() {
    let installed = install("synthetic");
    let exe = installed.compile("mpicc", "examples/synthetic/synthetic.c", &["-std=c99", "-Wall", "-Werror"]);
    let service = LocalService::up(&icheck_in_target(), "c-synthetic", 2, &["--provider", "tcp"]);
    let shm_dir = installed.prefix.join("mpi-shm");
    let config = |fault: &str| {
        let path = installed.prefix.join(format!("synthetic-{fault}.conf"));
        let text = format!(
            "cp_size = 200000\ncp_type = double\ncp_interval = 0\ncp_count = 5\ncp_mpiio = true\n\
             enable_ichk = true\nfault_inject = {fault}   # seconds\nprobe_interval = 0.001\nis_invasive = true\n\
             pfs_dir = {}\napp = synthetic\n",
            installed.prefix.display()
        );
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    };
    // The first step's commit lands, then rank 0 dies.
    let killed = mpirun(&service.config_path(), &shm_dir, &exe, &[&config("0.000001")]);
    let stdout = String::from_utf8_lossy(&killed.stdout);
    assert!(!killed.status.success() && stdout.contains("COMMIT step 0") && stdout.contains("FAULT"), "{stdout}");
    let again = mpirun(&service.config_path(), &shm_dir, &exe, &[&config("0")]);
    let stdout = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{stdout}{}", String::from_utf8_lossy(&again.stderr));
    assert!(stdout.contains("RESTARTED at step 0"), "{stdout}");
    let summary = stdout.lines().find(|l| l.starts_with("SUMMARY commits 4 ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(summary.contains("mpiio/icheck"), "{summary}");
}

/// libicheck's own ICHECK_LOG (it links no tracing-subscriber): a C
/// application sees the library's events with the spans they belong to,
/// and nothing below warnings by default.
#[test]
fn icheck_log_shows_the_librarys_events_with_their_spans_in_a_c_application() {
    let installed = install("log");
    let exe = installed.compile("mpicc", "examples/heat2d/heat2d.c", &["-std=c99"]);
    let service = LocalService::up(&icheck_in_target(), "c-log", 1, &["--provider", "tcp"]);
    let shm = service.dir.join("shm");
    let args = ["--n", "64", "--iters", "40", "--every", "20", "--app", "logged"];
    let out = mpirun_np(2, &service.config_path(), &shm, &exe, &args, &[("ICHECK_LOG", "warn,icheck_lib=info")]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let line = stderr.lines().find(|l| l.contains("version complete")).unwrap_or_else(|| panic!("{stderr}"));
    assert!(line.contains("INFO icheck_lib") && line.contains("commit{app=logged rank="), "{line}");
    let quiet =
        mpirun_np(2, &service.config_path(), &shm, &exe, &["--n", "64", "--iters", "40", "--app", "quiet"], &[]);
    let stderr = String::from_utf8_lossy(&quiet.stderr);
    assert!(quiet.status.success() && !stderr.contains("version complete"), "{stderr}");
}

#[test]
fn installed_binaries_are_stripped_and_their_debug_info_kept_beside_them() {
    let installed = install("strip");
    let sections = |file: &Path| {
        let out = run(Command::new("readelf").arg("-S").arg(file));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for (file, debug) in
        [("bin/icheck", "bin/.debug/icheck.debug"), ("lib/libicheck.so", "lib/.debug/libicheck.so.debug")]
    {
        let stripped = sections(&installed.prefix.join(file));
        assert!(!stripped.contains(".debug_info"), "{file} still carries its debug info");
        assert!(stripped.contains(".gnu_debuglink"), "{file} does not say where its debug info went");
        assert!(sections(&installed.prefix.join(debug)).contains(".debug_info"), "{debug} holds no debug info");
    }
    let archive = run(Command::new("readelf").arg("-S").arg(installed.prefix.join("lib/libicheck.a")));
    assert!(!String::from_utf8_lossy(&archive.stdout).contains(".debug_info"), "libicheck.a keeps its debug info");
    // What was stripped still links and runs: the other tests compile and
    // run the C and Fortran examples against such an installation.
}

/// `find_package(icheck)` against an installed prefix: heat2d (C) and the
/// Fortran examples build with CMake alone, and the built programs restart
/// to the fault-free checksum.
#[test]
fn cmake_find_package_builds_heat2d_and_the_fortran_examples() {
    let installed = install("cmake");
    let build = |source: &str| -> std::path::PathBuf {
        let dir = installed.prefix.join("build").join(Path::new(source).file_name().unwrap());
        run(Command::new("cmake")
            .arg("-S")
            .arg(common::install::repo().join(source))
            .arg("-B")
            .arg(&dir)
            .arg(format!("-DCMAKE_PREFIX_PATH={}", installed.prefix.display())));
        run(Command::new("cmake").arg("--build").arg(&dir));
        dir
    };
    let heat2d = build("examples/heat2d").join("heat2d");
    let fortran = build("examples/fortran");
    let service = LocalService::up(&icheck_in_target(), "cmake", 2, &["--provider", "tcp"]);
    let common = ["--n", "96", "--iters", "80", "--every", "20"];
    let with = |extra: &[&'static str]| -> Vec<&str> { common.iter().copied().chain(extra.iter().copied()).collect() };
    kill_and_restart(
        &heat2d,
        &service,
        &with(&["--app", "cmake-clean"]),
        &with(&["--app", "cmake-faulty", "--fail-at", "50"]),
        &with(&["--app", "cmake-faulty"]),
        &[],
    );
    kill_and_restart(
        &fortran.join("heat1d"),
        &service,
        &["256", "80", "20"],
        &["256", "80", "20", "50"],
        &["256", "80", "20"],
        &[],
    );
    // A version the installation cannot satisfy is refused by name.
    let wants_newer = installed.prefix.join("wants-newer");
    std::fs::create_dir_all(&wants_newer).unwrap();
    std::fs::write(
        wants_newer.join("CMakeLists.txt"),
        "cmake_minimum_required(VERSION 3.13)\nproject(x LANGUAGES C)\nfind_package(icheck 9.0 REQUIRED)\n",
    )
    .unwrap();
    let refused = Command::new("cmake")
        .arg("-S")
        .arg(&wants_newer)
        .arg("-B")
        .arg(wants_newer.join("build"))
        .arg(format!("-DCMAKE_PREFIX_PATH={}", installed.prefix.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("icheckConfig.cmake") && stderr.contains("9.0"), "{stderr}");
}

/// The Spack recipe (`packaging/spack/icheck/package.py`), loaded and
/// carried out by `packaging/spack/check_recipe.py`: it declares the
/// fortran and python variants and its dependencies, and its own steps
/// (`make build`, `make install-files ...`, pip for +python) install a
/// prefix that compiles heat2d and imports in Python. PROFILE=dev reuses
/// the debug build `cargo test` made instead of a release build.
#[test]
fn spack_recipe_declares_its_variants_and_its_steps_install_a_working_prefix() {
    let root = std::env::temp_dir().join(format!("icheck-spack-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let recipe = |spec: &str, prefix: &Path| -> String {
        let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
        let out = run(Command::new("/usr/bin/python3")
            .arg(common::install::repo().join("packaging/spack/check_recipe.py"))
            .arg("--prefix")
            .arg(prefix)
            .args(["--spec", spec])
            .env("PROFILE", "dev")
            .env("PATH", path));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let full = root.join("full");
    let declared = recipe("+fortran+python", &full);
    for expected in [
        r#""name": "icheck""#,
        r#""fortran": {"default": true"#,
        r#""python": {"default": false"#,
        r#""spec": "mpi""#,
        r#""spec": "libfabric@1.17:""#,
        r#""spec": "py-mpi4py", "type": "run", "when": "+python""#,
    ] {
        assert!(declared.contains(expected), "{expected} not declared: {declared}");
    }
    for file in ["bin/icheck", "lib/libicheck.so", "include/icheck.h", "include/icheck.mod", "lib/libicheck_f.a"] {
        assert!(full.join(file).exists(), "+fortran+python did not install {file}");
    }
    let package =
        walk(&full).into_iter().find(|p| p.ends_with("icheck/__init__.py")).expect("+python installs the package");
    let site = package.parent().unwrap().parent().unwrap();
    let out = run(Command::new("/usr/bin/python3")
        .args(["-c", "import icheck; print('ABI', icheck.abi_version())"])
        .env("PYTHONPATH", site));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ABI 200"), "{out:?}");
    // heat2d compiles against the recipe's installation.
    let flags = run(Command::new("pkg-config")
        .args(["--cflags", "--libs", "icheck"])
        .env("PKG_CONFIG_PATH", full.join("lib/pkgconfig")));
    run(Command::new("mpicc")
        .args(["-std=c99", "-Wall", "-Werror"])
        .arg(common::install::repo().join("examples/heat2d/heat2d.c"))
        .arg("-o")
        .arg(root.join("heat2d"))
        .args(String::from_utf8_lossy(&flags.stdout).split_whitespace()));

    let without_fortran = root.join("c-only");
    recipe("~fortran~python", &without_fortran);
    assert!(without_fortran.join("lib/libicheck.so").exists());
    assert!(!without_fortran.join("include/icheck.mod").exists(), "~fortran installed the Fortran module");
    let pc = std::fs::read_to_string(without_fortran.join("lib/pkgconfig/icheck.pc")).unwrap();
    assert!(!pc.contains("-licheck_f"), "{pc}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// `make install` writes a manual page per subcommand and shell
/// completions generated from the command's definitions: the pages carry
/// the options `--help` shows, and bash completes subcommands and flags
/// with the installed script.
#[test]
fn installed_manual_pages_and_completions_match_the_command() {
    let installed = install("man");
    let man1 = installed.prefix.join("share/man/man1");
    for page in ["icheck.1", "icheck-up.1", "icheck-status.1", "icheck-manager.1", "icheck-fabric-info.1"] {
        let text = std::fs::read_to_string(man1.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH icheck"), "{page} is not a manual page:\n{text}");
    }
    let up = std::fs::read_to_string(man1.join("icheck-up.1")).unwrap();
    assert!(up.contains("state\\-dir") && up.contains("Start a local service"), "{up}");
    let script = installed.prefix.join("share/bash-completion/completions/icheck");
    let complete = |words: &str| -> String {
        let program = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
             _icheck icheck \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; echo \"${{COMPREPLY[*]}}\"",
            script.display()
        );
        String::from_utf8_lossy(&run(Command::new("bash").args(["-c", &program])).stdout).trim().to_string()
    };
    assert_eq!(complete("icheck st"), "status");
    assert!(complete("icheck up --sta").split_whitespace().any(|w| w == "--state-dir"));
    for shell in ["share/zsh/site-functions/_icheck", "share/fish/vendor_completions.d/icheck.fish"] {
        let text = std::fs::read_to_string(installed.prefix.join(shell)).unwrap();
        assert!(text.contains("state-dir"), "{shell}: {text}");
    }
}
