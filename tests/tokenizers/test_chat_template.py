"""Chat templates: lmkit's apply_chat_template against transformers' on every template in the TRL wheel, on
folders saved by transformers (byte-level BPE and a SentencePiece-style Unigram), and the template files."""
import json
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

import lmkit  # noqa: E402
from lmkit.errors import LmkitError  # noqa: E402
from lmkit.tokenizers.chat_render import ChatTemplateError  # noqa: E402

TEMPLATES = sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja"))
SPECIAL = re.compile(r"<\|[^|\s'\"]{1,40}\|>|<｜[^｜]{1,40}｜>|<(?:start|end)_of_[a-z]+>|<end_of_utterance>|\[/?INST\]")
CORPUS = ["Hello there, how are you today? I am fine.", "The quick brown fox jumps over the lazy dog. " * 3,
          "def f(x):\n    return {'a': [1, 2, 3]}\n", "Paris weather: 21°C, sunny ☀️ — très bien. 中文 测试",
          "user assistant system tool function arguments name content role", "  spaces\n\n\ttabs and\r\nlines  "]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "the city"}},
                                               "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CHATS = {
    "one_user": [{"role": "user", "content": "Hi!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
               {"role": "assistant", "content": "4."}],
    "turns_unicode": [{"role": "user", "content": "Bonjour, ça va ? 你好"}, {"role": "assistant", "content": "Très bien ☀️!"},
                      {"role": "user", "content": "  and  spaces\n\nnewlines  "},
                      {"role": "assistant", "content": "Noted <b>&amp;</b> \"quoted\"."}],
    "empty": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "name": "get_weather", "content": "21°C"},
              {"role": "assistant", "content": "It is 21°C."}],
}


def _trained(kind: str) -> HFTokenizer:
    if kind == "bpe":
        tk = HFTokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        tk = HFTokenizer(models.Unigram())
        tk.normalizer = normalizers.NFKC()
        tk.pre_tokenizer = pre_tokenizers.Metaspace()
        tk.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=300, unk_token="<unk>", special_tokens=["<unk>"],
                                          show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    return tk


def _folder(tmp: Path, kind: str, template: str) -> Path:
    """A folder written by transformers' save_pretrained: the template's control tokens added as special tokens."""
    found = sorted(set(SPECIAL.findall(template)))
    bos = next((t for t in ("<|begin_of_text|>", "<bos>", "<|startoftext|>") if t in template), "<s>")
    eos = next((t for t in ("<|eot_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "<end_of_turn>", "<|end|>")
                if t in template), "</s>")
    hf = PreTrainedTokenizerFast(tokenizer_object=_trained(kind), bos_token=bos, eos_token=eos, pad_token="<pad>",
                                 extra_special_tokens=[t for t in found if t not in (bos, eos)])
    hf.chat_template = template
    hf.save_pretrained(tmp)
    return tmp


def _call(tok, chat, **kw):
    try:
        return tok.apply_chat_template(chat, **kw)
    except Exception as exc:  # transformers raises jinja's or ValueError; lmkit one ChatTemplateError
        return ("error", exc)


def _same(ours, theirs, what):
    if isinstance(theirs, tuple) and theirs[0] == "error":
        assert isinstance(ours, tuple) and isinstance(ours[1], ChatTemplateError), (what, theirs, ours)
        assert "\n" not in str(ours[1])
        return
    assert not (isinstance(ours, tuple) and ours[0] == "error"), (what, ours)
    if isinstance(theirs, (str, list)):
        assert ours == theirs, what
    else:
        assert {k: list(v) for k, v in ours.items()} == {k: list(v) for k, v in dict(theirs).items()}, what


def _compare(folder: Path, template: str):
    ours, theirs = lmkit.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.chat_template == template
    masks = "{% generation %}" in template or "{%- generation %}" in template
    checked = 0
    for name, chat in CHATS.items():
        tools = TOOLS if name == "tools" else None
        for kw in ({"tokenize": False}, {"tokenize": False, "add_generation_prompt": True}, {},
                   {"return_assistant_tokens_mask": masks}, {"return_dict": False, "add_generation_prompt": True}):
            what = (folder.name, name, kw)
            _same(_call(ours, chat, tools=tools, **kw), _call(theirs, chat, tools=tools, **kw), what)
            checked += 1
        if chat[-1]["role"] == "assistant" and chat[-1]["content"]:
            kw = {"continue_final_message": True, "tokenize": False}
            _same(_call(ours, chat, **kw), _call(theirs, chat, **kw), (folder.name, name, kw))
    batch = [CHATS["system"], CHATS["turns_unicode"]]
    kw = {"padding": True, "return_assistant_tokens_mask": masks}
    _same(_call(ours, batch, **kw), _call(theirs, batch, **kw), (folder.name, "batch", kw))
    return checked


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_every_trl_template_renders_and_encodes_as_transformers(path, tmp_path):
    template = path.read_text(encoding="utf-8")
    assert _compare(_folder(tmp_path, "bpe", template), template) > 0


@pytest.mark.parametrize("stem", ["llama3_training", "qwen3_training", "gemma_training", "phi3_training"])
def test_sentencepiece_style_folders_match_transformers(stem, tmp_path):
    path = next(p for p in TEMPLATES if p.stem == stem)
    template = path.read_text(encoding="utf-8")
    _compare(_folder(tmp_path, "unigram", template), template)


def test_assistant_masks_cover_exactly_the_generation_spans(tmp_path):
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")
    folder = _folder(tmp_path, "bpe", template)
    tok = lmkit.load_tokenizer(folder)
    out = tok.apply_chat_template(CHATS["turns_unicode"], return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "Très bien ☀️!<|im_end|>Noted <b>&amp;</b> \"quoted\".<|im_end|>"
    assert out["attention_mask"] == [1] * len(ids)


def test_named_templates_files_and_legacy_config(tmp_path):
    default, tool = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "TOOLS {{ tools | tojson }}"
    hf = PreTrainedTokenizerFast(tokenizer_object=_trained("bpe"), bos_token="<s>", eos_token="</s>")
    hf.chat_template = {"default": default, "tool_use": tool}
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "additional_chat_templates" / "tool_use.jinja").is_file()
    tok = lmkit.load_tokenizer(tmp_path / "hf")
    assert tok.chat_template == {"default": default, "tool_use": tool}
    chat = [{"role": "user", "content": "<a & b>"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "<s><a & b>"
    assert tok.apply_chat_template(chat, tools=TOOLS, tokenize=False) == "TOOLS " + json.dumps(TOOLS,
                                                                                              ensure_ascii=False)
    assert tok.apply_chat_template(chat, chat_template="tool_use", tokenize=False).startswith("TOOLS")
    # lmkit writes them where transformers reads them
    tok.save_pretrained(tmp_path / "ours")
    again = AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert again.chat_template == {"default": default, "tool_use": tool}
    # legacy forms: a string or a list of {name, template} in tokenizer_config.json, and chat_template.json
    for legacy, expect in ((default, default), ([{"name": "default", "template": default},
                                                 {"name": "tool_use", "template": tool}], {"default": default,
                                                                                          "tool_use": tool})):
        folder = tmp_path / f"legacy{len(str(legacy))}"
        lmkit.load_tokenizer(tmp_path / "hf").save_pretrained(folder)
        for p in [folder / "chat_template.jinja", *(folder / "additional_chat_templates").glob("*")]:
            p.unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": legacy}))
        assert lmkit.load_tokenizer(folder).chat_template == expect
        assert AutoTokenizer.from_pretrained(folder).chat_template == expect
        (folder / "chat_template.jinja").write_text("FILE WINS")
        assert lmkit.load_tokenizer(folder).chat_template == "FILE WINS"
    folder = tmp_path / "processor"
    lmkit.load_tokenizer(tmp_path / "hf").save_pretrained(folder)
    for p in [folder / "chat_template.jinja", *(folder / "additional_chat_templates").glob("*")]:
        p.unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": default}))
    assert lmkit.load_tokenizer(folder).chat_template == default


def test_raise_exception_and_misuse_are_one_line_errors(tmp_path):
    tok = lmkit.load_tokenizer(_folder(tmp_path, "bpe", "{{ raise_exception('Roles must alternate\nuser/assistant') }}"))
    with pytest.raises(ChatTemplateError, match=r"chat template 'default': Roles must alternate user/assistant") as e:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(e.value) and isinstance(e.value, LmkitError)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="do not go together"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                continue_final_message=True)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_refuses_attribute_escapes(tmp_path):
    tok = lmkit.load_tokenizer(_folder(tmp_path, "bpe", "{{ messages.__class__.__mro__ }}"))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    with pytest.raises(ChatTemplateError, match="underscore"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                chat_template="{% set ns = namespace(_x=1) %}")


def test_kwargs_and_special_tokens_are_template_variables(tmp_path):
    tok = lmkit.load_tokenizer(_folder(tmp_path, "bpe", "{{ bos_token }}|{{ eos_token }}|{{ flavour }}|{{ strftime_now('%Y') }}"))
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, flavour="mint", eos_token="E")
    assert re.fullmatch(r"<s>\|E\|mint\|\d{4}", text)
    ids = tok.apply_chat_template([{"role": "user", "content": "x"}], return_dict=False, flavour="m")
    assert ids.count(tok.token_to_id("<s>")) == 1  # the template's BOS, no second one added


def _arrays_equal(ours, theirs, what):
    import numpy as np

    assert type(ours) is np.ndarray and type(theirs) is np.ndarray, what
    assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), what
    if ours.dtype == object:  # rows of unequal length: one int64 array per row
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours, theirs)), what
    else:
        assert np.array_equal(ours, theirs), what


@pytest.mark.parametrize("kind, stem", [("bpe", "qwen2_5_training"), ("bpe", "llama3_training"),
                                        ("unigram", "phi3_training")])
def test_numpy_tensors_match_transformers(kind, stem, tmp_path):
    """return_tensors='np': the dtype, shape and values of transformers' arrays, single and batched, padded (both
    sides, to a fixed length), truncated, ragged, with assistant masks; 'pt' is refused (the tokenizers package never
    imports torch) and torch.from_numpy of the 'np' arrays gives transformers' 'pt' tensors."""
    import torch

    template = next(p for p in TEMPLATES if p.stem == stem).read_text(encoding="utf-8")
    folder = _folder(tmp_path, kind, template)
    ours, theirs = lmkit.load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    batch = [CHATS["system"], CHATS["turns_unicode"], CHATS["one_user"]]
    cases = [(CHATS["system"], {}), (CHATS["system"], {"return_assistant_tokens_mask": True}),
             (CHATS["one_user"], {"padding": "max_length", "max_length": 90}),
             (CHATS["turns_unicode"], {"truncation": True, "max_length": 17, "return_assistant_tokens_mask": True}),
             (batch, {}), (batch, {"return_assistant_tokens_mask": True}),
             (batch, {"padding": True, "return_assistant_tokens_mask": True}),
             (batch, {"padding": True, "tokenizer_kwargs": {"padding_side": "left"}, "return_assistant_tokens_mask": True}),
             (batch, {"padding": "max_length", "max_length": 64, "truncation": True, "return_assistant_tokens_mask": True}),
             (batch, {"padding": True, "tokenizer_kwargs": {"pad_to_multiple_of": 16}}),
             (CHATS["system"], {"return_dict": False}), (batch, {"return_dict": False, "padding": True})]
    for chat, kw in cases:
        what = (stem, kw)
        mine = ours.apply_chat_template(chat, return_tensors="np", **kw)
        hf = theirs.apply_chat_template(chat, return_tensors="np", **kw)
        if not kw.get("return_dict", True):
            mine, hf = {"input_ids": mine}, {"input_ids": hf}
        assert list(mine) == list(hf), what
        for key in hf:
            _arrays_equal(mine[key], hf[key], (what, key))
        if mine["input_ids"].dtype != object:  # torch makes no tensor of ragged rows
            pt = theirs.apply_chat_template(chat, return_tensors="pt", **kw)
            pt = pt if kw.get("return_dict", True) else {"input_ids": pt}
            assert all(torch.equal(torch.from_numpy(mine[k]), pt[k]) for k in pt), what
    assert ours.apply_chat_template(batch, return_tensors="np", tokenize=False) == \
           theirs.apply_chat_template(batch, return_tensors="np", tokenize=False)
    assert ours.apply_chat_template(batch, return_tensors="pt", tokenize=False) == \
           theirs.apply_chat_template(batch, return_tensors="pt", tokenize=False)  # text: no tensors to make
    with pytest.raises(ChatTemplateError, match="return_tensors='np' and torch.from_numpy"):
        ours.apply_chat_template(CHATS["system"], return_tensors="pt")
