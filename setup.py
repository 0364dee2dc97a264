"""Why services/ is imported as omniflow_services: a top-level `services` package would
collide with any other on sys.path; the repository keeps one short folder per service.

Package mapping that pyproject.toml cannot express: the shared library lives in
libs/omniflow (import name `omniflow`) and the services in services/<name>
(import name `omniflow_services.<name>`), and one install provides both."""

from setuptools import find_packages, setup

packages = find_packages("libs", include=["omniflow", "omniflow.*"])
packages += ["omniflow_services"] + [f"omniflow_services.{p}" for p in find_packages("services")]
setup(
    packages=packages,
    package_dir={"omniflow": "libs/omniflow", "omniflow_services": "services"},
)
