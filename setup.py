"""Packages are discovered, so a new folder under ftcore/ is never left out of the wheel; conf/
and launch/ stay at the top of the repository and install as ftcore.conf and ftcore.launch
(package-dir in pyproject.toml). Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["ftcore", "ftcore.*"]), "ftcore.conf", "ftcore.launch"])
