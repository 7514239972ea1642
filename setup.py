"""Packages are discovered, so a new folder under ftcore/ is never left out of the wheel; conf/
and launch/ stay at the top of the repository and install as ftcore.conf and ftcore.launch
(package-dir in pyproject.toml). Data folders (conf/exp, ftcore/assets/tokenizer, ...) are listed
as packages too, so setuptools installs their files without a warning per folder. Everything else
lives in pyproject.toml."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

here = Path(__file__).parent
conf = [
    "ftcore.conf",
    *(f"ftcore.conf.{d.name}" for d in sorted((here / "conf").iterdir()) if d.is_dir()),
]
packages = find_namespace_packages(include=["ftcore", "ftcore.*"], exclude=["*.__pycache__"])
setup(packages=[*packages, *conf, "ftcore.launch"])
