"""Input edges with typed errors naming the field (no model compiled): prompts and sampling params
given to ``LLM.generate``, prompt ids and ``top_k`` in ``EngineCore.validate``, checkpoint directories,
and vLLM's ``cumulative_logprob`` / ``prompt_logprobs`` fields."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from test_scheduler import EOS, VOCAB, FakeRunner

from deepinfer_jax import LLM
from deepinfer_jax.checkpoint.loader import load_hf_checkpoint_tree, read_hf_config
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine import EngineCore, RequestError, SamplingParams, Scheduler
from deepinfer_jax.engine.outputs import TokenLogprobs
from deepinfer_jax.engine.request import Request


@pytest.mark.parametrize("prompts", [123, None, 4.5, b"bytes"])
def test_generate_rejects_a_prompts_value_that_is_no_prompt(prompts):
    with pytest.raises(RequestError, match=r"^prompts: must be a string") as e:
        LLM.__new__(LLM).generate(prompts)
    assert e.value.field == "prompts"


def test_generate_rejects_a_dict_as_sampling_params():
    with pytest.raises(RequestError, match=r"SamplingParams\(\*\*settings\)") as e:
        LLM.__new__(LLM).generate("hi", {"temperature": 0})
    assert e.value.field == "sampling_params"


@pytest.fixture()
def engine():
    sched = Scheduler(num_blocks=16, block_size=4, max_blocks_per_request=16, max_num_seqs=2, max_model_len=64,
                      max_num_batched_tokens=16, chunking="tokens")
    return EngineCore(FakeRunner(4), sched, tokenizer=None, eos_token_id=EOS)


@pytest.mark.parametrize("ids, shown", [([0, 1.5], "1.5"), ([0, "3"], "'3'"), ([True, 2], "bool")])
def test_prompt_ids_must_be_integers_never_truncated(engine, ids, shown):
    with pytest.raises(RequestError, match="prompt_token_ids: must be a sequence of integers") as e:
        engine.validate(ids, SamplingParams())
    assert shown in str(e.value)
    assert engine.validate([np.int64(3), 4], SamplingParams()) == [3, 4]  # numpy integers are fine


def test_top_k_is_bounded_by_the_vocabulary(engine):
    engine.validate([3, 4], SamplingParams(top_k=VOCAB))
    with pytest.raises(RequestError, match=f"top_k: at most the vocabulary size {VOCAB}, got 1000000000"):
        engine.validate([3, 4], SamplingParams(top_k=10**9))


def test_config_json_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: config\.json is not valid JSON") as e:
        read_hf_config(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_directory_without_weights_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_config()))
    (tmp_path / "drafter.safetensors").write_bytes(b"")  # a drafter alone is no backbone
    with pytest.raises(FileNotFoundError, match="no weights file"):
        load_hf_checkpoint_tree(tmp_path, progress=False)


def test_cumulative_logprob_and_prompt_logprobs_fields():
    r = Request("r", 0, None, [3, 4], SamplingParams(logprobs=1), SimpleNamespace(text="ab"))
    r.output_ids = [5, 6]
    r.logprobs = [TokenLogprobs(5, -0.5, {5: -0.5}), TokenLogprobs(6, -1.25, {6: -1.25})]
    out = r.to_output()
    assert out.outputs[0].cumulative_logprob == pytest.approx(-1.75) and out.prompt_logprobs is None
    plain = Request("p", 1, None, [3], SamplingParams(), SimpleNamespace(text="")).to_output()
    assert plain.outputs[0].cumulative_logprob is None
