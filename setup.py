"""The package list for setuptools; every other setting is in pyproject.toml.

``libk3`` and all its subpackages are found automatically, so a new subpackage can never
be left out of a wheel (a hand-written list once omitted ``libk3.engine`` and
``libk3.stream``). The four front ends live in ``tools/k3-*``, directory names that are
not importable, so each is mapped to its package name here; ``tools/k3cli`` holds the
click pieces they share (libk3 never imports click).
"""

from setuptools import find_packages, setup

TOOLS = {"k3_doctor": "tools/k3-doctor", "k3_pack": "tools/k3-pack",
         "k3_run": "tools/k3-run", "k3_trace": "tools/k3-trace", "k3cli": "tools/k3cli"}

setup(packages=find_packages(include=["libk3", "libk3.*"]) + list(TOOLS), package_dir=TOOLS)
