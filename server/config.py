"""Server settings: defaults, `LOCKGATE_*` environment variables, CLI flags."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from lockgate.engine import EngineOptions
from lockgate.models.executor import ExecutorOptions

DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024


@dataclasses.dataclass
class Settings:
    """Everything `lockgate serve` can be told. Each field `foo_bar` is also
    read from the environment variable `LOCKGATE_FOO_BAR`."""

    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    chat_template: Path | None = None
    #: accepted bearer keys; empty means no authentication
    api_keys: tuple[str, ...] = ()
    #: browser origins allowed to call the API (CORS); "*" for any; empty for none
    allowed_origins: tuple[str, ...] = ()
    #: serve /metrics without the API key
    metrics_public: bool = False
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    executor: str = "tvm"
    target: str = "auto"
    max_num_seqs: int = 16
    max_total_tokens: int = 8192
    prefill_chunk_size: int = 512
    #: tokens one engine step processes (decode + prefill chunks); None: prefill_chunk_size
    max_num_batched_tokens: int | None = None
    max_queue: int = 256
    max_n: int = 8
    num_threads: int | None = None
    cache_dir: Path | None = None
    #: seconds in-flight requests get to finish on shutdown
    shutdown_grace: float = 30.0
    log_format: str = "auto"
    log_level: str = "info"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Defaults, then `LOCKGATE_*` variables, then `overrides` (not None)."""
        env = os.environ if env is None else env
        values = {}
        for field in dataclasses.fields(cls):
            raw = env.get(f"LOCKGATE_{field.name.upper()}")
            if field.name == "api_keys":
                raw = raw or env.get("LOCKGATE_API_KEY")
            if raw is not None and raw != "":
                values[field.name] = _parse(field, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name in _LIST_FIELDS:
            if isinstance(values.get(name), str):
                values[name] = _parse_keys(values[name])
        return cls(**values)

    def executor_options(self, progress=None) -> ExecutorOptions:
        return ExecutorOptions(
            max_num_seqs=self.max_num_seqs,
            max_total_tokens=self.max_total_tokens,
            prefill_chunk_size=self.prefill_chunk_size,
            target=self.target,
            cache_dir=self.cache_dir,
            num_threads=self.num_threads,
            progress=progress,
        )

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            max_queue=self.max_queue,
            max_n=self.max_n,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )


#: fields given as comma-separated lists
_LIST_FIELDS = ("api_keys", "allowed_origins")


def _parse_keys(raw: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in raw.split(",") if key.strip())


def _parse(field: dataclasses.Field, raw: str):
    kind = str(field.type)
    if field.name in _LIST_FIELDS:
        return _parse_keys(raw)
    if kind.startswith("bool"):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"LOCKGATE_{field.name.upper()} must be true or false, got {raw!r}")
    if "Path" in kind:
        return Path(raw)
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    return raw
