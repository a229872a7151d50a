"""Structured output on the host: the engine loop with a fake grammar backend (no JAX), the
llguidance backend on the real tokenizer, and the device-side bitmask unpacking."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from sharded.span_grammars import SpanGrammars
from test_scheduler import EOS, VOCAB, FakeRunner, reference

from deepinfer_jax.engine import EngineCore, RequestError, SamplingParams, Scheduler
from deepinfer_jax.engine.structured import GrammarError, LLGuidanceBackend, StructuredOutputs, mask_words


class FakeBackend(SpanGrammars):
    """The span grammars over the scheduler tests' vocabulary."""

    def __init__(self):
        super().__init__(VOCAB, EOS)


def make(async_scheduling=False, overlap=True, max_seqs=4):
    sched = Scheduler(num_blocks=64, block_size=4, max_blocks_per_request=64, max_num_seqs=max_seqs, max_model_len=256,
                      max_num_batched_tokens=16, chunking="tokens")
    structured = StructuredOutputs(FakeBackend(), overlap=overlap)
    return EngineCore(FakeRunner(4), sched, tokenizer=None, eos_token_id=EOS, async_scheduling=async_scheduling,
                      structured=structured)


def run(engine, prompts, params):
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(2000):
        for out in engine.step():
            done[out.request_id] = out
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished, "the engine did not finish"
    return [done[r] for r in rids]


def grammar(text, **kw):
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 40), structured_output={"grammar": text}, **kw)


PROMPTS = [[5, 9, 13], [7] * 11, [100, 200, 300, 400, 500, 600], [42, 43]]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("overlap", [True, False])
def test_masks_constrain_outputs_and_leave_free_requests_alone(async_scheduling, overlap):
    params = [grammar("10-19:5"), SamplingParams(temperature=0.0, max_tokens=12), grammar("500-520:3"),
              SamplingParams(temperature=0.0, max_tokens=7)]
    outs = run(make(async_scheduling, overlap), PROMPTS, params)
    a, b, c, d = (o.outputs[0] for o in outs)
    assert all(10 <= t <= 19 for t in a.token_ids[:5]) and a.token_ids[5:] == [EOS] and a.finish_reason == "stop"
    assert all(500 <= t <= 520 for t in c.token_ids[:3]) and c.token_ids[3:] == [EOS]
    # the unconstrained requests are exactly the known model's output, as if alone
    assert b.token_ids == reference(PROMPTS[1], 12) and d.token_ids == reference(PROMPTS[3], 7)
    # the mask moved the token only where the model's own choice was not allowed
    seq = list(PROMPTS[0])
    for t in a.token_ids[:5]:
        want = reference(seq, 1)[0]
        assert t == (want if 10 <= want <= 19 else t)
        seq.append(t)


def test_modes_agree():
    params = [grammar("10-19:6"), SamplingParams(temperature=0.0, max_tokens=9), grammar("3-400:20"), grammar("7-8:2")]
    runs = [[o.outputs[0].token_ids for o in run(make(a, ov), PROMPTS, params)]
            for a in (False, True) for ov in (True, False)]
    assert all(r == runs[0] for r in runs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unsatisfiable_grammar_ends_with_error_not_a_hang(async_scheduling):
    engine = make(async_scheduling)
    params = [grammar("dead 10-19:3"), SamplingParams(temperature=0.0, max_tokens=10)]
    dead, free = (o.outputs[0] for o in run(engine, PROMPTS[:2], params))
    assert dead.finish_reason == "error" and "no token can continue" in dead.stop_reason
    assert len(dead.token_ids) == 3 and all(10 <= t <= 19 for t in dead.token_ids)
    assert free.token_ids == reference(PROMPTS[1], 10) and free.finish_reason == "length"


def test_bad_grammar_is_refused_when_added_and_disturbs_nothing():
    engine = make()
    ok = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    with pytest.raises(RequestError) as e:
        engine.add_request(PROMPTS[0], grammar("no colon here"))
    assert e.value.field == "structured_output.grammar" and "cannot parse" in str(e.value)
    assert len(engine.requests) == 1
    while engine.has_unfinished:
        engine.step()
    assert engine.requests[ok].output_ids == reference(PROMPTS[1], 6)


def test_engine_without_backend_refuses_constraints():
    sched = Scheduler(num_blocks=8, block_size=4, max_blocks_per_request=8, max_num_seqs=1, max_model_len=32,
                      max_num_batched_tokens=16, chunking="tokens")
    engine = EngineCore(FakeRunner(4), sched, tokenizer=None, eos_token_id=EOS)
    with pytest.raises(RequestError, match="structured_output"):
        engine.add_request([3, 4], grammar("10-19:1"))


@pytest.mark.parametrize("spec, field", [
    ("json", "structured_output"), ({}, "structured_output"), ({"json_schema": {}, "regex": "a"}, "structured_output"),
    ({"yaml": "x"}, "structured_output"), ({"json_object": 1}, "structured_output.json_object"),
    ({"json_schema": "{not json"}, "structured_output.json_schema"), ({"json_schema": [1]}, "structured_output.json_schema"),
    ({"regex": ""}, "structured_output.regex"), ({"grammar": 3}, "structured_output.grammar"),
])
def test_sampling_params_reject_malformed_constraints(spec, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(structured_output=spec)
    assert e.value.field == field


def test_sampling_params_normalise_constraints():
    assert SamplingParams(structured_output={"json_object": True}).constraint == ("json_object", "{}")
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    kind, text = SamplingParams(structured_output={"json_schema": schema}).constraint
    assert kind == "json_schema" and json.loads(text) == schema and text.index('"b"') < text.index('"a"')
    assert SamplingParams(structured_output={"json_schema": json.dumps(schema)}).constraint == (kind, text)
    assert SamplingParams().constraint is None


# ---- llguidance on the real tokenizer (no model) ----

@pytest.fixture(scope="module")
def backend():
    from deepinfer_jax.tokenizer import load_tokenizer

    return LLGuidanceBackend(load_tokenizer(None), 129280, 1)


@pytest.mark.parametrize("kind, text, message", [
    ("regex", "[0-9", "unclosed character class"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("grammar", "start: undefined_rule", "unknown name"),
    ("grammar", "root ::= (", "GBNF"),
])
def test_llguidance_reports_compile_errors(backend, kind, text, message):
    with pytest.raises(GrammarError, match=message):
        backend.compile(kind, text)


def _allowed(backend, m) -> np.ndarray:
    row = np.zeros(mask_words(backend.vocab_size), np.int32)
    m.fill(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[: backend.vocab_size].astype(bool)


def test_llguidance_masks_follow_text_and_roll_back(backend):
    from deepinfer_jax.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    compiled = backend.compile("regex", r"(cat|dog)s? [0-9]{2}")
    assert backend.compile("regex", r"(cat|dog)s? [0-9]{2}") is compiled  # cached
    m = backend.matcher(compiled)
    first = _allowed(backend, m)
    texts = {re.sub("[0-9]", "0", tok.decode([int(i)])) for i in np.nonzero(first)[0]}
    full = ("cat 00", "cats 00", "dog 00", "dogs 00")
    assert {"c", "d"} <= texts and all(any(f.startswith(t) for f in full) for t in texts)
    ids = tok.encode("dogs 4", add_special_tokens=False).ids
    masks = []
    for t in ids:
        masks.append(_allowed(backend, m))
        assert masks[-1][t], f"{tok.decode([t])!r} should be allowed"
        assert m.consume(t)
    digits = _allowed(backend, m)
    assert {tok.decode([int(i)]) for i in np.nonzero(digits)[0]} <= set("0123456789")
    m.rollback(len(ids))  # back to the start: the same mask as before any token
    assert np.array_equal(_allowed(backend, m), first)
    for t in ids + tok.encode("2", add_special_tokens=False).ids:
        assert m.consume(t)
    end = _allowed(backend, m)
    assert np.nonzero(end)[0].tolist() == [1]  # complete: only EOS
    assert not m.consume(tok.encode("x", add_special_tokens=False).ids[0]) and m.error()


def test_structured_outputs_flags_dead_rows(backend):
    so = StructuredOutputs(backend)
    live = so.matcher(("json_object", "{}"))
    broken = so.matcher(("regex", "a"))
    assert not broken.consume(backend.tokenizer.encode("b", add_special_tokens=False).ids[0])
    mask, dead = so.masks(4, [(live, 0), (broken, 2)])
    assert mask.shape == (4, mask_words(129280)) and list(dead) == [2]
    assert (mask[1] == -1).all() and (mask[2] == -1).all() and (mask[3] == -1).all()
    assert 0 < np.unpackbits(mask[0].view(np.uint8)).sum() < 129280


def test_device_unpacking_matches_the_host_layout():
    import jax.numpy as jnp

    from deepinfer_jax.model.sampler import apply_bitmask, unpack_bitmask

    rng = np.random.default_rng(0)
    vocab = 77
    mask = rng.integers(-(2**31), 2**31, (3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    want = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(3, -1)[:, :vocab].astype(bool)
    assert np.array_equal(np.asarray(unpack_bitmask(jnp.asarray(mask), vocab)), want)
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    out = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(True)))
    assert np.array_equal(out[want], logits[want]) and np.all(out[~want] == -np.inf)
    assert np.array_equal(np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(False))), logits)


# ---- finite JSON numbers (engine.finite_numbers) ----

@pytest.mark.parametrize("literal, inf", [
    ("5.0e661", True), ("5.0e66", False), ("1e308", False), ("2e308", True), ("1e+", False), ("-3.5E400", True),
    ("1e-400", False), ("9" * 400, False), ("9" * 400 + ".", True), ('"a": 1', False), ("abc", False),
])
def test_overflow_rule(literal, inf):
    from deepinfer_jax.engine.finite_numbers import overflows

    assert overflows(literal) is inf


def _digit(tok, d):
    (t,) = tok.encode(d, add_special_tokens=False).ids
    return t


def test_json_numbers_cannot_overflow_and_the_rule_rolls_back(backend):
    tok = backend.tokenizer
    schema = json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    m = backend.matcher(backend.compile("json_schema", schema))
    for t in tok.encode('{"x": 5.0e30', add_special_tokens=False).ids:
        assert m.consume(t)
    allowed = _allowed(backend, m)
    assert allowed[_digit(tok, "7")] and not allowed[_digit(tok, "8")]  # 5e307 is finite, 5e308 is not
    assert not allowed[_digit(tok, "000")] and allowed[tok.encode("}", add_special_tokens=False).ids[0]]
    # llguidance alone allows 5.0e308 (the rule is the engine's): the raw grammar mask
    raw = np.zeros(mask_words(backend.vocab_size), np.int32)
    m.m.unsafe_compute_mask_ptr(raw.ctypes.data, raw.nbytes)
    assert np.unpackbits(raw.view(np.uint8), bitorder="little")[_digit(tok, "8")]
    assert m.consume(_digit(tok, "7"))
    assert not _allowed(backend, m)[_digit(tok, "0")]  # 5e3070
    m.rollback(1)
    assert not _allowed(backend, m)[_digit(tok, "8")] and _allowed(backend, m)[_digit(tok, "7")]
    # an adversarial walk: always the longest allowed digit token: the number still ends finite
    ids = tok.encode('{"x": 5.0e', add_special_tokens=False).ids
    m.rollback(len(tok.encode('{"x": 5.0e30', add_special_tokens=False).ids) - len(ids))
    digits = sorted((i for i in range(backend.vocab_size) if (s := tok.id_to_token(i)) and s.isdigit() and s.isascii()),
                    key=lambda i: -len(tok.id_to_token(i)))
    for _ in range(5):
        allowed = _allowed(backend, m)
        pick = next((i for i in digits if allowed[i]), None)
        if pick is None:
            break
        assert m.consume(pick)
        ids.append(pick)
    ids += tok.encode("}", add_special_tokens=False).ids
    assert m.consume(ids[-1]) and len(ids) > len(tok.encode('{"x": 5.0e', add_special_tokens=False).ids) + 1
    assert np.isfinite(json.loads(tok.decode(ids))["x"])


def test_finite_number_rule_only_for_json_constraints(backend):
    tok = backend.tokenizer
    m = backend.matcher(backend.compile("regex", r"[0-9]e[0-9]+"))
    for t in tok.encode("5e66", add_special_tokens=False).ids:
        assert m.consume(t)
    assert _allowed(backend, m)[_digit(tok, "1")]  # a regex asks for text, not a JSON number
