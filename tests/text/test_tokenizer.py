import pytest

from dspark_jax.data import corpora as C
from dspark_jax.text.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = C.build_corpus("train", seed=0, n_code=300, n_math=300, n_prose=300)
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer((C.conversation_text(c) for c in corpus), vocab_size=1024, save_path=d)
    return Tokenizer.load(d)


@pytest.mark.parametrize("s", [
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces, trailing\t\n\n",
    "Ünïcödé — 日本語 😀 and emoji",
    "The answer is 42.",
    "",
])
def test_round_trip(tok, s):
    ids = tok.encode(s)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == s


def test_compresses_and_specials(tok):
    text = "def function(argument):\n    return argument\n"
    assert len(tok.encode(text)) < len(text.encode()) / 2
    assert 256 < tok.vocab_size <= 1024
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(SPECIAL_TOKENS)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == tok.token_to_id("<|im_start|>")
    assert tok.encode("x<|im_end|>")[-1] == tok.token_to_id("<|im_end|>")
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|pad|>")
    assert tok.mask_id == tok.token_to_id("<|mask|>")
    assert tok.token_to_id("<|no such token|>") is None
    assert len(tok.fingerprint) == 64


def test_load_file_and_qwen_style_dir(tok, tmp_path):
    f = tok.save(tmp_path / "a" / "tokenizer.json")
    t2 = Tokenizer.load(f)
    assert t2.encode("hello world") == tok.encode("hello world")
    assert t2.fingerprint == Tokenizer.load(tmp_path / "a").fingerprint
    # a tokenizer without <|mask|>/<|pad|> (like Qwen3): mask None, pad from config/endoftext
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    q = HF(models.BPE())
    q.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    q.decoder = decoders.ByteLevel()
    q.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    qt = Tokenizer(q, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    assert qt.mask_id is None and qt.eos_id == 0 and qt.pad_id == 0
    assert set(qt.stop_ids) == {0, 2}


def test_missing_tokenizer_message(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        Tokenizer.load(tmp_path)
    assert str(tmp_path) in str(e.value) and "needs a tokenizer" in str(e.value)
    with pytest.raises(FileNotFoundError, match="needs a tokenizer"):
        Tokenizer.load(tmp_path / "nope" / "tokenizer.json")
