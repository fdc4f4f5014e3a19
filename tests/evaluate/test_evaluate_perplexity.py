"""Perplexity and bits per byte of evaluate_rows against a hand computation, row by row without padding."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lmkit.config import get_preset
from lmkit.errors import LmkitError
from lmkit.evaluate.perplexity import evaluate_rows
from lmkit.models import build_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(get_preset("tiny", vocab_size=50, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)).eval()


def _rows(lens, width=9):
    g = torch.Generator().manual_seed(1)
    rows, mask = torch.zeros((len(lens), width), dtype=torch.long), torch.zeros((len(lens), width), dtype=torch.long)
    for i, n in enumerate(lens):  # BOS (1), then n - 1 tokens, right-padded with 0
        rows[i, 0], mask[i, :n] = 1, 1
        rows[i, 1:n] = torch.randint(2, 50, (n - 1,), generator=g)
    return rows, mask


def test_loss_is_token_weighted_mean_and_bpb_total_nats(model):
    lens = [9, 3, 2, 9, 5, 1, 7]  # very unequal rows (one BOS alone) so a mean of batch means would differ
    rows, mask = _rows(lens)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, n in enumerate(lens):
            if n > 1:
                logp = torch.log_softmax(model(rows[i:i + 1, :n - 1]).logits.double(), -1)[0]
                total -= float(logp[torch.arange(n - 1), rows[i, 1:n]].sum())
                count += n - 1
    for batch_size in (1, 2, 3, 16):
        r = evaluate_rows(model, rows, mask, 123, batch_size=batch_size)
        assert r["tokens"] == count == 29
        assert r["loss"] == pytest.approx(total / count, rel=1e-6)
        assert r["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
        assert r["bpb"] == pytest.approx(total / math.log(2) / 123, rel=1e-6)


def test_nothing_to_score_is_a_clear_error(model):
    rows, mask = _rows([1, 1])
    with pytest.raises(LmkitError, match="nothing to score"):
        evaluate_rows(model, rows, mask, 10)
    with pytest.raises(LmkitError, match="nothing to score"):
        evaluate_rows(model, rows[:0], mask[:0], 0)


def test_evaluate_text_reads_a_tokenizer_without_a_pad_token(model):
    """GPT-2's own tokenizer has <|endoftext|> but no <|pad|>: padding is masked, so the numbers do not change."""
    from lmkit.data.corpus import Corpus, Document
    from lmkit.evaluate.perplexity import evaluate_text
    from lmkit.tokenizers import train_tokenizer

    texts = ["def f(x):\n    return x + 1\n" * 3, "a short one", "class A:\n    pass\n" * 5]
    corpus = Corpus("small", [Document(f"d{i}", t) for i, t in enumerate(texts)])
    with_pad = train_tokenizer(texts, kind="char", vocab_size=50, special_tokens=["<|endoftext|>", "<|pad|>"])
    without = train_tokenizer(texts, kind="char", vocab_size=50, special_tokens=["<|endoftext|>", "<pad>"])
    a = evaluate_text(model, with_pad, corpus, seq_len=16)
    b = evaluate_text(model, without, corpus, seq_len=16)
    assert a == pytest.approx(b)


def _guide_nll(model, seq: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """(nats, tokens) of transformers' perplexity guide for fixed-length models on one token sequence,
    summed exactly: each window's labels are its last trg_len tokens, shifted inside the model."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(seq), stride):
        end = min(begin + max_length, len(seq))
        ids = seq[begin:end][None]
        labels = ids.clone()
        labels[:, :-(end - prev_end)] = -100
        with torch.no_grad():
            logits = model(ids).logits.double()
        logp = torch.log_softmax(logits[:, :-1], -1)
        target = labels[:, 1:]
        keep = target != -100
        nll -= float(logp[keep].gather(-1, target[keep][:, None]).sum())
        count += int(keep.sum())
        prev_end = end
        if end == len(seq):
            break
    return nll, count


@pytest.mark.parametrize("stride", [1, 5, 11])
def test_strided_evaluation_equals_transformers_perplexity_guide(tmp_path, stride):
    """`evaluate_text(stride=...)` on a GPT-2 folder: the nats and token count of transformers' sliding-window
    recipe, run with transformers' own GPT2LMHeadModel on each document (BOS first)."""
    import transformers

    import lmkit
    from lmkit.data.corpus import Corpus, Document
    from lmkit.evaluate.perplexity import evaluate_text
    from lmkit.tokenizers import train_tokenizer

    texts = ["def f(x):\n    return x + 1\n" * 4, "é", "", "class A:\n    pass  # ünïcode ✓\n" * 6, "abcdefghijkl"]
    tok = train_tokenizer(texts, kind="char", vocab_size=60, special_tokens=["<|endoftext|>", "<|pad|>"])
    context = 12
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=60, n_positions=context, n_embd=24, n_layer=2,
                                                              n_head=2)).eval()
    hf.save_pretrained(tmp_path)
    model = lmkit.load_model(tmp_path)
    r = evaluate_text(model, tok, Corpus("c", [Document(f"d{i}", t) for i, t in enumerate(texts)]), stride=stride,
                      batch_size=4)
    bos = tok.token_to_id("<|endoftext|>")
    nll, count = 0.0, 0
    for text in texts:
        part = _guide_nll(hf, torch.tensor([bos] + tok.encode(text, add_special_tokens=False)), context, stride)
        nll, count = nll + part[0], count + part[1]
    assert r["tokens"] == count == sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    assert r["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert r["bpb"] == pytest.approx(nll / math.log(2) / sum(len(t.encode()) for t in texts), rel=1e-5)


def test_strided_windows_give_each_token_its_context(model):
    """Every token is scored once, and with at least context - stride tokens before it where the
    document has them; a stride outside 1 .. context - 1 is a clear error."""
    from lmkit.data.stream import TokenizedCorpus, strided_rows

    lengths = [0, 1, 15, 16, 17, 40]
    tokens = np.arange(sum(lengths), dtype=np.int32) % 40 + 5
    tc = TokenizedCorpus(tokens, np.concatenate([[0], np.cumsum(lengths)]), np.array(lengths))
    for stride in (1, 4, 15):
        rows, mask = strided_rows(tc, 1, 0, 16, stride)
        assert int(mask.sum()) == sum(lengths)
        seen = []
        for row, m in zip(rows, mask):
            for p in m.nonzero().flatten().tolist():
                assert p >= 1 and (p >= 16 - stride or row[0] == 1)  # full context, or the window starts the document
                seen.append(int(row[p]))
        assert seen == tokens.tolist()  # in document order
    for bad in (0, 16, 17):
        with pytest.raises(LmkitError, match="stride"):
            strided_rows(tc, 1, 0, 16, bad)


def test_a_pretrained_llama_folder_is_scored_after_its_own_bos(tmp_path):
    """A LLaMA folder whose tokenizer has <s> and no <|endoftext|> / <|pad|> (it was refused): each document is read
    after <s>, and the loss equals LlamaForCausalLM's on the same ids; `finetune --task clm` reads it the same way."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import lmkit
    from lmkit.data.corpus import Corpus, Document
    from lmkit.evaluate.perplexity import evaluate_text
    from lmkit.finetune.clm import CausalLMData

    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog. ✓"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)).eval()
    hf.save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)
    model, mine = lmkit.load_model(tmp_path), lmkit.load_tokenizer(tmp_path)
    r = evaluate_text(model, mine, Corpus("c", [Document(f"d{i}", t) for i, t in enumerate(texts)]))
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([[hf_tok.bos_token_id] + hf_tok(text, add_special_tokens=False).input_ids])
            n = ids.shape[1] - 1
            nll, count = nll + float(hf(ids, labels=ids).loss) * n, count + n
    assert r["tokens"] == count and r["loss"] == pytest.approx(nll / count, rel=1e-5)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts * 3), encoding="utf-8")
    data = CausalLMData(mine, str(tmp_path / "docs.jsonl"), seq_len=16)
    assert (data.bos, data.pad) == (hf_tok.bos_token_id, hf_tok.bos_token_id)
