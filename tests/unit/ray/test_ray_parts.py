"""The Ray plugin's parts without a Ray cluster: what crosses the wire,
the replica plan and deployment options, the router's choice."""

from __future__ import annotations

import dataclasses
import pickle
import types

import pytest

from lockgate.engine import Work
from lockgate.engine.params import SamplingParams
from lockgate.plugin_api.grammars import compile_json_schema
from lockgate.errors import ContextLengthExceeded, InvalidSchema, Overloaded
from lockgate.plugins.ray.deployment import ReplicaPlan, deployment_options
from lockgate.plugins.ray.routing import PrefixAffinityRouter
from lockgate.engine.wire import RemoteWork, from_wire, to_wire
from lockgate.plugins.ray.affinity import AFFINITY_BLOCK, prefix_hashes
from lockgate.server.config import Settings
from lockgate.settings import InvalidSetting


def test_errors_pickle_with_every_field():
    for error in (
        ContextLengthExceeded("too long", subject="prompt", param="messages"),
        Overloaded("full", retry_after=7),
        InvalidSchema("bad", code="schema_too_complex"),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert (copy.message, copy.param, copy.code, copy.subject, copy.headers) == \
            (error.message, error.param, error.code, error.subject, error.headers)
        assert str(copy) == str(error)
    assert pickle.loads(pickle.dumps(Overloaded("full", retry_after=7))).headers == {"Retry-After": "7"}


def test_a_grammar_travels_as_its_source(tiny_model):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    grammar = compile_json_schema(schema, tiny_model.tokenizer, eos_token_ids=tiny_model.eos_token_ids)
    work = Work("r1", [1, 2, 3], SamplingParams(grammar=grammar, max_tokens=5))
    remote = pickle.loads(pickle.dumps(to_wire(work)))
    assert remote.work.params.grammar is None and remote.prefix_hashes == ()
    rebuilt = from_wire(remote, tiny_model.grammar_from_source).params.grammar
    assert rebuilt.source == grammar.source
    width = tiny_model.vocab_size
    original, copy = grammar.matcher(), rebuilt.matcher()
    # both accept the same tokens, step after step
    for _ in range(4):
        allowed = original.allowed(width)
        assert (allowed == copy.allowed(width)).all()
        token = int(allowed.nonzero()[0][0])
        original.accept(token)
        copy.accept(token)


def test_prefix_hashes_share_exactly_the_shared_blocks():
    base = list(range(100, 100 + 5 * AFFINITY_BLOCK))
    same_start = base[: 3 * AFFINITY_BLOCK] + [7] * (2 * AFFINITY_BLOCK)
    a, b = prefix_hashes(base), prefix_hashes(same_start)
    assert len(a) == 4  # the last token is left out, so the fifth block is not whole
    assert a[:3] == b[:3] and a[3] != b[3]
    assert prefix_hashes(base[:AFFINITY_BLOCK]) == ()  # no whole block before the last token
    assert prefix_hashes(list(range(5000)))[-1:] == prefix_hashes(list(range(600)))[-1:]  # only the span counts
    assert to_wire(Work("r", base, SamplingParams()), prefix_hashes(base)).prefix_hashes == a


def test_replica_plan():
    assert ReplicaPlan.from_settings(Settings.of(replicas="3")) == ReplicaPlan(3, 3, 3)
    assert ReplicaPlan.from_settings(Settings.of(replicas="auto", min_replicas=2, max_replicas=5)) == ReplicaPlan(None, 2, 5)
    for bad in ("0", "two", "-1"):
        with pytest.raises(InvalidSetting, match="--replicas"):
            ReplicaPlan.from_settings(Settings.of(replicas=bad))
    with pytest.raises(InvalidSetting, match="--min-replicas"):
        ReplicaPlan.from_settings(Settings.of(replicas="auto", min_replicas=4, max_replicas=2))


def test_deployment_options():
    settings = Settings.of(replicas="auto", min_replicas=1, max_replicas=4, max_num_seqs=16, max_queue=32,
                        gpus_per_replica=1.0, cpus_per_replica=2.0)
    options = deployment_options(settings, ReplicaPlan.from_settings(settings))
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 12}
    assert "num_replicas" not in options
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert options["max_ongoing_requests"] == 48 and options["max_queued_requests"] == 32
    assert options["request_router_config"]["request_router_class"].endswith(":PrefixAffinityRouter")
    fixed = Settings.of(replicas="2", prefix_cache=False)
    options = deployment_options(fixed, ReplicaPlan.from_settings(fixed))
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    assert "request_router_config" not in options  # no cache, nothing to be near: Ray's default router


def _router(names: str, max_ongoing: int = 10) -> PrefixAffinityRouter:
    router = object.__new__(PrefixAffinityRouter)
    router.initialize_state(imbalance=3)
    router.replicas = [types.SimpleNamespace(replica_id=name, max_ongoing_requests=max_ongoing) for name in names]
    return router


_ids = iter(range(10**6))


def _pending(hashes):
    work = RemoteWork(Work("r", [1], SamplingParams()), None, tuple(hashes))
    return types.SimpleNamespace(args=[work], metadata=types.SimpleNamespace(internal_request_id=str(next(_ids))))


def _send(router, hashes, replica) -> str:
    pending = _pending(hashes)
    router.on_request_routed(pending, replica, None)
    return pending.metadata.internal_request_id


async def test_router_prefers_the_replica_of_the_longest_known_prefix():
    router = _router("abc")
    a, b, c = router.replicas
    _send(router, [1, 2, 3], "b")
    _send(router, [1, 2], "c")  # c was sent the prefix [1, 2] last
    ranks = await router.choose_replicas(router.replicas, _pending([1, 2, 3, 4]))
    assert ranks[0] == [b] and len(ranks) == 2  # b, then the load-based fallback
    ranks = await router.choose_replicas(router.replicas, _pending([1, 2, 9]))
    assert ranks[0] == [c]  # only [1, 2] is shared, and c was sent it last
    for unknown in ([5], [1, 7, 8, 9, 10]):  # nothing known; a shared start under half the prompt
        ranks = await router.choose_replicas(router.replicas, _pending(unknown))
        assert len(ranks) == 1 and {r.replica_id for r in ranks[0]} <= {"a", "b", "c"}


async def test_router_leaves_a_busy_or_gone_replica_to_load_balancing():
    router = _router("ab")
    a, b = router.replicas
    sent = [_send(router, [1, 2], "b") for _ in range(4)]  # b runs 4, a none: 4 > imbalance 3
    assert len(await router.choose_replicas(router.replicas, _pending([1, 2]))) == 1
    router.on_request_completed("b", sent.pop())  # 3 ongoing: near enough
    assert (await router.choose_replicas(router.replicas, _pending([1, 2])))[0] == [b]
    router.on_request_completed("a", "never routed")  # a refused request changes nothing
    assert (await router.choose_replicas(router.replicas, _pending([1, 2])))[0] == [b]
    assert len(await router.choose_replicas([a], _pending([1, 2]))) == 1  # b gone


def test_named_plugin_modules_are_registered(monkeypatch):
    from lockgate.errors import PluginError
    from lockgate.plugin_api.manager import get_plugin_manager

    monkeypatch.setenv("LOCKGATE_PLUGINS", "poisoned_executor")
    pm = get_plugin_manager(autoload=False)
    assert pm.get_plugin("poisoned_executor") is not None
    monkeypatch.setenv("LOCKGATE_PLUGINS", "no_such_plugin_module")
    with pytest.raises(PluginError, match="no_such_plugin_module"):
        get_plugin_manager(autoload=False)
