"""Ollama's model routes: `GET /api/version`, `GET /api/tags` (the models
served), `POST /api/show` (one model's details: family, parameter count,
quantization, context length, capabilities, template) and `GET /api/ps`
(the models loaded: every served model is). The figures come from the
model's own file: its GGUF header (tensor shapes, file type), its size and
its SHA-256, read once per model in a worker thread."""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
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
from lockgate.server.keys import MODELS
from lockgate.server.protocol import read_json_body

routes = web.RouteTableDef()

#: the Ollama release whose API this module follows (clients check it)
OLLAMA_API_VERSION = "0.12.6"
#: Ollama's tag for a model with none
LATEST = ":latest"


def ollama_name(model: Model) -> str:
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
        return {"size": size, "digest": "", "format": "safetensors", "parameters": None, "quantization": None}
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
    return {"size": size, "digest": digest.hexdigest(), "format": "gguf", "parameters": parameters,
            "quantization": quantization}


def _count(shape) -> int:
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def _size_label(parameters: int | None) -> str:
    if not parameters:
        return ""
    return f"{parameters / 1e9:.1f}B" if parameters >= 1e9 else f"{parameters / 1e6:.0f}M"


async def facts(model: Model) -> dict[str, Any]:
    stat = os.stat(model.path)
    return await in_worker(file_facts, os.fspath(model.path), stat.st_size, stat.st_mtime)


def _modified(model: Model) -> str:
    return datetime.datetime.fromtimestamp(model.created, datetime.timezone.utc).isoformat()


def details(model: Model, found: dict[str, Any]) -> dict[str, Any]:
    family = model.config.architecture
    return {"parent_model": "", "format": found["format"], "family": family, "families": [family],
            "parameter_size": _size_label(found["parameters"]), "quantization_level": found["quantization"] or ""}


async def model_entry(model: Model) -> dict[str, Any]:
    """A model as `/api/tags` and `/api/ps` list it."""
    found = await facts(model)
    return {"name": ollama_name(model), "model": ollama_name(model), "modified_at": _modified(model),
            "size": found["size"], "digest": found["digest"], "details": details(model, found)}


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
    return web.json_response({"models": [await model_entry(m) for m in request.config_dict[MODELS]]})


@routes.get("/ps")
async def ps(request: web.Request) -> web.Response:
    """Every served model is loaded, for as long as the server runs."""
    models = []
    for model in request.config_dict[MODELS]:
        entry = await model_entry(model)
        models.append({**entry, "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0,
                       "context_length": model.context_length})
    return web.json_response({"models": models})


@routes.post("/show")
async def show(request: web.Request) -> web.Response:
    body = await read_json_body(request)
    name = body.get("model", body.get("name"))  # `name`: older clients
    if name is None:
        raise InvalidRequestError("model is required", param="model")
    model = request.config_dict[MODELS].resolve(model_name(string(name, "model")))
    found = await facts(model)
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
        "details": details(model, found), "model_info": info, "capabilities": capabilities(model),
        "modified_at": _modified(model),
    })
