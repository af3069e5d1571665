"""Every setting of `lockgate serve`, declared once.

`SETTINGS` is the server's own table (datasette's `SETTINGS` is the model);
plugins add theirs through `lockgate_add_settings` (pytest's
`pytest_addoption` is the model: the TVM executor its target, threads and
cache, the Ray engine its replicas), and `settings_table(pm)` is the whole.
Each `Setting` names its type, default and help text, and from the table
come

* the fields and defaults of `lockgate.server.config.Settings` (a plugin's
  settings are held in `Settings.plugins` and read as attributes too), and
  the defaults of `EngineOptions` and `ExecutorOptions` (`setting_default`);
* the environment variables `LOCKGATE_<NAME>` (`values_from_env`);
* the `--flags` of `lockgate serve` (`add_arguments`);
* the configuration table of docs/configuration.md (`markdown_table`, or
  `python -m lockgate.settings`);
* `Settings`, the dataclass with one field per setting, which the server,
  the engines and the Ray replicas are configured from.

This module imports nothing from lockgate at import time, so every layer
may import it. It is over 450 lines because half of it is the table
itself, a setting a few lines, which reads best in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: what each value type is called in error messages
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false"}
#: `--help` placeholders for settings that declare none (argparse's `MAX_NUM_SEQS` says little)
_METAVARS = {int: "N", float: "N", Path: "PATH"}


class InvalidSetting(ValueError):
    """A setting's value (from the environment or a flag) does not parse."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: field `name`, flag `--name-with-dashes`, environment
    variable `LOCKGATE_NAME`.

    `type` is the value's type (`int`, `float`, `str`, `Path` or `bool`; the
    item type when `is_list`). A `bool` setting is an on/off flag
    (`--name` / `--no-name`; a None default means automatic until a flag or
    variable says on or off, its `default_text` saying what that is); a
    list is given comma separated, or as its flag given several times, and
    held as a tuple. `help` is markdown
    (backticks are dropped for `--help`).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    is_list: bool = False
    #: the flag, when not `--name-with-dashes`; its `LOCKGATE_` variable is read too
    flag: str = ""
    #: the default in words, where the value alone says too little (None, a computed path)
    default_text: str = ""
    #: placeholder for the value in `--help` and docs/configuration.md
    metavar: str | None = None

    def __post_init__(self):
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def is_bool(self) -> bool:
        return self.type is bool

    @property
    def env_vars(self) -> tuple[str, ...]:
        """Variables read, first non-empty wins: `LOCKGATE_<NAME>`, then
        `LOCKGATE_<FLAG>` where the flag is named differently (`--api-key`
        gives `LOCKGATE_API_KEY` besides `LOCKGATE_API_KEYS`)."""
        by_name = f"LOCKGATE_{self.name.upper()}"
        by_flag = "LOCKGATE_" + self.flag.removeprefix("--").replace("-", "_").upper()
        return (by_name,) if by_flag == by_name else (by_name, by_flag)

    @property
    def annotation(self) -> Any:
        """The field's type, for the `Settings` dataclass."""
        if self.is_list:
            return tuple[self.type, ...]
        return self.type | None if self.default is None else self.type

    def parse(self, raw: str) -> Any:
        """`raw` text as this setting's value; raises `InvalidSetting`
        (without naming the source; callers add the variable or flag)."""
        if self.is_list:
            return tuple(self._parse_one(item.strip()) for item in raw.split(",") if item.strip())
        return self._parse_one(raw)

    def _parse_one(self, raw: str) -> Any:
        if self.is_bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise InvalidSetting(f"must be true or false, got {raw!r}")
        if self.choices and raw not in self.choices:
            raise InvalidSetting(f"must be one of {', '.join(self.choices)}, got {raw!r}")
        try:
            return self.type(raw)
        except ValueError:
            raise InvalidSetting(f"must be {_TYPE_WORDS.get(self.type, self.type.__name__)}, got {raw!r}") from None

    def default_markdown(self) -> str:
        if self.default_text:
            return self.default_text
        if self.is_bool:
            return "on" if self.default else "off"
        if self.default is None or self.default == ():
            return "none"
        if isinstance(self.default, str):
            return f"`{self.default}`"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)


SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, (),
            "the model to serve: a registered name (`smollm2` works too), a GGUF file or a model directory; "
            "`NAME=MODEL` serves it as `NAME`. Given several times, the server serves each, every one in a "
            "process of its own, loaded on first use (see `--max-models`, `--models-memory`, `--idle-ttl`)",
            is_list=True, default_text="`SmolLM2-135M-Instruct`, where no `--models-dir` or `--models-preset` "
            "names models", metavar="[NAME=]MODEL"),
    Setting("models_dir", Path, None,
            "serve every GGUF file (and model directory) in this folder, each named by its file's name "
            "without `.gguf`", metavar="DIR"),
    Setting("models_preset", Path, None,
            "a TOML file of models, a table each: `[models.NAME]` with `model = \"PATH\"` and any per-model "
            "setting (`max_total_tokens`, `quantize`, `chat_template`, `pooling`, ...) by its name, and "
            "`idle_ttl`, `pinned` (loaded at start-up, never unloaded for room or time) and `aliases`",
            metavar="FILE"),
    Setting("max_models", int, None, "most models loaded at once: a load past it first unloads the least "
            "recently used idle model", default_text="no limit"),
    Setting("models_memory", int, None,
            "MiB the loaded models' weights and KV caches may take together, as their executors allocate "
            "them: a load past it first unloads least recently used idle models, and a model larger than it "
            "does not load", default_text="no limit", metavar="MIB"),
    Setting("idle_ttl", float, None,
            "seconds a model stays loaded without requests (a preset's `idle_ttl` per model; Ollama's "
            "`keep_alive` per request)", default_text="for good", metavar="SECONDS"),
    Setting("load_wait", float, 300.0,
            "seconds a request waits for its model to load (or for room to load it) before a 503 with "
            "`Retry-After`", metavar="SECONDS"),
    Setting("served_model_name", str, None, "the `model` clients send", default_text="the model's"),
    Setting("host", str, "127.0.0.1", "address to listen on"),
    Setting("port", int, 8000, "port to listen on"),
    Setting("chat_template", Path, None, "Jinja chat template file replacing the model's",
            default_text="the GGUF's", metavar="FILE"),
    Setting("api_keys", str, (),
            "required as `Authorization: Bearer K` on every route but `/health`; "
            "compared in constant time, never logged",
            is_list=True, flag="--api-key", metavar="K[,K2]"),
    Setting("allowed_origins", str, (),
            "browser origins allowed to call the API (CORS; `*` for any); "
            "preflights are answered without the key",
            is_list=True, metavar="O[,O2]"),
    Setting("metrics_public", bool, False,
            "serve `/metrics` without the API key, which it otherwise needs when keys are set"),
    Setting("max_body_size", int, 4 * 1024 * 1024, "bytes; larger bodies get 413"),
    Setting("accept_unknown_fields", bool, False,
            "accept (and log) request fields no row of the endpoint's field table names, for clients that "
            "send vendor noise; by default they are a 400 `unknown_parameter`, as OpenAI answers them"),
    Setting("executor", str, "tvm", "the executor plugin that runs the model"),
    Setting("max_num_seqs", int, 16, "sequences decoded in one batch"),
    Setting("max_total_tokens", int, 8192,
            "KV cache capacity, all sequences together (f16, about 22.5 KiB a token for the default model)"),
    Setting("prefill_chunk_size", int, 512, "prompt tokens per prefill call (longer prompts are chunked)"),
    Setting("max_num_batched_tokens", int, None,
            "tokens per engine step: every running sequence's decode token, then prefill chunks",
            default_text="the prefill chunk size"),
    Setting("max_queue", int, 256, "waiting requests before new ones get 429"),
    Setting("max_n", int, 8, "largest `n` a request may ask for"),
    Setting("responses_store_size", int, 1000,
            "responses `/v1/responses` keeps for `previous_response_id` (least recently used out; "
            "in memory, lost on restart)"),
    Setting("tool_call_format", str, None,
            "how the model writes tool calls: `generic`, `hermes`, `qwen3-coder`, `llama3`, `mistral`, `gemma4` "
            "or a plugin's format",
            default_text="from the chat template"),
    Setting("reasoning_format", str, None,
            "how the model writes its thinking apart from its answer: `deepseek_r1`, `qwen3` or a plugin's "
            "format, whose thinking answers carry as `reasoning_content` (chat), `reasoning` items "
            "(Responses) and `thinking` blocks (Messages); `none` leaves it in the answer's text",
            default_text="from the chat template"),
    Setting("pooling", str, None,
            "how `/v1/embeddings` pools the final hidden states of an input's tokens: `mean`, `last` or `cls` "
            "(the first token's); the vector is L2-normalized",
            default_text="the file's `pooling_type`, else `mean`", choices=("mean", "last", "cls")),
    Setting("rerank_tokens", str, (),
            "serve a relevance-generation reranker: the tokens whose logits at a pair's last position score it, "
            "the relevant one first, a softmax over them (Qwen3-Reranker: `yes,no`); by default a file's "
            "classification head (`cls.output.weight`) makes a reranker",
            is_list=True, metavar="T[,T2]"),
    Setting("rerank_template", Path, None,
            "file of a reranker's pair prompt, `{query}` and `{document}` in it, replacing the file's "
            "`tokenizer.chat_template.rerank`"),
    Setting("max_tool_calls", int, 16,
            "most tool calls one answer may carry: the grammar that constrains calls (`tool_choice` "
            "`required`, a named tool, and `auto` with the `generic` format) ends the list there, so a "
            "small model cannot fill its context with calls; 1 with `parallel_tool_calls: false`"),
    Setting("prefix_cache", bool, True,
            "keep finished sequences' KV pages, indexed by their tokens, for requests that share a prefix "
            "(evicted least recently used when pages are short); `--no-prefix-cache` turns it off"),
    Setting("speculation", bool, True,
            "speculative decoding without a second model: tokens drafted from the prompt and output (prompt "
            "lookup), from earlier requests, from a grammar's forced text and from OpenAI's `prediction` are "
            "verified several a step, the output exactly what it is without (`--no-speculation` turns it off)"),
    Setting("speculative_tokens", int, 0,
            "drafts one step verifies per choice: 0 chooses each step's number (up to 8) by what decode "
            "steps and verifications measure on this executor and how often each request's drafts were "
            "accepted; a positive number fixes it"),
    Setting("speculation_max_batch", int, 4,
            "speculate only while a step decodes at most this many choices (each draft costs a row)"),
    Setting("engine", str, None,
            "what runs the model's requests: `local` (continuous batching in this process) or an engine "
            "plugin's name (`lockgate_register_engines`)",
            default_text="`local`, or the engine that a setting of its plugin, given, chooses",
            metavar="NAME"),
    Setting("shutdown_grace", float, 30.0, "seconds in-flight requests get after SIGTERM"),
    Setting("log_format", str, "auto", "`console`, `json`, or `auto` (console on a TTY, json otherwise)",
            choices=("auto", "console", "json")),
    Setting("log_level", str, "info", "least severe level logged",
            choices=("debug", "info", "warning", "error")),
)

_BY_NAME = {setting.name: setting for setting in SETTINGS}

#: what `lockgate serve` serves when no model is named
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def split_model_entry(entry: str) -> tuple[str | None, str]:
    """`--model`'s `NAME=MODEL` as (NAME, MODEL), a bare MODEL as (None,
    MODEL); an `=` inside a path (after a `/`) is the path's."""
    name, sep, model = entry.partition("=")
    if sep and name and "/" not in name and "\\" not in name and model:
        return name, model
    return None, entry

#: a table of settings: the server's own, then those plugins added
Table = Sequence[Setting]


def settings_table(pm=None) -> tuple[Setting, ...]:
    """Every setting: `SETTINGS`, then those the plugins of `pm` add
    (`lockgate_add_settings`), plugin by plugin in registration order. Without `pm`, the
    built-in plugins' (what the docs' table shows).

    :raises InvalidSetting: a plugin's setting whose name is taken.
    """
    if pm is None:
        return _built_in_table()
    added: list[Setting] = []
    # called one by one in registration order (pluggy calls the last
    # registered first): the built-ins' rows first, in a stable order
    for impl in pm.hook.lockgate_add_settings.get_hookimpls():
        impl.function(**{name: added.append for name in impl.argnames if name == "register"})
    table = list(SETTINGS)
    names = {s.name for s in table}
    for setting in added:
        if setting.name in names:
            raise InvalidSetting(f"a plugin adds the setting {setting.name!r}, which is already taken")
        names.add(setting.name)
        table.append(setting)
    return tuple(table)


@functools.cache
def _built_in_table() -> tuple[Setting, ...]:
    # imported here: the plugin manager imports the plugins, which import this module
    from lockgate.plugin_api.manager import get_plugin_manager

    return settings_table(get_plugin_manager(autoload=False))


def get_setting(name: str, table: Table | None = None) -> Setting:
    """The setting `name` of `table` (the built-in table by default)."""
    found = _BY_NAME.get(name)
    if found is None:
        found = next((s for s in (table or settings_table()) if s.name == name), None)
    if found is None:
        raise KeyError(name)
    return found


def setting_default(name: str) -> Any:
    """The default of the server's setting `name`, for dataclasses that hold
    some settings (`max_queue: int = setting_default("max_queue")`)."""
    return _BY_NAME[name].default


def values_from_env(env: Mapping[str, str], table: Table = SETTINGS) -> dict[str, Any]:
    """Parsed values of the settings whose `LOCKGATE_*` variable is set and
    not empty; raises `InvalidSetting` naming the variable."""
    values = {}
    for setting in table:
        for var in setting.env_vars:
            raw = env.get(var)
            if raw:
                try:
                    values[setting.name] = setting.parse(raw)
                except InvalidSetting as exc:
                    raise InvalidSetting(f"{var} {exc}") from None
                break
    return values


def add_arguments(parser: argparse.ArgumentParser, table: Table = SETTINGS) -> None:
    """One flag per setting, `dest` the setting's name. Flags not given are
    None, so the environment and the defaults show through."""
    for setting in table:
        default = _plain(setting.default_markdown())
        help_text = f"{_plain(setting.help)} (default: {default}; env {', '.join(setting.env_vars)})"
        help_text = help_text.replace("%", "%%")
        if setting.is_bool:
            parser.add_argument(setting.flag, dest=setting.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
            continue
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            # a list's flag may repeat: each gives items
            action="extend" if setting.is_list else "store",
            type=_flag_parser(setting),
            choices=setting.choices or None,
            metavar=setting.metavar or _METAVARS.get(setting.type),
            help=help_text,
        )


def values_from_args(args: argparse.Namespace, table: Table = SETTINGS) -> dict[str, Any]:
    """The settings given as flags (those not None)."""
    given = vars(args)
    return {s.name: tuple(given[s.name]) if s.is_list else given[s.name]
            for s in table if given.get(s.name) is not None}


def _flag_parser(setting: Setting) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return setting.parse(raw)
        except InvalidSetting as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _plain(markdown: str) -> str:
    return markdown.replace("`", "")


def _fields_from_table(cls: type) -> type:
    """Make `cls` a dataclass with one field per entry of `SETTINGS`, the
    entry's default as the field's, and `plugins`: the values of the
    settings plugins add."""
    cls.__annotations__ = {setting.name: setting.annotation for setting in SETTINGS}
    for setting in SETTINGS:
        setattr(cls, setting.name, setting.default)
    cls.__annotations__["plugins"] = Mapping[str, Any]
    cls.plugins = dataclasses.field(default_factory=dict)
    return dataclasses.dataclass(cls)


@_fields_from_table
class Settings:
    """Everything `lockgate serve` can be told: one field per entry of
    `lockgate.settings.SETTINGS` (`Settings().port`, `Settings(port=9000)`),
    and the values of the settings plugins add, in `plugins` and read as
    attributes (`settings.replicas`); a plugin setting not given reads as
    its default."""

    def __post_init__(self) -> None:
        if isinstance(self.model, (str, Path)):  # one model, as code that builds Settings names it
            self.model = (str(self.model),)

    @property
    def model_source(self) -> str:
        """The one model these settings load: a registered name, a GGUF
        file or a model directory (`NAME=` left off; the default model
        where none is named). A server's plan gives each of several models
        settings of its own (`lockgate.models.plans`)."""
        if len(self.model) > 1:
            raise ValueError(f"these settings name {len(self.model)} models, not one")
        return split_model_entry(self.model[0])[1] if self.model else DEFAULT_MODEL

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not fields: a plugin's setting
        if name.startswith("__") or name == "plugins":
            raise AttributeError(name)
        plugins = self.__dict__.get("plugins", {})
        if name in plugins:
            return plugins[name]
        try:
            return get_setting(name).default
        except KeyError:
            raise AttributeError(f"no setting named {name!r}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, table: Table | None = None,
                 **overrides: Any) -> "Settings":
        """Defaults, then `LOCKGATE_*` variables, then `overrides` (those not
        None; text is parsed like a variable's, so `api_keys="a,b"` works),
        for the settings of `table` (the built-in plugins' too by default).
        Raises `InvalidSetting` naming the variable or setting that does not parse."""
        env = os.environ if env is None else env
        table = settings_table() if table is None else table
        values = values_from_env(env, table)
        for name, value in overrides.items():
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = get_setting(name, table).parse(value)
                except KeyError:
                    raise InvalidSetting(f"no setting named {name!r}") from None
                except InvalidSetting as exc:
                    raise InvalidSetting(f"{name} {exc}") from None
            values[name] = value
        # a plugin's settings not given hold their defaults
        for setting in table:
            values.setdefault(setting.name, setting.default)
        return cls.of(**values)

    @classmethod
    def of(cls, **values: Any) -> "Settings":
        """Settings from parsed values by name: the server's as fields, a
        plugin's in `plugins` (`Settings.of(port=9000, replicas="2")`)."""
        own = {name: value for name, value in values.items() if name in _BY_NAME}
        plugins = {name: value for name, value in values.items() if name not in _BY_NAME}
        return cls(**own, plugins=plugins)

    def replaced(self, **values: Any) -> "Settings":
        """A copy with `values` (the server's settings or a plugin's) changed."""
        merged = {**{s.name: getattr(self, s.name) for s in SETTINGS}, **self.plugins, **values}
        return Settings.of(**merged)

    def executor_options(self, progress=None, reserve=None):
        """The `ExecutorOptions` these settings hold: the sizes, and every
        plugin's settings for the executor to read its own from."""
        # imported here: those modules take their defaults from this one
        from lockgate.engine.executor import ExecutorOptions

        return ExecutorOptions(**self._held_by(ExecutorOptions), plugin_settings=dict(self.plugins),
                               progress=progress, reserve=reserve)

    def engine_options(self):
        """The `EngineOptions` these settings hold."""
        from lockgate.engine.options import EngineOptions

        return EngineOptions(**self._held_by(EngineOptions))

    def _held_by(self, options_class: type) -> dict[str, Any]:
        """The settings `options_class` has a field of the same name for."""
        names = {field.name for field in dataclasses.fields(options_class)}
        return {setting.name: getattr(self, setting.name) for setting in SETTINGS if setting.name in names}


def markdown_table(table: Table | None = None) -> str:
    """The configuration table of docs/configuration.md (checked by
    tests/unit/project/test_settings_documented.py): the server's settings
    and the built-in plugins'."""
    lines = ["| flag | environment | default | |", "|---|---|---|---|"]
    for s in settings_table() if table is None else table:
        flag = f"`{s.flag} {s.metavar}`" if s.metavar else f"`{s.flag}`"
        env = ", ".join(f"`{var}`" for var in s.env_vars)
        lines.append(f"| {flag} | {env} | {s.default_markdown()} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
