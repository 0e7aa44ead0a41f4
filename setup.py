"""Package discovery for the `epcc` distribution (all metadata is in pyproject.toml).

The repository's top-level directories are the subpackages of `epcc`
(compiler/ -> epcc, dialect/ -> epcc.dialect, ...), as given by
[tool.setuptools.package-dir] in pyproject.toml. `[tool.setuptools.packages.find]`
cannot rename what it finds, so the package list is computed here: every
directory under each mapped root (with or without an __init__.py, so data-only
folders such as runtime/native/ ship their headers too) becomes a package.
"""

import sys
from pathlib import Path

from setuptools import find_namespace_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
EXCLUDE = ["__pycache__", "*.__pycache__", "*.egg-info", "*.egg-info.*"]


def _packages():
    with open(HERE / "pyproject.toml", "rb") as fh:
        package_dir = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    roots = set(package_dir)
    packages = []
    for name, directory in sorted(package_dir.items()):
        packages.append(name)
        for sub in find_namespace_packages(where=str(HERE / directory), exclude=EXCLUDE):
            full = f"{name}.{sub}"
            # A directory that is itself mapped elsewhere is not a child here.
            if full not in roots:
                packages.append(full)
    return packages


setup(packages=_packages())
