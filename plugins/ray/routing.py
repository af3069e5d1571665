"""Prefix-affinity routing: requests whose prompts start alike go to the
replica that served that start before, so its prefix cache has the KV.

A Ray Serve request router (it runs in the front's process, inside the
deployment handle). Each `RemoteWork` carries chained hashes of its
prompt's first blocks (`affinity.prefix_hashes`); the router remembers which
replica each hash went to last and prefers the replica of the longest
prefix it has seen, if that prefix is at least half of the prompt's
hashed blocks (a chat template's short preamble, shared by every request,
is not worth piling all traffic onto one replica). It falls back to the
least loaded of two random replicas (Ray Serve's default, power of two
choices) when no such prefix is known, when that replica is gone, or when
it has more than `imbalance` requests ongoing beyond the least loaded
replica (counted here, from what this router sent and what completed).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lockgate.engine.wire import RemoteWork

#: prefixes remembered (least recently routed forgotten first)
REMEMBERED_PREFIXES = 100_000


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        #: requests sent and not yet completed, by replica
        self._ongoing: Counter[ReplicaID] = Counter()
        self._sent: dict[str, ReplicaID] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = _two_random(candidate_replicas)
        hashes = _prefix_hashes(pending_request)
        preferred, matched = self._owner_of(hashes, candidate_replicas)
        if preferred is None or 2 * matched < len(hashes) or not self._has_room(preferred, candidate_replicas):
            return [by_load]
        return [[preferred], by_load]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._sent[pending_request.metadata.internal_request_id] = replica_id
        self._ongoing[replica_id] += 1
        for digest in _prefix_hashes(pending_request):
            self._owner[digest] = replica_id
            self._owner.move_to_end(digest)
        while len(self._owner) > REMEMBERED_PREFIXES:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        # also called for requests a replica refused, which were never routed
        if self._sent.pop(internal_request_id, None) is not None:
            self._ongoing[replica_id] -= 1

    def _owner_of(
        self, hashes: tuple[int, ...], candidates: list[RunningReplica]
    ) -> tuple[RunningReplica | None, int]:
        """The replica that was sent the longest known prefix of `hashes`,
        and how many blocks that prefix has."""
        live = {replica.replica_id: replica for replica in candidates}
        for blocks in range(len(hashes), 0, -1):
            replica = live.get(self._owner.get(hashes[blocks - 1]))
            if replica is not None:
                return replica, blocks
        return None, 0

    def _has_room(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        least = min(self._ongoing[replica.replica_id] for replica in candidates)
        mine = self._ongoing[preferred.replica_id]
        return mine < preferred.max_ongoing_requests and mine - least <= self.imbalance


def _prefix_hashes(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        if isinstance(arg, RemoteWork):
            return arg.prefix_hashes
    return ()


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
