"""`--objective fim`: the FIM layouts, the rewritten rows and a run whose folder transformers reads back."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import lmkit
from lmkit.cli import main
from lmkit.data.fim import SENTINELS, FimIds, fim_layout, fim_piece, infill_prompt, sentinel_ids, split_points
from lmkit.errors import GenerationError, TrainingError
from lmkit.objectives import IGNORE_INDEX
from lmkit.train.config import TrainConfig
from lmkit.train.objective import clm_batch
from lmkit.train.trainer import Trainer

SMALL = dict(d_model=32, n_layers=2, n_heads=2, d_ff=64, dropout=0.0, attention_dropout=0.0)
CORPUS_DOCS = 40
IDS = FimIds(prefix=901, middle=902, suffix=903, pad=904)


def test_the_layouts_are_bigcodes_psm_and_spm():
    p, m, s = [1, 2], [3], [4, 5, 6]
    assert fim_layout(p, m, s, IDS, spm=False) == [901, 1, 2, 903, 4, 5, 6, 902, 3]
    assert fim_layout(p, m, s, IDS, spm=True) == [901, 903, 4, 5, 6, 902, 1, 2, 3]


def test_split_points_are_sorted_and_cover_every_offset():
    gen = torch.Generator().manual_seed(0)
    seen = Counter()
    for _ in range(3000):
        a, b = split_points(5, lambda n: int(torch.randint(n, (1,), generator=gen)))
        assert 0 <= a <= b <= 5
        seen[a] += 1
        seen[b] += 1
    assert set(seen) == set(range(6))
    assert min(seen.values()) > 600  # 6000 offsets over 6 values: uniform, about 1000 each


@pytest.fixture(scope="module")
def trainer(corpus_file, tmp_path_factory):
    cfg = TrainConfig(preset="tiny", objective="fim", corpus=[corpus_file], out=str(tmp_path_factory.mktemp("fim") / "run"),
                      max_steps=6, batch_size=8, seq_len=48, lr=3e-3, warmup_steps=1, vocab_size=400,
                      precision="fp32", progress=False, model_overrides=SMALL, fim_rate=1.0)
    return Trainer(cfg)


def _pieces(row: list[int], bos: int) -> list[list[int]]:
    starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
    return [row[a + 1:b] for a, b in zip(starts, starts[1:])]


def _restore(piece: list[int], ids: FimIds, tok) -> str | None:
    """The text of a FIM piece put back in document order (None: not a FIM piece)."""
    if not piece or piece[0] != ids.prefix:
        return None
    piece = [t for t in piece if t != ids.pad]
    if piece[1] == ids.suffix:  # SPM: <P> <S> suffix <M> prefix+middle
        k = piece.index(ids.middle)
        return tok.decode(piece[k + 1:]) + tok.decode(piece[2:k])
    k, j = piece.index(ids.suffix), piece.index(ids.middle)
    return tok.decode(piece[1:k]) + tok.decode(piece[j + 1:]) + tok.decode(piece[k + 1:j])


def test_a_fim_piece_keeps_its_length_and_its_text(trainer):
    tok = trainer.tokenizer
    ids = sentinel_ids(tok)
    text = "def add(a, b):\n    return a + b  # ünïcode ✓\n"
    tokens = tok.encode(text, add_special_tokens=False)
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        cut = split_points(len(text), lambda n: int(torch.randint(n, (1,), generator=gen)))
        spm = trial % 2 == 1
        piece = fim_piece(tokens, tok, ids, cut, spm)
        assert len(piece) == len(tokens)
        if piece == tokens:
            continue  # the suffix had no room for the three sentinels
        assert (piece[1] == ids.suffix) == spm
        restored = _restore(piece, ids, tok)
        if ids.pad in piece:  # padded: nothing lost, the text comes back whole
            assert restored == text
        else:  # tokens cut from the suffix's end
            assert text.startswith(restored.rstrip("\ufffd"))  # the cut may split a character's bytes
        assert tok.decode([t for t in piece if t not in (ids.prefix, ids.suffix, ids.middle, ids.pad)]) != ""


def test_rows_keep_their_shape_and_pieces_their_text(trainer):
    tok, bos, pad = trainer.tokenizer, trainer.bos_id, trainer.pad_id
    ids = sentinel_ids(tok)
    rows = trainer.stream.rows(0, 0, 32)
    batch = trainer.objective.build_batch(rows, pad, torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (32, 48)
    made = 0
    for old, row, labels in zip(rows.tolist(), batch["input_ids"].tolist(), batch["labels"].tolist()):
        assert row[0] == bos and [t == bos for t in row] == [t == bos for t in old[:-1]]  # pieces stay in place
        full = row + [labels[-1] if labels[-1] != IGNORE_INDEX else ids.pad]
        for before, after in zip(_pieces(old, bos), _pieces(full, bos)):  # a row's last piece as the row holds it
            restored = _restore(after, ids, tok)
            if restored is None:
                assert after == before
                continue
            made += 1
            original = tok.decode(before)
            if ids.pad in after:
                assert restored == original
            else:
                assert original.startswith(restored.rstrip("\ufffd"))
        assert not {pad, ids.pad} & set(labels)  # targets: every next token but the padding
    assert made > 10


def test_rate_zero_is_clm_and_the_draws_follow_the_seed(trainer):
    rows = trainer.stream.rows(0, 1, 16)
    task = trainer.objective
    a = task.build_batch(rows, trainer.pad_id, torch.Generator().manual_seed(5))
    b = task.build_batch(rows, trainer.pad_id, torch.Generator().manual_seed(5))
    c = task.build_batch(rows, trainer.pad_id, torch.Generator().manual_seed(6))
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"], c["input_ids"])
    from lmkit.train.fim import FillInTheMiddle
    plain = FillInTheMiddle(trainer.tokenizer, sentinel_ids(trainer.tokenizer), 0.0, 0.5)
    got, want = plain.build_batch(rows, trainer.pad_id), clm_batch(rows, trainer.pad_id)
    assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])


def test_the_spm_share_follows_fim_spm_rate(trainer):
    from lmkit.train.fim import FillInTheMiddle
    ids = sentinel_ids(trainer.tokenizer)
    rows = trainer.stream.rows(0, 2, 128)
    for spm_rate in (0.0, 0.25, 1.0):
        task = FillInTheMiddle(trainer.tokenizer, ids, 1.0, spm_rate)
        out = task.build_batch(rows, trainer.pad_id, torch.Generator().manual_seed(1))["input_ids"]
        leads = (out[:, :-1] == ids.prefix)
        spm = int((leads & (out[:, 1:] == ids.suffix)).sum())
        total = int(leads.sum())
        assert total > 40
        assert abs(spm / total - spm_rate) < 0.15


def test_fim_rates_are_checked(capsys):
    from lmkit.train.objectives import get_objective
    with pytest.raises(TrainingError, match="--fim-rate must be between 0 and 1"):
        get_objective("fim").configured(TrainConfig(objective="fim", fim_rate=1.5))
    assert main(["train", "--fim-spm-rate", "0.2", "--preset", "tiny"]) == 2
    assert "only --objective fim reads it" in capsys.readouterr().err


def test_a_fim_run_learns_and_saves_sentinels_transformers_reads(trainer, capsys):
    transformers = pytest.importorskip("transformers")
    ids = sentinel_ids(trainer.tokenizer)
    assert max(ids.prefix, ids.middle, ids.suffix, ids.pad) < trainer.model.config.vocab_size
    trainer.fit()
    out = trainer.out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] and "val_bpb" in rows[-1]
    ours = lmkit.load_tokenizer(out)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for name in SENTINELS:
        assert ours.token_to_id(name) == theirs.convert_tokens_to_ids(name) == trainer.tokenizer.token_to_id(name)
    text = "x = 1"
    prompt = infill_prompt(ours, "def f(x):\n  ", "\n  return y\n", bos=trainer.bos_id)
    want = theirs("<|endoftext|><fim_prefix>def f(x):\n  <fim_suffix>\n  return y\n<fim_middle>",
                  add_special_tokens=False)["input_ids"]
    assert prompt == want
    assert theirs(text)["input_ids"] == ours.encode(text, add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape[0] == len(theirs) == trainer.model.config.vocab_size
    with torch.no_grad():
        want_logits = model(torch.tensor([prompt])).logits
    got = lmkit.load_model(out)(torch.tensor([prompt])).logits
    assert torch.allclose(got, want_logits, atol=1e-4)
    # `lmkit generate --prefix --suffix` on the run: the BOS-led FIM prompt its rows had, the middle printed alone
    middle = lmkit.load_model(out).generate(torch.tensor([prompt]), max_new_tokens=8)[0, len(prompt):].tolist()
    assert main(["generate", "--model", str(out), "--prefix", "def f(x):\n  ", "--suffix", "\n  return y\n",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == ours.decode(middle, skip_special_tokens=True) + "\n"


def test_a_model_without_sentinels_cannot_infill():
    tok = lmkit.tokenizers.Tokenizer.from_str(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1},
                                                                     "unk_token": "[UNK]"}}))
    with pytest.raises(GenerationError, match="no fill-in-the-middle tokens"):
        infill_prompt(tok, "a", "a")
