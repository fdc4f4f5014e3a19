"""The reward model against TRL's RewardTrainer: tokenized pairs and batch, the loss with margins and centring and its
accuracy and margin on the same batch, and the folder transformers loads as ...ForSequenceClassification."""
import json

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast  # noqa: E402

import lmkit  # noqa: E402
from lmkit.errors import LmkitError  # noqa: E402
from lmkit.finetune.reward import (RewardConfig, collate_rewards, load_reward_model, reward_pairs,  # noqa: E402
                                  train_reward_model)
from test_dpo import folders, pairs, write  # noqa: E402,F401  (the fixture is shared)


@pytest.mark.parametrize("name, kind, margin, center", [("gpt2", "standard", True, 0.01), ("llama", "conversational",
                                                                                              False, None)])
def test_loss_and_metrics_match_trl_and_the_folder_loads_in_transformers(folders, tmp_path, name, kind, margin, center):
    from trl import RewardConfig as TRLConfig, RewardTrainer

    rows = pairs(kind)
    if margin:
        rows = [dict(r, margin=0.25 * i) for i, r in enumerate(rows)]
    out = tmp_path / "rm"
    train = write(tmp_path / "train.jsonl", rows)
    # lr 0: the folder keeps the weights the first step was scored with
    train_reward_model(RewardConfig(model=str(folders[name, "policy"]), train=str(train), out=str(out), lr=0.0,
                                    max_steps=1, batch_size=len(rows), center_rewards=center, precision="fp32"), log=None)
    ours = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1 and type(model).__name__.endswith("ForSequenceClassification")
    args = TRLConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, dataset_num_proc=None,
                     center_rewards_coefficient=center, max_length=96)
    trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=PreTrainedTokenizerFast.from_pretrained(out))
    theirs = [dict(r) for r in trainer.train_dataset]
    tok = lmkit.load_tokenizer(out)
    mine, report = reward_pairs(tok, train, 96)  # the models' positions: longer pairs are dropped, as TRL drops them
    assert [(p["chosen_ids"], p["rejected_ids"]) for p in mine] == [(r["chosen_ids"], r["rejected_ids"]) for r in theirs]
    batch = trainer.data_collator(theirs)
    assert all(torch.equal(batch[k], v) for k, v in collate_rewards(mine, tok.pad_token_id).items())
    model.eval()
    with torch.no_grad():
        loss = float(trainer.compute_loss(model, dict(batch)))
        back = load_reward_model(out)(batch["input_ids"], attention_mask=batch["attention_mask"])
        assert torch.allclose(back, model(**batch).logits.squeeze(-1), atol=1e-5)  # lmkit reads the folder back
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    assert abs(loss - ours["loss"]) < 1e-5, (loss, ours)
    for key in ("accuracy", "margin", "mean_reward"):
        assert abs(metrics[key] - ours[key]) < 1e-5, (key, metrics, ours)


def test_bad_rows_name_the_file_and_line(folders, tmp_path):
    tok = lmkit.load_tokenizer(folders["gpt2", "policy"])
    good = pairs("standard", 2)
    for bad, match in (({"prompt": "a", "chosen": " b"}, "no 'rejected'"),
                       ({"prompt": "a", "chosen": " b", "rejected": " b"}, "chosen equals rejected"),
                       (dict(good[0], margin="big"), "numeric")):
        path = write(tmp_path / "bad.jsonl", good + [bad])
        with pytest.raises(LmkitError, match=rf"bad.jsonl:3: .*{match}"):
            reward_pairs(tok, path, 1024)
