"""Build of the icheck Python package: pure Python over libicheck (ctypes),
with the library bundled into the package when one is at hand.

Where libicheck.so comes from, first match wins:
  ICHECK_LIBRARY=/path/to/libicheck.so   that file
  a checkout with cargo on PATH          cargo build --release -p icheck-ffi
  neither                                none bundled; at run time the package
                                         uses $ICHECK_LIBRARY or the system's
                                         libicheck (make install + ldconfig)
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def library_to_bundle():
    given = os.environ.get("ICHECK_LIBRARY")
    if given:
        path = Path(given)
        if not path.is_file():
            sys.exit(f"icheck: ICHECK_LIBRARY={given}: no such file")
        return path
    if (REPO / "Cargo.toml").is_file() and shutil.which("cargo"):
        print("icheck: building libicheck with cargo (release; minutes on a first build)", file=sys.stderr)
        subprocess.run(["cargo", "build", "--release", "-p", "icheck-ffi"], cwd=REPO, check=True)
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        if not target.is_absolute():
            target = REPO / target
        return target / "release" / "libicheck.so"
    print(
        "icheck: no libicheck bundled (set ICHECK_LIBRARY or build from a checkout); "
        "the package will use $ICHECK_LIBRARY or the system's libicheck at run time",
        file=sys.stderr,
    )
    return None


class BuildWithLibrary(build_py):
    """Copies libicheck.so next to the package's modules."""

    def run(self):
        super().run()
        library = library_to_bundle()
        if library is None:
            return
        destination = Path(self.build_lib) / "icheck" / "libicheck.so"
        shutil.copyfile(library, destination)
        # Debug info makes the library tens of MB; the package ships without.
        if shutil.which("strip"):
            subprocess.run(["strip", "--strip-debug", str(destination)], check=False)


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
