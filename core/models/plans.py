"""Which models a server serves, and each one's settings: `model_plans`.

Models come from `--model [NAME=]MODEL` (repeatable), every GGUF file or
model directory in `--models-dir`, and the tables of a `--models-preset`
TOML file:

```toml
[models.chat]
model = "/models/qwen2.5-0.5b-instruct-q4_k_m.gguf"
max_total_tokens = 16384
pinned = true

[models.embed]
model = "/models/nomic-embed-text-v1.5.Q8_0.gguf"
pooling = "mean"
idle_ttl = 600
aliases = ["nomic"]
```

A preset's table sets any per-model setting by its name (every setting but
the server's own: host, port, keys, limits of the fleet, logging), and
`idle_ttl`, `pinned` and `aliases`. With no model named anywhere, the
default model is served.

One model is loaded at start-up and runs in this process (the engine
`--engine` chooses), as a single-model server always has. Several run each
in a child process of its own (the engine `process`, unless `--engine`, a
setting that chooses an engine such as `--replicas`, or the preset says
otherwise), loaded on first use.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pluggy

from lockgate.errors import ModelLoadError
from lockgate.models.slots import ModelPlan
from lockgate.models.loading import chosen_engine, locate_model, registered_engines, registered_models
from lockgate.settings import DEFAULT_MODEL, InvalidSetting, Setting, get_setting, split_model_entry

#: settings of the whole server, which a preset's model may not set
SERVER_SETTINGS = frozenset({
    "host", "port", "api_keys", "allowed_origins", "metrics_public", "max_body_size", "accept_unknown_fields",
    "responses_store_size", "shutdown_grace", "log_format", "log_level",
    "model", "models_dir", "models_preset", "max_models", "models_memory", "load_wait",
})
#: what a preset's table says of a model beyond its settings
PLAN_KEYS = frozenset({"model", "pinned", "aliases"})
#: the engine each model of a server with several runs on, unless told otherwise
SEVERAL_MODELS_ENGINE = "process"


def model_plans(settings, pm: pluggy.PluginManager, table) -> list[ModelPlan]:
    """Every model `settings` name, with the settings each loads with.
    Raises `InvalidSetting` for a preset that does not read or two models of
    one name, and `ModelLoadError` for a model that is not there or a
    models folder that holds none."""
    entries = [_Entry(*split_model_entry(entry)) for entry in settings.model]
    if settings.models_dir is not None:
        entries += _folder_entries(settings.models_dir)
    if settings.models_preset is not None:
        entries += _preset_entries(settings.models_preset, table)
    if not entries:
        entries = [_Entry(None, DEFAULT_MODEL)]
    several = len(entries) > 1
    if several and settings.served_model_name is not None:
        raise InvalidSetting("--served-model-name names one model; with several, name each as --model NAME=MODEL")
    specs = registered_models(pm)
    engines = registered_engines(pm)
    plans = []
    for entry in entries:
        # a file that is not there stops start-up, as one model's load would
        given_name = entry.name or settings.served_model_name
        path, found_name, found_aliases = locate_model(specs, entry.source, given_name)
        name = given_name or found_name
        aliases = tuple(entry.aliases) + found_aliases
        per_model = settings.replaced(model=(entry.source,), served_model_name=name, **entry.settings)
        if several and per_model.engine is None and chosen_engine(per_model, engines) == "local":
            # a setting that chooses an engine (`--replicas`) keeps its say
            per_model = per_model.replaced(engine=SEVERAL_MODELS_ENGINE)
        idle_ttl = per_model.idle_ttl
        pinned = entry.pinned if entry.pinned is not None else (not several and idle_ttl is None)
        plans.append(ModelPlan(name, per_model, aliases=aliases, idle_ttl=idle_ttl, pinned=pinned, path=path))
    names = [plan.name for plan in plans]
    for name in names:
        if names.count(name) > 1:
            raise InvalidSetting(f"two models are named {name!r}: name one with --model NAME=MODEL "
                                 "or its preset table")
    return plans


class _Entry:
    def __init__(self, name: str | None, source: str, settings: dict[str, Any] | None = None,
                 pinned: bool | None = None, aliases: tuple[str, ...] = ()) -> None:
        self.name = name
        self.source = source
        self.settings = settings or {}
        self.pinned = pinned
        self.aliases = aliases


def _folder_entries(folder: Path) -> list[_Entry]:
    from lockgate.models import hf

    folder = folder.expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"--models-dir {folder} is not a folder")
    found = [path for path in sorted(folder.iterdir())
             if (path.is_file() and path.suffix == ".gguf") or hf.is_hf_directory(path)]
    if not found:
        raise ModelLoadError(f"--models-dir {folder} holds no GGUF file and no model directory")
    return [_Entry(None, str(path)) for path in found]


def _preset_entries(path: Path, table) -> list[_Entry]:
    try:
        document = tomllib.loads(path.expanduser().read_text())
    except OSError as exc:
        raise InvalidSetting(f"--models-preset {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidSetting(f"--models-preset {path} is not TOML: {exc}") from None
    models = document.get("models")
    extra = sorted(set(document) - {"models"})
    if extra:
        raise InvalidSetting(f"--models-preset {path}: unknown table or key {extra[0]!r}; models go in "
                             "[models.NAME] tables")
    if not isinstance(models, dict) or not models:
        raise InvalidSetting(f"--models-preset {path} has no [models.NAME] table")
    entries = []
    for name, fields in models.items():
        where = f"--models-preset {path}: models.{name}"
        if not isinstance(fields, dict):
            raise InvalidSetting(f"{where} must be a table")
        source = fields.get("model")
        if not isinstance(source, str) or not source:
            raise InvalidSetting(f"{where} needs `model`, the GGUF file, model directory or registered name")
        if "/" in name:
            raise InvalidSetting(f"{where}: a model's name may not hold '/'")
        pinned = fields.get("pinned")
        if pinned is not None and not isinstance(pinned, bool):
            raise InvalidSetting(f"{where}.pinned must be true or false")
        aliases = fields.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise InvalidSetting(f"{where}.aliases must be a list of names")
        values = {}
        for key, value in fields.items():
            if key in PLAN_KEYS:
                continue
            if key in SERVER_SETTINGS:
                raise InvalidSetting(f"{where}.{key} is a setting of the whole server, not of one model")
            try:
                setting = get_setting(key, table)
            except KeyError:
                raise InvalidSetting(f"{where}.{key}: no setting has that name") from None
            values[key] = _typed(setting, value, f"{where}.{key}")
        entries.append(_Entry(name, source, values, pinned, tuple(aliases)))
    return entries


def _typed(setting: Setting, value: Any, where: str) -> Any:
    """A TOML value as `setting`'s value: text is parsed as a flag's is,
    other values must already be of its type."""
    if isinstance(value, str):
        try:
            return setting.parse(value)
        except InvalidSetting as exc:
            raise InvalidSetting(f"{where} {exc}") from None
    if setting.is_list and isinstance(value, list):
        return tuple(_typed_one(setting, item, where) for item in value)
    return _typed_one(setting, value, where)


def _typed_one(setting: Setting, value: Any, where: str) -> Any:
    if isinstance(value, str):
        return setting.parse(value)[0] if setting.is_list else setting.parse(value)
    wanted = setting.type
    fits = (isinstance(value, bool) if wanted is bool
            else isinstance(value, (int, float)) and not isinstance(value, bool) if wanted is float
            else isinstance(value, int) and not isinstance(value, bool) if wanted is int
            else False)
    if not fits:
        raise InvalidSetting(f"{where} must be {setting.type.__name__}, got {value!r}")
    return float(value) if wanted is float else value
