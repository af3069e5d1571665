"""Prefix-affinity routing: requests whose prompts start alike go to the
replica that served that start before, so its prefix cache has the KV.

A Ray Serve request router (it runs in the front's process, inside the
deployment handle). Each `RemoteWork` carries chained hashes of its
prompt's first blocks (`wire.prefix_hashes`); the router remembers which
replica each hash went to last and prefers the replica of the longest
prefix it has seen. It falls back to the least loaded of two random
replicas (Ray Serve's default, power of two choices) when no prefix is
known, when that replica is gone, or when it is busier than the least
loaded replica by more than `imbalance` ongoing requests.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from lockgate.plugins.ray.wire import RemoteWork

#: prefixes remembered (least recently routed forgotten first)
REMEMBERED_PREFIXES = 100_000


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8) -> None:
        self.imbalance = imbalance
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = _two_random(candidate_replicas)
        hashes = _prefix_hashes(pending_request)
        preferred = self._owner_of(hashes, candidate_replicas)
        if preferred is None or not self._has_room(preferred, candidate_replicas):
            return [by_load]
        return [[preferred], by_load]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        for digest in _prefix_hashes(pending_request):
            self._owner[digest] = replica_id
            self._owner.move_to_end(digest)
        while len(self._owner) > REMEMBERED_PREFIXES:
            self._owner.popitem(last=False)

    def _owner_of(self, hashes: tuple[int, ...], candidates: list[RunningReplica]) -> RunningReplica | None:
        live = {replica.replica_id: replica for replica in candidates}
        for digest in reversed(hashes):  # the longest known prefix first
            replica = live.get(self._owner.get(digest))
            if replica is not None:
                return replica
        return None

    def _has_room(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        queue = self._replica_queue_len_cache.get
        mine = queue(preferred.replica_id)
        if mine is None:  # not known yet: let the probe decide
            return True
        others = [n for n in (queue(r.replica_id) for r in candidates) if n is not None]
        return mine < preferred.max_ongoing_requests and mine - min(others, default=mine) <= self.imbalance


def _prefix_hashes(pending_request: PendingRequest | None) -> tuple[int, ...]:
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        if isinstance(arg, RemoteWork):
            return arg.prefix_hashes
    return ()


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
