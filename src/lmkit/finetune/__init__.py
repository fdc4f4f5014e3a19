"""Fine-tuning pretrained encoders: text classification from CSV/JSONL (`lmkit finetune`)."""
from lmkit.finetune.classify import FinetuneConfig, classifier_from_pretrained, finetune, predict
from lmkit.finetune.data import Example, label_names, read_examples, split_examples
from lmkit.finetune.metrics import accuracy, macro_f1

__all__ = ["FinetuneConfig", "Example", "accuracy", "classifier_from_pretrained", "finetune", "label_names",
           "macro_f1", "predict", "read_examples", "split_examples"]
