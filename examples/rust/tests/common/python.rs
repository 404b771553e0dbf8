//! The Python package installed as users install it: `pip install` of a
//! copy of `python/` into a virtual environment over Debian's numpy and
//! mpi4py.

use std::path::PathBuf;
use std::process::Command;

use icheck_service::testkit::icheck_in_target;

use super::install::{repo, run};

/// Debian's interpreter, which has python3-numpy and python3-mpi4py (a
/// `python3` earlier on PATH, e.g. pyenv's, may have neither).
const SYSTEM_PYTHON: &str = "/usr/bin/python3";

/// A virtual environment with the icheck package installed; removed on drop.
pub struct Venv {
    /// The temporary directory holding the environment.
    pub dir: PathBuf,
}

impl Drop for Venv {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Venv {
    /// `pip install` of a copy of `python/` (the build writes into its
    /// source tree), bundling the debug libicheck.so `cargo test` built.
    pub fn with_icheck(name: &str) -> Venv {
        let dir = std::env::temp_dir().join(format!("icheck-python-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let source = dir.join("src");
        std::fs::create_dir_all(source.join("icheck")).unwrap();
        for file in ["pyproject.toml", "setup.py", "README.md", "icheck/__init__.py", "icheck/_native.py"] {
            std::fs::copy(repo().join("python").join(file), source.join(file)).unwrap();
        }
        let venv = Venv { dir };
        run(Command::new(SYSTEM_PYTHON).args(["-m", "venv", "--system-site-packages"]).arg(venv.dir.join("venv")));
        let library = icheck_in_target().parent().unwrap().join("libicheck.so");
        assert!(library.exists(), "build the workspace first (cargo build --workspace)");
        // No index and no build isolation: the test needs no network; numpy
        // and setuptools come from Debian through the system site packages.
        run(Command::new(venv.python())
            .args(["-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation"])
            .arg(&source)
            .env("ICHECK_LIBRARY", library));
        venv
    }

    /// The environment's interpreter.
    pub fn python(&self) -> PathBuf {
        self.dir.join("venv/bin/python")
    }
}
