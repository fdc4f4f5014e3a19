"""Data mixtures: --corpus A:0.7,B:0.3 samples rows by weight, deterministically from (seed, step), so that the
realised share of each source follows the weights and a run resumes with the same rows."""
import pytest
import torch

from lmkit.data.mixture import MixedStream, Source, corpus_specs, parse_mixture
from lmkit.errors import CorpusError


class Constant:
    """A stream whose every token is its own id: the rows show which source they came from."""

    def __init__(self, token: int, seq_len: int = 5):
        self.token, self.seq_len, self.num_tokens = token, seq_len, 1000

    def global_rows(self, seed, step, batch_size):
        return torch.full((batch_size, self.seq_len + 1), self.token)


def test_parse_mixture_normalises_and_keeps_plain_specs_plain(tmp_path):
    assert parse_mixture(["pydocs"]) is None and parse_mixture(["pydocs", "pycode"]) is None
    assert parse_mixture(["pydocs:0.7,pycode:0.3"]) == [Source("pydocs", 0.7), Source("pycode", 0.3)]
    mixed = parse_mixture(["pydocs:3", "pycode:1"])
    assert [s.weight for s in mixed] == [0.75, 0.25]
    odd = tmp_path / "notes:2"  # an existing file whose name looks weighted is a file, not a weight
    odd.write_text("x")
    assert parse_mixture([str(odd)]) is None
    assert corpus_specs(["pydocs:0.7,pycode:0.3"]) == ["pydocs", "pycode"]
    for bad, match in ((["pydocs:0"], "positive"), (["pydocs:0.5", "pycode"], "every source"),
                       (["pydocs:0.5,pydocs:0.5"], "twice"), (["pydocs:nan"], "positive")):
        with pytest.raises(CorpusError, match=match):
            parse_mixture(bad)


def test_rows_follow_the_weights_and_depend_on_seed_and_step_only():
    sources = [Source("a", 0.7), Source("b", 0.2), Source("c", 0.1)]
    stream = MixedStream([Constant(1), Constant(2), Constant(3)], sources)
    rows = torch.cat([stream.rows(0, step, 64) for step in range(200)])
    shares = torch.bincount(rows[:, 0], minlength=4)[1:].double() / len(rows)
    assert torch.allclose(shares, torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64), atol=0.01)
    assert (rows == rows[:, :1]).all()  # a row comes from one source
    assert torch.equal(stream.rows(0, 17, 64), stream.rows(0, 17, 64))  # what a resumed run reads again
    assert not torch.equal(stream.rows(0, 17, 64), stream.rows(1, 17, 64))
    realised = stream.realised(0, 200, 64)
    assert realised == pytest.approx({"a": shares[0].item(), "b": shares[1].item(), "c": shares[2].item()})
    halves = torch.cat([stream.rows(0, 5, 64, rank, 2) for rank in (0, 1)])
    assert torch.equal(halves, stream.rows(0, 5, 64))  # ranks read their shares of the same global batch


def test_train_on_a_mixture_of_two_files_reports_the_realised_shares(tmp_path):
    from lmkit.train import TrainConfig, Trainer

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(f"alpha {i} the quick brown fox" for i in range(300)))
    b.write_text("\n\n".join(f"def beta_{i}(x):\n    return x + {i}" for i in range(300)))
    cfg = TrainConfig(preset="tiny", corpus=[f"{a}:0.8,{b}:0.2"], out=str(tmp_path / "run"), max_steps=20,
                      batch_size=8, seq_len=16, vocab_size=300, precision="fp32", progress=False)
    result = Trainer(cfg).fit()
    assert set(result["mixture"]) == {str(a), str(b)}
    assert result["mixture"][str(a)] == pytest.approx(0.8, abs=0.08)
