"""Compression of encoders: DistilBERT's distillation of a masked LM, and head pruning of a fine-tuned classifier.

Distillation (Sanh et al. 2019) trains the student (every other layer of the teacher, `student_from_teacher`) on
BERT's dynamic masking of packed rows (train/masked.py) with `distillation_loss`: alpha x the masked-LM
cross-entropy, beta x T^2 KL between the teacher's and the student's distributions at T, gamma x (1 - cos) between
their last hidden states, every term over the masked positions (the original script's restrict_ce_to_mask). Both
are scored by masked loss and masked-token accuracy under one fixed masking of the validation rows.

Pruning (Michel et al. 2019) scores each head of a sequence classifier by |dL/d gate| of the classification loss on
labelled rows and removes the least important; accuracy on those rows before and after.
"""
from __future__ import annotations

import torch
from torch import nn

from lmkit.compress.distill import DistillWeights, distillation_loss
from lmkit.compress.prune import head_importance, least_important, prune_heads
from lmkit.errors import ConfigError
from lmkit.finetune.classify import predict
from lmkit.finetune.common import fitting_length
from lmkit.finetune.data import read_examples
from lmkit.finetune.metrics import accuracy
from lmkit.objectives import IGNORE_INDEX, LossSum
from lmkit.train.masked import MaskedLM, mask_token_id


def masked_lm_task(model: nn.Module, tok) -> MaskedLM:
    """BERT's masking with the tokenizer's own mask token, which the model must know."""
    if getattr(model, "mlm_head", None) is None:
        raise ConfigError("lmkit distill takes an encoder with a masked-LM head (BertForMaskedLM, a `lmkit train "
                          "--objective mlm` run); a classifier distils through its pre-trained masked LM")
    size = getattr(tok, "vocab_size", None)
    mask = mask_token_id(tok)
    if size is not None and mask >= model.config.vocab_size:
        raise ConfigError("the teacher's tokenizer has no mask token the model knows; use the tokenizer it was "
                          "trained with")
    special = tuple(int(i) for i in getattr(tok, "all_special_ids", []) or [mask])
    return MaskedLM(mask, model.config.vocab_size, special)


class MaskedDistillation:
    """The student's loss against a frozen encoder teacher on masked rows, as a sum over the masked positions."""

    def __init__(self, teacher: nn.Module, task: MaskedLM, weights: DistillWeights | None = None):
        self.teacher, self.task, self.weights, self.parts = teacher.eval(), task, weights or DistillWeights(), {}
        self.build_batch = task.build_batch

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[LossSum, torch.Tensor | None]:
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        with torch.no_grad():
            ref = self.teacher(batch["input_ids"], attention_mask=batch["attention_mask"])
        parts = distillation_loss(out.logits, ref.logits, batch["labels"], out.last_hidden_state,
                                  ref.last_hidden_state, self.weights)
        n = (batch["labels"] != IGNORE_INDEX).sum()
        self.parts = {k: float(parts[k].detach()) for k in ("ce", "kl", "cos")}
        return LossSum(parts["loss"] * n, n), getattr(out, "aux_loss", None)


def masked_scores(task: MaskedLM, model: nn.Module, data) -> dict[str, float]:
    """Masked loss and masked-token accuracy of `model` on the validation rows of `data` (CausalLMData)."""
    r = task.evaluate(model, rows=data.val_rows, mask=data.val_mask, num_bytes=data.val_bytes)
    return {"masked_loss": r["masked_loss"], "masked_accuracy": r["masked_accuracy"], "tokens": r["tokens"]}


def classifier_loss(tok, labels: dict[str, int], max_length: int = 128):
    """loss_fn(model, examples) for `head_importance`: the classifier's mean cross-entropy on a list of Examples."""
    def loss(model, part):
        enc = tok([e.text for e in part], pair=[e.text_pair for e in part] if part[0].text_pair else None,
                  padding=True, truncation=True, max_length=max_length)
        device = next(model.parameters()).device
        types = torch.tensor(enc["token_type_ids"], device=device) if model.config.type_vocab_size else None
        return model(torch.tensor(enc["input_ids"], device=device),
                     attention_mask=torch.tensor(enc["attention_mask"], device=device), token_type_ids=types,
                     labels=torch.tensor([labels[e.label] for e in part], device=device)).loss
    return loss


def prune_classifier(model: nn.Module, tok, heads: int, data_file: str, batches: int, batch_size: int = 8,
                     max_length: int | None = None, progress=None) -> dict:
    """Prune the `heads` least important heads of a sequence classifier by its loss on the labelled rows of
    `data_file` (the first batches x batch_size of them); accuracy on all of them before and after. Rows are cut at
    `max_length` pieces (None: 128, or the model's positions when it has fewer)."""
    if getattr(model, "head", None) != "sequence":
        raise ConfigError("lmkit prune --data scores the heads of a sequence classifier (from `lmkit finetune`); "
                          "this encoder has no classification head")
    id2label = model.config.extra.get("id2label") or {str(i): str(i) for i in range(model.num_labels)}
    labels = {name: int(i) for i, name in id2label.items()}
    rows = read_examples(data_file)
    unknown = sorted({e.label for e in rows} - set(labels))
    if unknown:
        raise ConfigError(f"{data_file} has labels the classifier does not know ({', '.join(unknown[:5])}); its "
                          f"labels are {', '.join(labels)}")
    gold = [labels[e.label] for e in rows]
    max_length = fitting_length(model.config.max_seq_len, "full", {}, max_length, 128)  # 128 or the model's positions

    def score() -> float:
        return accuracy(predict(model, tok, rows, labels, max_length=max_length), gold)

    before, params = score(), model.num_parameters()
    parts = [rows[i:i + batch_size] for i in range(0, min(len(rows), batches * batch_size), batch_size)]
    importance = head_importance(model, progress(parts) if progress else parts,
                                 loss_fn=classifier_loss(tok, labels, max_length))
    chosen = least_important(importance, heads, model)
    prune_heads(model, chosen)
    total = sum(len(v) for v in importance.values())
    return {"pruned": {k: sorted(v) for k, v in chosen.items()}, "heads_pruned": sum(map(len, chosen.values())),
            "heads_total": total, "parameters_before": params, "parameters_after": model.num_parameters(),
            "before": {"accuracy": before}, "after": {"accuracy": score()}}
