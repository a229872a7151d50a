"""The streaming engine interface: ``AsyncEngine`` (engine thread, deltas, abort, back-pressure) and
``LLM.generate_stream``, against ``LLM.generate`` on the shipped model."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.engine import RequestError
from deepinfer_jax.engine.async_engine import AsyncEngine, EngineDead, EngineOverloaded

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "import numpy as np\n"]


@pytest.fixture(scope="module")
def llm():
    # the engine shape of tests/test_chat.py: the compiled programs are shared through the cache
    return LLM(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
               chunking="tokens", use_tqdm=False)


def _params(n=4, **kw):
    return [SamplingParams(temperature=0.8, seed=i, max_tokens=10, **kw) for i in range(n)]


def _ids(llm, prompt):
    return [llm.model_config.bos_token_id, *llm.tokenizer.encode(prompt, add_special_tokens=False).ids]


async def _collect(aengine, ids, params):
    stream = await aengine.add_request(ids, params)
    deltas = [d async for d in stream]
    return deltas


def _joined(deltas):
    return ([t for d in deltas for t in d.outputs[0].token_ids], "".join(d.outputs[0].text for d in deltas),
            deltas[-1].outputs[0].finish_reason)


def test_generate_stream_deltas_add_up_to_generate(llm):
    params = _params()
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    got: dict[str, list] = {}
    for d in llm.generate_stream(PROMPTS, params):
        got.setdefault(d.request_id, []).append(d)
    assert len(got) == 4
    for r, deltas in zip(ref, got.values()):
        assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
        assert _joined(deltas) == (r.outputs[0].token_ids, r.outputs[0].text, r.outputs[0].finish_reason)
    # closing the iterator early aborts what still runs and frees its blocks
    it = llm.generate_stream(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
    first = next(it)
    assert not first.finished
    it.close()
    llm.engine.drain()
    assert llm.engine.scheduler.pool.used_count == 0 and not llm.engine.requests


def test_async_engine_streams_what_generate_returns(llm):
    params = _params()
    text = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    stop = SamplingParams(temperature=0, max_tokens=12, stop=[text[4:7]])  # a stop string the output reaches
    ref = llm.generate([*PROMPTS, PROMPTS[1]], [*params, stop], use_tqdm=False)
    assert ref[-1].outputs[0].finish_reason == "stop" and ref[-1].outputs[0].text == text[:4]
    aengine = AsyncEngine(llm.engine, max_queued=8).start()
    try:
        async def main():
            jobs = [_collect(aengine, _ids(llm, p), sp) for p, sp in zip([*PROMPTS, PROMPTS[1]], [*params, stop])]
            return await asyncio.gather(*jobs)

        results = asyncio.run(main())
        for r, deltas in zip(ref, results):
            assert _joined(deltas) == (r.outputs[0].token_ids, r.outputs[0].text, r.outputs[0].finish_reason)
        # a held-back stop-string prefix is never sent and taken back: every delta's text is final
        assert "".join(d.outputs[0].text for d in results[-1]) == text[:4]
        assert aengine.num_admitted == 0 and not llm.engine.requests
    finally:
        aengine.stop()


def test_abort_frees_blocks_and_the_thread_sleeps_when_idle(llm):
    aengine = AsyncEngine(llm.engine).start()
    try:
        async def main():
            stream = await aengine.add_request(_ids(llm, PROMPTS[2]), SamplingParams(max_tokens=300, ignore_eos=True))
            first = await stream.__anext__()
            used = await asyncio.wrap_future(aengine.call(lambda: llm.engine.scheduler.pool.used_count))
            aengine.abort(stream.request_id)
            rest = [d async for d in stream]
            return first, used, rest

        first, used, rest = asyncio.run(main())
        assert used > 0 and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(first.outputs[0].token_ids) + sum(len(d.outputs[0].token_ids) for d in rest) < 300
        assert aengine.aborted == 1
        assert aengine.call(lambda: llm.engine.scheduler.pool.used_count).result(timeout=30) == 0
        steps = aengine.steps
        time.sleep(0.3)
        assert aengine.steps == steps, "the engine thread steps while idle"
    finally:
        aengine.stop()


def test_back_pressure_and_bad_requests(llm):
    aengine = AsyncEngine(llm.engine, max_queued=2).start()
    try:
        async def main():
            a = await aengine.add_request(_ids(llm, PROMPTS[0]), SamplingParams(max_tokens=4))
            b = await aengine.add_request(_ids(llm, PROMPTS[1]), SamplingParams(max_tokens=4))
            with pytest.raises(EngineOverloaded, match="capacity"):
                await aengine.add_request(_ids(llm, PROMPTS[2]), SamplingParams(max_tokens=4))
            done = [[d async for d in s][-1].finished for s in (a, b)]
            with pytest.raises(RequestError) as e:  # validated on the engine thread, raised to the caller
                await aengine.add_request([10**9], SamplingParams(max_tokens=4))
            assert e.value.field == "prompt_token_ids"
            c = await aengine.add_request(_ids(llm, PROMPTS[2]), SamplingParams(max_tokens=4))  # room again
            return done, [d async for d in c]

        done, c = asyncio.run(main())
        assert done == [True, True] and c[-1].finished and aengine.num_admitted == 0
    finally:
        aengine.stop()

    async def late():
        await aengine.add_request(_ids(llm, PROMPTS[0]), SamplingParams(max_tokens=4))

    with pytest.raises(EngineDead):
        asyncio.run(late())
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)[0].finished  # usable again
