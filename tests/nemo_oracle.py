"""Test support: the NeMo AutoModel DeepSeek-V4.1 port as an external numerical oracle.

Builds NeMo's ``DeepseekV41ForCausalLM`` on a small text config (CPU, eager, fp32), initialises it
with a seed, and exports its DeepSeek-native state dict so our loader reads the same weights.
torch and nemo_automodel are test-only dependencies; nothing in ``deepinfer_jax`` imports them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch")
nemo_config = __import__("pytest").importorskip("nemo_automodel.components.models.deepseek_v41.config")


def synthetic_tokenizer(vocab_size: int):
    """A fast WordLevel tokenizer of distinct tokens 'tok0'..: its Engram map is the identity."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"tok{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="tok0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def build_nemo(hf_config: dict, seed: int, output_scale: float = 1.0):
    """NeMo model in fp32/eval from a published-layout nested config dict.

    ``output_scale`` multiplies every sublayer's output projection (attention ``wo_b``, routed and
    shared expert ``w2``) so that a rounding-level difference that flips one fake-quant bin cannot
    cascade into a visible logit difference downstream.
    """
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    cfg = nemo_config.DeepseekV41Config(**{**hf_config, "vision_config": {"num_hidden_layers": 0}})
    torch.manual_seed(seed)
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    model = DeepseekV41ForCausalLM(cfg, backend=backend, tokenizer=synthetic_tokenizer(cfg.text_config.vocab_size))
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Non-trivial norms, sinks, biases and mHC offsets so that every parameter matters.
            if name.endswith(("norm.weight", "_hc.scale", "engram.q_weight", "engram.k_weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "sinks_param" in name or name.endswith(".base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("wo_b.weight") or "down_proj" in name:
                p.mul_(output_scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def native_state_dict(model) -> dict[str, np.ndarray]:
    """The model's weights under DeepSeek-native checkpoint names, as fp32 numpy arrays."""
    sd = model.state_dict_adapter.to_hf(model.state_dict())
    return {k: v.detach().to(torch.float32).numpy().copy() for k, v in sd.items()}


def load_native_state_dict(model, tensors: dict[str, np.ndarray]) -> None:
    """Load DeepSeek-native fp32 tensors back into the NeMo model (so both sides share exact weights)."""
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
    native = model.state_dict_adapter.from_hf(tensors)
    missing, unexpected = model.load_state_dict(native, strict=False)
    missing = [m for m in missing if "engram_hash" not in m]
    assert not missing and not unexpected, (missing, unexpected)


def logits(model, token_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(token_ids, np.int64))).logits.float().numpy()


def write_config(directory: Path, hf_config: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
