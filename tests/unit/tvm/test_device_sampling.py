"""The device sampler (`lockgate.plugins.tvm.sampler`) compiled for llvm
chooses exactly the host sampler's tokens.

Both sides get identically seeded generators for every row; the device
sampler takes its per-row uniform from the row's generator where the host
sampler draws, so equal tokens step after step mean the same draw was turned
into the same token. Logprobs agree to float32 tolerance. The same module
cross-compiles for CUDA sm_90 with every kernel scheduled by its own rules.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest


from tiny_model import write_tiny_gguf  # noqa: E402

from lockgate.engine.params import SamplingParams  # noqa: E402
from lockgate.engine.sampling import SamplingRow, make_generator, sample_batch  # noqa: E402
from lockgate.models.config import ModelConfig  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.models.model_file import ModelFile  # noqa: E402

tvm = pytest.importorskip("tvm")

from tvm.target import Target  # noqa: E402

from lockgate.plugins.tvm.sampler import DeviceSampler  # noqa: E402
from lockgate.plugins.tvm.sampler_build import build_sampler  # noqa: E402

#: the default model's vocabulary
VOCAB = 49152

#: one request kind per entry; rows of a batch cycle through them
KINDS = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.9},
    {"temperature": 0.6, "top_p": 0.5},
    {"min_p": 0.1},
    {"temperature": 1.2, "top_k": 50, "top_p": 0.8, "min_p": 0.02},
    {"top_k": 1},
    {"temperature": 0.5, "logprobs": 3},
    {"temperature": 0.0, "logprobs": 20},
    {"temperature": 0.9, "top_p": 0.95, "logprobs": 0},
    {"logit_bias": {3: 5.0, 7: -100.0, 40: 2.5}, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"temperature": 0.8, "repetition_penalty": 1.3, "top_k": 20},
    {"temperature": 0.0, "repetition_penalty": 0.8, "logit_bias": {5: 1.0}},
]


def _params(kind: int, seed: int) -> SamplingParams:
    return SamplingParams(seed=seed, **KINDS[kind % len(KINDS)])


def _rows(params, histories, masks=None, choice=0):
    masks = masks or [None] * len(params)
    return [
        SamplingRow(p, make_generator(p, choice), prompt, output, mask)
        for p, (prompt, output), mask in zip(params, histories, masks)
    ]


def _assert_same(host, device):
    host_tokens, host_logprobs = host
    device_tokens, device_logprobs = device
    np.testing.assert_array_equal(device_tokens, host_tokens)
    for want, got in zip(host_logprobs, device_logprobs):
        assert (want is None) == (got is None)
        if want is None:
            continue
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert len(got.top) == len(want.top)
        # ids may swap only between equal values; compare values, then ids
        np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=1e-4)
        for (gid, gv), (wid, wv) in zip(got.top, want.top):
            assert gid == wid or abs(gv - wv) < 1e-4


@pytest.fixture(scope="module")
def sampler() -> DeviceSampler:
    return DeviceSampler(VOCAB, Target.from_device(tvm.cpu()), tvm.cpu(0))


@pytest.mark.parametrize("batch", [1, 7, 32])
def test_random_logits_same_tokens(sampler, batch):
    rng = np.random.default_rng(batch)
    kinds_seen = set()
    for trial in range(6):
        logits = (rng.standard_normal((batch, VOCAB)) * 3).astype(np.float32)
        params = [_params(trial * batch + i, seed=1000 * trial + i) for i in range(batch)]
        kinds_seen |= {(trial * batch + i) % len(KINDS) for i in range(batch)}
        histories = [(list(rng.integers(0, VOCAB, 20)), list(rng.integers(0, 60, 12))) for _ in range(batch)]
        _assert_same(
            sample_batch(logits, _rows(params, histories)),
            sampler.sample_batch(logits, _rows(params, histories)),
        )
    if batch == 32:
        assert kinds_seen == set(range(len(KINDS)))


def test_device_tensor_input_and_seeded_batches(sampler):
    """A seeded row's token does not depend on the rest of its batch, on
    the device either; a device tensor is taken as it is."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((8, VOCAB)) * 2).astype(np.float32)
    params = [_params(1 + i % 7, seed=77) for i in range(8)]
    histories = [([1, 2], [3])] * 8
    whole, _ = sampler.sample_batch(tvm.runtime.tensor(logits, tvm.cpu(0)), _rows(params, histories))
    for i in range(8):
        alone, _ = sampler.sample_batch(logits[i : i + 1], _rows(params[i : i + 1], histories[i : i + 1]))
        assert alone[0] == whole[i]
    host, _ = sample_batch(logits, _rows(params, histories))
    np.testing.assert_array_equal(whole, host)


def test_many_seeds_cover_the_distribution(sampler):
    """Over many seeds a sampled row picks many different tokens, and each
    pick is the host's: the draw is really used, not a constant."""
    logits = np.linspace(0.0, 4.0, VOCAB, dtype=np.float32)[None, :].copy()
    logits[0, -40:] = 10.0 + np.arange(40, dtype=np.float32) * 0.05
    picked = set()
    for seed in range(60):
        for kind in ({"temperature": 1.0}, {"top_p": 0.7}, {"top_k": 10, "temperature": 2.0}, {"min_p": 0.3}):
            params = [SamplingParams(seed=seed, **kind)]
            host, _ = sample_batch(logits, _rows(params, [((), ())]))
            device, _ = sampler.sample_batch(logits, _rows(params, [((), ())]))
            assert device[0] == host[0], (seed, kind)
            picked.add(int(host[0]))
    assert len(picked) > 20


def test_ties_at_the_top_p_cut(sampler):
    """Rows whose top-p cut falls inside a run of equal probabilities: the
    host keeps the first of them in vocabulary order (its stable argsort),
    and so must the device."""
    logits = np.full((4, VOCAB), -20.0, dtype=np.float32)
    tied = [50, 10, 3000, 7, 49151, 222]  # six equal maxima, out of order
    logits[:, tied] = 5.0
    logits[:, 99] = 6.0
    # token 99 holds 0.31 of the mass, each tied token 0.115: top_p 0.5
    # keeps 99 and the first two tied tokens in vocabulary order
    params = [SamplingParams(seed=s, top_p=0.5) for s in range(4)]
    chosen = set()
    for step in range(50):
        rows_host = _rows(params, [((), ())] * 4, choice=step)
        rows_device = _rows(params, [((), ())] * 4, choice=step)
        host, _ = sample_batch(logits, rows_host)
        device, _ = sampler.sample_batch(logits, rows_device)
        np.testing.assert_array_equal(device, host)
        chosen |= set(host.tolist())
    assert chosen == {99, 7, 10}

    # rounded logits: ties everywhere, with top-k ties at the k-th value too
    rng = np.random.default_rng(11)
    logits = np.round(rng.standard_normal((12, VOCAB)) * 2).astype(np.float32)
    params = [_params(i, seed=i) for i in range(12)]
    histories = [((), (4, 4, 9))] * 12
    _assert_same(
        sample_batch(logits, _rows(params, histories)), sampler.sample_batch(logits, _rows(params, histories))
    )


def test_grammar_masks(sampler):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((6, VOCAB)) * 3).astype(np.float32)
    masks = []
    for i in range(6):
        if i % 3 == 0:
            masks.append(None)
            continue
        allowed = np.zeros(VOCAB + 17, dtype=bool)  # longer than the vocabulary, as a matcher's may be
        allowed[rng.choice(VOCAB, size=1 + 40 * i, replace=False)] = True
        masks.append(allowed)
    for trial in range(5):
        params = [_params(trial + i, seed=trial * 10 + i) for i in range(6)]
        histories = [((1,), (2, 2))] * 6
        host = sample_batch(logits, _rows(params, histories, masks))
        device = sampler.sample_batch(logits, _rows(params, histories, masks))
        _assert_same(host, device)
        for token, mask in zip(device[0], masks):
            assert mask is None or mask[token]


def test_wrong_shape_is_refused(sampler):
    with pytest.raises(ValueError):
        sampler.sample_batch(tvm.runtime.tensor(np.zeros((2, VOCAB), np.float32)), _rows([SamplingParams()], [((), ())]))


# the tiny model -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_executor(tmp_path_factory):
    from lockgate.plugins.tvm.executor import create_executor

    d = tmp_path_factory.mktemp("device-sampling")
    path = write_tiny_gguf(d / "tiny.gguf")
    config = ModelConfig.from_gguf(gguf.GGUFReader(path))
    options = ExecutorOptions.of(
        max_num_seqs=8, max_total_tokens=2048, prefill_chunk_size=128, cache_dir=d / "cache"
    )
    executor = create_executor(ModelFile(path, config), options)
    yield executor
    executor.close()


def test_tiny_model_generation_is_the_same(tiny_executor):
    """Eight mixed requests decoded together for 24 steps, each step's
    tokens chosen by both samplers from the model's own logits and fed
    back: every token agrees, so the two generations are identical."""
    ex = tiny_executor
    sampler = DeviceSampler(ex.vocab_size, Target.from_device(tvm.cpu()), tvm.cpu(0))
    prompts = [[1, 70, 71, 72, 260 + i, 30, 40 + i, 2, 198] for i in range(8)]
    params = [_params(k, seed=31 + k) for k in (0, 1, 3, 4, 7, 9, 12, 13)]
    host_rngs = [make_generator(p, 0) for p in params]
    device_rngs = [make_generator(p, 0) for p in params]
    ids = list(range(500, 508))
    for seq_id in ids:
        ex.add_sequence(seq_id)
    try:
        logits = ex.prefill(ids, prompts)
        outputs: list[list[int]] = [[] for _ in ids]
        distinct = set()
        for step in range(24):
            def rows(rngs):
                return [SamplingRow(p, g, prompt, list(out)) for p, g, prompt, out in zip(params, rngs, prompts, outputs)]

            host = sample_batch(logits, rows(host_rngs))
            device = sampler.sample_batch(logits, rows(device_rngs))
            _assert_same(host, device)
            for out, token in zip(outputs, host[0]):
                out.append(int(token))
            distinct |= set(host[0].tolist())
            logits = ex.decode(ids, [int(t) for t in host[0]])
        assert len(distinct) > 10  # the sampled rows really do vary
    finally:
        for seq_id in ids:
            ex.remove_sequence(seq_id)


# CUDA -----------------------------------------------------------------------


def test_cross_compiles_for_sm90_without_fallback(monkeypatch, tmp_path):
    """The same module builds for sm_90 on a machine without a GPU, and no
    kernel is left to dl.gpu.Fallback (not even inside TVM's sort/scan
    dispatch): an unscheduled kernel fails a CUDA build."""
    from tvm.s_tir import dlight as dl

    fallback_calls = []
    original = dl.gpu.Fallback.apply

    def spy(self, func, target, tunable):
        fallback_calls.append(func)
        return original(self, func, target, tunable)

    monkeypatch.setattr(dl.gpu.Fallback, "apply", spy)
    target = Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})
    executable = build_sampler(VOCAB, target)
    assert fallback_calls == []
    library = tmp_path / "sampler.so"
    executable.export_library(str(library))
    blob = library.read_bytes()
    kernels = set(re.findall(rb'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)', blob))
    for name in (b"mask", b"apply_entries", b"argmax", b"mass", b"draw", b"keep", b"kept", b"top_logprob", b"take"):
        assert any(k.startswith(name) for k in kernels), (name, kernels)
    assert any(b"sort" in k for k in kernels), kernels
    assert any(b"cumsum" in k or b"scan" in k for k in kernels), kernels
    # float64 probabilities on the device as on the host
    assert b"double" in blob
