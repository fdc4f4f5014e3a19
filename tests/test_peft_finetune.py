"""Causal-LM fine-tuning with a PEFT method on a model folder: the adapter written reproduces the model."""
import json

import pytest
import torch

import lmkit
from lmkit.config import ModelConfig
from lmkit.data.tokenize import vocab_size_of
from lmkit.models import build_model
from lmkit.peft import load_adapter
from lmkit.peft.finetune import CausalLMData, finetune_causal_lm_folder, peft_for_task

TEXT = "\n\n".join(f"class Item{i}:\n    size = {i * 3}\n    name = 'item {i}'" for i in range(120))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    tok = lmkit.train_tokenizer([TEXT], kind="bpe", vocab_size=260, special_tokens=["<|endoftext|>", "<|pad|>"])
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=vocab_size_of(tok), d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                                    position="rope", norm="rmsnorm", activation="swiglu", bias=False, family="llama"))
    model.save_pretrained(root / "model")
    tok.save(str(root / "model" / "tokenizer.json"))
    return root


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_finetune_writes_an_adapter_that_reproduces_the_scores(folder, method):
    out = folder / method
    report = finetune_causal_lm_folder(folder / "model", out, method, [str(folder / "corpus.txt")], steps=4,
                                       batch_size=4, seq_len=16)
    assert report["after"]["loss"] < report["before"]["loss"]
    assert 0 < report["trainable"] < report["total"]
    saved = json.loads((out / "finetune.json").read_text())
    assert saved["method"] == method
    model = load_adapter(lmkit.load_model(folder / "model"), out)
    data = CausalLMData(lmkit.load_tokenizer(folder / "model" / "tokenizer.json"), [str(folder / "corpus.txt")], 16)
    assert abs(data.evaluate(model)["loss"] - report["after"]["loss"]) < 1e-5


def test_task_head_is_trained_in_full():
    try:
        model = build_model(ModelConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, architecture="encoder",
                                        norm_placement="post", extra={"head": "sequence", "num_labels": 3}))
    except ModuleNotFoundError:
        pytest.skip("the encoder family is not built yet")
    peft = peft_for_task(model, "lora", r=2)
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert any("classifier" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert not any("pooler" in n or "embeddings" in n for n in trainable)
