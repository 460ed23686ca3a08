"""Maps the committed folder generated/ to the package ejgen.generated (metadata: pyproject.toml)."""

from setuptools import find_packages, setup

generated = ["ejgen.generated"] + [f"ejgen.generated.{p}" for p in find_packages("generated")]
setup(
    packages=find_packages(include=["ejgen", "ejgen.*"]) + generated,
    package_dir={"ejgen": "ejgen", "ejgen.generated": "generated"},
)
