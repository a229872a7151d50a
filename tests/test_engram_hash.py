"""Engram hashing: compressed token map, hash constants, numpy reference, jitted JAX version.

The numpy reference is checked against NeMo AutoModel's DeepSeek-V4.1 port (the oracle);
the JAX version is checked bit-exactly against the numpy reference.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax import engram_vocab as ev
from deepinfer_jax.model.engram_hash import ngram_hash_ids

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class EngramCfg:
    """The Engram fields of ModelConfig (duck-typed), with the tiny preset's values."""

    vocab_size: int = 512
    engram_layer_ids: tuple[int, ...] = (1, 4)
    engram_num_embeddings: tuple[int, ...] = (2000, 2000)
    engram_max_ngram_size: int = 3
    engram_vocab_size: int = 101
    engram_n_heads: int = 2
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 512


def _tiny_cfg():
    """The project's tiny ModelConfig when config.py is there, else the local stand-in."""
    try:
        from deepinfer_jax.config import ModelConfig
    except ImportError:
        return EngramCfg()
    return ModelConfig.tiny()


@functools.cache
def _jitted(consts, max_ngram, pad_token_id):
    return jax.jit(
        functools.partial(ngram_hash_ids, consts=consts, max_ngram=max_ngram, pad_token_id=pad_token_id)
    )


def _hash_both(ids, token_map, consts, max_ngram, pad, history=None, mask=None):
    ref = ev.hash_ids_with_constants_np(
        ids, token_map, consts, max_ngram=max_ngram, pad_token_id=pad, history=history, token_mask=mask
    )
    fn = _jitted(consts, max_ngram, pad)
    out = fn(
        np.asarray(ids, np.int32),
        np.asarray(token_map, np.int32),
        history=None if history is None else np.asarray(history, np.int32),
        token_mask=mask,
    )
    return ref, np.asarray(out)


# --------------------------------------------------------------------------------------------
# JAX vs numpy reference
# --------------------------------------------------------------------------------------------

_PRIMES = st.one_of(
    st.integers(1, 12),
    st.integers((1 << 24) - 64, (1 << 24) - 1),
    st.integers(1, (1 << 24) - 1),
)
_MULTIPLIERS = st.one_of(
    st.integers(0, (1 << 64) - 1),
    st.integers((1 << 63) - 16, (1 << 63) + 16),
    st.integers(0, 1 << 20),
    st.integers(-(1 << 63), -1),
)


@st.composite
def _hash_problem(draw):
    max_ngram = draw(st.integers(2, 4))
    n_heads = draw(st.integers(1, 3))
    n_layers = draw(st.integers(1, 3))
    n_cols = (max_ngram - 1) * n_heads
    consts = []
    for _ in range(n_layers):
        primes = tuple(draw(st.lists(_PRIMES, min_size=n_cols, max_size=n_cols)))
        offsets = tuple(int(x) for x in np.cumsum([0, *primes[:-1]]))
        mults = tuple(draw(st.lists(_MULTIPLIERS, min_size=max_ngram, max_size=max_ngram)))
        consts.append(ev.EngramLayerHash(primes, offsets, mults))
    vocab = draw(st.integers(3, 40))
    id_bound = draw(st.sampled_from([1 << 17, 1 << 31]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    token_map = rng.integers(0, id_bound, vocab).astype(np.int32)
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    ids = rng.integers(0, vocab, (batch, seq))
    history = rng.integers(-1, vocab, (batch, max_ngram - 1)) if draw(st.booleans()) else None
    mask = rng.random((batch, seq)) < 0.8 if draw(st.booleans()) else None
    pad = draw(st.integers(0, vocab - 1))
    return tuple(consts), max_ngram, pad, token_map, ids, history, mask


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hash_problem())
def test_jax_matches_numpy_reference(problem):
    consts, max_ngram, pad, token_map, ids, history, mask = problem
    ref, out = _hash_both(ids, token_map, consts, max_ngram, pad, history, mask)
    assert out.dtype == np.int32
    assert out.shape == ref.shape == (*ids.shape, len(consts), len(consts[0].primes))
    np.testing.assert_array_equal(out, ref)
    primes = np.array([c.primes for c in consts])
    offsets = np.array([c.offsets for c in consts])
    assert ((ref >= offsets) & (ref < offsets + primes)).all()


def test_jax_extreme_products_and_negative_hashes():
    """Max compressed ids times multipliers with every high bit pattern, primes at the limit."""
    token_map = np.array([0, 1, (1 << 17) - 1, (1 << 31) - 1, 12345, 65535, 65536], np.int32)
    mults = (2**64 - 1, 2**63 - 1, 2**63 + 1, 2**32 + 1)
    primes = ((1 << 24) - 3, (1 << 24) - 1, 2, 1, 16000057, 3, 65537, 255, 256)
    consts = (ev.EngramLayerHash(primes, tuple(int(x) for x in np.cumsum([0, *primes[:-1]])), mults),)
    ids = np.array([[0, 1, 2, 3, 4, 5, 6, 3, 3, 2, 2, 6]])
    ref, out = _hash_both(ids, token_map, consts, 4, 3)
    np.testing.assert_array_equal(out, ref)
    with np.errstate(over="ignore"):
        signed = token_map[ids].astype(np.int64)[..., None] * np.array([ev._as_int64(m) for m in mults])
    assert (signed < 0).any()  # the signed (negative) branch of the floor mod is exercised


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(2, 4), st.booleans())
def test_history_continues_a_sequence(seed, max_ngram, use_mask):
    """Hashing tokens[t0:] with the previous max_ngram-1 ids as history == slicing the whole."""
    cfg = EngramCfg(engram_max_ngram_size=max_ngram, engram_num_embeddings=(5000, 5000))
    token_map = ev.identity_token_map(cfg.vocab_size)
    rng = np.random.default_rng(seed)
    batch, seq = 2, 12
    ids = rng.integers(0, cfg.vocab_size, (batch, seq))
    mask = rng.random((batch, seq)) < 0.75 if use_mask else np.ones((batch, seq), bool)
    whole = ev.ngram_hash_ids_np(cfg, ids, token_map, token_mask=mask)
    consts = ev.hash_constants(cfg)
    n_hist = max_ngram - 1
    padded_ids = np.concatenate([np.full((batch, n_hist), -1), np.where(mask, ids, -1)], axis=1)
    for t0 in range(seq):
        history = padded_ids[:, t0 : t0 + n_hist]  # raw ids before t0, masked/absent -> -1
        ref = ev.ngram_hash_ids_np(cfg, ids[:, t0:], token_map, history=history, token_mask=mask[:, t0:])
        np.testing.assert_array_equal(ref, whole[:, t0:])
        if t0 in (0, 1, 2, seq - 1):  # the device version too (fewer shapes, fewer compiles)
            ref, out = _hash_both(ids[:, t0:], token_map, consts, max_ngram, 2, history, mask[:, t0:])
            np.testing.assert_array_equal(out, whole[:, t0:])


def test_mask_and_sequence_start_use_pad_class():
    cfg = EngramCfg()
    token_map = ev.identity_token_map(cfg.vocab_size)
    ids = np.array([[7, 8, 9, 10]])
    mask = np.array([[True, True, False, True]])
    got = ev.ngram_hash_ids_np(cfg, ids, token_map, token_mask=mask)
    # Position 3 looks back through the masked position 2: equal to [pad, pad, 10] grams,
    # which is also what position 0 of the single-token sequence [10] sees.
    alone = ev.ngram_hash_ids_np(cfg, np.array([[10]]), token_map)
    np.testing.assert_array_equal(got[:, 3], alone[:, 0])
    # A masked position hashes pad ids only.
    pads = ev.ngram_hash_ids_np(cfg, np.array([[cfg.engram_pad_token_id]]), token_map)
    np.testing.assert_array_equal(got[:, 2], pads[:, 0])


def test_jit_traces_once_per_shape():
    cfg = _tiny_cfg()
    consts = ev.hash_constants(cfg)
    traces = []

    def step(ids, token_map, history):
        traces.append(1)
        return ngram_hash_ids(
            ids,
            token_map,
            consts,
            max_ngram=cfg.engram_max_ngram_size,
            pad_token_id=cfg.engram_pad_token_id,
            history=history,
        )

    fn = jax.jit(step)
    token_map = ev.default_token_map(cfg)
    hist = np.full((2, cfg.engram_max_ngram_size - 1), -1, np.int32)
    for seed in range(3):
        ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
        out = fn(ids, token_map, hist)
        want = ev.ngram_hash_ids_np(cfg, ids, token_map, history=hist)
        np.testing.assert_array_equal(np.asarray(out), want)
    assert len(traces) == 1
    assert jax.config.jax_enable_x64 is False


def test_device_rejects_large_primes_and_bad_shapes():
    consts = (ev.EngramLayerHash((1 << 24, 3), (0, 1 << 24), (3, 5)),)
    ids, token_map = np.zeros((1, 3), np.int32), np.arange(8, dtype=np.int32)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        ngram_hash_ids(ids, token_map, consts, max_ngram=2, pad_token_id=2)
    ok = (ev.EngramLayerHash((5, 3), (0, 5), (3, 5)),)
    with pytest.raises(ValueError, match="multipliers"):
        ngram_hash_ids(ids, token_map, ok, max_ngram=3, pad_token_id=2)
    with pytest.raises(ValueError, match="engram_pad_token_id"):
        ngram_hash_ids(ids, token_map, ok, max_ngram=2, pad_token_id=8)
    with pytest.raises(ValueError, match="history"):
        ngram_hash_ids(ids, token_map, ok, max_ngram=2, pad_token_id=2, history=np.zeros((1, 2), np.int32))


def test_reference_rejects_bad_inputs():
    cfg = EngramCfg()
    token_map = ev.identity_token_map(cfg.vocab_size)
    with pytest.raises(ValueError, match="token_ids"):
        ev.ngram_hash_ids_np(cfg, np.array([[0, cfg.vocab_size]]), token_map)
    with pytest.raises(ValueError, match="history"):
        ev.ngram_hash_ids_np(cfg, np.array([[0, 1]]), token_map, history=np.array([[-2, 0]]))
    with pytest.raises(ValueError, match="token_mask"):
        ev.ngram_hash_ids_np(cfg, np.array([[0, 1]]), token_map, token_mask=np.array([[1, 0]]))


# --------------------------------------------------------------------------------------------
# Hash constants
# --------------------------------------------------------------------------------------------


def _sieve(limit: int) -> np.ndarray:
    is_prime = np.ones(limit + 1, bool)
    is_prime[:2] = False
    for d in range(2, int(limit**0.5) + 1):
        if is_prime[d]:
            is_prime[d * d :: d] = False
    return is_prime


@pytest.mark.parametrize(
    "cfg",
    [
        EngramCfg(),
        EngramCfg(
            engram_layer_ids=(0, 3, 7),
            engram_num_embeddings=(900, 900, 900),
            engram_max_ngram_size=4,
            engram_n_heads=3,
            engram_vocab_size=2,
        ),
        EngramCfg(
            engram_vocab_size=20000, engram_num_embeddings=(90000, 90000), engram_compressed_vocab_size=300
        ),
    ],
)
def test_hash_constants_primes(cfg):
    consts = ev.hash_constants(cfg)
    assert len(consts) == len(cfg.engram_layer_ids)
    n_heads, n_orders = cfg.engram_n_heads, cfg.engram_max_ngram_size - 1
    all_primes = [p for c in consts for p in c.primes]
    is_prime = _sieve(max(all_primes))
    assert all(is_prime[p] for p in all_primes)
    assert len(set(all_primes)) == len(all_primes)  # never reused, within or across layers
    used: set[int] = set()
    bound = max(1, (2**63 - 1) // cfg.engram_compressed_vocab_size // 2)
    for layer_id, c, rows in zip(cfg.engram_layer_ids, consts, cfg.engram_num_embeddings):
        assert len(c.primes) == n_orders * n_heads
        for order in range(n_orders):
            block = c.primes[order * n_heads : (order + 1) * n_heads]
            assert all(p > cfg.engram_vocab_size - 1 for p in block)
            # Each order takes the smallest primes above the floor that no earlier column took.
            candidates = range(cfg.engram_vocab_size, max(block) + 1)
            expect = [p for p in candidates if is_prime[p] and p not in used]
            assert list(block) == expect
            used.update(block)
        assert c.offsets == tuple(int(x) for x in np.cumsum([0, *c.primes[:-1]]))
        assert sum(c.primes) <= rows
        rng = np.random.default_rng(10007 * layer_id)
        u = rng.integers(0, bound, cfg.engram_max_ngram_size, dtype=np.int64)
        assert c.multipliers == tuple(2 * int(x) + 1 for x in u)
    assert ev.hash_constants(cfg) is consts  # cached


def test_hash_constants_agree_with_model_config():
    config = pytest.importorskip("deepinfer_jax.config")
    for cfg in (config.ModelConfig.tiny(), config.ModelConfig.small(), config.ModelConfig()):
        consts = ev.hash_constants(cfg)
        assert tuple(c.primes for c in consts) == cfg.engram_primes()


def test_hash_constants_errors():
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        ev.hash_constants(EngramCfg(engram_num_embeddings=(2000, 400)))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        ev.hash_constants(EngramCfg(engram_num_embeddings=(2000,)))
    with pytest.raises(ValueError, match="engram_max_ngram_size"):
        ev.hash_constants(EngramCfg(engram_max_ngram_size=1))
    with pytest.raises(ValueError, match="engram_layer_ids"):
        ev.hash_constants(EngramCfg(engram_layer_ids=(1, 1)))


# --------------------------------------------------------------------------------------------
# Compressed token map
# --------------------------------------------------------------------------------------------


def _word_level(tokens, special=()):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=tokens[0]))
    if special:
        tok.add_special_tokens(list(special))
    return tok


def _nemo_map(tok):
    nemo_engram = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.engram")
    transformers = pytest.importorskip("transformers")
    values, n = nemo_engram._compressed_token_map(transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    return np.array(values, np.int32), n


COLLIDING_TOKENS = [
    "<pad>", "Café", "cafe", "CAFÉ", "café ", " café", "naïve", "NAIVE", "ﬁ", "fi", "Ｆｉ",
    " ", "  ", "\t", "\n\n", " \t\r\n ", "a  b", "a b", "A\tB", "a\r\nb", "x\u00a0y", "x y",
    "\ue000", " \ue000", "x\ue000y", "x y ", "bad\ufffd", "\ufffd", "\u0301", "\u0301\u0301",
    "Ǆ", "ǆ", "Ω", "ω", "\u2126", "Å", "\u212b", "å", "a\u030a",
    "Straße", "strasse", "\u2003", "\u3000x",
]


@pytest.mark.oracle
def test_compressed_token_map_matches_nemo_on_collisions():
    tok = _word_level(COLLIDING_TOKENS, special=["<|S|>", "<|s|>"])
    got, n = ev.compressed_token_map(tok)
    want, n_want = _nemo_map(tok)
    assert got.dtype == np.int32 and got.shape == (tok.get_vocab_size(True),)
    np.testing.assert_array_equal(got, want)
    assert n == n_want
    assert n < len(COLLIDING_TOKENS)  # the collisions really collide
    index = {t: i for i, t in enumerate(COLLIDING_TOKENS)}
    assert got[index["Café"]] == got[index["cafe"]] == got[index["CAFÉ"]] == got[index[" café"]]
    assert got[index[" "]] == got[index["\t"]] == got[index["\n\n"]]
    assert got[index["a  b"]] == got[index["A\tB"]]


@pytest.mark.oracle
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.text("aAbéÉeE \t\r\n\u00a0\ue000\ufffd\u0301ﬁ", min_size=1, max_size=5),
        min_size=1,
        max_size=30,
        unique=True,
    )
)
def test_compressed_token_map_matches_nemo_random(tokens):
    tok = _word_level(tokens)
    got, n = ev.compressed_token_map(tok)
    want, n_want = _nemo_map(tok)
    np.testing.assert_array_equal(got, want)
    assert n == n_want


def test_identity_and_default_map_for_tiny():
    cfg = _tiny_cfg()
    np.testing.assert_array_equal(ev.default_token_map(cfg), np.arange(cfg.vocab_size))
    with pytest.raises(ValueError, match="vocab_size"):
        ev.identity_token_map(0)


@pytest.mark.slow
def test_real_tokenizer_map_class_count(tmp_path):
    """The DeepSeek-V4 tokenizer folds 129,280 ids into 99,092 classes (the V4.1 config's number)."""
    real = dataclasses.replace(EngramCfg(), vocab_size=129280, engram_compressed_vocab_size=99092)
    token_map = ev.default_token_map(real)  # disk-cached under ~/.cache/deepinfer_jax after the first run
    assert token_map.shape == (129280,) and token_map.dtype == np.int32
    assert np.unique(token_map).size == 99092 and token_map.max() == 99091
    full, n = ev.tokenizer_file_token_map(ev.deepseek_v4_tokenizer_path())
    assert n == 99092
    wider = ev.default_token_map(dataclasses.replace(real, vocab_size=129290))
    np.testing.assert_array_equal(wider[:129280], token_map)
    assert (wider[129280:] == token_map[real.engram_pad_token_id]).all()
    with pytest.raises(ValueError, match="engram_compressed_vocab_size.*99091.*99092"):
        ev.default_token_map(dataclasses.replace(real, engram_compressed_vocab_size=99091))
    # A second disk cache in tmp_path round-trips the same map.
    ev._file_token_map.cache_clear()
    first, _ = ev.tokenizer_file_token_map(ev.deepseek_v4_tokenizer_path(), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("engram_token_map_*.npy"))) == 1
    ev._file_token_map.cache_clear()
    again, _ = ev.tokenizer_file_token_map(ev.deepseek_v4_tokenizer_path(), cache_dir=tmp_path)
    np.testing.assert_array_equal(first, full)
    np.testing.assert_array_equal(again, full)


# --------------------------------------------------------------------------------------------
# numpy reference vs NeMo's DeepseekV41NgramHash
# --------------------------------------------------------------------------------------------


def _nemo_hasher(cfg, fast_tokenizer):
    nemo_config = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.config")
    nemo_engram = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.engram")
    text_cfg = nemo_config.DeepseekV41TextConfig(
        vocab_size=cfg.vocab_size,
        engram_layer_ids=list(cfg.engram_layer_ids),
        engram_num_embeddings=list(cfg.engram_num_embeddings),
        engram_max_ngram_size=cfg.engram_max_ngram_size,
        engram_vocab_size=cfg.engram_vocab_size,
        engram_n_heads=cfg.engram_n_heads,
        engram_pad_token_id=cfg.engram_pad_token_id,
        engram_compressed_vocab_size=cfg.engram_compressed_vocab_size,
    )
    return nemo_engram.DeepseekV41NgramHash(text_cfg, fast_tokenizer)


_NEMO_ROPE_WARNING = "ignore:`rope_scaling` is deprecated:FutureWarning"


def _compare_with_nemo(cfg, tok, token_map, seed, batch=3, seq=24):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hasher = _nemo_hasher(cfg, transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    consts = ev.hash_constants(cfg)
    assert tuple(c.primes for c in consts) == hasher._prime_values
    assert tuple(c.offsets for c in consts) == hasher._offset_values
    assert tuple(c.multipliers for c in consts) == hasher._multiplier_values
    np.testing.assert_array_equal(token_map[: len(hasher._token_map_values)], hasher._token_map_values)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, len(hasher._token_map_values), (batch, seq))
    mask = rng.random((batch, seq)) < 0.85
    for token_mask in (None, mask):
        want = hasher(
            torch.from_numpy(ids), token_mask=None if token_mask is None else torch.from_numpy(token_mask)
        ).numpy()
        got = ev.ngram_hash_ids_np(cfg, ids, token_map, token_mask=token_mask)
        np.testing.assert_array_equal(got, want)
        out = _jitted(consts, cfg.engram_max_ngram_size, cfg.engram_pad_token_id)(
            ids.astype(np.int32), np.asarray(token_map, np.int32), token_mask=token_mask
        )
        np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.oracle
@pytest.mark.filterwarnings(_NEMO_ROPE_WARNING)
@pytest.mark.parametrize("max_ngram", [2, 3, 4])
def test_reference_matches_nemo_ngram_hash_synthetic(max_ngram):
    n_words = 60
    tokens = [f"tok{i}" for i in range(n_words)] + ["TOK3", "Tok7 ", "tök9"]  # 3 case/accent twins
    tok = _word_level(tokens)
    token_map, n_classes = ev.compressed_token_map(tok)
    assert n_classes == n_words
    cfg = EngramCfg(
        vocab_size=len(tokens),
        engram_max_ngram_size=max_ngram,
        engram_num_embeddings=(3000, 3000),
        engram_compressed_vocab_size=n_classes,
    )
    _compare_with_nemo(cfg, tok, token_map, seed=max_ngram)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.filterwarnings(_NEMO_ROPE_WARNING)
def test_reference_matches_nemo_ngram_hash_real_config():
    """The released Engram geometry (layers 1 and 14, primes above 16M) and the V4 tokenizer."""
    cfg = EngramCfg(
        vocab_size=129280,
        engram_layer_ids=(1, 14),
        engram_num_embeddings=(384006168, 384016682),
        engram_max_ngram_size=4,
        engram_vocab_size=16000000,
        engram_n_heads=8,
        engram_compressed_vocab_size=99092,
    )
    token_map = ev.default_token_map(cfg)
    tok = tokenizers.Tokenizer.from_file(str(ev.deepseek_v4_tokenizer_path()))
    _compare_with_nemo(cfg, tok, token_map, seed=0, batch=2, seq=64)


# --------------------------------------------------------------------------------------------
# Module boundaries
# --------------------------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_host_and_device_modules_keep_their_worlds():
    host = _imports(ROOT / "deepinfer_jax" / "engram_vocab.py")
    assert not any(n == "jax" or n.startswith(("jax.", "flax")) for n in host)
    neutral = _imports(ROOT / "deepinfer_jax" / "model" / "engram_consts.py")
    assert neutral <= {"__future__", "dataclasses", "functools", "math", "typing", "numpy"}
    device = _imports(ROOT / "deepinfer_jax" / "model" / "engram_hash.py")
    assert not any(n.startswith(("deepinfer_jax", "tokenizers", "torch")) for n in device)
