"""The hook reference (docs/plugins.md) against the hookspecs: a heading per hook with
its signature as the code has it, its docstring's first line, how it is
called, its phase; no hook the code lacks; and a test implementing each."""

from __future__ import annotations

import inspect
import re

import pytest

from lockgate.plugin_api import hookspecs

from paths import ROOT
REFERENCE = (ROOT / "docs" / "plugins.md").read_text()
#: every document that may name a hook
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: every function `lockgate.plugin_api.hookspecs` marks as a hookspec, in source order
HOOKSPECS = {
    name: function for name, function in vars(hookspecs).items()
    if hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}
STOPS_AT_FIRST = "Stops at the first non-None result."
EVERY_ONE_RUNS = "Every implementation runs."


def hook_signature(function) -> str:
    """`name(arg: Annotation, ...) -> Return` as the hookspec writes it
    (annotations are strings there, shown without quotes)."""
    signature = inspect.signature(function)
    params = ", ".join(f"{name}: {param.annotation}" for name, param in signature.parameters.items())
    return f"{function.__name__}({params}) -> {signature.return_annotation}"


def hook_phases() -> dict[str, str]:
    """Each hook's phase: the section comment above it in hookspecs.py
    ("# Request pipeline: ..." under a "# ----" rule), lower case."""
    phases, phase, after_rule = {}, None, False
    for line in inspect.getsource(hookspecs).splitlines():
        if line.startswith("# ---"):
            after_rule = True
            continue
        if after_rule and (match := re.match(r"# ([A-Z][\w -]*?):", line)):
            phase = match[1].lower()
        after_rule = False
        if match := re.match(r"def (lockgate_\w+)\(", line):
            phases[match[1]] = phase
    return phases


def readme_hook_sections() -> dict[str, tuple[str, str]]:
    """The reference's `### `lockgate_...`` sections: hook name -> (the phase
    of the `## Hooks: phase` heading above it, the text under it)."""
    sections: dict[str, tuple[str, str]] = {}
    phase = None
    for part in re.split(r"^(?=#{1,3} )", REFERENCE, flags=re.M):
        heading, _, body = part.partition("\n")
        if match := re.fullmatch(r"## Hooks: (.+)", heading):
            phase = match[1]
        elif match := re.fullmatch(r"### `(lockgate_\w+)`", heading):
            assert match[1] not in sections, f"docs/plugins.md documents {match[1]} twice"
            sections[match[1]] = (phase, body)
    return sections


def test_hookspecs_are_found_and_grouped():
    assert HOOKSPECS, "no hookspecs found"
    phases = hook_phases()
    assert set(phases) == set(HOOKSPECS)
    assert set(phases.values()) == {"request pipeline", "errors", "registration", "start-up"}


def test_readme_documents_every_hook_and_no_other():
    sections = readme_hook_sections()
    assert list(sections) == list(HOOKSPECS), "docs/plugins.md's hook headings differ from the hookspecs (or their order)"
    # a hook named anywhere else (prose, examples) exists too
    named = set(re.findall(r"`(lockgate_\w+)`", DOCS)) | set(re.findall(r"\b(lockgate_\w+)\(", DOCS))
    named -= metric_names()  # the metrics share the prefix
    assert named <= set(HOOKSPECS), f"the docs name hooks that do not exist: {sorted(named - set(HOOKSPECS))}"


def metric_names() -> set[str]:
    from lockgate.metrics import Metrics

    # a counter `x` is exposed as `x_total` too
    return {name + suffix for family in Metrics().registry.collect() for name in [family.name]
            for suffix in ("", "_total")}


@pytest.mark.parametrize("hook", list(HOOKSPECS))
def test_readme_section_matches_the_hookspec(hook):
    function = HOOKSPECS[hook]
    phase, body = readme_hook_sections()[hook]
    assert phase == hook_phases()[hook], f"docs/plugins.md puts {hook} under 'Hooks: {phase}'"
    documented = re.search(r"```python\n(.*?)\n```", body, flags=re.S)
    assert documented, f"docs/plugins.md's {hook} section shows no signature"
    assert documented[1] == hook_signature(function)
    docstring = inspect.getdoc(function)
    first_line = docstring.split("\n\n", 1)[0].replace("\n", " ")
    prose = " ".join(body[documented.end():].split())
    assert first_line in prose, f"docs/plugins.md's {hook} section does not say {first_line!r}"
    calling = STOPS_AT_FIRST if getattr(function, f"{hookspecs.PROJECT_NAME}_spec")["firstresult"] else EVERY_ONE_RUNS
    assert docstring.endswith(calling), f"{hook}'s docstring does not end with {calling!r}"
    assert calling in prose, f"docs/plugins.md's {hook} section does not say {calling!r}"


@pytest.mark.parametrize("hook", list(HOOKSPECS))
def test_every_hookspec_is_annotated_and_documented(hook):
    function = HOOKSPECS[hook]
    signature = inspect.signature(function)
    assert signature.return_annotation is not inspect.Signature.empty, f"{hook} has no return annotation"
    docstring = inspect.getdoc(function)
    for name, param in signature.parameters.items():
        assert param.annotation is not inspect.Parameter.empty, f"{hook}: {name} has no annotation"
        assert f":param {name}:" in docstring, f"{hook}'s docstring does not describe {name}"
    assert ":returns:" in docstring and ":raises:" in docstring, f"{hook}'s docstring lacks :returns: or :raises:"


@pytest.mark.parametrize("hook", list(HOOKSPECS))
def test_every_hook_is_implemented_by_a_test(hook):
    # a test "uses" a hook when it implements it in a plugin of its own
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    assert f"def {hook}(" in tests or f'"{hook}": ' in tests, f"no test implements {hook}"
