"""Maps the three code folders onto sub-packages of `metronome` (pyproject.toml holds everything else).

`server/` → `metronome.server`, `kernels/` → `metronome.kernels`, `operator/` → `metronome.operator`:
nothing becomes importable as a top-level `operator`, which is a standard-library module.
"""
from setuptools import find_packages, setup

CODE_FOLDERS = ("server", "kernels", "operator")

packages = ["metronome"] + [f"metronome.{sub}" for sub in find_packages("metronome")]
package_dir = {"metronome": "metronome"}
for folder in CODE_FOLDERS:
    package_dir[f"metronome.{folder}"] = folder
    packages += [f"metronome.{folder}"] + [f"metronome.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
