"""What the prefix-affinity router (`routing`) reads of a prompt: chained
hashes of its first blocks, computed in the front and carried on the
`RemoteWork` (`lockgate.engine.wire`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

#: prompt tokens per affinity block (the KV page size of the built-in executor)
AFFINITY_BLOCK = 16
#: the longest prompt prefix the router looks at, in tokens
AFFINITY_SPAN = 512


def prefix_hashes(tokens: Sequence[int]) -> tuple[int, ...]:
    """One hash per whole `AFFINITY_BLOCK` of the prompt's first
    `AFFINITY_SPAN` tokens, each covering every block before it too, so two
    prompts share the first k hashes exactly when they share the first k
    blocks. The last token is left out: a prompt equal to a block boundary
    still prefills one token of its own."""
    usable = min(len(tokens) - 1, AFFINITY_SPAN) // AFFINITY_BLOCK * AFFINITY_BLOCK
    data = np.asarray(tokens[:usable], dtype=np.int64).tobytes()
    hashes = []
    digest = hashlib.blake2b(digest_size=8)
    step = AFFINITY_BLOCK * 8
    for start in range(0, len(data), step):
        digest.update(data[start:start + step])
        hashes.append(int.from_bytes(digest.copy().digest(), "little"))
    return tuple(hashes)
