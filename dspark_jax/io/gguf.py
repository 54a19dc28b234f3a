"""Import a GGUF file (llama.cpp's format) as an ordinary Hugging Face checkpoint directory.

    python -m dspark_jax convert gguf FILE.gguf OUT_DIR [--dtype float32|bfloat16]

Writes `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (with
the chat template) and `generation_config.json`, which `load_target` (and transformers) read
like any checkpoint. Quantized tensors are dequantized with llama.cpp's own Python reader
(`gguf`); llama.cpp's RoPE permutation of Llama's q/k projections is undone; the byte-level
BPE tokenizer is rebuilt from the GGUF metadata with the `tokenizers` library. The directory
is written next to OUT_DIR and renamed into place, so an interrupted import leaves nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
)

from dspark_jax.io import safetensors_io
from dspark_jax.io.files import atomic_dir

__all__ = ["GGUFError", "SUPPORTED_ARCHITECTURES", "SUPPORTED_QUANTIZATIONS", "read_gguf", "gguf_config",
           "gguf_tensors", "gguf_tokenizer", "import_gguf"]

# GGUF architecture -> (HF architecture, HF model_type, whether llama.cpp permuted q/k for its RoPE)
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}
SUPPORTED_QUANTIZATIONS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name -> HF name ({i}: layer index); a declarative table like io/hf.TARGET_KEY_TABLE.
TENSOR_TABLE = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{i}.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{i}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{i}.mlp.down_proj.weight"),
]

# Pre-tokenizer split regexes of llama.cpp's `tokenizer.ggml.pre` types (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # type -> (split digits one by one first, split regex)
    "default": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT), "starcoder": (True, _GPT2_SPLIT), "refact": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT), "llama3": (False, _LLAMA3_SPLIT), "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT), "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


class GGUFError(ValueError):
    pass


def read_gguf(path):
    """A `gguf.GGUFReader`; a missing, truncated or corrupt file raises GGUFError naming it."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / IndexError / struct errors on damaged files
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); it may be truncated or "
                        "corrupt: download it again") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; dspark_jax imports: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _f32(x) -> float:
    """GGUF stores float metadata as float32: back to the shortest decimal that rounds to it
    (an eps of 1e-5 arrives as 9.99999974e-6 and is written to config.json as 1e-05 again)."""
    return float(str(np.float32(x)))


def gguf_config(reader, dtype: str = "float32") -> dict:
    """The Hugging Face config.json of the model described by the GGUF metadata."""
    arch = _architecture(reader)
    hf_arch, model_type, _ = SUPPORTED_ARCHITECTURES[arch]
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(get("vocab_size", len(tokens))), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    scaling = get("rope.scaling.type")
    if "rope_freqs.weight" in names or scaling not in (None, "none"):
        # Llama 3.1-style GGUFs carry the scaled frequencies as a tensor, not the HF parameters;
        # rebuilding those parameters is not verified yet, so such files are refused, not guessed.
        raise GGUFError(f"{getattr(reader.data, 'filename', 'the GGUF file')} uses RoPE scaling "
                        f"({scaling or 'rope_freqs tensor'}); dspark_jax imports GGUFs with plain RoPE only")
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its RoPE pairs adjacent dims; HF pairs halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    for pattern, hf in TENSOR_TABLE:
        m = re.fullmatch(pattern, name)
        if m:
            return hf.format(i=m.group(1)) if m.groups() else hf
    return None


def gguf_tensors(reader, cfg: dict, np_dtype=np.float32) -> dict[str, np.ndarray]:
    """Every weight dequantized to `np_dtype` under its HF name, in HF's [out, in] layout; all
    unsupported quantization types and unknown tensors are reported in one error."""
    import gguf

    arch = _architecture(reader)
    permuted = SUPPORTED_ARCHITECTURES[arch][2]
    out, problems = {}, []
    for t in reader.tensors:
        hf = _hf_name(t.name)
        qtype = t.tensor_type.name
        if hf is None:
            problems.append(f"tensor {t.name!r} has no Hugging Face counterpart in the {arch} table")
            continue
        if qtype not in SUPPORTED_QUANTIZATIONS:
            problems.append(f"tensor {t.name!r} is {qtype}")
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        if permuted and hf.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permuted and hf.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[hf] = w.astype(np_dtype)
    if problems:
        if any(" is " in p for p in problems):
            problems.append(f"supported quantizations: {', '.join(SUPPORTED_QUANTIZATIONS)}")
        raise GGUFError(f"cannot import {getattr(reader.data, 'filename', 'the GGUF file')}:\n  "
                        + "\n  ".join(problems))
    return out


def gguf_tokenizer(reader):
    """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) from the GGUF metadata."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"the GGUF tokenizer model is {model!r}; dspark_jax rebuilds byte-level BPE tokenizers "
                        "(tokenizer.ggml.model 'gpt2') only")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"unknown GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False, ignore_merges=False))
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED])
    def name(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"), "pad_token": name("tokenizer.ggml.padding_token_id"),
            "unk_token": name("tokenizer.ggml.unknown_token_id"),
            "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
            "model_max_length": int(_field(reader, f"{_architecture(reader)}.context_length", 4096)),
            "chat_template": _field(reader, "tokenizer.chat_template")}
    gen = {k: _field(reader, f"tokenizer.ggml.{g}") for k, g in
           (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))}
    return tok, tcfg, {k: v for k, v in gen.items() if v is not None}


def import_gguf(gguf_path, out_dir, dtype: str = "float32") -> Path:
    """Write the Hugging Face directory for `gguf_path` at `out_dir` (replaced atomically)."""
    if dtype not in ("float32", "bfloat16"):
        raise GGUFError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
    reader = read_gguf(gguf_path)
    cfg = gguf_config(reader, dtype)
    tok, tcfg, gen = gguf_tokenizer(reader)  # before the weights: a bad tokenizer fails fast
    tensors = gguf_tensors(reader, cfg, ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    with atomic_dir(out_dir) as tmp:
        safetensors_io.save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return Path(out_dir)
