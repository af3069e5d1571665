"""lockgate: an OpenAI-compatible LLM server built on a pluggy hook pipeline."""

from lockgate.plugin_api.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = ["hookimpl", "__version__"]
