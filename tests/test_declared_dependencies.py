"""Every package the shipped code imports is installed by `pip install ksi` itself.

The test environment holds more than a user's (the test extra and what it pulls in), so a module
the daemon imports but only a test dependency brings would pass every other test here and fail
for the user: the HTTP door's WebSocket protocol needed `websockets`, which only LangChain's
`langsmith` installed. This reads the imports of the shipped packages and the base dependencies
of pyproject.toml with what they require in turn, and names what is missing."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("ksi_common", "ksi_daemon", "ksi_cli", "ksi_mcp", "ksi_llm")


def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@cache
def requires_of(distribution: str) -> tuple[Requirement, ...]:
    return tuple(Requirement(line) for line in metadata.requires(distribution) or ())


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions `pip install` brings for these requirements: each with its own
    requirements and those of the extras it was asked for (`pyjwt[crypto]`), no others."""
    def wanted(requirement: Requirement, extras: set[str]) -> bool:
        return requirement.marker is None or any(requirement.marker.evaluate({"extra": extra})
                                                 for extra in {"", *extras})

    found: set[tuple[str, frozenset[str]]] = set()
    todo = [r for r in requirements if wanted(r, set())]
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in found:
            continue
        found.add(key)
        todo.extend(r for r in requires_of(requirement.name) if wanted(r, requirement.extras))
    return {name for name, _ in found}


def imported_modules(package: str) -> dict[str, str]:
    """Top-level third-party modules the package imports, each with one file that does."""
    own = set(SHIPPED)
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in own and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


IMPORT_ALL = """
import importlib, importlib.abc, json, pkgutil, sys
blocked = set(json.loads(sys.argv[1]))

class Uninstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed by these requirements)", name=name)
        return None

sys.meta_path.insert(0, Uninstalled())
failed = []
for package in sys.argv[2:]:
    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        if module.name.endswith(".__main__"):  # runs the program when imported
            continue
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as error:
            failed.append(f"{module.name}: {error}")
print(json.dumps(failed))
"""


def missing(packages: tuple[str, ...], requirements: list[Requirement]) -> list[str]:
    """What the packages import, at the top of a file or where they are loaded, that these
    requirements do not install: the direct imports read from the source, and every module
    imported in a child Python that cannot find the distributions left out."""
    closure = installed_closure(requirements)
    providers = metadata.packages_distributions()
    problems = []
    for package in packages:
        for module, where in imported_modules(package).items():
            distributions = {canonicalize_name(d) for d in providers.get(module, [])}
            if not distributions & closure:
                problems.append(f"{module} (imported by {where}; installed here by {sorted(distributions)})")
    blocked = sorted(module for module, distributions in providers.items()
                     if module not in SHIPPED and not {canonicalize_name(d) for d in distributions} & closure)
    child = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(blocked), *packages],
                           capture_output=True, text=True, cwd=ROOT)
    assert child.returncode == 0, child.stderr
    return problems + json.loads(child.stdout)


def test_the_base_install_brings_every_module_the_daemon_the_cli_and_mcp_import() -> None:
    base = [Requirement(line) for line in project()["dependencies"]]
    assert missing(("ksi_common", "ksi_daemon", "ksi_cli", "ksi_mcp"), base) == []


def test_the_llm_extra_brings_what_the_llm_plugin_imports() -> None:
    declared = project()
    with_llm = [Requirement(line) for line in declared["dependencies"] + declared["optional-dependencies"]["llm"]]
    assert missing(("ksi_llm",), with_llm) == []
