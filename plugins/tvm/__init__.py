"""The built-in `tvm` executor plugin and the model families it builds.

Importing TVM costs about 190 MiB and a few seconds, so this module only
registers a factory and declares the families (their networks are named as
"module:class" text); TVM is imported when an executor is actually created.
"""

from __future__ import annotations

import os
import sys

from lockgate.models.families import ModelFamilies, ModelFamily
from lockgate.plugin_api.hookspecs import hookimpl

_NETWORKS = "lockgate.plugins.tvm.families"

#: the families the TVM executor builds, as this plugin registers them
BUILTIN_FAMILIES = (
    ModelFamily(
        "llama",
        ("llama",),
        networks={"tvm": f"{_NETWORKS}.llama:LlamaForCausalLM"},
        hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        permuted_qk=True,
    ),
    ModelFamily(
        "qwen2",
        ("qwen2",),
        networks={"tvm": f"{_NETWORKS}.qwen2:Qwen2ForCausalLM"},
        hf_architectures=("Qwen2ForCausalLM",),
        hf_config={"attention_bias": True},
    ),
    ModelFamily(
        "qwen3",
        ("qwen3",),
        networks={"tvm": f"{_NETWORKS}.qwen3:Qwen3ForCausalLM"},
        hf_architectures=("Qwen3ForCausalLM",),
        hf_config={"qk_norm": True},
    ),
    ModelFamily(
        "gemma3",
        ("gemma3",),
        networks={"tvm": f"{_NETWORKS}.gemma3:Gemma3ForCausalLM"},
        # text-only directories (270M, 1B); the multimodal ones nest theirs
        hf_architectures=("Gemma3ForCausalLM",),
        hf_config={"qk_norm": True, "tie_word_embeddings": True},
        hf_tensor_names={
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        hf_norm_shift=1.0,
    ),
)


def builtin_families() -> ModelFamilies:
    """The built-in families, for callers that have no plugin manager."""
    return ModelFamilies(BUILTIN_FAMILIES)


def prefer_runtime_library() -> bool:
    """Make this process's first `import tvm` load TVM's runtime library
    alone, for a process that serves: running a compiled library never needs
    the compiler, whose library costs about 107 MiB of resident memory; a
    library missing from the compile cache is built in a child process
    (`compile_cache`). Nothing changes when TVM is imported already or
    `TVM_USE_RUNTIME_LIB` is set (`TVM_USE_RUNTIME_LIB=0` keeps the compiler
    in the process, for a plugin that compiles). True when it was set."""
    if "tvm" in sys.modules or "TVM_USE_RUNTIME_LIB" in os.environ:
        return False
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    return True


def create_executor(model_file, options):
    """Create a `TVMExecutor` (see `lockgate.plugins.tvm.executor`)."""
    from lockgate.plugins.tvm.executor import create_executor as create

    return create(model_file, options)


@hookimpl
def lockgate_serving_process():
    prefer_runtime_library()


@hookimpl
def lockgate_register_executors(register):
    register("tvm", create_executor)


@hookimpl(trylast=True)
def lockgate_register_model_families(register):
    for family in BUILTIN_FAMILIES:
        register(family)


@hookimpl
def lockgate_add_settings(register) -> None:
    from lockgate.plugins.tvm.settings import SETTINGS

    for setting in SETTINGS:
        register(setting)
