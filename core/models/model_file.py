"""`ModelFile`: a model's weights on disk with their architecture, what an
executor factory (`lockgate.engine.executor.ExecutorFactory`) is given."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lockgate.models.config import ModelConfig
from lockgate.models.families import ModelFamily
from lockgate.models.gguf_metadata import GGUFMetadata


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model's weights on disk together with its architecture."""

    path: Path
    config: ModelConfig
    #: the family that runs `config.architecture`; None lets the executor
    #: look it up among the families it ships
    family: ModelFamily | None = None
    #: the file's metadata and tensor table as the loader already read them,
    #: so an executor need not parse the header again; None when the caller
    #: did not read them (the executor then reads them from `path`)
    metadata: GGUFMetadata | None = dataclasses.field(default=None, compare=False, repr=False)
