"""generate(..., grammar=...) and the engine constrain every new token with xgrammar's mask, for a byte-level BPE
(Qwen2-style) and a byte-fallback SentencePiece BPE (LLaMA-style) vocabulary: every row matches its grammar and ends at
an end token; lmkit's tokenizer and transformers' give xgrammar the same vocabulary (the same tokens); the engine
decodes what generate decodes; whitespace stays bounded even for a model that prefers it; `lmkit generate
--json-schema` prints JSON that validates."""
import json
import re

import pytest
import torch

import lmkit
from lmkit.errors import GenerationError

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")
from helpers.hf_folders import DECODER, byte_level_bpe, cli, spm_bpe  # noqa: E402

from lmkit.generation import GenerationConfig  # noqa: E402
from lmkit.generation.engine import Engine, Request  # noqa: E402
from lmkit.generation.grammar import MAX_WHITESPACE, GrammarConstraint  # noqa: E402

FLAT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kind": {"enum": ["x", "yé"]}, "ok": {"type": "boolean"}},
        "required": ["n", "kind", "ok"]}
GRAMMARS = [({"json_schema": FLAT}, lambda t: jsonschema.validate(json.loads(t), FLAT) is None),
            ({"regex": r"[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
            ({"choice": ["yes", "no", "naïve café"]}, lambda t: t in ("yes", "no", "naïve café")),
            ({"grammar": 'root ::= "(" [1-9] ("," [1-9])* ")"'}, lambda t: re.fullmatch(r"\(\d(,\d)*\)", t))]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def folder(request, tmp_path_factory):
    T, out = transformers, tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    decoder = {**DECODER, "max_position_embeddings": 256}
    if request.param == "qwen2":
        tok = T.Qwen2TokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None)
        model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, **decoder))
    else:
        tok = T.LlamaTokenizerFast(tokenizer_object=spm_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, **decoder))
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def loaded(folder):
    return lmkit.load_model(folder), lmkit.load_tokenizer(folder)


def test_the_vocabulary_xgrammar_sees_is_the_one_it_reads_from_transformers(loaded, folder):
    from lmkit.generation.grammar import _tokenizer_info

    model, tok = loaded
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = _tokenizer_info(xgrammar, tok, model.config.vocab_size)
    theirs = xgrammar.TokenizerInfo.from_huggingface(hf_tok, vocab_size=model.config.vocab_size)
    assert ours.vocab_type == theirs.vocab_type and ours.add_prefix_space == theirs.add_prefix_space
    differ = [i for i, (a, b) in enumerate(zip(ours.decoded_vocab, theirs.decoded_vocab)) if a != b]
    named = {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}  # the special added tokens
    assert differ and set(differ) <= named and all(ours.decoded_vocab[i] == b"" for i in differ)


def _new(tok, row, start):
    return tok.decode([t for t in row[start:].tolist() if t != tok.eos_token_id])  # byte pieces may count as special


@pytest.mark.parametrize("grammar, holds", GRAMMARS, ids=[next(iter(g)) for g, _ in GRAMMARS])
def test_every_row_matches_and_ends(loaded, folder, grammar, holds):
    model, tok = loaded
    first = tok.encode("hello world")
    ids = torch.tensor([first, first[::-1]])
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=80, do_sample=True, top_k=0, num_return_sequences=2, tokenizer=tok,
                         grammar=grammar)
    eos = model.config.eos_token_id
    for row in out:
        assert eos in row[ids.shape[1]:].tolist()  # the grammar completed and the row ended there
        assert holds(_new(tok, row, ids.shape[1])), _new(tok, row, ids.shape[1])
    greedy = model.generate(ids[:1], max_new_tokens=80, tokenizer=tok, grammar=grammar)
    assert holds(_new(tok, greedy[0], ids.shape[1]))
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)  # xgrammar reading transformers' tokenizer itself
    torch.manual_seed(0)
    same = model.generate(ids, max_new_tokens=80, do_sample=True, top_k=0, num_return_sequences=2, tokenizer=hf_tok,
                          grammar=grammar)
    assert torch.equal(same, out)


def test_the_engine_decodes_what_generate_decodes(loaded):
    model, tok = loaded
    grammar = {"json_schema": FLAT}
    prompts = [tok.encode("hello world"), tok.encode("The quick brown fox")]
    engine = Engine(model, max_batch=4, prefill_chunk=8)
    requests = []
    for i, prompt in enumerate(prompts):
        config = GenerationConfig(max_new_tokens=60, do_sample=True, top_k=0)
        requests.append(Request(prompt=prompt, config=config, seed=i, processors=[GrammarConstraint.build(
            tok, model.config.vocab_size, grammar, 1, len(prompt), [model.config.eos_token_id])]))
        requests.append(Request(prompt=prompt, config=GenerationConfig(max_new_tokens=20)))  # a free row beside it
    engine.run_all(requests)
    for i, prompt in enumerate(prompts):
        torch.manual_seed(i)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=True, top_k=0, tokenizer=tok,
                                  grammar=grammar)[0, len(prompt):].tolist()
        assert requests[2 * i].output == expected
        free = model.generate(torch.tensor([prompt]), max_new_tokens=20)[0, len(prompt):].tolist()
        assert requests[2 * i + 1].output == free[:len(requests[2 * i + 1].output)]


def test_whitespace_is_bounded_for_a_model_that_prefers_it(loaded):
    model, tok = loaded
    spaces = [i for i in range(tok.vocab_size) if (tok.decode([i]) or "x").isspace()]
    assert spaces
    bias = [[[i], 50.0] for i in spaces]
    ids = torch.tensor([tok.encode("hello")])
    for any_space in (True, False):
        grammar = {"json_schema": FLAT} if any_space else lmkit.generation.grammar.Grammar("json_schema", FLAT, False)
        out = model.generate(ids, max_new_tokens=120, sequence_bias=bias, tokenizer=tok, grammar=grammar)
        text = _new(tok, out[0], ids.shape[1])
        jsonschema.validate(json.loads(text), FLAT)
        longest = max((len(m) for m in re.findall(r"\s+", text)), default=0)
        assert longest <= (MAX_WHITESPACE if any_space else 1), repr(text)
        if any_space:
            assert longest == MAX_WHITESPACE  # the model took all the room it had, and still finished


def test_bad_grammars_are_refused(loaded):
    model, tok = loaded
    ids = torch.tensor([tok.encode("hi")])
    for grammar, needle in (({"json_schema": {"type": "objectx"}}, "objectx"), ({"regex": "[a-"}, "regex"),
                            ({"grammar": "root ::= nothing"}, "nothing"), ({"yaml": "x"}, "kind")):
        with pytest.raises(GenerationError, match=needle):
            model.generate(ids, max_new_tokens=3, tokenizer=tok, grammar=grammar)
    with pytest.raises(GenerationError, match="tokenizer"):
        model.generate(ids, max_new_tokens=3, grammar={"regex": "a+"})
    with pytest.raises(GenerationError, match="num_beams"):
        model.generate(ids, max_new_tokens=3, num_beams=2, tokenizer=tok, grammar={"regex": "a+"})
    with pytest.raises(GenerationError, match="prompt_lookup"):
        model.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=2, tokenizer=tok, grammar={"regex": "a+"})


def test_cli_json_schema(folder, tmp_path, capfd):
    if folder.name.startswith("llama"):
        pytest.skip("this helper folder's byte pieces are special tokens, which the printed text skips (as transformers)")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(FLAT))
    rc, out, _ = cli(capfd, "generate", "--model", str(folder), "--prompt", "data:", "--json-schema", str(schema),
                     "--max-new-tokens", "80")
    assert rc == 0 and out.startswith("data:")
    jsonschema.validate(json.loads(out[len("data:"):]), FLAT)
    (tmp_path / "bad.json").write_text("{not json")
    rc, _, err = cli(capfd, "generate", "--model", str(folder), "--prompt", "x", "--json-schema",
                     str(tmp_path / "bad.json"))
    assert rc == 2 and "is not JSON" in err and len(err.strip().splitlines()) == 1
