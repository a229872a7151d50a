"""Batch jobs across processes: ``kill -9`` mid-job then a re-run, two shard processes, Ray Data with 2 actors.

One module fixture starts, at once, the CLI on a file of greedy records (killed with SIGKILL once some
results exist, then re-run to completion: the single-process reference) and two shard processes of the
same file (one with ``--shard 0/2``, one given its slice by ``DEEPINFER_PROCESS_ID`` /
``DEEPINFER_NUM_PROCESSES``; the last to finish merges). Greedy outputs do not depend on the batch, so
the shards' merged results and Ray Data's equal the reference record for record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
# one step shape (a bucket each): every process loads one compiled program from the persistent cache
SETTINGS = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=128, chunking="tokens",
                speculation="none", token_buckets="32", request_buckets="4")
N = 32


def records():
    return [{"custom_id": f"r{i:02d}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": [1 + i % 7, 2 + i % 5, 3 + i, 4], "max_tokens": 6, "temperature": 0}}
            for i in range(N)]


def cli(src, out, *extra, env=None):
    flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in SETTINGS.items()), [])  # as a user types them
    log = open(f"{out}.log", "ab")  # the shards share one log
    return subprocess.Popen([sys.executable, "-m", "deepinfer_jax.batch", "-i", str(src), "-o", str(out), "--model",
                             "tiny", "--no-progress", *flags, *extra], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT)


def lines(path):
    return Path(path).read_text().splitlines() if Path(path).exists() else []


def strip(record):
    """A result without what differs run to run (ids, timestamps)."""
    body = dict(record["response"]["body"])
    for key in ("id", "created"):
        body.pop(key)
    return record["custom_id"], body


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch_procs")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records()))
    single, sharded = tmp / "single.jsonl", tmp / "sharded.jsonl"
    killed = cli(src, single)
    shards = [cli(src, sharded, "--shard", "0/2"),
              cli(src, sharded, env={"DEEPINFER_NUM_PROCESSES": "2", "DEEPINFER_PROCESS_ID": "1"})]
    t0 = time.time()
    while not lines(single) and killed.poll() is None and time.time() - t0 < TIMEOUT_S:
        time.sleep(0.005)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    at_kill = lines(single)
    rerun = cli(src, single)
    try:
        for p in [rerun, *shards]:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in [rerun, *shards]:
            if p.poll() is None:
                p.kill()
    logs = {name: Path(f"{path}.log").read_text() for name, path in (("single", single), ("sharded", sharded))}
    assert rerun.returncode == 0 and all(p.returncode == 0 for p in shards), logs
    return {"at_kill": at_kill, "killed_rc": killed.returncode, "single": lines(single), "sharded": lines(sharded),
            "logs": logs, "src": src, "tmp": tmp}


def test_kill_9_mid_job_then_a_rerun_gives_every_record_exactly_once(runs):
    assert runs["killed_rc"] == -signal.SIGKILL
    assert 0 < len(runs["at_kill"]) < N, "the job was not killed in the middle"
    got = [json.loads(x) for x in runs["single"]]  # every line parses: no torn line
    assert sorted(r["custom_id"] for r in got) == [f"r{i:02d}" for i in range(N)]
    assert all(r["response"]["status_code"] == 200 for r in got)
    assert runs["single"][: len(runs["at_kill"])] == runs["at_kill"]  # what was there is kept, not redone
    assert f"resuming: {len(runs['at_kill'])} records already in" in runs["logs"]["single"]


def test_two_shard_processes_merge_to_the_single_process_results_in_input_order(runs):
    merged = [json.loads(x) for x in runs["sharded"]]
    assert [r["custom_id"] for r in merged] == [f"r{i:02d}" for i in range(N)]
    assert [strip(r) for r in merged] == sorted(strip(json.loads(x)) for x in runs["single"])
    assert "merged 2 parts" in runs["logs"]["sharded"]


def test_ray_data_with_two_actors_gives_the_cli_results(runs):
    ray = pytest.importorskip("ray")
    from deepinfer_jax.batch import ray_map

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        ds = ray.data.read_text(str(runs["src"]))
        settings = {**SETTINGS, "token_buckets": (32,), "request_buckets": (4,)}
        out = ray_map(ds, model="tiny", concurrency=2, batch_size=12, num_cpus=0.5, **settings).take_all()
    finally:
        ray.shutdown()
    assert len(out) == N and all(row["ok"] for row in out)
    got = sorted(strip(json.loads(row["output"])) for row in out)
    assert got == sorted(strip(json.loads(x)) for x in runs["single"])
