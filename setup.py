"""Maps the committed folders generated/ (the core ops, from specs/) and zoo/generated/ (the spec zoo, from zoo/) to
the packages ejgen.generated and ejgen.zoo (metadata: pyproject.toml)."""

from setuptools import find_packages, setup

generated = ["ejgen.generated"] + [f"ejgen.generated.{p}" for p in find_packages("generated")]
zoo = ["ejgen.zoo"] + [f"ejgen.zoo.{p}" for p in find_packages("zoo/generated")]
setup(
    packages=find_packages(include=["ejgen", "ejgen.*"]) + generated + zoo,
    package_dir={"ejgen": "ejgen", "ejgen.generated": "generated", "ejgen.zoo": "zoo/generated"},
)
