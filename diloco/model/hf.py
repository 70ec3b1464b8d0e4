"""The Hugging Face Llama format, both ways: :func:`export_hf` writes a folder that ``transformers`` loads as
``LlamaForCausalLM`` (``config.json``, ``model.safetensors``) with a byte-level tokenizer (``tokenizer.json``)
whose ids are our byte tokens; :func:`read_hf` reads such a folder back into our parameter names.

Our attention rotates channel pairs (2i, 2i+1) of each head; Llama in ``transformers`` rotates (i, i+d/2).
The query and key projections are therefore permuted per head on the way out and back, as Meta's
conversion script does, so that both compute the same function.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from diloco.config import ModelConfig, resolve_model
from diloco.data.tokenizer import Tokenizer
from diloco.model.checkpoint import CheckpointError

HF_WEIGHTS = "model.safetensors"
_BLOCK_NAMES = {  # ours (inside layers.{i}.) -> transformers' (inside model.layers.{i}.)
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def is_hf_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`export_hf` (or any Llama folder with safetensors)."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and (p / HF_WEIGHTS).is_file()


def _rotary_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _rotary_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, inp = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


def to_hf_state(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``{name: tensor}`` renamed (and q/k permuted) to ``LlamaForCausalLM``'s names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t
            continue
        _, index, rest = name.split(".", 2)
        if rest in ("attention.wq.weight", "attention.wk.weight"):
            t = _rotary_to_hf(t, cfg.n_heads)
        out[f"model.layers.{index}.{_BLOCK_NAMES[rest]}"] = t
    return {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in out.items()}


def from_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf_state`."""
    top = {v: k for k, v in _TOP_NAMES.items()}
    block = {v: k for k, v in _BLOCK_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
            continue
        parts = name.split(".", 3)  # model, layers, index, rest
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in block:
            raise CheckpointError(f"the exported folder holds a tensor {name!r} that this model does not have; "
                                  f"only Llama folders written by `diloco export` can be read back")
        ours = block[parts[3]]
        if ours in ("attention.wq.weight", "attention.wk.weight"):
            t = _rotary_from_hf(t, cfg.n_heads)
        out[f"layers.{parts[2]}.{ours}"] = t
    return out


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` computing what our model computes."""
    resolve_model(cfg)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads, "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "diloco_model": {"dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "ffn_dim": cfg.ffn_dim,
                         "seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta,
                         "norm_eps": cfg.norm_eps},
    }


def export_hf(params: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path,
              tokenizer: Tokenizer | None = None) -> Path:
    """Write ``params`` (our names) as a Hugging Face Llama folder at ``out``, with ``tokenizer`` (None:
    bytes); returns the folder."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a folder; pass a new or empty folder to export into")
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state(params, cfg), str(out / HF_WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    (tokenizer or Tokenizer()).save(out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len, "clean_up_tokenization_spaces":
        False, "add_bos_token": False, "add_eos_token": False}, indent=2) + "\n")
    return out


def read_hf(folder: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Parameters (our names) and model config of an exported folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        meta = json.loads((folder / "config.json").read_text())
        cfg = ModelConfig(dim=meta["hidden_size"], n_layers=meta["num_hidden_layers"],
                          n_heads=meta["num_attention_heads"], ffn_dim=meta["intermediate_size"],
                          seq_len=meta["max_position_embeddings"], vocab_size=meta["vocab_size"],
                          rope_theta=float(meta.get("rope_theta", 10000.0)), norm_eps=float(meta["rms_norm_eps"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder}/config.json is not a Llama config ({type(e).__name__}: {e}); export the "
                              f"folder with `diloco export --format hf`") from None
    if meta.get("num_key_value_heads", cfg.n_heads) != cfg.n_heads or meta.get("tie_word_embeddings"):
        raise CheckpointError(f"{folder} uses grouped-query attention or tied embeddings, which this model does not "
                              f"have; only folders written by `diloco export` can be read back")
    return from_hf_state(load_file(str(folder / HF_WEIGHTS)), cfg), cfg
