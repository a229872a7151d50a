"""Batch jobs in one process: the file format, error records, resume, shards and merge, dry run, CLI settings.

The tiny model (random weights, vocabulary 512) runs ``/v1/completions`` records with token-id prompts;
the chat protocols run on the shipped model (its engine shape is tests/test_chat.py's, so the compiled
programs come from the persistent cache). Subprocess runs (kill -9, two processes, Ray Data) are in
tests/test_batch_processes.py.
"""

from __future__ import annotations

import argparse
import io
import json

import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.batch import BatchError, Shard, dry_run, files, parse_line, results, run_job
from deepinfer_jax.batch.cli import main
from deepinfer_jax.batch.job import shard_records
from deepinfer_jax.batch.settings import add_engine_options, engine_settings

TINY = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=128, chunking="tokens")


def completion(cid, prompt, max_tokens=6, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


GOOD = [completion(f"ok{i}", [1, 2, 3 + i, 7, 9 + i][: 2 + i % 4], max_tokens=3 + i % 4) for i in range(8)]
BAD = {  # line text -> (custom_id, where the error is reported, the field it names)
    "{not json": (None, "error", None),
    "[1, 2]": (None, "error", None),
    json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}): (None, "error", "custom_id"),
    json.dumps({**completion("m", [1]), "method": "GET"}): ("m", "error", "method"),
    json.dumps({**completion("u", [1]), "url": "/v1/embeddings"}): ("u", "error", "url"),
    json.dumps({**completion("b", [1]), "body": "hi"}): ("b", "error", "body"),
    json.dumps({**completion("x", [1]), "extra": 1}): ("x", "error", "extra"),
    json.dumps(completion("s", [1], stream=True)): ("s", "error", "body.stream"),
    json.dumps(completion("ok0", [5, 6])): ("ok0", "error", "custom_id"),  # a duplicate of line 1
    json.dumps(completion("long", [1] * 200)): ("long", 400, "prompt"),
    json.dumps(completion("temp", [1, 2], temperature=9)): ("temp", 400, "temperature"),
    json.dumps(completion("vocab", [1, 100000])): ("vocab", 400, "prompt"),
}


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def masked(record):
    """A result without what differs run to run (response ids, also inside item ids, and timestamps)."""
    r = json.loads(json.dumps(record))
    if r.get("response"):
        r["response"].pop("request_id")
        body = r["response"]["body"]
        if isinstance(body.get("id"), str):
            body = json.loads(json.dumps(body).replace(body["id"], "ID"))
        for key in ("created", "created_at", "completed_at"):
            body.pop(key, None)
        r["response"]["body"] = body
    return r


def no_cache(body):
    """A response body without its usage's cache counts."""
    usage = body.get("usage") or {}
    body["usage"] = {k: v for k, v in usage.items() if "cache" not in k and "details" not in k}
    return body


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny", use_tqdm=False, speculation="none", **TINY)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Good records first (lines 1-8), then every kind of bad line, a blank line among them."""
    return write_jsonl(tmp_path_factory.mktemp("batch") / "in.jsonl", [*GOOD, *list(BAD)[:6], "", *list(BAD)[6:]])


@pytest.fixture(scope="module")
def reference(tiny):
    """custom_id -> (text, token ids) of the good records from LLM.generate, greedy."""
    outs = tiny.generate([{"prompt_token_ids": g["body"]["prompt"]} for g in GOOD],
                         [SamplingParams(temperature=0, max_tokens=g["body"]["max_tokens"]) for g in GOOD],
                         use_tqdm=False)
    return {g["custom_id"]: o.outputs[0].text for g, o in zip(GOOD, outs)}


@pytest.fixture(scope="module")
def full_run(tiny, mixed, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    summary = run_job(tiny, mixed, out, progress=False, log=None)
    return summary, read_jsonl(out)


def test_parse_line_never_raises_and_names_the_field():
    for text, (cid, _, param) in BAD.items():
        record = parse_line(text, 3)
        if param in ("prompt", "temperature") or (param == "custom_id" and cid):
            assert record.error is None  # refused later: by the protocol, or as a duplicate
        else:
            assert record.error is not None and record.error.param == param, text
            assert record.custom_id == cid and record.line == 3


def test_every_line_is_answered_once_and_bad_ones_are_error_records(full_run, reference):
    summary, out = full_run
    assert (summary.ok, summary.failed, summary.skipped) == (len(GOOD), len(BAD), 0)
    assert sorted(files.line_of(r) for r in out) == [*range(1, 15), *range(16, 22)]  # line 15 is blank
    by_line = {files.line_of(r): r for r in out}
    for k, (cid, where, param) in enumerate(BAD.values()):
        r = by_line[9 + k + (k >= 6)]
        assert r["custom_id"] == cid
        if where == "error":
            assert r["response"] is None and r["error"]["param"] == param and r["error"]["line"] == 9 + k + (k >= 6)
        else:
            assert r["error"] is None and r["response"]["status_code"] == 400
            assert r["response"]["body"]["error"]["param"] == param
    assert by_line[18]["error"]["code"] == "duplicate_custom_id"


def test_good_records_equal_llm_generate_despite_the_bad_ones(full_run, reference):
    _, out = full_run
    ok = {r["custom_id"]: r["response"]["body"] for r in out if r["response"] and r["response"]["status_code"] == 200}
    assert {cid: b["choices"][0]["text"] for cid, b in ok.items()} == reference
    for g in GOOD:
        usage = ok[g["custom_id"]]["usage"]
        assert usage["prompt_tokens"] == len(g["body"]["prompt"])
        assert usage["completion_tokens"] == g["body"]["max_tokens"]
        assert "cached_tokens" in usage["prompt_tokens_details"]


def test_rerun_skips_what_is_done_and_completes_each_record_once(tiny, mixed, full_run, tmp_path):
    out = tmp_path / "out.jsonl"
    first = run_job(tiny, mixed, out, max_records=5, progress=False, log=None)
    assert first.records == 5
    with open(out, "ab") as f:
        f.write(b'{"id":"batch_req_6","custom_id":"ok5","resp')  # a line torn by a crash
    log = io.StringIO()
    second = run_job(tiny, mixed, out, progress=False, log=log)
    assert second.skipped == 5 and second.records == len(GOOD) + len(BAD) - 5
    assert "cut off a torn last line" in log.getvalue() and "5 records already" in log.getvalue()
    got = read_jsonl(out)
    assert sorted(files.line_of(r) for r in got) == sorted(files.line_of(r) for r in full_run[1])
    assert sorted(map(json.dumps, map(masked, got))) == sorted(map(json.dumps, map(masked, full_run[1])))
    third = run_job(tiny, mixed, out, progress=False, log=None)
    assert third.records == 0 and third.skipped == len(GOOD) + len(BAD)


def test_results_of_another_input_are_refused(tiny, mixed, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "batch_req_1", "custom_id": "someone-else", "response": None, "error": {}}) + "\n")
    with pytest.raises(BatchError, match="another input file") as e:
        run_job(tiny, mixed, out, progress=False, log=None)
    assert e.value.param == "--output"
    (tmp_path / "junk.jsonl").write_text("hello\n")
    with pytest.raises(BatchError, match="not a batch result"):
        run_job(tiny, mixed, tmp_path / "junk.jsonl", progress=False, log=None)


def test_shards_take_disjoint_slices_and_the_last_one_merges_in_input_order(tiny, mixed, full_run, tmp_path):
    out = tmp_path / "out.jsonl"
    a = run_job(tiny, mixed, out, shard=Shard(1, 2), progress=False, log=None)
    assert a.merged is None and not out.exists()
    b = run_job(tiny, mixed, out, shard=Shard(0, 2), progress=False, log=None)
    assert b.merged == len(GOOD) + len(BAD) and a.records + b.records == b.merged
    merged = read_jsonl(out)
    assert [files.line_of(r) for r in merged] == sorted(files.line_of(r) for r in full_run[1])
    assert [masked(r) for r in merged] == sorted(map(masked, full_run[1]), key=files.line_of)
    assert main(["merge", "-o", str(out), "--num-shards", "2", "-i", str(mixed)]) == 0
    assert main(["merge", "-o", str(out), "--num-shards", "3"]) == 2  # no such parts


def test_the_engine_is_fed_as_it_drains(tiny):
    pulled = []

    def records():
        for i in range(40):
            pulled.append(i)
            yield parse_line(json.dumps(completion(f"r{i}", [1, 2, i + 3], max_tokens=2)), i + 1)

    seen = 0
    for r in results(tiny, records(), window=4):
        seen += 1
        assert len(pulled) - seen <= 4  # never more than the window waits in the engine
    assert seen == 40 and not tiny.engine.requests


def test_the_input_streams_from_disk(tmp_path):
    import tracemalloc

    path = tmp_path / "big.jsonl"
    pad = "x" * 1000  # 2 x 10^4 lines of ~1 KB: a 20 MB file
    with open(path, "w") as f:
        for i in range(20_000):
            f.write(json.dumps(completion(f"r{i}", [1, 2], suffix=pad)) + "\n")
    tracemalloc.start()
    try:
        n = sum(1 for _ in shard_records(path, Shard(1, 2)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 10_000 and peak < 6 << 20  # the custom_ids seen (for duplicates), never the file's 20 MB


def test_dry_run_validates_everything_and_runs_nothing(tiny, mixed):
    steps = tiny.engine.stats.steps
    out = io.StringIO()
    summary = dry_run(tiny, mixed, out=out, log=None)
    assert (summary.ok, summary.failed) == (len(GOOD), len(BAD))
    assert len(out.getvalue().splitlines()) == len(BAD) and tiny.engine.stats.steps == steps


def test_cli_dry_run_exits_1_and_prints_the_invalid_records(mixed, capsys):
    flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items()), [])
    assert main(["-i", str(mixed), "--model", "tiny", "--dry-run", *flags]) == 1
    captured = capsys.readouterr()
    printed = [json.loads(x) for x in captured.out.splitlines()]
    assert len(printed) == len(BAD) and f"{len(GOOD)} records valid, {len(BAD)} invalid" in captured.err


def test_shard_settings_are_checked():
    assert Shard.parse("1/3") == Shard(1, 3)
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(BatchError, match="--shard"):
            Shard.parse(bad)
    env = {"DEEPINFER_NUM_PROCESSES": "2", "DEEPINFER_PROCESS_ID": "1"}
    assert Shard.from_env(env) == Shard(1, 2) and Shard.from_env({}) is None
    with pytest.raises(BatchError, match="DEEPINFER_PROCESS_ID"):
        Shard.from_env({"DEEPINFER_NUM_PROCESSES": "2", "DEEPINFER_PROCESS_ID": "2"})
    with pytest.raises(BatchError, match="DEEPINFER_PROCESS_ID"):
        Shard.from_env({"DEEPINFER_NUM_PROCESSES": "2"})


def test_engine_settings_map_onto_engine_config_fields(capsys):
    p = argparse.ArgumentParser()
    add_engine_options(p)
    args = p.parse_args(["--max-num-seqs", "4", "--token-buckets", "32,256", "--enable-prefix-caching", "no",
                         "--max-model-len", "none", "--sharding", "cpu-dp2-ep4", "--compilation-cache", "off"])
    assert engine_settings(args) == {"max_num_seqs": 4, "token_buckets": (32, 256), "enable_prefix_caching": False,
                                     "max_model_len": None, "sharding": "cpu-dp2-ep4", "compilation_cache": False}
    for argv, needle in ((["--max-num-seqs", "four"], "--max-num-seqs"), (["--async-scheduling", "maybe"],
                                                                           "--async-scheduling"),
                         (["--no-such-setting", "1"], "unrecognized arguments")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert needle in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_settings(p.parse_args(["--max-num-seqs", "0"]))


def test_cli_usage_errors_exit_2_naming_the_problem(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", GOOD[:1])
    for argv, needle in ((["--max-num-seqs", "0"], "max_num_seqs"), (["--shard", "2/2"], "--shard"),
                         (["--max-records", "-1"], "--max-records")):
        assert main(["-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny", *argv]) == 2
        assert needle in capsys.readouterr().err
    assert main(["-i", str(src), "--model", "tiny"]) == 2 and "--output" in capsys.readouterr().err
    assert main(["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny",
                 "--no-progress", *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items()), [])]) == 2
    assert "is not a file" in capsys.readouterr().err


# ---- the chat protocols on the shipped model ------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CHAT = [
    ("/v1/chat/completions", "chat", {"messages": [{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": "Say hi."}],
                                      "max_tokens": 6, "temperature": 0, "thinking": {"type": "disabled"}}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "A city as JSON."}], "max_tokens": 8,
                                      "temperature": 0, "thinking": {"type": "disabled"},
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "c", "schema": SCHEMA}}}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                      "max_tokens": 8, "temperature": 0, "tools": [TOOL], "tool_choice": "required",
                                      "thinking": {"type": "disabled"}}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "Think."}], "max_tokens": 4,
                                      "seed": 7}),  # thinking on by default (sampled: seeded), runs out reasoning
    ("/v1/responses", "responses", {"input": "Say hi.", "max_output_tokens": 6, "temperature": 0,
                                    "reasoning": {"effort": "none"}}),
    ("/v1/messages", "messages", {"max_tokens": 6, "temperature": 0, "thinking": {"type": "disabled"},
                                  "messages": [{"role": "user", "content": "Say hi."}]}),
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                      "tool_choice": "required", "thinking": {"type": "disabled"}}),  # 400
    ("/v1/chat/completions", "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                                      "thinking": {"type": "disabled"}, "response_format": {"type": "regex",
                                                                                            "regex": "(["}}),  # 400
]


def test_chat_protocol_records_answer_as_llm_chat_does(tmp_path):
    llm = LLM(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
              chunking="tokens", use_tqdm=False)
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"c{i}", "method": "POST", "url": url,
                                               "body": {"model": "DeepSeek-V4.1-Flash", **body}}
                                              for i, (url, _, body) in enumerate(CHAT)])
    summary = run_job(llm, src, tmp_path / "out.jsonl", progress=False, log=None)
    assert (summary.ok, summary.failed) == (len(CHAT) - 2, 2)
    got = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    for i, (_, protocol, body) in enumerate(CHAT[:-2]):
        want = llm.chat({"model": "DeepSeek-V4.1-Flash", **body}, protocol)
        r = got[f"c{i}"]
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"] == r["response"]["body"]["id"]
        want = masked({"response": {"request_id": 0, "body": want}})["response"]["body"]
        assert no_cache(masked(r)["response"]["body"]) == no_cache(want), protocol  # LLM.chat ran second: a hit
    assert "warning" in got["c3"]["response"]["body"]  # the reasoning budget ran out, as LLM.chat says
    err = got[f"c{len(CHAT) - 2}"]["response"]
    assert err["status_code"] == 400 and err["body"]["error"]["param"] == "tool_choice"
    err = got[f"c{len(CHAT) - 1}"]["response"]  # a regex that does not compile: refused before anything runs
    assert err["status_code"] == 400 and err["body"]["error"]["param"] == "response_format"
    assert "invalid regex" in err["body"]["error"]["message"]
