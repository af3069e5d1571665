"""The layout map (docs/architecture.md) names every module of the three packages, and
only modules that exist."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("core", "plugins", "server")


def layout_paths() -> set[str]:
    readme = (ROOT / "docs" / "architecture.md").read_text()
    block = readme.split("<!-- layout -->", 1)[1].split("<!-- end of layout -->", 1)[0]
    paths, stack = set(), []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match or match[2].startswith("`"):
            continue
        depth = len(match[1]) // 2
        name = match[2]
        stack[depth:] = [name]
        if name.endswith(".py") or name.endswith("/"):
            paths.add("".join(stack))
    return paths


def test_the_layout_map_is_true():
    mapped = layout_paths()
    modules = {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }
    folders = {str(path.relative_to(ROOT)) + "/" for package in PACKAGES for path in (ROOT / package).rglob("*") if path.is_dir() and path.name != "__pycache__"}
    missing = modules - mapped
    assert not missing, f"modules docs/architecture.md's layout does not name: {sorted(missing)}"
    invented = {p for p in mapped if p.endswith(".py")} - modules
    assert not invented, f"docs/architecture.md's layout names modules that do not exist: {sorted(invented)}"
    for folder in {p for p in mapped if p.endswith("/") and p.split("/")[0] in PACKAGES and p.count("/") > 1}:
        assert folder in folders, folder


def test_core_never_imports_the_server_or_aiohttp():
    for path in (ROOT / "core").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) (aiohttp|lockgate\.server)\b", text, re.M), path
    for path in (ROOT / "plugins").rglob("*.py"):
        assert not re.search(r"^\s*(from|import) lockgate\.server\b", path.read_text(), re.M), path


def test_core_and_server_import_no_plugin():
    """Plugins plug in through hooks: nothing in core/ or server/ imports
    `lockgate.plugins` (the plugin manager names its built-ins as strings)."""
    import ast

    found = []
    for package in ("core", "server"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("lockgate.plugins")]
    assert not found, found
