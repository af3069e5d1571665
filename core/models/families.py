"""Model families: which architectures lockgate can run, and how.

A family names the `general.architecture` values of the GGUF files it runs
(and the `architectures` of a Hugging Face `config.json`), what llama.cpp's
converter did to their tensors, and, per executor, the network that executor
builds for it. Families are offered by plugins through
`lockgate_register_model_families`; the built-in ones come with the `tvm`
executor plugin. The config itself is read the same way for every family
(`lockgate.models.config.ModelConfig.from_gguf`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from lockgate.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family of decoder models.

    :ivar name: the family's name ("llama", "qwen2", ...).
    :ivar architectures: GGUF `general.architecture` values it runs.
    :ivar hf_architectures: `config.json` `architectures` entries it runs.
    :ivar networks: per executor name, what that executor builds: an object,
        or "module:attribute" text imported on first use (so registering a
        family does not import an executor's heavy dependencies).
    :ivar permuted_qk: llama.cpp's converter reorders the rows of this
        architecture's Q and K matrices for its interleaved-pair RoPE
        (true for `llama`, not for Qwen or Gemma), so a loader that rotates
        halves, as Hugging Face models do, undoes it.
    :ivar hf_config: `config.json` values this family's directories have
        without writing them (Qwen2's `attention_bias`, Qwen3's `qk_norm`).
    :ivar hf_tensor_names: Hugging Face names of a layer's tensors where
        this family's differ from Llama's, keyed by llama.cpp's
        (`"ffn_norm.weight": "pre_feedforward_layernorm.weight"`).
    :ivar hf_norm_shift: added to every norm weight read from a directory
        (Gemma keeps `w` and multiplies by `1 + w`; llama.cpp's converter
        stores `1 + w`, which is what the networks multiply by).
    """

    name: str
    architectures: tuple[str, ...]
    networks: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_architectures: tuple[str, ...] = ()
    permuted_qk: bool = False
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_tensor_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hf_norm_shift: float = 0.0

    def network(self, executor: str) -> Any:
        """What `executor` builds for this family.

        :raises ModelLoadError: the family has no network for that executor.
        """
        found = self.networks.get(executor)
        if found is None:
            raise ModelLoadError(
                f"the {self.name!r} model family has no network for the {executor!r} executor"
            )
        if isinstance(found, str):
            module, _, attribute = found.partition(":")
            found = getattr(importlib.import_module(module), attribute)
        return found


class ModelFamilies:
    """The registered families, looked up by architecture."""

    def __init__(self, families: Iterable[ModelFamily] = ()) -> None:
        self._by_architecture: dict[str, ModelFamily] = {}
        self._by_hf_architecture: dict[str, ModelFamily] = {}
        for family in families:
            self.add(family)

    def add(self, family: ModelFamily) -> None:
        """Register `family`; the first family to claim an architecture keeps it."""
        for arch in family.architectures:
            self._by_architecture.setdefault(arch, family)
        for arch in family.hf_architectures:
            self._by_hf_architecture.setdefault(arch, family)

    @property
    def architectures(self) -> list[str]:
        return sorted(self._by_architecture)

    def for_architecture(self, architecture: str) -> ModelFamily:
        """The family that runs GGUF files of `architecture`.

        :raises ModelLoadError: no registered family does; the message lists
            the architectures that can run.
        """
        family = self._by_architecture.get(architecture)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r}; lockgate runs: "
                + (", ".join(self.architectures) or "none (no model family is registered)")
            )
        return family

    def for_hf_architectures(self, architectures: Iterable[str]) -> ModelFamily:
        """The family of a Hugging Face `config.json`'s `architectures` list."""
        names = list(architectures)
        for name in names:
            if name in self._by_hf_architecture:
                return self._by_hf_architecture[name]
        raise ModelLoadError(
            f"unsupported architectures {names}; lockgate runs: "
            + (", ".join(sorted(self._by_hf_architecture)) or "none")
        )

