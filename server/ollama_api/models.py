"""Ollama's model routes: `GET /api/version`, `GET /api/tags` (every model
served, loaded or not), `POST /api/show` (one model's details: family,
parameter count, quantization, context length, capabilities, template; it
loads the model) and `GET /api/ps` (the models loaded, each with when it
unloads if left idle). The figures come from the model's own file: its
GGUF header (architecture, tensor shapes, file type), its size and its
SHA-256, read once per file in a worker thread."""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import time
from typing import Any

import gguf
from aiohttp import web

from lockgate import __version__
from lockgate.errors import InvalidRequestError
from lockgate.models import Model
from lockgate.models.gguf_metadata import GGUFMetadata
from lockgate.plugin_api.pipeline import in_worker
from lockgate.plugin_api.readers import string
from lockgate.plugin_api.tool_calls import chat_template_for
from lockgate.models.slots import READY, ModelSlot
from lockgate.server.keys import MODELS
from lockgate.server.protocol import leased_model, read_json_body

routes = web.RouteTableDef()

#: the Ollama release whose API this module follows (clients check it)
OLLAMA_API_VERSION = "0.12.6"
#: Ollama's tag for a model with none
LATEST = ":latest"


def ollama_name(model: Model | ModelSlot) -> str:
    return model.name + LATEST


def model_name(name: Any) -> Any:
    """A requested name as the served models know it: `:latest` dropped."""
    return name[: -len(LATEST)] if isinstance(name, str) and name.endswith(LATEST) else name


@functools.lru_cache(maxsize=64)
def file_facts(path: str, size: int, mtime: float) -> dict[str, Any]:
    """What Ollama reports of a model file: its size, digest, format,
    parameter count and quantization (from the GGUF header; a Hugging Face
    directory's safetensors are not read: their count and type are None)."""
    if os.path.isdir(path):
        return {"size": size, "digest": "", "format": "safetensors", "parameters": None, "quantization": None,
                "family": None}
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    header = GGUFMetadata(path)
    parameters = sum(_count(t.shape) for t in header.tensors)
    file_type = header.fields.get("general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type.value)).name.removeprefix("MOSTLY_")
    except (AttributeError, TypeError, ValueError):
        quantization = None
    architecture = header.fields.get("general.architecture")
    return {"size": size, "digest": digest.hexdigest(), "format": "gguf", "parameters": parameters,
            "quantization": quantization, "family": None if architecture is None else architecture.contents()}


def _count(shape) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def _size_label(parameters: int | None) -> str:
    if not parameters:
        return ""
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


async def facts(path: os.PathLike | None) -> dict[str, Any]:
    """`file_facts` of the model at `path` (nothing known without one)."""
    if path is None:
        return {"size": 0, "digest": "", "format": "", "parameters": None, "quantization": None, "family": None}
    stat = os.stat(path)
    return await in_worker(file_facts, os.fspath(path), stat.st_size, stat.st_mtime)


def _modified(slot: ModelSlot) -> str:
    return datetime.datetime.fromtimestamp(slot.created, datetime.timezone.utc).isoformat()


def details(found: dict[str, Any], family: str | None = None) -> dict[str, Any]:
    family = family or found["family"] or ""
    return {"parent_model": "", "format": found["format"], "family": family, "families": [family],
            "parameter_size": _size_label(found["parameters"]), "quantization_level": found["quantization"] or ""}


def _path(slot: ModelSlot) -> os.PathLike | None:
    return slot.loaded.model.path if slot.loaded is not None else slot.plan.path


async def model_entry(slot: ModelSlot) -> dict[str, Any]:
    """A model as `/api/tags` and `/api/ps` list it."""
    found = await facts(_path(slot))
    return {"name": ollama_name(slot), "model": ollama_name(slot), "modified_at": _modified(slot),
            "size": found["size"], "digest": found["digest"], "details": details(found)}


def capabilities(model: Model) -> list[str]:
    """What the model does, in Ollama's words."""
    found = ["completion"]
    if model.tool_call_format is not None:
        found.append("tools")
    if model.reasoning_format is not None:
        found.append("thinking")
    if model.can_embed:
        found.append("embedding")
    return found


@routes.get("/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_API_VERSION, "lockgate": __version__})


@routes.get("/tags")
async def tags(request: web.Request) -> web.Response:
    return web.json_response({"models": [await model_entry(slot) for slot in request.config_dict[MODELS]]})


#: Ollama's `expires_at` for a model that stays loaded
FOR_GOOD = "2318-01-01T00:00:00Z"


@routes.get("/ps")
async def ps(request: web.Request) -> web.Response:
    """The models loaded now: how much memory their weights and KV cache
    take (`size`), and when each unloads if left idle."""
    models = []
    for slot in request.config_dict[MODELS]:
        if slot.state != READY or slot.loaded is None:
            continue
        entry = await model_entry(slot)
        expires = slot.loaded.expires
        expires_at = FOR_GOOD if expires is None else datetime.datetime.fromtimestamp(
            time.time() + max(0.0, expires - time.monotonic()), datetime.timezone.utc).isoformat()
        models.append({**entry, "size": slot.memory_bytes or entry["size"], "expires_at": expires_at,
                       "size_vram": 0, "context_length": slot.loaded.model.context_length})
    return web.json_response({"models": models})


@routes.post("/show")
async def show(request: web.Request) -> web.Response:
    body = await read_json_body(request)
    name = body.get("model", body.get("name"))  # `name`: older clients
    if name is None:
        raise InvalidRequestError("model is required", param="model")
    model = await leased_model(request, model_name(string(name, "model")))
    found = await facts(model.path)
    config, family = model.config, model.config.architecture
    info = {
        "general.architecture": family,
        "general.parameter_count": found["parameters"],
        f"{family}.context_length": model.context_length,
        f"{family}.embedding_length": config.hidden_size,
        f"{family}.block_count": config.num_layers,
        f"{family}.attention.head_count": config.num_heads,
        f"{family}.attention.head_count_kv": config.num_kv_heads,
        f"{family}.feed_forward_length": config.intermediate_size,
        f"{family}.vocab_size": config.vocab_size,
    }
    return web.json_response({
        "modelfile": f"FROM {model.path}\n", "parameters": "", "license": "",
        "template": chat_template_for(model.tokenizer, tools=False) or "",
        "details": details(found, family), "model_info": info, "capabilities": capabilities(model),
        "modified_at": _modified(request.config_dict[MODELS].slot(model.name)),
    })
