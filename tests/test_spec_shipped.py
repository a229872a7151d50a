"""Speculative decoding with the shipped drafter (issue 9): on by default ("auto" = the dynamic budget),
lossless against the plain engine on real prompts, and the drafter really gets drafts accepted."""

from __future__ import annotations

import pytest
from test_spec_engine import plain_priced_out

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.checkpoint.draft_vocab import load_draft_vocab
from deepinfer_jax.config import EngineConfig
from deepinfer_jax.llm import DEFAULT_CHECKPOINT

# the engine shape of tests/test_chat.py and tests/test_structured_model.py (compiled programs are shared)
SETTINGS = dict(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
                chunking="tokens", use_tqdm=False, precompile="all")  # profiled step-time tables
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\n", "class Stack:\n    def __init__(self):\n",
           "# Return the sum of a list\ndef total(items):\n"]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(**SETTINGS)  # speculation="auto"


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(speculation="none", **SETTINGS)


def test_the_shipped_drafter_loads_and_auto_speculates(spec_llm):
    assert spec_llm.speculation == "dspark" and spec_llm.drafter is not None
    assert LLM._speculation(EngineConfig(), spec_llm.drafter) == "dspark"
    assert LLM._speculation(EngineConfig(), None) == "none"  # no drafter: plain decoding, no error
    sharded = EngineConfig(sharding="cpu-dp2-ep4", enable_prefix_caching=False)
    assert LLM._speculation(sharded, spec_llm.drafter) == "none"
    policy = spec_llm.engine.spec.policy
    assert policy.name == "dspark" and policy.deterministic_k == 0  # seeded requests decode plainly under "auto"
    vocab = load_draft_vocab(DEFAULT_CHECKPOINT, spec_llm.model_config.vocab_size)
    assert len(vocab) == 8192 and spec_llm.runner.speculation.heads.ids.shape == (8192,)


def test_auto_seeded_requests_decode_as_without_speculation(spec_llm, plain_llm):
    """A request with its own seed verifies no drafts under "auto" (no fixed count was asked for), so its
    tokens are the plain engine's whatever else runs; a greedy request beside it still speculates."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    s = spec_llm.engine.spec.stats
    verified0 = s.drafts_verified
    got = spec_llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
    assert s.drafts_verified == verified0
    want = plain_llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    both = spec_llm.generate(PROMPTS[:2], [seeded, greedy], use_tqdm=False)
    assert both[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_shipped_greedy_outputs_equal_plain_decoding(spec_llm, plain_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    before = spec_llm.engine.spec.stats.drafts_accepted
    got = spec_llm.generate(PROMPTS, sp, use_tqdm=False)
    want = plain_llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert spec_llm.engine.spec.stats.drafts_accepted - before > 5
    stats = spec_llm.stats
    assert stats["spec_verify_rows"] > 0 and 0 < stats["spec_acceptance"] < 1
    assert stats["steps"] > 0


def test_greedy_only_speculation_leaves_sampled_requests_to_plain_decoding(spec_llm, plain_llm):
    """With ``sampled_drafts=False`` (what "auto" uses where it speculates) a sampled request verifies no
    drafts: its seeded tokens are those of the plain engine; a greedy one beside it still speculates."""
    spec = spec_llm.engine.spec
    # plain steps priced out of reach: the greedy row drafts whatever this machine's profiled (and disk-cached)
    # step times say, so what is tested is which rows verify drafts, not the budget's timing decision
    spec.sampled_drafts = False
    try:
        with plain_priced_out(spec):
            _greedy_only(spec_llm, plain_llm)
    finally:
        spec.sampled_drafts = True


def _greedy_only(spec_llm, plain_llm):
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    s = spec_llm.engine.spec.stats
    rows0, verified0, accepted0 = s.verify_rows, s.drafts_verified, s.drafts_accepted
    got = spec_llm.generate(PROMPTS[:1], sampled, use_tqdm=False)
    assert s.verify_rows > rows0 and (s.drafts_verified, s.drafts_accepted) == (verified0, accepted0)
    want = plain_llm.generate(PROMPTS[:1], sampled, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    rows0 = s.verify_rows
    spec_llm.generate(PROMPTS[:2], [sampled, greedy], use_tqdm=False)
    assert s.verify_rows > rows0 and s.drafts_accepted > accepted0
