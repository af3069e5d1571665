"""Models: which ones plugins offer, loading one from a GGUF file, and the
served set that requests name."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pluggy

from lockgate.engine import Engine, EngineClient, EngineOptions
from lockgate.engine.client import conformance_problems
from lockgate.errors import ModelLoadError
from lockgate.memory import trim_allocator
from lockgate.models.text_tokenizer import TextTokenizer
from lockgate.engine.executor import Executor, ExecutorFactory, ExecutorOptions
from lockgate.engine.pooling import MEAN, file_pooling
from lockgate.models.model_file import ModelFile
from lockgate.models.config import ModelConfig
from lockgate.models.families import ModelFamilies, ModelFamily
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.plugin_api.grammars import rebuild_grammar
from lockgate.plugin_api.reasoning import ReasoningFormat, choose_reasoning_format
from lockgate.plugin_api.rerank import RankHead, file_rerank_template, read_rank_head
from lockgate.plugin_api.tool_calls import ToolCallFormat, chat_template_for, choose_tool_call_format
from lockgate.settings import setting_default


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model offered by a plugin through `lockgate_register_models`."""

    name: str
    #: returns the GGUF path; raises `ModelLoadError` saying how to get it when absent
    locate: Callable[[], Path]
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass(kw_only=True)
class ServingTraits:
    """How a model is served beyond its file and engine: its names, output
    formats, pooling and rerank head. `ModelSource` reads them, the `Model`
    it becomes keeps them (`traits()`)."""

    aliases: tuple[str, ...] = ()
    #: how this model writes tool calls; None where no format fits its template
    tool_call_format: ToolCallFormat | None = None
    #: most calls one answer may carry (`--max-tool-calls`)
    max_tool_calls: int = setting_default("max_tool_calls")
    #: how this model writes its thinking; None where it does not think
    reasoning_format: ReasoningFormat | None = None
    #: how embeddings pool the final hidden states (`lockgate.engine.pooling.POOLINGS`)
    pooling: str = MEAN
    #: a reranker's classification head (`lockgate.plugin_api.rerank`); None: not a reranker
    rank_head: RankHead | None = None
    #: the file's rerank template (`tokenizer.chat_template.rerank`), `{query}` and `{document}` in it
    rerank_template: str | None = None

    def traits(self) -> dict[str, Any]:
        """These fields' values, by name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(ServingTraits)}


@dataclasses.dataclass
class Model(ServingTraits):
    """A loaded model: tokenizer, executor and the engine that serves it
    (`executor` is None where the engine runs in other processes)."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: TextTokenizer
    eos_token_ids: list[int]
    executor: Executor | None
    engine: EngineClient
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def token_bytes(self):
        """`TokenBytes` of this model's tokenizer: each token's raw bytes and text."""
        from lockgate.models.text_tokenizer import TokenBytes

        return TokenBytes(self.tokenizer)

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of text one token stands for (its spelling in
        the vocabulary: a byte-level token's length is its byte count, at
        least its character count). A prompt of C characters is at least
        C / this many tokens."""
        return max(1, max(map(len, self.tokenizer.get_vocab()), default=1))

    def close(self) -> None:
        """Release the executor and what the engine holds beyond it (an
        engine plugin's replicas)."""
        if self.executor is not None:
            self.executor.close()
        self.engine.close()

    def grammar_from_source(self, source: str):
        """The `Grammar` whose `source` this is, compiled for this model
        (a request's grammar as it crossed to an engine elsewhere,
        `lockgate.engine.wire`)."""
        return rebuild_grammar(source, self.tokenizer, eos_token_ids=self.eos_token_ids)

    @property
    def can_embed(self) -> bool:
        """Whether the executor returns hidden states (`Executor.can_embed`);
        an engine elsewhere (no executor here) is taken to, and refuses
        each request itself if it does not."""
        return self.executor is None or self.executor.can_embed

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size if self.executor is None else self.executor.vocab_size


def registered_models(pm: pluggy.PluginManager) -> dict[str, ModelSpec]:
    """Every model plugins offer, by name and by alias."""
    specs: dict[str, ModelSpec] = {}

    def register(spec: ModelSpec) -> None:
        for key in (spec.name, *spec.aliases):
            specs[key] = spec

    pm.hook.lockgate_register_models(register=register)
    return specs


def _by_name(hook) -> dict[str, Any]:
    """What the implementations of a `register(name, thing)` hook offer, by name."""
    offered: dict[str, Any] = {}
    hook(register=offered.__setitem__)
    return offered


def registered_executors(pm: pluggy.PluginManager) -> dict[str, ExecutorFactory]:
    """Every executor plugins offer, by name."""
    return _by_name(pm.hook.lockgate_register_executors)


#: `load(pm, settings, progress)` -> Model: an engine plugin's loader; where
#: a memory budget applies it is also given `reserve=`, what its executor is
#: to call before it allocates (`ExecutorOptions.reserve`)
EngineLoader = Callable[[pluggy.PluginManager, Any, Callable[[str], None], Any], "Model"]


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """An engine a plugin offers: its loader and, optionally, the setting
    of that plugin whose being given chooses it when `--engine` is not."""

    load: EngineLoader
    chosen_by: str | None = None


def registered_engines(pm: pluggy.PluginManager) -> dict[str, EngineEntry]:
    """Every engine plugins offer, by name."""
    offered: dict[str, EngineEntry] = {}

    def register(name: str, load: EngineLoader, *, chosen_by: str | None = None) -> None:
        offered[name] = EngineEntry(load, chosen_by)

    pm.hook.lockgate_register_engines(register=register)
    return offered


def chosen_engine(settings, engines: dict[str, EngineEntry]) -> str:
    """The engine `--engine` names; where it names none, the first engine
    whose `chosen_by` setting was given (the Ray plugin's `--replicas`
    chooses `ray`), else `local`."""
    if settings.engine:
        return settings.engine
    for name, entry in engines.items():
        if entry.chosen_by is not None and getattr(settings, entry.chosen_by, None) is not None:
            return name
    return "local"


def load_served_model(pm: pluggy.PluginManager, settings, progress: Callable[[str], None] | None = None,
                      reserve: Callable[[dict[str, int]], None] | None = None) -> "Model":
    """The model `settings` names, loaded by the engine they choose
    (`chosen_engine`); `reserve` as `ExecutorOptions.reserve`."""
    engines = registered_engines(pm)
    name = chosen_engine(settings, engines)
    if name not in engines:
        known = ", ".join(sorted(engines)) or "none"
        raise ModelLoadError(f"no engine named {name!r} (engines: {known})")
    extra = {}
    if reserve is not None:
        # only where a budget applies: a loader written before it keeps working without one
        if not _takes(engines[name].load, "reserve"):
            raise ModelLoadError(f"the engine {name!r} cannot keep to a memory budget (its loader takes no "
                                 "`reserve`): serve its models without --models-memory")
        extra["reserve"] = reserve
    model = engines[name].load(pm, settings, progress or (lambda message: None), **extra)
    problems = conformance_problems(model.engine, EngineClient)
    if problems:
        model.close()
        raise ModelLoadError(f"the engine {name!r} does not implement EngineClient: {'; '.join(problems)}")
    return model


def _takes(function: Callable, name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind == p.VAR_KEYWORD for p in parameters)


def registered_families(pm: pluggy.PluginManager) -> ModelFamilies:
    """Every model family plugins offer, looked up by architecture."""
    families = ModelFamilies()
    pm.hook.lockgate_register_model_families(register=families.add)
    return families


def _in_order(hook) -> list:
    """What the implementations of a `register(thing)` hook offer, in the order they register it."""
    offered: list = []
    hook(register=offered.append)
    return offered


def registered_tool_call_formats(pm: pluggy.PluginManager) -> list[type]:
    """Every tool-call format plugins offer, in the order they are tried."""
    return _in_order(pm.hook.lockgate_register_tool_call_formats)


def registered_drafters(pm: pluggy.PluginManager) -> list[type]:
    """Every drafter plugins offer, in the order the engine asks them."""
    return _in_order(pm.hook.lockgate_register_drafters)


def registered_reasoning_formats(pm: pluggy.PluginManager) -> list[type]:
    """Every reasoning format plugins offer, in the order they are tried."""
    return _in_order(pm.hook.lockgate_register_reasoning_formats)


@dataclasses.dataclass
class ModelSource(ServingTraits):
    """What serving a model needs besides its executor: the file, its
    architecture, tokenizer and tool-call format. The front of a server whose
    engines run elsewhere (`lockgate.plugins.ray`) holds only this."""

    name: str
    path: Path
    config: ModelConfig
    #: the GGUF header as read (None for a Hugging Face directory)
    metadata: GGUFMetadata | None
    tokenizer: TextTokenizer
    eos_token_ids: list[int]
    #: the family that runs the file's architecture
    family: ModelFamily | None = None

    def model_file(self) -> ModelFile:
        return ModelFile(path=self.path, config=self.config, family=self.family, metadata=self.metadata)

    def serve_with(self, engine: EngineClient, executor: Executor | None = None) -> Model:
        """The `Model` this source becomes with `engine` serving it
        (`executor` None: the engine runs elsewhere)."""
        return Model(
            name=self.name,
            path=self.path,
            config=self.config,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            executor=executor,
            engine=engine,
            **self.traits(),
        )


def locate_model(specs: dict[str, ModelSpec], model: str,
                 served_name: str | None = None) -> tuple[Path, str, tuple[str, ...]]:
    """Where `model` is (a registered name or alias, a GGUF file, or a Hugging
    Face model directory), the name it is known by (its spec's, or the
    file's without `.gguf`) and the other names it answers to besides
    `served_name`. Raises `ModelLoadError` saying what is not there."""
    from lockgate.models import hf

    if model in specs:
        spec = specs[model]
        return Path(spec.locate()), spec.name, tuple(a for a in (spec.name, *spec.aliases)
                                                     if a != (served_name or spec.name))
    path = Path(model).expanduser()
    if not path.is_file() and not hf.is_hf_directory(path):
        known = ", ".join(sorted({s.name for s in specs.values()})) or "none"
        raise ModelLoadError(
            f"{model!r} is neither a registered model (known: {known}), a GGUF file, "
            "nor a model directory with a config.json"
        )
    return path, path.name.removesuffix(".gguf"), ()


def open_model(
    pm: pluggy.PluginManager,
    model: str,
    *,
    served_name: str | None = None,
    chat_template: str | None = None,
    tool_call_format: str | None = None,
    max_tool_calls: int = setting_default("max_tool_calls"),
    reasoning_format: str | None = None,
    pooling: str | None = None,
    rerank_tokens: tuple[str, ...] = (),
    rerank_template: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelSource:
    """Find `model` (a registered name or alias, a path to a GGUF file, or
    a Hugging Face model directory) and read what serving it needs short of
    an executor: the config and its family, the tokenizer (`chat_template`
    text overrides the model's template), the tool-call format and the
    embeddings' pooling (`pooling`, else the file's, else mean), and a
    reranker's head and pair template (`lockgate.plugin_api.rerank`)."""
    from lockgate.models import hf
    from lockgate.models.gguf_metadata import GGUFMetadata
    from lockgate.models.tokenizer import eos_token_ids, load_tokenizer

    path, name, aliases = locate_model(registered_models(pm), model, served_name)
    formats = registered_tool_call_formats(pm)
    (progress or (lambda message: None))(f"reading {path}")
    families = registered_families(pm)
    if path.is_dir():
        metadata = None
        config, family = hf.read_hf_config(path, families)
        tokenizer = hf.load_hf_tokenizer(path, chat_template=chat_template)
        eos_ids = hf.hf_eos_token_ids(path, tokenizer)
    else:
        # The header is parsed once: the config, the tokenizer and the
        # executor (through `ModelFile.metadata`) all read this copy.
        metadata = GGUFMetadata(path)
        config = ModelConfig.from_gguf(metadata)
        family = families.for_architecture(config.architecture)
        tokenizer = load_tokenizer(metadata, chat_template=chat_template)
        eos_ids = eos_token_ids(metadata, tokenizer)
    try:
        # calls are written the way the template a request with tools renders with asks
        tool_format = choose_tool_call_format(formats, tool_call_format, chat_template_for(tokenizer, tools=True))
        # the thinking is read as the template every request may render with writes it
        thinking = choose_reasoning_format(registered_reasoning_formats(pm), reasoning_format,
                                           chat_template_for(tokenizer, tools=False))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    # The grammar engine's copy of the vocabulary is built by the first
    # request that constrains its output (`grammars._llg_tokenizer`), not
    # here: it holds 60-110 MiB for a 150k-token vocabulary (its slices for
    # fast JSON masks most of it), memory a server that never constrains
    # output need not hold; the first such request pays its build once
    # (measured on two cores: 0.44 s on the default model, 0.83 s on
    # Qwen2.5's vocabulary).
    # reading the tokenizer freed far more than it keeps (16 MiB resident
    # on the default model until the C allocator is asked to give it back)
    trim_allocator()
    return ModelSource(
        name=served_name or name,
        path=path,
        config=config,
        metadata=metadata,
        family=family,
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        aliases=aliases,
        tool_call_format=tool_format,
        max_tool_calls=max_tool_calls,
        reasoning_format=thinking,
        pooling=pooling or file_pooling(metadata),
        rank_head=read_rank_head(path, metadata, tokenizer, rerank_tokens, config.final_logit_softcap),
        rerank_template=rerank_template or file_rerank_template(metadata),
    )


def load_model(
    pm: pluggy.PluginManager,
    model: str,
    *,
    executor: str = "tvm",
    executor_options: ExecutorOptions = ExecutorOptions(),
    engine_options: EngineOptions = EngineOptions(),
    **source_options: Any,
) -> Model:
    """Load `model` (a registered name or alias, or a path to a GGUF file).

    Reads it as `open_model` does, given `source_options` (`served_name`,
    `chat_template` text overriding the file's template, `pooling`, ...),
    compiles or loads the executor, and creates the engine (not yet
    started).
    """
    factories = registered_executors(pm)
    if executor not in factories:
        raise ModelLoadError(
            f"no executor named {executor!r}; registered: {', '.join(sorted(factories)) or 'none'}"
        )
    source = open_model(pm, model, progress=executor_options.progress, **source_options)
    backend = factories[executor](source.model_file(), executor_options)
    source.metadata = None
    problems = conformance_problems(backend, Executor)
    if problems:
        if hasattr(backend, "close"):
            backend.close()
        raise ModelLoadError(f"the executor {executor!r} does not implement the interface: {'; '.join(problems)}")
    engine = Engine(
        backend,
        source.tokenizer,
        eos_token_ids=source.eos_token_ids,
        context_length=source.config.context_length,
        options=engine_options,
        name=source.name,
        drafters=[drafter() for drafter in registered_drafters(pm)],
    )
    return source.serve_with(engine, backend)


def source_options(settings) -> dict[str, Any]:
    """What `open_model` is told by `settings` (a `lockgate.settings.Settings`):
    the served name, the template files read, the formats, the pooling."""
    return dict(
        served_name=settings.served_model_name,
        chat_template=None if settings.chat_template is None else settings.chat_template.read_text(),
        tool_call_format=settings.tool_call_format,
        max_tool_calls=settings.max_tool_calls,
        reasoning_format=settings.reasoning_format,
        pooling=settings.pooling,
        rerank_tokens=settings.rerank_tokens,
        rerank_template=None if settings.rerank_template is None else settings.rerank_template.read_text(),
    )


def load_model_from_settings(pm: pluggy.PluginManager, settings, progress=None, reserve=None) -> Model:
    """`load_model` as `settings` (a `lockgate.settings.Settings`) say;
    `reserve` as `ExecutorOptions.reserve`."""
    return load_model(
        pm,
        settings.model_source,
        executor=settings.executor,
        executor_options=settings.executor_options(progress=progress, reserve=reserve),
        engine_options=settings.engine_options(),
        **source_options(settings),
    )
