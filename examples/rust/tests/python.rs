//! The Python package as users meet it: `pip install` of `python/` into a
//! virtual environment over Debian's numpy and mpi4py, the examples in
//! `examples/python` run under `mpirun` against a real local service,
//! killed and restarted.

mod common;

use std::process::Command;

use common::install::{kill_and_restart, mpirun_np, repo, run, succeeded};
use common::python::Venv;
use icheck_service::testkit::{icheck_in_target, LocalService};

fn example(name: &str) -> String {
    repo().join("examples/python").join(name).to_string_lossy().into_owned()
}

#[test]
fn python_heat1d_restarts_to_the_fault_free_checksum() {
    let venv = Venv::with_icheck("heat1d");
    let service = LocalService::up(&icheck_in_target(), "py-heat1d", 2, &["--provider", "tcp"]);
    let script = example("heat1d.py");
    let common = [script.as_str(), "--n", "512", "--iters", "120", "--every", "20"];
    let with = |extra: &[&'static str]| -> Vec<&str> { common.iter().copied().chain(extra.iter().copied()).collect() };
    kill_and_restart(
        &venv.python(),
        &service,
        &with(&["--app", "clean"]),
        &with(&["--app", "faulty", "--fail-at", "70"]),
        &with(&["--app", "faulty"]),
        &[],
    );
    // Asynchronous commits and probes through the same bindings.
    kill_and_restart(
        &venv.python(),
        &service,
        &with(&["--app", "clean-async", "--asynchronous"]),
        &with(&["--app", "faulty-async", "--asynchronous", "--probe-every", "3", "--fail-at", "70"]),
        &with(&["--app", "faulty-async", "--asynchronous", "--probe-every", "3"]),
        &[],
    );
}

#[test]
fn python_block_array_restores_with_another_process_count() {
    let venv = Venv::with_icheck("block");
    let service = LocalService::up(&icheck_in_target(), "py-block", 2, &["--provider", "tcp"]);
    let config = service.config_path();
    let shm_dir = service.dir.join("mpi-shm");
    let script = example("block.py");
    let job = |np: u32| succeeded(mpirun_np(np, &config, &shm_dir, &venv.python(), &[&script], &[]));
    let written = job(4);
    assert!(written.contains("PYTHON COMMITTED ranks=4"), "{written}");
    let restored = job(3);
    assert!(restored.contains("PYTHON TYPE CHECKED"), "{restored}");
    assert!(restored.contains("PYTHON VERIFIED ranks=3 from=4"), "{restored}");
}

#[test]
fn python_errors_name_the_call_and_the_cause() {
    let venv = Venv::with_icheck("errors");
    let missing = venv.dir.join("missing.toml");
    let program = format!(
        "import icheck, numpy\n\
         assert icheck.library_path().endswith('site-packages/icheck/libicheck.so'), icheck.library_path()\n\
         try:\n    icheck.init('x', config={missing:?})\n\
         except icheck.Error as e:\n    print('ERROR', e.name, e)\n\
         try:\n    icheck.add('a', numpy.arange(10)[::2])\n\
         except ValueError as e:\n    print('STRIDED', e)\n",
        missing = missing.display().to_string()
    );
    let out = run(Command::new(venv.python()).args(["-c", &program]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ERROR ICHECK_ERR_CONFIG icheck_init:"), "{stdout}");
    assert!(stdout.contains(&format!("{}", missing.display())), "the error names the file: {stdout}");
    assert!(stdout.contains("STRIDED icheck: add('a'): the array is not contiguous"), "{stdout}");
}
