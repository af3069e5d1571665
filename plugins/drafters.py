"""Built-in `lockgate_register_drafters`: the drafters of speculative
decoding without a second model (`lockgate.engine.speculation`), in the
order the engine asks them: the request's predicted output, a grammar's
forced tokens, the sequence's own n-grams, the server's memory of earlier
sequences. A plugin's drafters are asked first."""

from __future__ import annotations

from lockgate.engine.speculation import DEFAULT_DRAFTERS
from lockgate.plugin_api.hookspecs import hookimpl


@hookimpl(trylast=True)
def lockgate_register_drafters(register):
    for drafter in DEFAULT_DRAFTERS:
        register(drafter)
