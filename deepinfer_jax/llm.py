"""``LLM``: the offline facade, in the shape vLLM users know.

    llm = LLM()                                   # the shipped checkpoint (checkpoints/small-trained,
                                                  # package data in a wheel: docs/packaging.md)
    llm = LLM("path/to/hf_dir", max_num_seqs=16)   # a Hugging Face-format V4.1 directory
    llm = LLM("tiny")                             # a preset config with seeded random weights
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0.7, max_tokens=32))

Keyword settings map 1:1 onto ``EngineConfig`` fields. Start-up loads the weights, compiles every
step bucket, and (``chunking="cost"``) fits the step-time model, from the disk cache when this
configuration was profiled on this machine before.

Speculative decoding (``speculation``, engine.md §2.3) is on by default when the checkpoint ships a
DSpark drafter (``drafter.safetensors`` or ``mtp.*`` tensors), as the default checkpoint does: the
runner then holds the speculative step component (``runner.spec_step``) and the engine plans each step's
verification with the confidence-driven budget, whose step times it profiles once per token bucket at start-up.

Weights stay resident in the checkpoint's FP8/FP4 formats by default (``weights="auto"``: quantized
for a quantized checkpoint on one device; ``"float32"`` / ``"bfloat16"`` decode at load; docs/residency.md).

``LLM(..., sharding="cpu-dp2-ep4")`` (a preset name, a preset ``.toml`` path or a ``ShardingPreset``)
runs over a device mesh: parameters placed by the sharding rules (routed experts over ``ep``), one
KV cache and scheduler per attention DP rank (``engine.core.EngineCore``,
``runner.ModelRunner`` over the mesh); ``EngineConfig.sharding`` says what it needs and refuses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from deepinfer_jax import compile_cache
from deepinfer_jax.cache.block_hash import extra_keys, model_fingerprint
from deepinfer_jax.cache.block_store import FileBlockStore, HostBlockStore, StoreError
from deepinfer_jax.config import CacheConfig, EngineConfig, ModelConfig, yoco_keep_tokens
from deepinfer_jax.config.shipped import shipped
from deepinfer_jax.engine import EngineCore, RequestError, RequestOutput, SamplingParams, Scheduler
from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.profiling import profile_cost_model, profile_step_times
from deepinfer_jax.engine.structured import LLGuidanceBackend, StructuredOutputs
from deepinfer_jax.runner import Buckets, ModelRunner, SampleSpec
from deepinfer_jax.runner.program_store import ProgramLog
from deepinfer_jax.runner.buckets import block_buckets
from deepinfer_jax.tokenizer import load_tokenizer

__all__ = ["DEFAULT_CHECKPOINT", "LLM", "PRESETS"]

#: The shipped checkpoint: the wheel's copy (package data), else the checkout's ``checkpoints/small-trained``.
DEFAULT_CHECKPOINT = shipped("checkpoints/small-trained")
#: Preset names: a config with seeded random weights (``init_params(cfg, seed=0)``).
PRESETS = {"tiny": ModelConfig.tiny, "small": ModelConfig.small}
_DEFAULT_MAX_MODEL_LEN = 2048


def _resolve_weights(weights, dtype: str, preset=None) -> str:
    """The ``weights`` setting for a checkpoint load: None follows ``dtype`` (``"auto"`` unless bfloat16).
    Sharded (``preset``, a ``ShardingPreset``) ``"auto"`` becomes ``dtype``; ``"quantized"`` runs over attention
    data parallelism and the engine's EP MoE, and is refused with any other split (``WeightsError``)."""
    from deepinfer_jax.checkpoint.residency import WeightsError, check_weights

    weights = check_weights(weights if weights is not None else ("auto" if dtype == "float32" else dtype))
    if preset is not None and weights == "quantized":
        from deepinfer_jax.runner.model_runner import quantized_split_ok

        if not quantized_split_ok(preset):
            raise WeightsError(f"quantized residency runs on one device, over attention data parallelism and with the "
                               f"engine's EP MoE; the preset {preset.name!r} "
                               f"({dict(zip(preset.axes, preset.shape))}) splits tensors, the context or experts "
                               "without EPLB: use weights='float32' or 'bfloat16' (or 'auto', float when sharded)")
    return dtype if preset is not None and weights == "auto" else weights


def _load_model(model, dtype: str, weights: str = "float32"):
    """(config, params, checkpoint dir or None); ``weights`` resolved by ``_resolve_weights``."""
    if model is None:
        if not DEFAULT_CHECKPOINT.is_dir():
            raise FileNotFoundError(f"the shipped checkpoint is missing: {DEFAULT_CHECKPOINT}")
        model = DEFAULT_CHECKPOINT
    if isinstance(model, str) and model in PRESETS:
        from deepinfer_jax.params import init_params

        cfg = PRESETS[model]()
        return cfg, init_params(cfg, seed=0), None
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model: {model!r} is neither a preset {sorted(PRESETS)} nor a checkpoint directory")
    from deepinfer_jax.checkpoint import load_hf_checkpoint

    cfg, params = load_hf_checkpoint(path, dtype=dtype, weights=weights)
    return cfg, params, path


def _weights_resident(params) -> str:
    """``"quantized"`` when any parameter leaf is a ``QWeight``, else the float dtype of the head."""
    from deepinfer_jax.model.qweight import QWeight

    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, QWeight))
    if any(isinstance(leaf, QWeight) for leaf in leaves):
        return "quantized"
    return str(jax.tree_util.tree_leaves(params["head"])[0].dtype)


def _token_buckets(ec: EngineConfig, k: int) -> tuple[int, ...]:
    """Default token buckets: one decode token per sequence and the step budget; with speculation also
    steps verifying about 1, 2 and k drafts per sequence (the budget lands in these)."""
    n, cap = ec.max_num_seqs, ec.max_num_batched_tokens
    sizes = {n, cap}
    if k:
        sizes |= {min(cap, n * m) for m in (2, 3, k + 1)}
    return tuple(sorted(sizes))


def _bar_progress(bar):
    """A ``progress(i, total)`` callback that drives a tqdm bar (its total known from the first call)."""
    def tick(i, n):
        bar.total = n
        bar.n = i
        bar.refresh()
    return tick


def _atomic_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent engines never read half a file
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class LLM:
    """An offline engine over one model. See the module docstring."""

    def __init__(self, model: str | os.PathLike | None = None, *, params=None, config: ModelConfig | None = None,
                 drafter=None, dtype: str = "float32", weights: str | None = None, use_tqdm: bool = True,
                 **settings) -> None:
        unknown = sorted(set(settings) - set(EngineConfig.fields()))
        if unknown:
            raise TypeError(f"unknown engine settings {unknown}; see EngineConfig for the fields")
        ec = EngineConfig(**settings)
        t_start = time.perf_counter()
        self.compilation_cache_dir = compile_cache.enable(ec.compilation_cache)
        # the step programs an engine of these arguments used last time start loading now, beside the checkpoint
        self.program_log = ProgramLog(repr((None if model is None else str(model), config, dtype, weights,
                                            params is None, drafter is None, ec)))
        self.program_log.prefetch()
        self.sharding_preset = self.mesh = None
        if ec.sharding is not None:  # a bad preset or too few devices fail here, before anything loads
            from deepinfer_jax import sharding as sh

            sh.init_distributed()  # several processes: from DEEPINFER_COORDINATOR etc.; a no-op when unset
            self.sharding_preset = sh.resolve_preset(ec.sharding)
            self.sharding_preset.validate_engine()  # the EP MoE's layout (eplb.enabled)
            if self.sharding_preset.context_parallel and ec.speculation in ("fixed", "dspark"):
                raise ValueError(f"speculation={ec.speculation!r} is not supported with a context-parallel preset "
                                 f"({self.sharding_preset.name!r}); set speculation='none' (docs/context_parallel.md)")
            self.mesh = sh.make_mesh(self.sharding_preset)
            if ec.chunking == "cost" and jax.process_count() > 1:  # timed decisions would differ between processes
                raise ValueError("chunking: 'cost' chunking is not supported over several processes; use 'tokens'")
        if params is not None:
            if config is None:
                raise ValueError("config: pass the ModelConfig together with params")
            cfg, ckpt = config, None
        else:
            weights = _resolve_weights(weights, dtype, self.sharding_preset)
            cfg, params, ckpt = _load_model(model, dtype, weights)
        if self.sharding_preset is not None:
            self.sharding_preset.validate_for(cfg)  # the routed experts divide over the EP ranks
        self.model_config, self.engine_config, self.params = cfg, ec, params
        self.weights_resident = _weights_resident(params)
        self.checkpoint_dir = ckpt
        if drafter is None and ckpt is not None and ec.speculation != "none":
            from deepinfer_jax.checkpoint import load_hf_drafter

            drafter = load_hf_drafter(ckpt, cfg, dtype=dtype)
        self.drafter = drafter
        self.speculation = self._speculation(ec, drafter)
        self.tokenizer = load_tokenizer(ckpt)
        self._prompt_tokenizer = self._parser_tokenizer = None

        bs = ec.block_size
        max_len = ec.max_model_len or min(cfg.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        mbpr = ec.max_blocks_per_request or math.ceil(max_len / bs)
        max_len = min(max_len, mbpr * bs)
        cache_cfg = CacheConfig(block_size=bs, num_blocks=ec.num_blocks or ec.max_num_seqs * mbpr,
                                max_requests=ec.max_num_seqs, max_blocks_per_request=mbpr, storage=ec.kv_storage)
        k = cfg.dspark_block_size if self.speculation != "none" else 0
        if k and ec.num_speculative_tokens is not None and ec.num_speculative_tokens > k:
            raise ValueError(f"num_speculative_tokens must be at most the drafter's block size {k}, "
                             f"got {ec.num_speculative_tokens}")
        if k and cache_cfg.spec_slack < k:
            raise ValueError(f"speculation needs the cache's spec_slack ({cache_cfg.spec_slack}) >= dspark_block_size {k}")
        if ec.block_buckets and ec.block_buckets[-1] != mbpr:
            raise ValueError(f"block_buckets must end at max_blocks_per_request ({mbpr}), got {ec.block_buckets}")
        buckets = Buckets(tokens=ec.token_buckets or _token_buckets(ec, k), requests=ec.request_buckets or (ec.max_num_seqs,),
                          blocks=ec.block_buckets or block_buckets(mbpr, bs))
        self.max_model_len, self.cache_config, self.buckets = max_len, cache_cfg, buckets

        extra = extra_keys(self.fingerprint(), ec.cache_salt) if ec.enable_prefix_caching else None
        host_store = HostBlockStore(ec.host_store_bytes) if extra is not None and ec.host_store_bytes else None
        file_store = None
        if extra is not None and ec.block_store is not None:
            try:
                file_store = FileBlockStore(ec.block_store, self.fingerprint())
            except StoreError as e:
                if not ec.block_store_fallback:
                    raise
                logging.getLogger(__name__).warning("%s; running without a block store", e)
        t0 = time.perf_counter()
        spec = {}  # the speculative step component; a cp preset adds the context-parallel one itself
        if self.speculation != "none":
            from deepinfer_jax.checkpoint.draft_vocab import load_draft_vocab

            spec = dict(drafter=drafter, draft_vocab=load_draft_vocab(ckpt, cfg.vocab_size, ec.draft_vocab_size))
        mesh = {} if self.sharding_preset is None else dict(mesh=self.mesh, preset=self.sharding_preset)
        self.runner = ModelRunner(cfg, params, cache_cfg, buckets, num_top_logprobs=ec.max_logprobs,
                                  decoder_replay=ec.decoder_replay, program_log=self.program_log, **mesh, **spec)
        self._online_saves: dict[str, Path] = {}  # profiles fitted online, saved after each generate
        self.runner.bucket_use.lazy = ec.precompile == "lazy"
        if ec.precompile == "all":
            with tqdm(desc="compiling step buckets", unit="bucket", disable=not use_tqdm) as bar:
                self.runner.precompile(sampling=True, progress=_bar_progress(bar))
        self.compile_s = time.perf_counter() - t0
        cost_model = self._cost_model(use_tqdm) if ec.chunking == "cost" else None
        make_scheduler = lambda: Scheduler(
            num_blocks=cache_cfg.num_blocks, block_size=bs, max_blocks_per_request=mbpr, max_num_seqs=ec.max_num_seqs,
            max_model_len=max_len, max_num_batched_tokens=ec.max_num_batched_tokens, chunking=ec.chunking,
            cost_model=cost_model, step_budget_ns=ec.step_budget_ns, prefix_extra=extra,
            ring_rows=cache_cfg.ring_capacity(cfg), swa_snapshot_entries=ec.swa_snapshot_entries,
            encoder_replay=ec.encoder_replay, replay_tokens=ec.replay_tokens or cfg.sliding_window,
            host_store=host_store, file_store=file_store,
            decoder_keep=yoco_keep_tokens(ec.yoco_keep_tokens) if ec.decoder_replay else None, spec_tokens=k,
            cp_threshold=self._cp_threshold(ec))
        structured = StructuredOutputs(LLGuidanceBackend(self.tokenizer, cfg.vocab_size, cfg.eos_token_id),
                                       overlap=ec.structured_output_overlap)
        spec = self._spec_decoding(k, use_tqdm) if k else None
        # one scheduling domain per attention DP rank (one device, and a context-parallel preset: one)
        self.engine = EngineCore(self.runner, [make_scheduler() for _ in range(self.runner.dp_size)],
                                 tokenizer=self.tokenizer, eos_token_id=cfg.eos_token_id, seed=ec.seed,
                                 async_scheduling=ec.async_scheduling, max_logprobs=ec.max_logprobs,
                                 structured=structured, spec=spec, dp_match_floor_ns=ec.dp_match_floor_ns)
        self.ready_s = time.perf_counter() - t_start

    def _cp_threshold(self, ec: EngineConfig) -> int:
        """Prompt tokens from which a request prefills by context parallelism (0 = never; no cp preset: 0)."""
        preset = self.sharding_preset
        if preset is None or not preset.context_parallel:
            return 0
        if ec.cp_threshold is not None:
            return ec.cp_threshold
        return preset.cp_threshold or 2 * ec.max_num_batched_tokens

    @staticmethod
    def _speculation(ec: EngineConfig, drafter) -> str:
        """The speculation mode this engine runs: "auto" resolved, the others checked against the model."""
        mode = ec.speculation
        if mode == "auto":  # the dynamic budget, which decodes plainly whenever verifying would not pay
            return "dspark" if drafter is not None and ec.sharding is None else "none"
        if mode != "none" and drafter is None:
            raise ValueError(f"speculation={mode!r} needs a DSpark drafter: the checkpoint has none "
                             f"(drafter.safetensors or mtp.* tensors), pass drafter= or set speculation='none'")
        return mode

    def _spec_decoding(self, k: int, use_tqdm: bool):
        """The verification policy with its step-time table (profiled per token bucket)."""
        from deepinfer_jax.engine.spec_decode import SpecDecoding
        from deepinfer_jax.engine.spec_policy import AcceptanceStats, StepTimes, make_policy

        times = plain = search = None
        if self.speculation == "dspark":  # step times with and without the drafter, per token bucket, for
            # steps whose sampling searches top-p / top-k thresholds over every logit row and for the others
            times, plain, *search = self._step_time_tables(use_tqdm)
            search = tuple(search)
        ntok = self.engine_config.num_speculative_tokens
        if ntok is None:  # "auto": seeded requests decode plainly unless a fixed count is asked for
            ntok = 0 if self.engine_config.speculation == "auto" else 3
        stats = AcceptanceStats(k)
        policy = make_policy(self.speculation, k=k, num_speculative_tokens=ntok, times=times, stats=stats,
                             plain_times=plain)
        step = self.runner.speculation
        if self.engine_config.speculation == "auto" and self.engine_config.precompile == "lazy":
            step.defer_drafting()  # the drafter's program waits until it is stored or wanted often (one device)
        return SpecDecoding(policy, k, times or StepTimes(self.buckets.tokens), stats, plain, search_times=search,
                            can_draft=step.can_draft)

    def _step_time_tables(self, use_tqdm: bool) -> list:
        """[drafting, plain, drafting with search, plain with search] ``StepTimes``: from the disk cache
        (keyed like the cost model), else profiled (``precompile="all"``) or measured online from the
        real steps (``"lazy"``: saved after each ``generate``)."""
        from deepinfer_jax.engine.spec_policy import StepTimes

        path = self._profile_path("spec_times")
        buckets = self.buckets.tokens
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                data, profiled = saved["tables"], saved.get("source") == "profiled"
                tables = []
                for i, d in enumerate(data):
                    tables.append(StepTimes.from_json(d, buckets, fallback=tables[i - 1] if i % 2 else None))
                if len(tables) == 4:
                    if self.engine_config.precompile == "lazy" and not all(t.fully_measured for t in tables):
                        self._online_saves["spec_times"] = path
                    if self.engine_config.precompile == "lazy" or profiled:  # "all" profiles over online fits
                        return tables
            except (ValueError, KeyError, TypeError, OSError):
                pass  # a damaged or foreign file: measure again
        if self.engine_config.precompile == "lazy":
            draft, search_draft = StepTimes(buckets), StepTimes(buckets)
            self._online_saves["spec_times"] = path
            return [draft, StepTimes(buckets, fallback=draft), search_draft, StepTimes(buckets, fallback=search_draft)]
        nb = len(buckets)
        with tqdm(desc="profiling step times", unit="step", disable=not use_tqdm, total=4 * nb) as bar:
            tick = lambda *_: bar.update(1)
            runner = self.runner if self.sharding_preset is None else self.runner.every_rank()  # a DP step: all ranks
            prof = lambda draft, sp=None: StepTimes(buckets, profile_step_times(
                runner, progress=tick, draft=draft, sample=sp))
            top_p = SampleSpec(temperature=1.0, top_p=0.95)
            tables = [prof(True), prof(False), prof(True, top_p), prof(False, top_p)]
        _atomic_json(path, {"tables": [t.to_json() for t in tables], "source": "profiled"})
        return tables

    def save_profiles(self) -> None:
        """Write what a lazily started engine fitted online (cost model, step-time tables) to the profile
        cache; ``generate`` calls it after each call, other drivers of ``llm.engine`` after their work."""
        for what, path in list(self._online_saves.items()):
            try:
                if what == "cost_model":
                    cm = self.engine.cost_model
                    if cm is not None and cm.num_refits:
                        cm.save(path, {"jax": jax.__version__, "source": "online"})
                elif what == "spec_times":
                    spec = getattr(self.engine, "spec", None)
                    if spec is not None:
                        tables = [spec.times, spec.plain_times, *(spec.search_times or ())]
                        if len(tables) == 4 and any(any(t.measured) for t in tables):
                            _atomic_json(path, {"tables": [t.to_json() for t in tables], "source": "online"})
            except OSError as e:
                logging.getLogger(__name__).warning("could not save the %s profile to %s: %s", what, path, e)

    def fingerprint(self) -> bytes:
        """The model fingerprint in every block digest: the config and every weight's bytes."""
        if getattr(self, "_fingerprint", None) is None:
            flat, _ = jax.tree_util.tree_flatten_with_path(self.params)
            leaves = [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]
            self._fingerprint = model_fingerprint(self.model_config.to_hf_config(), leaves)
        return self._fingerprint

    # ---- cost model ----
    def _cost_model_path(self) -> Path:
        return self._profile_path("cost_model")

    def _profile_path(self, what: str) -> Path:
        """Where a start-up profile of this model, cache layout, buckets and machine is cached."""
        root = Path(self.engine_config.cost_model_dir or Path.home() / ".cache" / "deepinfer_jax" / "cost_model")
        dev = jax.devices()[0]
        key = json.dumps([repr(self.model_config), repr(self.cache_config), repr(self.buckets), jax.__version__,
                          self.weights_resident,
                          dev.platform, dev.device_kind, platform.machine(), platform.node(), os.cpu_count()]
                         + ([] if self.sharding_preset is None else [repr(self.sharding_preset)]))
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        return root / (f"{name}.json" if what == "cost_model" else f"{name}.{what}.json")

    def _cost_model(self, use_tqdm: bool) -> CostModel:
        ec = self.engine_config
        path = self._cost_model_path()
        if path.is_file():
            try:
                model = CostModel.load(path)
                online = json.loads(path.read_text()).get("meta", {}).get("source") == "online"
                if not online or ec.precompile == "lazy" or not ec.profile_steps:
                    return model  # "all" profiles over a model that was only fitted online
            except (ValueError, KeyError, OSError):
                pass  # a damaged cache file: profile again
        if not ec.profile_steps or ec.precompile == "lazy":  # a token-proportional guess, refitted online
            if ec.precompile == "lazy":
                self._online_saves["cost_model"] = path
            per_token = ec.step_budget_ns / ec.max_num_batched_tokens
            return CostModel((0.0, per_token, 0.0, 0.0))
        with tqdm(desc="profiling step cost", unit="step", disable=not use_tqdm) as bar:
            runner = self.runner if self.sharding_preset is None else self.runner.every_rank()
            model, _steps, _times = profile_cost_model(runner, max_tokens=ec.max_num_batched_tokens,
                                                     max_model_len=self.max_model_len, max_seqs=ec.max_num_seqs,
                                                     progress=_bar_progress(bar))
        model.save(path, {"jax": jax.__version__, "device": jax.devices()[0].device_kind})
        return model

    # ---- generation ----
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        ``prompts``: a string, a list of strings, or ``{"prompt_token_ids": [...]}`` dicts (or a
        list mixing them). Every request is validated before any runs; a ``RequestError`` names the
        bad field and the prompt's index.
        """
        items = self._prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            if isinstance(sampling_params, dict) or not hasattr(sampling_params, "__iter__"):
                raise RequestError("sampling_params", f"must be a SamplingParams or a list of them (one per prompt), "
                                                      f"got {type(sampling_params).__name__}; for a dict of settings "
                                                      "use SamplingParams(**settings)")
            params = list(sampling_params)
            if len(params) != len(items):
                raise RequestError("sampling_params", f"{len(params)} given for {len(items)} prompts")
        requests = []
        for i, (item, sp) in enumerate(zip(items, params)):
            try:
                text, ids = self._prompt(item)
                ids = self.engine.validate(ids, sp)
            except RequestError as e:
                raise RequestError(f"prompts[{i}].{e.field}", str(e).split(": ", 1)[1]) from None
            requests.append((text, ids, sp))
        rids = [self.engine.add_request(ids, sp, prompt=text) for text, ids, sp in requests]
        wanted, done = set(rids), {}
        with tqdm(total=len(rids), desc="generating", disable=not use_tqdm) as bar:
            while wanted - done.keys():
                for out in self.engine.step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                if not self.engine.has_unfinished and wanted - done.keys():
                    raise RuntimeError(f"engine stopped with unfinished requests {sorted(wanted - done.keys())}")
        for rid in rids:
            self.engine.requests.pop(rid, None)
        if self._online_saves:
            self.save_profiles()
        return [done[rid] for rid in rids]

    def generate_stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Like ``generate``, as an iterator of ``RequestOutput`` deltas (``engine.streaming``: new
        tokens and text per step, the last one ``finished``) for all prompts, interleaved; match them
        by ``request_id``. Steps in the calling thread; closing the iterator aborts what still runs."""
        from deepinfer_jax.engine.streaming import stream_requests

        items = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            if isinstance(sampling_params, dict) or not hasattr(sampling_params, "__iter__"):
                raise RequestError("sampling_params", "must be a SamplingParams or a list of them (one per prompt)")
            params = list(sampling_params)
            if len(params) != len(items):
                raise RequestError("sampling_params", f"{len(params)} given for {len(items)} prompts")
        requests = []
        for item, sp in zip(items, params):
            text, ids = self._prompt(item)
            requests.append((ids, sp, text))
        return stream_requests(self.engine, requests)

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts is None or isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
            raise RequestError("prompts", f"must be a string, a {{'prompt_token_ids': [...]}} dict or a list of them, "
                                          f"got {type(prompts).__name__}")
        return list(prompts)

    def _prompt(self, item) -> tuple[str | None, list[int]]:
        if isinstance(item, str):
            if not item:
                raise RequestError("prompt", "the prompt is empty")
            ids = self.tokenizer.encode(item, add_special_tokens=False).ids
            return item, [self.model_config.bos_token_id, *ids]
        if isinstance(item, dict):
            if "prompt_token_ids" not in item:
                raise RequestError("prompt", "a dict prompt needs 'prompt_token_ids'")
            ids = item["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise RequestError("prompt_token_ids", "must be a list of integers")
            return item.get("prompt"), list(ids)
        raise RequestError("prompt", f"must be a string or a {{'prompt_token_ids': [...]}} dict, got "
                                     f"{type(item).__name__}")

    def flush(self) -> None:
        """Wait until every cached block has been written to the block store (and prefetches ended)."""
        self.engine.flush()

    # ---- the recipe layer ----
    def chat(self, request, protocol: str = "chat") -> dict:
        """A Chat Completions / Responses / Messages request (a dict or JSON text) -> the protocol's
        response JSON. ``recipe.ConversionError`` (status 400) for a request the protocol rejects."""
        from deepinfer_jax.chat import chat

        return chat(self, request, protocol)

    def chat_stream(self, request, protocol: str = "chat"):
        """Like ``chat``, as an iterator of the protocol's stream events (``event.sse()``)."""
        from deepinfer_jax.chat import chat_stream

        return chat_stream(self, request, protocol)

    @property
    def conversion_options(self):
        """The ``recipe.ConversionOptions`` ``chat`` converts with: the official defaults, except
        ``default_thinking_mode`` from the engine setting of that name. Assignable."""
        if getattr(self, "_conversion_options", None) is None:
            from deepinfer_jax import recipe

            self._conversion_options = recipe.ConversionOptions(
                default_thinking_mode=self.engine_config.default_thinking_mode)
        return self._conversion_options

    @conversion_options.setter
    def conversion_options(self, options) -> None:
        self._conversion_options = options

    @property
    def prompt_tokenizer(self):
        """The recipe's prompt encoder: the checkpoint's tokenizer.json, else the V4.1-compatible one."""
        if self._prompt_tokenizer is None:
            from deepinfer_jax import recipe

            has_own = self.checkpoint_dir is not None and (Path(self.checkpoint_dir) / "tokenizer.json").is_file()
            self._prompt_tokenizer = recipe.load_prompt_tokenizer(self.checkpoint_dir if has_own else None)
        return self._prompt_tokenizer

    @property
    def parser_tokenizer(self):
        """The ``tokenizers.Tokenizer`` the streaming parser decodes with (same vocabulary as above)."""
        if self._parser_tokenizer is None:
            self._parser_tokenizer = load_tokenizer(self.checkpoint_dir, v41=True)
        return self._parser_tokenizer

    @property
    def stats(self) -> dict:
        """Engine counters, the cost model's mean relative prediction error, and ``prefix``: the prefix
        cache's hits, blocks reused per tier and miss reasons (``_prefix_stats``)."""
        s = self.engine.stats
        cm = self.engine.cost_model
        return {"steps": s.steps, "scheduled_tokens": s.scheduled_tokens, "generated_tokens": s.generated_tokens,
                "preemptions": s.preemptions, "matched_steps": s.matched_steps, "host_s": s.host_s, "wait_s": s.wait_s,
                "device_s": s.device_s, "compile_s": self.compile_s,
                "cost_model_error": None if cm is None else cm.mean_relative_error,
                "cost_model_coef_ns": None if cm is None else cm.coef.tolist(),
                "speculation": self.speculation,
                **(self.engine.spec.summary() if getattr(self.engine, "spec", None) is not None else {}),
                # False while a lazy "auto" engine defers the drafter's program (docs/speculative.md)
                **({"spec_drafter_ready": self.runner.speculation.drafting_ready}
                   if self.runner.speculation is not None else {}),
                **(self._dp_stats() if self.mesh is not None and not self.sharding_preset.context_parallel else {}),
                "prefix": self._prefix_stats()}

    def _prefix_stats(self) -> dict | None:
        """``PrefixCache.stats()`` summed over the schedulers (None without prefix caching): hits, blocks
        reused per tier, and why requests missed (``engine/prefix_cache.py``)."""
        scheds = getattr(self.engine, "schedulers", None) or [self.engine.scheduler]
        parts = [s.prefix.stats() for s in scheds if s.prefix is not None]
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            for k, v in p.items():
                out[k] = {n: out[k][n] + c for n, c in v.items()} if isinstance(v, dict) else out[k] + v
        return out

    def _dp_stats(self) -> dict:
        """Per DP rank: requests routed to it, tokens it computed, steps it ran only padding, prefix-cache hits
        (requests admitted with a hit; ``prefix`` sums every rank's counters); with the EP MoE the
        ``eplb_*`` keys (``EngineCore.eplb_stats``: rebalances, moe_lb per layer now and around the last one); with
        speculation the drafts each rank verified and accepted (``dp_rank_spec_drafts_verified`` /
        ``dp_rank_spec_accepted``, summing to ``spec_drafts_verified`` / ``spec_drafts_accepted``)."""
        e = self.engine
        return {"dp_rank_requests": list(e.rank_requests), "dp_rank_tokens": list(e.rank_tokens),
                "dp_rank_idle_steps": list(e.rank_idle_steps),
                "dp_rank_prefix_hits": [0 if s.prefix is None else s.prefix.hits for s in e.schedulers],
                **({} if e.spec is None else {"dp_rank_spec_drafts_verified": list(e.rank_spec_verified),
                                              "dp_rank_spec_accepted": list(e.rank_spec_accepted)}),
                **e.eplb_stats()}
