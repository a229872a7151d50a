"""Start-up: the persistent compilation cache, lazy buckets, profiles fitted online and saved."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams, compile_cache
from deepinfer_jax.config import EngineConfig
from deepinfer_jax.engine.spec_policy import StepTimes
from deepinfer_jax.model.host_arrays import filled, to_device
from deepinfer_jax.runner import step_programs

# --- the compilation cache -------------------------------------------------------------------


def test_cache_directory_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "from-env"))
    assert compile_cache.resolve(str(tmp_path / "setting")) == tmp_path / "setting"  # the setting wins
    assert compile_cache.resolve() == tmp_path / "from-env"
    assert compile_cache.resolve(False) is None and compile_cache.resolve("off") is None
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve() is None
    with pytest.raises(ValueError, match="compilation_cache"):
        compile_cache.resolve(3)


@pytest.mark.parametrize("field, value", [("precompile", "eager"), ("compilation_cache", 3)])
def test_bad_start_up_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_engine_programs_compile_at_the_cpu_level_unless_xla_flags_or_the_variable_say_otherwise(monkeypatch):
    from deepinfer_jax import compile_options as co

    dots = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    level = lambda n: {"xla_backend_optimization_level": n, **dots}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    monkeypatch.delenv(co.ENV, raising=False)
    monkeypatch.delenv(co.YNN_ENV, raising=False)
    assert co.compiler_options() == level(co.DEFAULT_CPU_LEVEL) == level(1)
    assert co.compiler_options("gpu") is None  # other backends keep XLA's defaults
    f = co.jit(lambda x: x * 2)
    assert dict(f.lower(jnp.ones(3))._lowering._compiler_options_kvs) == level(1)
    monkeypatch.setenv(co.ENV, " 3 ")
    assert co.compiler_options() == level(3)
    monkeypatch.setenv(co.ENV, "default")
    assert co.compiler_options() == dots
    monkeypatch.setenv(co.YNN_ENV, "default")
    assert co.compiler_options() is None
    assert co.jit(lambda x: x * 2).lower(jnp.ones(3))._lowering._compiler_options_kvs == ()
    monkeypatch.setenv(co.YNN_ENV, "dots")
    monkeypatch.setenv(co.ENV, "0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")  # the user's own flag wins
    assert co.compiler_options() == dots
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2 --xla_cpu_experimental_ynn_fusion_type=-reduce")
    assert co.compiler_options() is None
    for bad in ("fast", "4", "-1"):
        monkeypatch.setenv(co.ENV, bad)
        with pytest.raises(ValueError, match=co.ENV):
            co.compiler_options()
    monkeypatch.setenv(co.ENV, "1")
    monkeypatch.setenv(co.YNN_ENV, "reduce")
    with pytest.raises(ValueError, match=co.YNN_ENV):
        co.compiler_options()


def test_engine_programs_leave_reductions_to_xla_and_dots_to_ynnpack(monkeypatch):
    """The option really reaches XLA:CPU: the mHC collapse's sum is XLA's own loop, the matmul stays a YNNPACK
    fusion; with ``DEEPINFER_XLA_CPU_YNN=default`` the sum is a YNNPACK fusion too (XLA's default list)."""
    from deepinfer_jax import compile_options as co

    if jax.default_backend() != "cpu":
        pytest.skip("the YNNPACK fusions are XLA:CPU's")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv(co.ENV, raising=False)

    def fusions(fn, *args):
        text = co.jit(fn).lower(*args).compile().as_text()
        return sorted({line.split('op_name="jit(')[1].split("/")[1].split('"')[0].split(" ")[0]
                       for line in text.splitlines() if "__ynn_fusion" in line and 'op_name="jit(' in line})

    collapse = lambda pre, streams: jnp.max(jnp.sum(pre[..., None] * streams, axis=2), axis=-1)
    matmul = lambda x, w: x @ w
    args = (jnp.ones((1, 64, 4)), jnp.ones((1, 64, 4, 128)))
    monkeypatch.delenv(co.YNN_ENV, raising=False)
    assert fusions(collapse, *args) == []
    assert fusions(matmul, jnp.ones((64, 128)), jnp.ones((128, 128))) == ["dot_general"]
    monkeypatch.setenv(co.YNN_ENV, "default")
    assert "reduce_max" in fusions(collapse, *args)


_CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from deepinfer_jax import compile_cache
    hits = []
    jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    compile_cache.enable(sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T + 1.0)
    f(np.ones((int(sys.argv[2]), 8), np.float32)).block_until_ready()  # numpy input: f is the only program
    print(json.dumps({"hits": len(hits)}))
""")


def _child(cache_dir, rows: int) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(cache_dir), str(rows)], capture_output=True, text=True,
                         check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.stdout.strip().splitlines()[-1])["hits"]


def test_a_second_process_loads_the_program_and_another_shape_does_not(tmp_path):
    assert _child(tmp_path, 4) == 0
    assert any(tmp_path.iterdir())
    assert _child(tmp_path, 4) == 1  # a fresh process: from the disk cache
    assert _child(tmp_path, 5) == 0  # another shape is another program


# --- lazy buckets and online profiles ----------------------------------------------------------

SETTINGS = dict(max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(8, 32), block_size=16, max_model_len=64,
                use_tqdm=False, speculation="none")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
PROMPTS = [{"prompt_token_ids": [0, 5, 9, 11, 20]}, {"prompt_token_ids": [0, 7, 3]}]
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_lazy_engine_compiles_on_first_use_then_never_again(tmp_path):
    lazy = LLM("tiny", chunking="tokens", cost_model_dir=str(tmp_path), **SETTINGS)
    traces = lazy.runner.traces
    first = lazy.generate(PROMPTS, SP, use_tqdm=False)
    assert lazy.runner.traces > traces  # the buckets compiled while generating
    traces = lazy.runner.traces
    again = lazy.generate(PROMPTS, SP, use_tqdm=False)
    assert lazy.runner.traces == traces, "a bucket compiled twice"
    eager = LLM("tiny", chunking="tokens", cost_model_dir=str(tmp_path), precompile="all", **SETTINGS)
    traces = eager.runner.traces
    want = eager.generate(PROMPTS, SP, use_tqdm=False)
    assert eager.runner.traces == traces
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    assert ids(first) == ids(again) == ids(want)


def test_lazy_start_of_the_shipped_model_compiles_one_small_program():
    """Putting the FP8/FP4 weights, the cache buffers and the speculation state on the device compiles
    nothing (``model.host_arrays``): with jax 0.10 each ``jnp.asarray`` of a host array was a program of its
    own, ~70 of them loaded or compiled at every start. Only the drafter's head rows remain."""
    compiled = []  # XLA compilations, or loads from the persistent cache (JAX times both as this event)
    listener = lambda event, secs, **kw: compiled.append(kw.get("fun_name")) if event == BACKEND_COMPILE else None
    traces = step_programs.TRACES[0]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, block_size=32, max_model_len=256, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert llm.speculation != "none" and llm.runner.traces == traces  # no step program either
    assert set(compiled) <= {"jit(_head_rows)"}, compiled  # (none if this process built it already)


def test_host_arrays_reach_the_device_with_the_bits_jnp_asarray_gives():
    rng = np.random.default_rng(0)
    f64 = rng.standard_normal((33, 7)) * 1e3
    cases = [(f64, None), (f64, jnp.bfloat16), (f64.astype(np.float32), jnp.bfloat16), (f64, jnp.float32),
             (rng.integers(-9, 9, (5, 3)), None), (rng.integers(0, 255, (4, 6)).astype(np.uint8), None),
             (f64.astype(np.float32), "bfloat16")]
    for x, dtype in cases:
        want, got = jnp.asarray(x, dtype), to_device(x, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), (x.dtype, dtype)
    assert filled((2, 3), jnp.float8_e4m3fn, 0).dtype == jnp.float8_e4m3fn
    assert np.asarray(filled((4,), jnp.int32, -1)).tolist() == [-1] * 4


def test_lazy_cost_model_is_fitted_online_saved_and_reloaded(tmp_path):
    llm = LLM("tiny", chunking="cost", cost_model_dir=str(tmp_path), **SETTINGS)
    path = llm._cost_model_path()
    assert not path.exists()  # nothing profiled at start-up
    traces = llm.runner.traces
    llm.generate([{"prompt_token_ids": [0, 5 + i, 9]} for i in range(6)], SamplingParams(temperature=0, max_tokens=16,
                                                                                        ignore_eos=True), use_tqdm=False)
    cm = llm.engine.cost_model
    assert cm.num_refits >= 1
    if llm.runner.traces > traces:  # steps that waited on a compilation were not observed
        assert cm.num_observed < llm.engine.stats.steps
    else:  # the programs were already in memory (an earlier test): every step counts
        assert cm.num_observed == llm.engine.stats.steps
    saved = json.loads(path.read_text())
    assert saved["meta"]["source"] == "online" and saved["coef"] == cm.coef.tolist()
    again = LLM("tiny", chunking="cost", cost_model_dir=str(tmp_path), **SETTINGS)
    assert again.engine.cost_model.coef.tolist() == cm.coef.tolist()


def test_unmeasured_step_times_take_their_first_sample_and_estimate_the_rest():
    draft = StepTimes((4, 8, 16))
    plain = StepTimes((4, 8, 16), fallback=draft)
    assert draft.time(8) == 8.0 and not any(draft.measured)  # relative units before any measurement
    draft.observe(8, 1000.0)
    assert draft.times[1] == 1000.0 and draft.measured == [False, True, False]
    assert draft.time(16) == pytest.approx(2000.0)  # proportional to the one measured bucket
    assert plain.time(8) == 1000.0  # no plain measurement yet: drafting looks free
    draft.observe(16, 1400.0)
    assert draft.time(4) == pytest.approx(800.0)  # the line through (8, 1000) and (16, 1400)
    draft.observe(8, 3000.0)
    assert draft.times[1] == pytest.approx(1100.0)  # measured: the moving average, one sample capped at 2x
    back = StepTimes.from_json(json.loads(json.dumps(draft.to_json())), (4, 8, 16))
    assert back.times == draft.times and back.measured == draft.measured
    with pytest.raises(ValueError, match="buckets"):
        StepTimes.from_json(draft.to_json(), (4, 8))


def test_lazy_buckets_pad_into_a_compiled_bucket_until_one_is_wanted_often():
    from deepinfer_jax.runner.buckets import BucketUse

    eager = BucketUse((8, 32, 64))
    assert [eager.choose(n, 4, 2)[0] for n in (8, 32, 8)] == [8, 32, 8]  # always the tightest bucket
    lazy = BucketUse((8, 32, 64), lazy=True, compile_after=3)
    assert lazy.choose(8, 4, 2) == (64, 2)  # nothing compiled: the largest, which every later step fits
    assert lazy.choose(32, 4, 2) == (64, 2) and lazy.choose(8, 4, 2) == (64, 2)
    assert lazy.choose(8, 4, 2) == (8, 2)  # the third want of 8 compiles it
    assert lazy.choose(8, 4, 2) == (8, 2) and lazy.choose(32, 4, 2) == (64, 2)
    assert lazy.choose(8, 2, 2) == (64, 2)  # another request width has its own compiled set
    assert lazy.compiled == {(64, 4, 2), (8, 4, 2), (64, 2, 2)}


def test_abstract_model_is_built_once_kept_on_disk_and_keyed_by_config(tmp_path, monkeypatch):
    from flax import nnx

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.model import abstract_cache
    from deepinfer_jax.model.deepseek_v41 import DeepseekV41

    cfg = ModelConfig.tiny()
    builds = []
    real = abstract_cache._build
    monkeypatch.setattr(abstract_cache, "_build", lambda c, k: builds.append(k) or real(c, k))
    monkeypatch.setattr(compile_cache, "cache_dir", lambda: tmp_path / "xla")
    abstract_cache._cached.cache_clear()
    g1, s1 = abstract_cache.abstract_model(DeepseekV41, cfg)
    files = list((tmp_path / "xla-graphs").iterdir())
    assert len(builds) == 1 and len(files) == 1
    abstract_cache._cached.cache_clear()  # a new process: read from disk, not rebuilt
    g2, s2 = abstract_cache.abstract_model(DeepseekV41, cfg)
    assert len(builds) == 1 and g2 == g1 and s2 is not s1
    assert jax.tree.leaves(s2) == jax.tree.leaves(s1)
    ref_g, ref_s = nnx.split(nnx.eval_shape(lambda: DeepseekV41(cfg, rngs=nnx.Rngs(0))))
    assert g2 == ref_g and jax.tree.leaves(s2) == jax.tree.leaves(ref_s)
    other = dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 2)  # another config: its own file
    abstract_cache.abstract_model(DeepseekV41, other)
    assert len(builds) == 2 and len(list((tmp_path / "xla-graphs").iterdir())) == 2
    files[0].write_bytes(b"not a pickle")  # a damaged file is rebuilt, not trusted
    abstract_cache._cached.cache_clear()
    assert abstract_cache.abstract_model(DeepseekV41, cfg)[0] == g1 and len(builds) == 3
    abstract_cache._cached.cache_clear()


def test_program_store_traces_once_per_machine_and_loads_the_same_program(tmp_path, monkeypatch):
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.runner.program_store import StoredJit

    monkeypatch.setattr(compile_cache, "cache_dir", lambda: tmp_path / "xla")
    monkeypatch.delenv("DEEPINFER_PROGRAM_STORE", raising=False)  # on by default
    traced, loaded = [], []

    def step(scale, state, x):
        traced.append(1)
        return {"state": {1: state[1] * scale + x.sum()}, "y": jnp.tanh(x) * scale}

    def make():
        return StoredJit(step, "toy", static_argnums=(0,), donate_argnums=(1,), on_build=lambda: loaded.append(1))

    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    first = make()(3, {1: jnp.ones(4)}, x)
    assert len(traced) == 1 and not loaded and len(list((tmp_path / "xla-programs").iterdir())) == 1
    again = make()  # a new process: the program comes from the file, nothing is traced
    state = {1: jnp.ones(4)}
    second = again(3, state, x)
    assert len(traced) == 1 and len(loaded) == 1
    assert state[1].is_deleted()  # the donation survives the stored form
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), first, second))
    again(3, {1: jnp.ones(4)}, x)
    assert len(traced) == 1 and len(loaded) == 1  # in memory now
    from deepinfer_jax.ops.dispatch import use_kernels

    with use_kernels("pallas_interpret"):  # the kernel selection is part of the key, as in jit's
        again(3, {1: jnp.ones(4)}, x)
    assert len(traced) == 2
    traced.pop()
    from deepinfer_jax.ops import dispatch
    from deepinfer_jax.runner import program_store

    before, impls = program_store._context(), dispatch.TABLE["mhc_mix"]
    monkeypatch.setitem(dispatch.TABLE, "mhc_mix", {**impls, "cpu": jnp.tanh})
    assert program_store._context() != before  # a kernel registered at run time selects another program
    monkeypatch.setitem(dispatch.TABLE, "mhc_mix", impls)
    assert program_store._context() == before
    again(4, {1: jnp.ones(4)}, x)  # another static argument
    again(3, {1: jnp.ones(4)}, x[:2])  # another shape
    assert len(traced) == 3 and len(list((tmp_path / "xla-programs").iterdir())) == 4
    for f in (tmp_path / "xla-programs").iterdir():
        f.write_bytes(b"damaged")
    make()(3, {1: jnp.ones(4)}, x)  # a damaged file is traced again, not trusted
    assert len(traced) == 4
    monkeypatch.setenv("DEEPINFER_PROGRAM_STORE", "off")
    make()(5, {1: jnp.ones(4)}, x)
    assert len(traced) == 5 and len(list((tmp_path / "xla-programs").iterdir())) == 4
    plain = jax.jit(step, static_argnums=(0,))(3, {1: jnp.ones(4)}, x)  # the plain jit computes the same
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), plain, second))


def test_stored_lowering_stores_the_public_jits_program_and_loads_it_in_a_new_process(tmp_path, monkeypatch):
    """``StoredLowering`` (``generate_ragged``'s store): a miss compiles through the public jit itself and stores
    it; a new process loads it without tracing, computes bit-identical results for other run-time values
    (a PRNG key, a dynamic keyword), and static arguments and shapes select files of their own. A compilation
    cache of its own (the suite's may answer the compile, and an answered compile is not stored)."""
    from deepinfer_jax.runner.program_store import StoredLowering

    monkeypatch.delenv("DEEPINFER_PROGRAM_STORE", raising=False)
    traced = []

    def jit():  # a new function each time, as in a new process (JAX shares traces between jits of one function)
        def fn(x, scale, key, *, count=1, negate=False):
            traced.append(1)
            y = (x * scale + jax.random.normal(key, x.shape)) * count
            return {"y": -y if negate else y, "n": count + 1}

        return jax.jit(fn, static_argnames=("scale", "negate")), fn

    make = lambda: StoredLowering(*jit(), "toy_lowering", ("scale", "negate"))
    plain = jit()[0]
    files = lambda: sorted((tmp_path / "xla-programs").iterdir())
    x, key = jnp.linspace(-1.0, 1.0, 6), jax.random.key(4)
    suite_cache, min_s = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        compile_cache.enable(str(tmp_path / "xla"))
        first = make()
        out = first(x, 2.0, key, count=3, negate=True)
        assert len(traced) == 1 and len(files()) == 1 and first.programs == 1
        # compiled as a user's own ``jax.jit(fn)`` is (its module, with the compilation cache on): that jit finds it
        assert "jit_fn" in {p.name.split("-")[0] for p in (tmp_path / "xla").iterdir()}
        again = make()  # a new process
        for count, k in ((3, key), (5, jax.random.key(9))):  # run-time values, the same program
            got, want = again(x, 2.0, k, count=count, negate=True), plain(x, 2.0, k, count=count, negate=True)
            assert np.array_equal(got["y"], want["y"]) and int(got["n"]) == count + 1
        assert np.array_equal(out["y"], again(x, 2.0, key, count=3, negate=True)["y"])
        assert len(traced) == 2 and again.programs == 1  # loaded: only the plain jit traced
        again(x, 3.0, key, count=3, negate=True)  # another static argument
        again(x[:4], 2.0, key, count=3, negate=True)  # another shape
        assert len(traced) == 4 and len(files()) == 3 and again.programs == 3
        monkeypatch.setenv("DEEPINFER_PROGRAM_STORE", "off")
        assert np.array_equal(make()(x, 2.0, key, count=3, negate=True)["y"], out["y"]) and len(files()) == 3
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
        compile_cache.enable(suite_cache)  # back to the suite's cache


def test_program_store_keeps_only_programs_compiled_in_this_process(tmp_path, monkeypatch):
    """A compile answered by the compilation cache is not stored (its executable does not serialize
    again faithfully on XLA:CPU); the program still runs, and a real compile of it is stored."""
    import jax.numpy as jnp

    from deepinfer_jax.runner.program_store import StoredJit

    monkeypatch.setattr(compile_cache, "cache_dir", lambda: tmp_path / "xla")
    monkeypatch.delenv("DEEPINFER_PROGRAM_STORE", raising=False)
    hit = [True]

    def step(x):
        if hit[0]:  # what JAX reports when the compilation cache answers the compile
            jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return jnp.cos(x) * 2

    x = jnp.arange(6.0)
    assert np.allclose(StoredJit(step, "hit")(x), np.cos(np.arange(6.0)) * 2)
    assert not (tmp_path / "xla-programs").exists()
    hit[0] = False
    StoredJit(step, "hit")(x)
    assert len(list((tmp_path / "xla-programs").iterdir())) == 1


def test_program_store_compiles_its_programs_without_the_compilation_cache(tmp_path, monkeypatch):
    """A store miss compiles for real (the compilation cache neither answers nor keeps that compile), so a
    program the compilation cache already holds, e.g. after an upgrade of the package, is stored once instead
    of being traced and lowered again by every warm process; and the compiles after it use the cache again,
    whichever came first (JAX decides at the first compile after a reset of its cache, and a store compile
    first once left the cache off for the rest of the process)."""
    from deepinfer_jax.runner.program_store import StoredJit

    monkeypatch.delenv("DEEPINFER_PROGRAM_STORE", raising=False)
    seen = []

    def step(k):
        def fn(x):
            seen.append(jax.config.jax_enable_compilation_cache)
            return jnp.sin(x) * k + 1
        return fn

    suite_cache, min_s = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    before = jax.config.jax_enable_compilation_cache
    entries = lambda d: sorted(p.name for p in d.iterdir() if p.name.startswith("jit_"))
    x4, x5, x6 = (jnp.asarray(np.arange(n, dtype=np.float32)) for n in (4, 5, 6))  # no compile of their own
    try:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        for first_store, d in ((True, tmp_path / "a" / "xla"), (False, tmp_path / "b" / "xla")):
            compile_cache.enable(str(d))  # a new directory: JAX's cache is reset, the next compile decides
            if not first_store:
                jax.jit(step(3.0))(x4)
            n = len(entries(d))
            StoredJit(step(2.0), "uncached")(x5)
            assert seen[-1] is False and len(entries(d)) == n, entries(d)  # not in the compilation cache
            assert len(list((d.parent / "xla-programs").iterdir())) == 1  # but in the store
            jax.jit(step(5.0))(x6)
            assert seen[-1] == before and len(entries(d)) == n + 1, entries(d)  # later compiles are cached again
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
        compile_cache.enable(suite_cache)  # back to the suite's cache
    assert jax.config.jax_enable_compilation_cache == before


def test_program_log_prefetches_what_the_configuration_used_last_and_survives_a_damaged_manifest(tmp_path,
                                                                                                   monkeypatch):
    from deepinfer_jax.runner import program_store
    from deepinfer_jax.runner.program_store import ProgramLog, StoredJit

    monkeypatch.setattr(compile_cache, "cache_dir", lambda: tmp_path / "xla")
    monkeypatch.delenv("DEEPINFER_PROGRAM_STORE", raising=False)
    traced, loaded = [], []

    def step(x):
        traced.append(1)
        return jnp.sin(x) * 3

    make = lambda log: StoredJit(step, "toy", on_build=lambda: loaded.append(1), log=log)
    x = jnp.arange(8.0)
    first = make(ProgramLog("engine A"))(x)
    [stored] = [f for f in (tmp_path / "xla-programs").iterdir() if f.suffix == ".bin"]
    log = ProgramLog("engine A")  # a new process with the same configuration
    assert log.entries() == [[stored.name, jax.devices()[0].id]]
    assert ProgramLog("engine B").prefetch() == 0 and stored not in program_store._prefetched  # another one
    assert log.prefetch() == 1 and stored in program_store._prefetched
    assert log.prefetch() == 0  # already loading
    second = make(log)(x)  # takes the prefetched program: nothing traced, nothing left pending
    assert len(traced) == 1 and len(loaded) == 1 and stored not in program_store._prefetched
    assert np.array_equal(np.asarray(first), np.asarray(second))

    manifest = log.path()
    manifest.write_text("{not json")  # damaged: nothing to prefetch, and the next use rewrites it
    damaged = ProgramLog("engine A")
    assert damaged.entries() == [] and damaged.prefetch() == 0
    make(damaged)(x)
    assert json.loads(manifest.read_text()) == [[stored.name, jax.devices()[0].id]]
    manifest.write_text(json.dumps([["toy-gone.bin", 0], [stored.name, 12345]]))  # a deleted file, a foreign device
    assert ProgramLog("engine A").prefetch() == 0
    monkeypatch.setattr(program_store, "_prefetched", type(program_store._prefetched)())
    for i in range(program_store._PREFETCH_KEPT + 3):  # loads nobody takes are dropped, oldest first
        twin = tmp_path / "xla-programs" / f"toy-twin{i}.bin"
        twin.write_bytes(stored.read_bytes())
        manifest.write_text(json.dumps([[twin.name, jax.devices()[0].id]]))
        assert ProgramLog("engine A").prefetch() == 1
    assert len(program_store._prefetched) == program_store._PREFETCH_KEPT and twin in program_store._prefetched
    monkeypatch.setenv("DEEPINFER_PROGRAM_STORE", "off")
    assert ProgramLog("engine A").path() is None and ProgramLog("engine A").prefetch() == 0


def test_a_second_engine_of_the_same_settings_prefetches_its_step_programs(tmp_path, monkeypatch):
    """End to end through ``LLM``, in the suite's store (the programs may be there already: the engine's settings are
    ``test_lazy_engine_compiles_on_first_use_then_never_again``'s), with a manifest of its own: a cost-model directory
    no other engine uses makes the settings, and so the manifest's name, new."""
    from deepinfer_jax.runner import program_store

    taken = []
    take = program_store._take_prefetched
    monkeypatch.setattr(program_store, "_take_prefetched", lambda path: taken.append(take(path)) or taken[-1])
    monkeypatch.setattr(program_store, "_prefetched", collections.OrderedDict())  # none left by earlier engines
    own = {**SETTINGS, "chunking": "tokens", "cost_model_dir": str(tmp_path)}
    first = LLM("tiny", **own)
    assert first.program_log.entries() == []  # no engine of these settings ran before: nothing to prefetch
    want = first.generate(PROMPTS, SP, use_tqdm=False)
    assert len(first.program_log.entries()) >= 2  # the step's forward and sample programs, at least
    assert not any(t is not None for t in taken)
    again = LLM("tiny", **own)  # started loading them before the checkpoint
    got = again.generate(PROMPTS, SP, use_tqdm=False)
    assert sum(t is not None for t in taken) >= 2, taken
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert LLM("tiny", **{**own, "max_num_seqs": 3}).program_log.path() != first.program_log.path()


def test_lazy_block_buckets_pad_into_a_compiled_wider_table_until_one_is_wanted_often():
    from deepinfer_jax.runner.buckets import BucketUse

    eager = BucketUse((8, 64), blocks=(2, 8, 32))
    assert [eager.choose(8, 1, b) for b in (2, 32, 8)] == [(8, 2), (8, 32), (8, 8)]  # always the narrowest
    lazy = BucketUse((8, 64), lazy=True, compile_after=3, blocks=(2, 8, 32))
    assert lazy.choose(8, 1, 2) == (64, 32)  # nothing compiled: the largest of both, which every step fits
    assert lazy.choose(8, 1, 8) == (64, 32) and lazy.choose(8, 1, 8) == (64, 32)
    assert lazy.choose(8, 1, 8) == (8, 8)  # the third want compiles the tight shape
    assert lazy.choose(8, 1, 2) == (8, 8)  # the fewest tokens, then the narrowest table that fits
    assert lazy.choose(64, 1, 2) == (64, 32) and lazy.choose(8, 1, 32) == (64, 32)
    assert lazy.compiled == {(64, 1, 32), (8, 1, 8)}
