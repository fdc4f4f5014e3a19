"""A user's journey on pretrained-style Hugging Face folders: tiny random models saved by transformers with
`save_pretrained`, beside a tokenizer trained in the family's style and saved through the family's fast tokenizer
class, used through `python -m lmkit ...` and the Python API; numbers compared with transformers, PEFT and
sentence-transformers on the same folder."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lmkit
from helpers.hf_folders import ROBERTA_SPECIALS, build, byte_level_bpe, cli, spm_bpe, unigram

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from tokenizers import pre_tokenizers  # noqa: E402


def folder_fixture(family: str):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        return build(family, tmp_path_factory.mktemp(family))
    return fixture


gpt2_dir, llama_dir, qwen2_dir = folder_fixture("gpt2"), folder_fixture("llama"), folder_fixture("qwen2")
distilbert_dir, t5_dir, bart_dir = folder_fixture("distilbert"), folder_fixture("t5"), folder_fixture("bart")


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path)


# --- generate --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, options", [
    ((), dict(do_sample=False)),
    (("--num-beams", "3", "--num-return-sequences", "2"), dict(num_beams=3, num_return_sequences=2, do_sample=False)),
])
@pytest.mark.parametrize("which", ["llama_dir", "gpt2_dir"])
def test_generate_prompt_is_encoded_as_transformers_tokenizer_does(request, capfd, which, flags, options):
    """A pretrained folder's prompt gets the tokenizer's own specials (LLaMA's <s>; GPT-2 none): the printed text is
    what transformers' generate continues from tokenizer(prompt). The LLaMA prompt lost its <s> before."""
    path = request.getfixturevalue(which)
    prompt = "Hello world"
    rc, out, err = cli(capfd, "generate", "--model", path, "--prompt", prompt, "--max-new-tokens", "6", *flags)
    assert rc == 0, err
    tok = hf_tokenizer(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    enc = tok(prompt, return_tensors="pt")
    rows = model.generate(**enc, max_new_tokens=6, pad_token_id=tok.eos_token_id, **options)
    texts = [prompt + tok.decode(r[enc.input_ids.shape[1]:], skip_special_tokens=True) for r in rows]
    expected = "".join((f"--- {i + 1} of {len(texts)}\n" if len(texts) > 1 else "") + t + "\n"
                       for i, t in enumerate(texts))
    assert out == expected


def test_generate_no_bos_drops_the_tokenizers_specials(llama_dir, capfd):
    rc, out, err = cli(capfd, "generate", "--model", llama_dir, "--prompt", "Hello world", "--max-new-tokens", "5",
                       "--no-bos")
    assert rc == 0, err
    tok = hf_tokenizer(llama_dir)
    model = lmkit.load_model(llama_dir)
    ids = torch.tensor([tok("Hello world", add_special_tokens=False).input_ids])
    new = model.generate(ids, max_new_tokens=5)[0, ids.shape[1]:].tolist()
    assert out == "Hello world" + tok.decode(new, skip_special_tokens=True) + "\n"


def test_generate_empty_prompt_without_specials_is_one_line(gpt2_dir, capfd):
    rc, out, err = cli(capfd, "generate", "--model", gpt2_dir, "--prompt", "")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "the prompt is empty" in err and "--bos" in err and "--no-bos" not in err


# --- eval --pairs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["bart_dir", "t5_dir"])
def test_eval_pairs_loss_is_transformers_loss_on_its_tokenizers_labels(request, capfd, tmp_path, which):
    """References are labeled as tokenizer(text_target=...) labels them: BART's `<s> y </s>` (lmkit scored `y </s>`,
    two tokens fewer and another loss), T5's `y </s>`."""
    path = request.getfixturevalue(which)
    pairs = [("Hello world", "Hello"), ("The quick fox", "quick brown fox")]
    (tmp_path / "pairs.tsv").write_text("".join(f"{s}\t{r}\n" for s, r in pairs), encoding="utf-8")
    rc, out, err = cli(capfd, "eval", "--model", path, "--pairs", str(tmp_path / "pairs.tsv"))
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("loss"))
    loss, count = float(line.split()[1]), int(line.split("(")[1].split()[0])
    tok = hf_tokenizer(path)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path).eval()
    total = n = 0
    with torch.no_grad():
        for s, r in pairs:
            enc = tok(s, text_target=r, return_tensors="pt")
            total += model(**enc).loss.item() * enc["labels"].shape[1]
            n += enc["labels"].shape[1]
    assert count == n
    assert loss == pytest.approx(total / n, abs=1e-4)


# --- finetune --peft on DistilBERT --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_distilbert_classifier_adapter_loads_in_peft(distilbert_dir, capfd, tmp_path, method):
    """PEFT matches modules_to_save=["classifier"] by a bare endswith, so DistilBERT's fresh pre_classifier is trained
    and saved with the classifier; lmkit froze it at random and left it out, and PEFT failed with a KeyError."""
    peft = pytest.importorskip("peft")
    from lmkit.finetune.classify import classifier_from_pretrained
    from lmkit.peft import load_adapter

    rows = ["text,label", "the quick fox,pos", "lazy dog here,neg", "hello world test,pos", "numbers and words,neg"]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "clf"
    rc, _, err = cli(capfd, "finetune", "--model", distilbert_dir, "--train", str(tmp_path / "train.csv"),
                     "--eval", str(tmp_path / "train.csv"), "--out", str(out), "--epochs", "1", "--peft", method)
    assert rc == 0, err
    tok = hf_tokenizer(distilbert_dir)
    enc = tok(["the quick fox", "hello world test"], padding=True, return_tensors="pt")
    base = transformers.AutoModelForSequenceClassification.from_pretrained(distilbert_dir, num_labels=2)
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ours = load_adapter(classifier_from_pretrained(distilbert_dir, 2), out).eval()
    with torch.no_grad():
        expected = theirs(**enc).logits
        got = ours(enc.input_ids, attention_mask=enc.attention_mask).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert {"base_model.model.pre_classifier.weight", "base_model.model.classifier.weight"} <= set(f.keys())


# --- sentence embeddings ----------------------------------------------------------------------------------------

SENTENCES = ["the quick fox", "hello world, a longer sentence here", "x"]


@pytest.mark.parametrize("which", ["t5_dir", "qwen2_dir"])
def test_sentence_encoder_on_plain_folders_equals_sentence_transformers(request, which):
    """sentence-transformers 6 embeds a plain T5 folder by its encoder (lmkit raised a traceback) and pools a plain
    ...ForCausalLM folder by its last token (lmkit mean-pooled it)."""
    st = pytest.importorskip("sentence_transformers")
    path = request.getfixturevalue(which)
    expected = st.SentenceTransformer(path, device="cpu").encode(SENTENCES)
    got = lmkit.SentenceEncoder.from_pretrained(path).encode(SENTENCES)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_search_refuses_bart_in_one_line(bart_dir, capfd, tmp_path):
    (tmp_path / "docs.txt").write_text("the quick brown fox jumps\n\nhello world again\n", encoding="utf-8")
    rc, out, err = cli(capfd, "search", "--model", bart_dir, "--query", "fox", "--corpus", str(tmp_path / "docs.txt"),
                       "--no-cache")
    assert rc == 2
    assert err.count("\n") == 1 and "encoder-decoder" in err and "T5" in err


# --- what already agreed ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gpt2_dir", "distilbert_dir", "bart_dir", "qwen2_dir"])
def test_tokenizer_ids_equal_the_fast_tokenizer(request, which):
    path = request.getfixturevalue(which)
    theirs, ours = hf_tokenizer(path), lmkit.load_tokenizer(path)
    for text in ["Hello world", "café  naïve\tüber 123", " leading space", "", "x </s> <s> [MASK] <mask> y"]:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special).input_ids
            assert ours.encode(text, add_special_tokens=special) == ids
        ids = theirs(text).input_ids
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


# --- tokenizer folders read as transformers 5 reads them -----------------------------------------------------------

TRICKY = ["Hello world", " leading space", "a  b\tc", "<s> inline </s> x", "x </s> y", "Numbers 12345 here", "",
          "漢字 😀 café", "cafe\u0301 nai\u0308ve"]


def old_t5_unigram():
    """A T5 tokenizer.json as older converters wrote it: Metaspace without WhitespaceSplit."""
    t = unigram(["<pad>", "</s>", "<unk>"])
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    return t


@pytest.mark.parametrize("family, settings", [
    ("llama", {}), ("llama", {"legacy": True}), ("llama", {"add_prefix_space": False}),
    ("t5", {}), ("qwen2", {}), ("mbart", {}),
])
def test_folder_tokenizer_follows_the_transformers_class(tmp_path, family, settings):
    """transformers 5 rebuilds LlamaTokenizer's, T5Tokenizer's, Qwen2Tokenizer's and MBartTokenizer's pipelines from
    the class (a legacy LLaMA Prepend normalizer becomes a Metaspace that prepends ▁ to the first piece only; T5 and
    mBART split on whitespace first; Qwen2 splits digits one by one): lmkit read the folder's tokenizer.json as is,
    so a leading space, a space after a special token, a tab or a number got other ids."""
    T = transformers
    if family == "llama":
        tok = T.LlamaTokenizerFast(tokenizer_object=spm_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   **settings)
    elif family == "t5":
        tok = T.T5TokenizerFast(tokenizer_object=old_t5_unigram(), eos_token="</s>", unk_token="<unk>",
                                pad_token="<pad>", extra_ids=4)
    elif family == "qwen2":
        tok = T.Qwen2TokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>"]), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token=None, bos_token=None)
    else:
        base = unigram(["<s>", "<pad>", "</s>", "<unk>"])
        base.pre_tokenizer = pre_tokenizers.Metaspace()
        tok = T.MBartTokenizerFast(tokenizer_object=base, src_lang="en_XX", tgt_lang="fr_XX",
                                   additional_special_tokens=["en_XX", "fr_XX"], **ROBERTA_SPECIALS)
    tok.save_pretrained(tmp_path)
    theirs, ours = hf_tokenizer(tmp_path), lmkit.load_tokenizer(tmp_path)
    assert any(theirs(t).input_ids != tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(t).ids
               for t in TRICKY) or family == "mbart"  # the file alone reads otherwise: the class decides
    for text in TRICKY:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs(text, add_special_tokens=special).input_ids
        ids = theirs(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    # the tokenizer.json file on its own still reads as the `tokenizers` library reads it
    raw = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    alone = lmkit.load_tokenizer(tmp_path / "tokenizer.json")
    assert all(alone.encode(t) == raw.encode(t).ids for t in TRICKY)


def test_classify_refuses_a_text_to_text_folder_in_one_line(t5_dir, capfd, tmp_path):
    (tmp_path / "train.csv").write_text("text,label\na,x\nb,y\nc,x\nd,y\n", encoding="utf-8")
    rc, out, err = cli(capfd, "finetune", "--model", t5_dir, "--train", str(tmp_path / "train.csv"),
                       "--eval", str(tmp_path / "train.csv"), "--out", str(tmp_path / "out"))
    assert rc == 2 and err.count("\n") == 1
    assert "holds an encoder-decoder model" in err and "needs an encoder" in err
    assert not (tmp_path / "out").exists()
