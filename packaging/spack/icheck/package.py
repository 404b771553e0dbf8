# Spack recipe for icheck, an RDMA checkpoint service for MPI applications.
#
# Use it from a Spack repository of your own:
#   spack repo create ~/spack-icheck && cp -r packaging/spack/icheck ~/spack-icheck/packages/
#   spack repo add ~/spack-icheck
#   spack install icheck +fortran +python ^openmpi
#
# The build is the project's Makefile: `make build` (cargo, release), then
# `make install-files` with Spack's MPI compiler wrappers; the Python
# bindings are pip-installed from python/ with the just-installed
# libicheck bundled. Tested by examples/rust/tests/c_fortran.rs
# (packaging_recipe_*), which runs these same steps.

from spack.package import *


class Icheck(MakefilePackage):
    """icheck: checkpoints of MPI applications moved by one-sided RMA
    (libfabric) into the memory of dedicated checkpoint nodes, restarted
    from there; C, Fortran, Rust and Python client libraries."""

    # The project has no public home yet: point these at your clone.
    homepage = "https://example.invalid/icheck"
    git = "https://example.invalid/icheck.git"

    license("MIT OR Apache-2.0")

    version("main", branch="main")

    variant("fortran", default=True, description="Fortran module (use icheck) and libicheck_f")
    variant("python", default=False, description="Python bindings over libicheck (numpy, mpi4py)")

    depends_on("rust@1.75:", type="build")
    depends_on("pkgconfig", type="build")
    depends_on("llvm+clang", type="build")  # bindgen reads libfabric's headers through libclang
    depends_on("libfabric@1.17:")
    depends_on("mpi")

    with when("+python"):
        extends("python")
        depends_on("python@3.9:", type=("build", "run"))
        depends_on("py-pip", type="build")
        depends_on("py-setuptools@61:", type="build")
        depends_on("py-numpy", type=("build", "run"))
        depends_on("py-mpi4py", type="run")

    @property
    def build_targets(self):
        return ["build"]

    @property
    def install_targets(self):
        spec = self.spec
        targets = [
            "install-files",
            f"PREFIX={self.prefix}",
            f"MPICC={spec['mpi'].mpicc}",
            f"FORTRAN={'yes' if spec.satisfies('+fortran') else 'no'}",
        ]
        if spec.satisfies("+fortran"):
            targets.append(f"FC={spec['mpi'].mpifc}")
        return targets

    @run_after("install")
    def install_python_bindings(self):
        if not self.spec.satisfies("+python"):
            return
        python = which("python3", required=True)
        with working_dir("python"):
            python(
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                f"--prefix={self.prefix}",
                ".",
                extra_env={"ICHECK_LIBRARY": join_path(self.prefix.lib, "libicheck.so")},
            )
