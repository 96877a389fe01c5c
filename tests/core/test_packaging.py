"""A non-editable install carries every package: pyproject lists each directory that is one."""

import tomllib

from tests.conftest import REPO


def test_every_package_directory_is_listed_in_pyproject():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    mapped = {v: k for k, v in tool["package-dir"].items()}  # directory -> package name
    found = set()
    for top, package in mapped.items():
        for init in (REPO / top).glob("**/__init__.py"):
            rest = init.parent.relative_to(REPO / top).as_posix()
            found.add(package if rest == "." else f"{package}.{rest.replace('/', '.')}")
    assert found and found == listed, f"listed but not packages: {listed - found}; missing: {found - listed}"
