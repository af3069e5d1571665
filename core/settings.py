"""Every setting of `lockgate serve`, declared once.

`SETTINGS` is the single table (datasette's `SETTINGS` is the model): each
`Setting` names its type, default and help text, and from it come

* the fields and defaults of `lockgate.server.config.Settings`, and the
  defaults of `EngineOptions` and `ExecutorOptions` (`setting_default`);
* the environment variables `LOCKGATE_<NAME>` (`values_from_env`);
* the `--flags` of `lockgate serve` (`add_arguments`);
* the configuration table of docs/configuration.md (`markdown_table`, or
  `python -m lockgate.settings`);
* `Settings`, the dataclass with one field per setting, which the server,
  the engines and the Ray replicas are configured from.

This module imports nothing from lockgate at import time, so every layer
may import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
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
    list is given comma separated and held as a tuple. `help` is markdown
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
    Setting("model", str, "SmolLM2-135M-Instruct",
            "a registered model name (`smollm2` works too) or a GGUF path"),
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
    Setting("executor", str, "tvm", "the executor plugin that runs the model"),
    Setting("target", str, "auto", "compile target: `llvm`, `cuda`, or `auto` (CUDA when a GPU is present)",
            choices=("auto", "llvm", "cuda")),
    Setting("quantize", str, None,
            "pack float weights at load, a Hugging Face directory's or a GGUF file's F32/F16/BF16 "
            "matrices: `q8_0` or `q4_0`", choices=("q8_0", "q4_0")),
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
    Setting("max_tool_calls", int, 16,
            "most tool calls one answer may carry: the grammar that constrains calls (`tool_choice` "
            "`required`, a named tool, and `auto` with the `generic` format) ends the list there, so a "
            "small model cannot fill its context with calls; 1 with `parallel_tool_calls: false`"),
    Setting("prefix_cache", bool, True,
            "keep finished sequences' KV pages, indexed by their tokens, for requests that share a prefix "
            "(evicted least recently used when pages are short); `--no-prefix-cache` turns it off"),
    Setting("engine", str, None,
            "what runs the model's requests: `local` (continuous batching in this process) or an engine "
            "plugin's name (`lockgate_register_engines`; built in: `ray`, replicas on Ray Serve)",
            default_text="`ray` where `--replicas` is given, else `local`", metavar="NAME"),
    Setting("replicas", str, None,
            "engine replicas on Ray Serve (`lockgate[ray]`): a number, or `auto` to scale between "
            "`--min-replicas` and `--max-replicas` on ongoing requests",
            default_text="none: one engine in this process", metavar="N"),
    Setting("min_replicas", int, 1, "fewest replicas with `--replicas auto`"),
    Setting("max_replicas", int, 4, "most replicas with `--replicas auto`"),
    Setting("ray_address", str, "local",
            "the Ray cluster replicas run on: `local` starts one in this process; `auto` or "
            "`HOST:6379` joins an existing one from one of its nodes (KubeRay included), and attaches to "
            "replicas already deployed there as `lockgate-<served model name>`", metavar="ADDRESS"),
    Setting("gpus_per_replica", float, 0.0, "GPUs Ray gives each replica (0: CPU replicas)"),
    Setting("cpus_per_replica", float, 1.0,
            "CPUs Ray reserves for each replica (its executor threads are `--num-threads`)"),
    Setting("num_threads", int, None, "CPU threads for the executor", default_text="all cores"),
    Setting("exact_matmul", bool, False,
            "multiply quantized weights exactly on the CPU, each dequantized to float32 (2-7x slower); by "
            "default activations are rounded to 8 bits per block of 32, as llama.cpp does, and integer dot "
            "products (AVX2, AVX-512 VNNI) do the work"),
    Setting("device_sampling", bool, None,
            "choose tokens where the logits are, so only token ids (and requested logprobs) cross to the "
            "host; `--no-device-sampling` samples on the host with numpy",
            default_text="on for CUDA, off for llvm (numpy is faster on the CPU)"),
    Setting("cache_dir", Path, None, "where compiled models are cached",
            default_text="`~/.cache/lockgate`", metavar="DIR"),
    Setting("shutdown_grace", float, 30.0, "seconds in-flight requests get after SIGTERM"),
    Setting("log_format", str, "auto", "`console`, `json`, or `auto` (console on a TTY, json otherwise)",
            choices=("auto", "console", "json")),
    Setting("log_level", str, "info", "least severe level logged",
            choices=("debug", "info", "warning", "error")),
)

_BY_NAME = {setting.name: setting for setting in SETTINGS}


def get_setting(name: str) -> Setting:
    return _BY_NAME[name]


def setting_default(name: str) -> Any:
    """The default of setting `name`, for dataclasses that hold some settings
    (`max_queue: int = setting_default("max_queue")`)."""
    return _BY_NAME[name].default


def values_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Parsed values of the settings whose `LOCKGATE_*` variable is set and
    not empty; raises `InvalidSetting` naming the variable."""
    values = {}
    for setting in SETTINGS:
        for var in setting.env_vars:
            raw = env.get(var)
            if raw:
                try:
                    values[setting.name] = setting.parse(raw)
                except InvalidSetting as exc:
                    raise InvalidSetting(f"{var} {exc}") from None
                break
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, `dest` the setting's name. Flags not given are
    None, so the environment and the defaults show through."""
    for setting in SETTINGS:
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
            type=_flag_parser(setting),
            choices=setting.choices or None,
            metavar=setting.metavar or _METAVARS.get(setting.type),
            help=help_text,
        )


def values_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (those not None)."""
    given = vars(args)
    return {s.name: given[s.name] for s in SETTINGS if given.get(s.name) is not None}


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
    entry's default as the field's."""
    cls.__annotations__ = {setting.name: setting.annotation for setting in SETTINGS}
    for setting in SETTINGS:
        setattr(cls, setting.name, setting.default)
    return dataclasses.dataclass(cls)


@_fields_from_table
class Settings:
    """Everything `lockgate serve` can be told: one field per entry of
    `lockgate.settings.SETTINGS` (`Settings().port`, `Settings(port=9000)`)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then `LOCKGATE_*` variables, then `overrides` (those not
        None; text is parsed like a variable's, so `api_keys="a,b"` works).
        Raises `InvalidSetting` naming the variable or setting that does not parse."""
        env = os.environ if env is None else env
        values = values_from_env(env)
        for name, value in overrides.items():
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = get_setting(name).parse(value)
                except InvalidSetting as exc:
                    raise InvalidSetting(f"{name} {exc}") from None
            values[name] = value
        return cls(**values)

    def executor_options(self, progress=None):
        """The `ExecutorOptions` these settings hold."""
        # imported here: those modules take their defaults from this one
        from lockgate.models.executor import ExecutorOptions

        return ExecutorOptions(**self._held_by(ExecutorOptions), progress=progress)

    @property
    def engine_name(self) -> str:
        """The engine `engine` names, or the one its default stands for."""
        if self.engine:
            return self.engine
        return "local" if self.replicas is None else "ray"

    def engine_options(self):
        """The `EngineOptions` these settings hold."""
        from lockgate.engine.options import EngineOptions

        return EngineOptions(**self._held_by(EngineOptions))

    def _held_by(self, options_class: type) -> dict[str, Any]:
        """The settings `options_class` has a field of the same name for."""
        names = {field.name for field in dataclasses.fields(options_class)}
        return {setting.name: getattr(self, setting.name) for setting in SETTINGS if setting.name in names}


def markdown_table() -> str:
    """The configuration table of docs/configuration.md (checked by
    tests/unit/project/test_settings_documented.py)."""
    lines = ["| flag | environment | default | |", "|---|---|---|---|"]
    for s in SETTINGS:
        flag = f"`{s.flag} {s.metavar}`" if s.metavar else f"`{s.flag}`"
        env = ", ".join(f"`{var}`" for var in s.env_vars)
        lines.append(f"| {flag} | {env} | {s.default_markdown()} | {s.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
