"""Scores of a text-to-text model on (source, reference) pairs: corpus BLEU (sacrebleu), ROUGE-1/2/L F1
and exact match, of its greedy (or beam-search) outputs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from lmkit.data.translation import make_pairs
from lmkit.errors import ConfigError, CorpusError
from lmkit.evaluate.bleu import corpus_bleu
from lmkit.evaluate.rouge import corpus_rouge
from lmkit.objectives import next_token_loss, perplexity, seq2seq_batch


def encode_source(tokenizer, text: str, eos_id: int | None) -> list[int]:
    """Encoder ids of a source text: the tokenizer's ids with its specials, ending with EOS unless the tokenizer's
    own template already places EOS (T5: x </s>; BART: <s> x </s>; mBART: x </s> lang_code).

    lmkit's span, denoise and translation training feeds sources that end with EOS; a source without it is one
    the model never saw.
    """
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    if eos_id is None or eos_id in ids and len(ids) > len(tokenizer.encode(text, add_special_tokens=False)):
        return ids
    if not ids or ids[-1] != eos_id:
        ids.append(eos_id)
    return ids


def encode_target(model, tokenizer, text: str) -> list[int]:
    """Label ids of a reference: as transformers' tokenizer(text_target=...) gives them, with the tokenizer's own
    specials, ending with EOS (T5: `X </s>`; BART: `<s> X </s>`, the <s> that its forced_bos_token_id makes
    generation emit). An mBART model (decoder_start_from_labels) carries the target
    language code where transformers' tokenizers put it: `X </s> code` when the decoder starts from the code
    (MBartTokenizer; mbart-large-en-ro), `code X </s>` when it starts from EOS and forced_bos_token_id is the code
    (MBart50Tokenizer): the labels shifted right, the last wrapped to the front, then begin as generation does."""
    cfg = model.config
    if not cfg.decoder_start_from_labels:
        return encode_source(tokenizer, text, cfg.eos_token_id)
    ids = list(tokenizer.encode(text, add_special_tokens=False)) + ([cfg.eos_token_id] if cfg.eos_token_id is not None
                                                                    else [])
    defaults = getattr(model, "generation_defaults", {})
    start = defaults.get("decoder_start_token_id")
    start = model.decoder_start_token_id if start is None else start
    forced = defaults.get("forced_bos_token_id")  # where generate takes it from
    if start != cfg.eos_token_id:
        return ids + [int(start)]
    return ids if forced is None else [int(forced)] + ids


def encode_pairs(model, tokenizer, pairs: Sequence[tuple[str, str]]) -> tuple[list[list[int]], list[list[int]]]:
    """(encoder ids, label ids) of (source, reference) pairs by `encode_source` and `encode_target`: what pair
    training (lmkit.train.translation) learns from and what `reference_loss` scores, labeled alike."""
    eos = model.config.eos_token_id
    return [encode_source(tokenizer, s, eos) for s, _ in pairs], [encode_target(model, tokenizer, r) for _, r in pairs]


@torch.no_grad()
def translate(model, tokenizer, sources: Sequence[str], batch_size: int = 128, max_new_tokens: int = 32,
              num_beams: int = 1) -> list[str]:
    """The model's outputs for `sources`, decoded without special tokens (sources right-padded per batch)."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    out: list[str] = []
    for start in range(0, len(sources), batch_size):
        ids = [encode_source(tokenizer, s, model.config.eos_token_id) for s in sources[start:start + batch_size]]
        width = max(1, max(map(len, ids)))
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, row in enumerate(ids):
            input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        device = next(model.parameters()).device
        gen = model.generate(input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             num_beams=num_beams, do_sample=False, num_return_sequences=1)  # whatever the folder says
        out += [tokenizer.decode(row.tolist(), skip_special_tokens=True).strip() for row in gen]
    return out


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """bleu (0-100, sacrebleu corpus BLEU), rouge1/rouge2/rougeL (0-1, mean F1), exact_match (0-1)."""
    bleu = corpus_bleu(hypotheses, references)
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / max(len(references), 1)
    return {"bleu": bleu.score, **corpus_rouge(hypotheses, references), "exact_match": exact}


def evaluate_pairs(model, tokenizer, pairs: Sequence[tuple[str, str]], num_beams: int = 1,
                   batch_size: int = 128, max_new_tokens: int = 32) -> dict[str, float]:
    """score_translations of the model's outputs for the sources of `pairs`."""
    was_training = model.training
    model.eval()
    try:
        hyps = translate(model, tokenizer, [s for s, _ in pairs], batch_size, max_new_tokens, num_beams)
    finally:
        model.train(was_training)
    return score_translations(hyps, [r for _, r in pairs])


@torch.no_grad()
def reference_loss(model, tokenizer, pairs: Sequence[tuple[str, str]], batch_size: int = 128) -> tuple[float, int]:
    """(nats per reference token, token count) of the references under teacher forcing, labeled as `encode_target`
    makes them (EOS, and mBART's language code, included): transformers' loss on its tokenizer's labels."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for start in range(0, len(pairs), batch_size):
        batch = seq2seq_batch(*encode_pairs(model, tokenizer, pairs[start:start + batch_size]), pad)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).logits
        ls = next_token_loss(logits, batch["labels"])
        total, count = total + float(ls.sum), count + int(ls.count)
    return total / max(count, 1), count


def read_pairs(path) -> list[tuple[str, str]]:
    """(source, reference) pairs from a .tsv (source<TAB>reference per line) or .jsonl ({"source", "target"})."""
    path = Path(path)
    try:
        lines = [l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"cannot read pairs from {path} ({exc}); give a UTF-8 .tsv or .jsonl file") from None
    pairs = []
    for n, line in enumerate(lines, 1):
        if path.suffix == ".jsonl":
            try:
                row = json.loads(line)
                pair = (row["source"], row["target"])
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"{path}:{n} is not a JSON object with 'source' and 'target'") from None
            if not all(isinstance(x, str) for x in pair):
                raise CorpusError(f"{path}:{n}: 'source' and 'target' must be strings")
            pairs.append(pair)
        else:
            parts = line.split("\t")
            if len(parts) != 2:
                raise CorpusError(f"{path}:{n} needs exactly one tab between source and reference")
            pairs.append((parts[0], parts[1]))
    if not pairs:
        raise CorpusError(f"{path} holds no pairs")
    return pairs


def report_pairs(model, tokenizer, pairs: Sequence[tuple[str, str]], num_beams: int = 1) -> list[str]:
    """The lines `lmkit eval` prints for a text-to-text model: loss, perplexity, BLEU, ROUGE, exact match."""
    loss, tokens = reference_loss(model, tokenizer, pairs)
    s = evaluate_pairs(model, tokenizer, pairs, num_beams=num_beams)
    return [f"loss           {loss:.4f} nats/token ({tokens} reference tokens)",
            f"perplexity     {perplexity(loss):.3f}",
            f"BLEU           {s['bleu']:.2f} (sacrebleu corpus BLEU, 13a tokenizer)",
            f"ROUGE-1/2/L    {s['rouge1']:.4f} / {s['rouge2']:.4f} / {s['rougeL']:.4f} (F1)",
            f"exact match    {s['exact_match']:.4f}"]


def builtin_pairs(task: str) -> list[tuple[str, str]]:
    """The held-out pairs of a built-in task ("numbers": lmkit.data.translation, default seed)."""
    if task != "numbers":
        raise CorpusError(f"unknown task {task!r}; the built-in task is 'numbers'")

    return make_pairs()[1]


def resolve_pairs(model_dir, pairs_path=None, task: str | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(name, pairs) that `lmkit eval` scores: --pairs, else --task, else the task the run folder names."""
    if pairs_path:
        return str(pairs_path), read_pairs(pairs_path)
    if task is None and (Path(model_dir) / "task.json").is_file():
        task = json.loads((Path(model_dir) / "task.json").read_text(encoding="utf-8")).get("task")
    if task is None:
        raise ConfigError(f"{model_dir} is a text-to-text model: pass --pairs FILE (.tsv or .jsonl of source and "
                          "reference) or --task numbers to score it")
    return task, builtin_pairs(task)
