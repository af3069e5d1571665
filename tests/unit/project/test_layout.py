"""The layout map (docs/architecture.md) names every module of the three packages, and
only modules that exist; no module is over 450 lines without saying why."""

from __future__ import annotations

import ast
import re

from paths import ROOT

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


def test_the_tests_have_a_map():
    """Test modules live in tests/unit/<package>/ (one package's code, no
    server) or tests/e2e/ (through HTTP or whole processes), the helpers
    and test doubles in tests/support/, and each folder is in the map."""
    mapped = layout_paths()
    tests = ROOT / "tests"
    for path in tests.rglob("*.py"):
        where = str(path.relative_to(tests))
        if path.name.startswith("test_"):
            assert where.startswith(("unit/", "e2e/")), f"tests/{where}: a test module outside unit/ and e2e/"
        elif path.name != "conftest.py" and not where.startswith("data/"):
            assert where.startswith("support/"), f"tests/{where}: a helper outside tests/support/"
    folders = {str(p.relative_to(ROOT)) + "/" for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    folders = {f for f in folders if f.count("/") <= 3 and (f == "tests/data/" or not f.startswith("tests/data/"))}
    assert folders <= mapped, f"test folders the map does not name: {sorted(folders - mapped)}"
    assert {p for p in mapped if p.startswith("tests/")} <= folders | {"tests/"}


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


#: the most lines a module has unless its docstring says why it needs more
MAX_MODULE_LINES = 450


def test_no_module_is_over_450_lines_without_saying_why():
    """A module past `MAX_MODULE_LINES` says in its docstring why it is one
    piece ("over 450 lines because ..."); any other is split by concern."""
    unexplained = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            lines = source.count("\n")
            docstring = ast.get_docstring(ast.parse(source)) or ""
            if lines > MAX_MODULE_LINES and "over 450 lines because" not in docstring:
                unexplained.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not unexplained, f"split these by concern, or say why in their docstring: {unexplained}"
