"""The run's set-up as one step: the preset is resolved once, a resumed run takes its recorded model and settings,
and nothing is written before the first step."""
import pytest

import lmkit.config
from lmkit.errors import TrainingError
from lmkit.train import TrainConfig, Trainer
from lmkit.train.setup import prepare_training


def config(corpus_file, out, **kw):
    return TrainConfig(**{**dict(preset="tiny", corpus=[corpus_file], out=str(out), max_steps=2, batch_size=4,
                                 seq_len=32, precision="fp32", progress=False, warmup_steps=1, save_every=2), **kw})


def test_the_preset_is_resolved_once_and_the_setup_is_complete(corpus_file, tmp_path, monkeypatch):
    calls = []
    real = lmkit.config.get_preset
    monkeypatch.setattr("lmkit.train.setup.get_preset", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr("lmkit.train.config.get_preset", lambda *a, **k: calls.append(a) or real(*a, **k))
    setup = prepare_training(config(corpus_file, tmp_path / "run", model_overrides={"n_layers": 1}))
    assert calls == [("tiny",)]
    assert setup.cfg.micro_batch_size == 4 and setup.cfg.vocab_size == 512  # resolved: defaults filled in
    assert setup.model_config.n_layers == 1 and setup.model.config == setup.model_config and setup.model.training
    assert setup.model_config.vocab_size == setup.data.tokenizer.vocab_size
    assert setup.model_config.bos_token_id == setup.data.bos_id and setup.model_config.max_seq_len == 32
    assert setup.checkpoint is None and not (tmp_path / "run").exists()  # set-up writes nothing


def test_a_resumed_setup_takes_the_recorded_model_and_settings(corpus_file, tmp_path):
    out = tmp_path / "run"
    Trainer(config(corpus_file, out, model_overrides={"d_model": 32})).fit()
    setup = prepare_training(config(corpus_file, out, resume=True, batch_size=None, model_overrides={"d_model": 32}),
                             explicit={"resume", "corpus", "out"})
    assert setup.checkpoint is not None and setup.cfg.batch_size == 4 and setup.model_config.d_model == 32
    with pytest.raises(TrainingError, match="already holds a training run"):
        prepare_training(config(corpus_file, out))
