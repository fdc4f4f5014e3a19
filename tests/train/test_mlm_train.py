"""`--objective mlm` through the trainer: small bert/roberta presets on a slice of the built-in corpus."""
from __future__ import annotations

import json

import pytest
import torch

import lmkit
from lmkit.objectives import IGNORE_INDEX
from lmkit.train.config import TrainConfig
from lmkit.train.objectives import get_objective
from lmkit.train.trainer import Trainer

SMALL = dict(d_model=32, n_layers=2, n_heads=2, d_ff=64, dropout=0.0, attention_dropout=0.0)
CORPUS_DOCS = 40  # the corpus_file fixture (conftest.py)


@pytest.mark.parametrize("preset", ["bert", "roberta"])
def test_mlm_training_learns_and_saves_a_loadable_model(corpus_file, tmp_path, preset):
    cfg = TrainConfig(preset=preset, objective="mlm", corpus=[corpus_file], out=str(tmp_path / preset), max_steps=8,
                      batch_size=8, seq_len=32, lr=3e-3, warmup_steps=1, vocab_size=400, precision="fp32",
                      progress=False, model_overrides=SMALL)
    trainer = Trainer(cfg)
    mask_id = trainer.tokenizer.token_to_id("<|mask|>")
    assert mask_id is not None and mask_id < trainer.model.config.vocab_size
    result = trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and "val_loss" in rows[-1]
    assert result["step"] == 8
    model = lmkit.load_model(tmp_path / preset)
    assert model.head == "mlm" and model.config.family == preset
    tok = lmkit.load_tokenizer(tmp_path / preset)
    assert tok.token_to_id("<|mask|>") == mask_id


def test_mlm_batches_mask_only_real_tokens(corpus_file, tmp_path):
    cfg = TrainConfig(preset="bert", objective="mlm", corpus=[corpus_file], out=str(tmp_path / "b"), max_steps=1,
                      batch_size=4, seq_len=32, vocab_size=400, precision="fp32", progress=False, model_overrides=SMALL)
    trainer = Trainer(cfg)
    rows = trainer.stream.rows(0, 0, 64)
    gen = torch.Generator().manual_seed(0)
    batch = trainer.objective.build_batch(rows, trainer.pad_id, gen)
    assert batch["input_ids"].shape == (64, 32)
    chosen = batch["labels"] != IGNORE_INDEX
    assert not chosen[rows[:, :-1] == trainer.bos_id].any()  # BOS separators are never chosen
    assert 0.10 < chosen.float().mean() < 0.20
    again = trainer.objective.build_batch(rows, trainer.pad_id, torch.Generator().manual_seed(1))
    assert not torch.equal(again["labels"], batch["labels"])  # a new mask every step
    assert get_objective("mlm").architecture == "encoder"


def test_bert_tiny_preset_trains_into_a_folder_transformers_reads(corpus_file, tmp_path):
    """`--preset bert-tiny`: BERT's architecture at BERT-Tiny's size; the run's folder is a BertForMaskedLM."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "tiny"
    cfg = TrainConfig(preset="bert-tiny", objective="mlm", corpus=[corpus_file], out=str(out), max_steps=3,
                      batch_size=8, seq_len=32, vocab_size=400, precision="fp32", progress=False)
    Trainer(cfg).fit()
    ours = lmkit.load_model(out)
    c = ours.config
    assert (c.family, c.d_model, c.n_layers, c.n_heads, c.d_ff) == ("bert", 128, 2, 2, 512)
    hf = transformers.BertForMaskedLM.from_pretrained(out).eval()
    ids = torch.randint(5, c.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)


def test_mlm_run_folder_loads_in_auto_tokenizer_with_its_mask_token(corpus_file, tmp_path):
    """AutoTokenizer on the run folder reads lmkit's special tokens (tokenizer_config.json), not BertTokenizer's
    [UNK]/[MASK] defaults that the byte-level vocabulary lacks; ids and logits agree with lmkit's."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "tiny"
    cfg = TrainConfig(preset="bert-tiny", objective="mlm", corpus=[corpus_file], out=str(out), max_steps=1,
                      batch_size=4, seq_len=32, vocab_size=400, precision="fp32", progress=False)
    Trainer(cfg).fit()
    ours, tok = lmkit.load_model(out).eval(), lmkit.load_tokenizer(out)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.mask_token == "<|mask|>" and auto.mask_token_id == tok.token_to_id("<|mask|>")
    assert len(auto) == ours.config.vocab_size
    texts = ["def f(x): return x + 1", "a longer line of text to pad the other one against"]
    enc = auto(texts, padding=True, return_tensors="pt")
    assert enc["input_ids"][0][:enc["attention_mask"][0].sum()].tolist() == tok.encode(texts[0])
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(**enc).logits
        got = ours(enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    keep = enc["attention_mask"].bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=1e-4, rtol=0)


def test_lmkit_eval_scores_a_masked_lm_run_as_its_training_does(corpus_file, tmp_path, capsys):
    """`lmkit eval` on an mlm run prints the masked-token loss that the run's validation reported (it used to
    score the encoder's outputs as next-token predictions); --stride, a causal-LM reading, is refused."""
    from lmkit.cli import main

    cfg = TrainConfig(preset="bert", objective="mlm", corpus=[corpus_file], out=str(tmp_path / "run"), max_steps=3,
                      batch_size=8, seq_len=32, lr=3e-3, warmup_steps=1, vocab_size=400, precision="fp32",
                      progress=False, model_overrides=SMALL)
    result = Trainer(cfg).fit()
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "run")]) == 0
    printed = {line[:15].strip(): float(line[15:].split()[0]) for line in capsys.readouterr().out.splitlines()[1:]}
    assert printed["masked loss"] == pytest.approx(result["val_masked_loss"], abs=1e-4)
    assert printed["masked acc"] == pytest.approx(result["val_masked_accuracy"], abs=1e-4)
    assert 0 <= printed["masked acc"] <= 1
    assert "perplexity" not in printed and "bits per byte" not in printed  # no reading of a masked LM's loss as text's
    assert main(["eval", "--model", str(tmp_path / "run"), "--stride", "8"]) == 2
    assert "--stride applies to causal language models" in capsys.readouterr().err


def test_lmkit_eval_scores_a_pretrained_bert_folder_with_its_own_mask_token(tmp_path, capsys):
    """A BertForMaskedLM folder whose tokenizer has [CLS]/[MASK] and no lmkit tokens (it was refused): rows start
    with [CLS], [MASK] hides the tokens, and the printed loss is transformers' on the batch lmkit masked."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from lmkit.cli import main
    from lmkit.data.corpus import Corpus, Document
    from lmkit.data.stream import eval_rows, tokenize_corpus

    texts = ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over the lazy dog."]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts * 20, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    hf_tok = transformers.BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                            pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(hf_tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "bert")
    hf_tok.save_pretrained(tmp_path / "bert")
    text = " ".join(texts * 8)
    (tmp_path / "held_out.txt").write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "bert"), "--corpus", str(tmp_path / "held_out.txt")]) == 0
    printed = {line[:15].strip(): float(line[15:].split()[0]) for line in capsys.readouterr().out.splitlines()[1:]}

    mine = lmkit.load_tokenizer(tmp_path / "bert")
    task = get_objective("mlm").prepare(mine)
    rows, mask, _ = eval_rows(tokenize_corpus(Corpus("c", [Document(str(tmp_path / "held_out.txt"), text)]), mine),
                              hf_tok.cls_token_id, hf_tok.pad_token_id, 64)
    batch = task.build_batch(rows, hf_tok.pad_token_id, torch.Generator().manual_seed(1234))
    hidden = batch["labels"] != IGNORE_INDEX
    assert hidden.any() and (batch["input_ids"][hidden] == hf_tok.mask_token_id).any()
    assert int(batch["input_ids"].max()) < len(hf_tok) and bool((rows[:, 0] == hf_tok.cls_token_id).all())
    with torch.no_grad():
        out = hf(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    assert printed["masked loss"] == pytest.approx(float(out.loss), abs=1e-4)
    right = (out.logits.argmax(-1)[hidden] == batch["labels"][hidden]).float().mean()
    assert printed["masked acc"] == pytest.approx(float(right), abs=1e-4)


def test_lmkit_eval_refuses_a_masked_lm_folder_whose_tokenizer_has_no_mask_token(tmp_path, capsys):
    """A BertForMaskedLM folder whose tokenizer lacks a mask token: scoring it would mask with a `<|mask|>` added past
    the model's vocabulary (an IndexError deep in the embedding); one clear error instead, the tokenizer's size kept."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from lmkit.cli import main

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20, trainers.WordPieceTrainer(
        vocab_size=100, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                  cls_token="[CLS]", sep_token="[SEP]")
    transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=len(hf_tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32)).save_pretrained(tmp_path / "bert")
    hf_tok.save_pretrained(tmp_path / "bert")
    (tmp_path / "held_out.txt").write_text("the lazy dog jumps over the quick brown fox. " * 4, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "bert"), "--corpus", str(tmp_path / "held_out.txt")]) == 2
    assert "the tokenizer has no mask token for --objective mlm" in capsys.readouterr().err


def test_longformer_tiny_preset_trains_into_a_folder_transformers_reads(corpus_file, tmp_path):
    """`--preset longformer-tiny --objective mlm`: sequences longer than the 64-token window, global tokens none; the
    run's folder is a LongformerForMaskedLM with the same logits, global tokens given or not."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "lf"
    cfg = TrainConfig(preset="longformer-tiny", objective="mlm", corpus=[corpus_file], out=str(out), max_steps=3,
                      batch_size=4, seq_len=150, lr=3e-3, warmup_steps=1, vocab_size=400, precision="fp32",
                      progress=False)
    Trainer(cfg).fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    ours = lmkit.load_model(out).eval()
    assert ours.config.sparse.attention_window == [64, 64] and ours.config.family == "longformer"
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LongformerForMaskedLM"
    ids = torch.randint(5, ours.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    glob = torch.zeros_like(ids)
    glob[:, [0, 99]] = 1
    with torch.no_grad():
        for kwargs in ({}, {"global_attention_mask": glob}):
            torch.testing.assert_close(ours(ids, **kwargs).logits, hf(ids, **kwargs).logits, atol=1e-4, rtol=0)
