#!/usr/bin/env python3
"""check_recipe.py: loads packaging/spack/icheck/package.py the way Spack
would and carries out the steps it declares, without Spack itself.

    python3 packaging/spack/check_recipe.py --prefix /tmp/p --spec +fortran~python

What stands in for Spack is only what the recipe touches: the directives
(version, variant, depends_on, extends, license, when) record what they
declare; MakefilePackage runs `make <build_targets>` then
`make <install_targets>` in the source tree, then the run_after("install")
hooks, as Spack's MakefilePackage builder does; `spec['mpi'].mpicc` and
`.mpifc` are the mpicc/mpifort on PATH. It prints the declarations as JSON
(the test checks them) and fails on any step that fails.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent

_declared = {"versions": {}, "variants": {}, "dependencies": [], "extends": [], "license": None}
_conditions = []
_hooks = []
_working = [SOURCE]


def _when():
    return " ".join(_conditions) or None


def version(name, **kwargs):
    _declared["versions"][name] = kwargs


def variant(name, default=None, description="", **kwargs):
    _declared["variants"][name] = {"default": default, "description": description}


def depends_on(spec, type=("build", "link"), when=None):  # noqa: A002 - Spack's keyword
    _declared["dependencies"].append({"spec": spec, "type": type, "when": when or _when()})


def extends(spec, **kwargs):
    _declared["extends"].append({"spec": spec, "when": _when()})


def license(text, **kwargs):  # noqa: A001 - Spack's directive
    _declared["license"] = text


@contextlib.contextmanager
def when(condition):
    _conditions.append(condition)
    try:
        yield
    finally:
        _conditions.pop()


def run_after(phase):
    def register(function):
        _hooks.append((phase, function.__name__))
        return function

    return register


@contextlib.contextmanager
def working_dir(path):
    _working.append(_working[-1] / path)
    try:
        yield
    finally:
        _working.pop()


def join_path(*parts):
    return os.path.join(*[str(p) for p in parts])


class Executable:
    def __init__(self, path):
        self.path = path

    def __call__(self, *args, extra_env=None, **kwargs):
        env = dict(os.environ, **(extra_env or {}))
        print(f"check_recipe: ({_working[-1]}) {self.path} {' '.join(args)}", file=sys.stderr, flush=True)
        subprocess.run([self.path, *args], cwd=_working[-1], env=env, check=True)


def which(name, required=False):
    path = shutil.which(name)
    if path is None and required:
        sys.exit(f"check_recipe: {name} not found on PATH")
    return Executable(path) if path else None


class Prefix(str):
    """Spack's Prefix: a path whose attributes are subdirectories."""

    def __getattr__(self, name):
        return Prefix(os.path.join(self, name))


class Spec:
    def __init__(self, text):
        self.enabled = {}
        for sign, name in _variant_tokens(text):
            self.enabled[name] = sign == "+"

    def satisfies(self, condition):
        return all(self.enabled.get(name, False) == (sign == "+") for sign, name in _variant_tokens(condition))

    def __getitem__(self, name):
        if name != "mpi":
            raise KeyError(name)
        return types.SimpleNamespace(mpicc=shutil.which("mpicc"), mpifc=shutil.which("mpifort"))


def _variant_tokens(text):
    tokens, sign, name = [], None, ""
    for char in text + "+":
        if char in "+~":
            if sign and name:
                tokens.append((sign, name))
            sign, name = char, ""
        elif not char.isspace():
            name += char
    return tokens


class MakefilePackage:
    def __init__(self, spec, prefix):
        self.spec = spec
        self.prefix = Prefix(prefix)

    def run(self):
        make = which("make", required=True)
        make(*self.build_targets)
        make(*self.install_targets)
        for phase, name in _hooks:
            if phase == "install":
                getattr(self, name)()


def load_recipe():
    spack = types.ModuleType("spack")
    package = types.ModuleType("spack.package")
    for name in (
        "version",
        "variant",
        "depends_on",
        "extends",
        "license",
        "when",
        "run_after",
        "working_dir",
        "join_path",
        "which",
        "MakefilePackage",
    ):
        setattr(package, name, globals()[name])
    package.__all__ = [n for n in vars(package) if not n.startswith("_")]
    spack.package = package
    sys.modules["spack"], sys.modules["spack.package"] = spack, package
    spec = importlib.util.spec_from_file_location("icheck_recipe", HERE / "icheck" / "package.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Icheck


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", required=True, help="installation prefix")
    parser.add_argument("--spec", default="+fortran~python", help="variants, e.g. +fortran+python")
    parser.add_argument("--parse-only", action="store_true", help="print the declarations, build nothing")
    args = parser.parse_args()
    recipe = load_recipe()
    declared = dict(_declared, name=recipe.__name__.lower(), hooks=_hooks)
    print(json.dumps(declared, default=list), flush=True)
    if not args.parse_only:
        recipe(Spec(args.spec), args.prefix).run()
        print(f"check_recipe: installed {args.spec} under {args.prefix}", file=sys.stderr)


if __name__ == "__main__":
    main()
