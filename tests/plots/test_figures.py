"""Pictures a reader can read, checked from the title and panels each PNG carries (`lmkit.plots.read_summary`):
attention has a colour bar, query/key axes, tokens with visible spaces and a model/prompt title; the lens of a
tied model leaves out its self-predicting embeddings row and says so; embeddings show the corpus' most frequent
whole words, in order, with labels that never overlap."""
import json
from collections import Counter

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import lmkit  # noqa: E402
from lmkit.cli import main  # noqa: E402
from lmkit.plots import new_figure, read_summary, token_label  # noqa: E402
from lmkit.plots.embeddings import frequent_words, place_labels, word_pieces  # noqa: E402

# word counts chosen so that the ranking is known: tower 40 > the 30 > stands 20 > river 12 > city 8 > ...
COUNTS = {"tower": 40, "the": 30, "stands": 20, "river": 12, "city": 8, "north": 5, "bridge": 3, "stone": 2}


def _corpus() -> list[str]:
    words = [w for w, n in COUNTS.items() for _ in range(n)]
    rng = np.random.default_rng(0)
    rng.shuffle(words)
    # each line opens with "Note:", which has no word-start space, so every counted word is " word"
    return ["Note: " + " ".join(words[i:i + 12]) + "." for i in range(0, len(words), 12)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tied GPT-2 folder laid out as a training run whose checkpoint names its corpus (a text file)."""
    folder = tmp_path_factory.mktemp("run")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(_corpus()) + "\n", encoding="utf-8")
    tok = lmkit.train_tokenizer(_corpus() * 4, kind="bpe", vocab_size=300, special_tokens=["<|endoftext|>"])
    tok.save(folder / "tokenizer.json")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2,
                                                         n_head=2, tie_word_embeddings=True)).save_pretrained(folder)
    state = folder / "checkpoint" / "step-00000010" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"step": 10, "train_config": {"corpus": [str(corpus)]}}), encoding="utf-8")
    return folder


def test_token_labels_show_spaces_and_breaks():
    assert [token_label(t) for t in (" the", "the", "a\n", "\t", "", "\x00")] == ["\u2423the", "the", "a\u21b5",
                                                                                 "\u21e5", "\u2205", "\\x00"]


def test_attention_picture_has_colour_bar_axes_and_title(run, tmp_path):
    out = tmp_path / "att.png"
    assert main(["plot", "attention", "--model", str(run), "--text", "the tower stands", "--out", str(out)]) == 0
    summary = read_summary(out)
    assert run.name in summary["title"] and "\u201cthe tower stands\u201d" in summary["title"]
    maps = [p for p in summary["panels"] if not p["colorbar"]]
    bars = [p for p in summary["panels"] if p["colorbar"]]
    assert len(maps) == 2 * 2 and len(bars) == 1 and bars[0]["ylabel"] == "attention probability"
    assert [p["xlabel"] for p in maps] == ["", "", "key", "key"]  # the bottom row of 2 layers x 2 heads
    assert [p["ylabel"] for p in maps] == ["query", "", "query", ""]  # the first column
    tok = lmkit.load_tokenizer(run)
    tokens = [tok.decode([i]) for i in tok.encode("the tower stands")]
    assert maps[0]["xticklabels"] == maps[0]["yticklabels"] == [token_label(t) for t in tokens]
    assert any(label.startswith("\u2423") for label in maps[0]["xticklabels"])  # " tower" reads as ␣tower


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lens_leaves_out_a_tied_embeddings_row(run, tmp_path, family):
    folder = run
    if family == "llama":
        folder = tmp_path / "llama"
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(folder)
        (folder / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    out = tmp_path / "lens.png"
    assert main(["plot", "lens", "--model", str(folder), "--prompt", "the tower stands", "--out", str(out)]) == 0
    summary, data = read_summary(out), json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    grid, bar = summary["panels"]
    assert bar["colorbar"] and bar["ylabel"] and grid["xlabel"] and grid["ylabel"]
    assert "\u201cthe tower stands\u201d" in summary["title"] and folder.name in summary["title"]
    tied = family == "gpt2"
    assert ("embeddings" in data["layers"]) == (not tied) and ("left out" in summary["title"]) == tied
    assert grid["yticklabels"] == data["layers"]
    assert any(label.startswith("\u2423") for label in grid["xticklabels"])
    if tied:
        assert main(["plot", "lens", "--model", str(folder), "--prompt", "the tower stands", "--out", str(out),
                     "--embeddings-row"]) == 0
        assert json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))["layers"][0] == "embeddings"
        assert "left out" not in read_summary(out)["title"]


def test_embeddings_default_to_the_corpus_most_frequent_words(run, tmp_path):
    out = tmp_path / "emb.png"
    assert main(["plot", "embeddings", "--model", str(run), "--out", str(out)]) == 0
    data, summary = json.loads(out.with_suffix(".json").read_text(encoding="utf-8")), read_summary(out)
    tok = lmkit.load_tokenizer(run)
    whole = [w for w in COUNTS if len(tok.encode(" " + w, add_special_tokens=False)) == 1]
    assert len(whole) >= 4  # the tokenizer keeps the frequent words whole
    assert data["labels"] == sorted(whole, key=lambda w: -COUNTS[w])
    assert run.name in summary["title"] and "most frequent words" in summary["title"]
    (panel,) = summary["panels"]
    assert panel["xlabel"].startswith("PC 1") and panel["ylabel"].startswith("PC 2")
    boxes = data["label_boxes"]
    assert data["labelled"][:2] == [0, 1] and len(boxes) >= 4
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)


def test_frequent_words_count_only_whole_words(run):
    tok = lmkit.load_tokenizer(run)
    texts = ["Note: the towers stand", "Note: the tower stands by the tower."]
    got = frequent_words(tok, texts, 10)
    words = word_pieces(tok)
    seen = Counter()
    for text in texts:  # a word piece counts when no letter or digit follows it in the same word
        for word in text.replace(".", " ").split()[1:]:  # after "Note:", every word starts with a space
            ids = tok.encode(" " + word, add_special_tokens=False)
            if len(ids) == 1 and ids[0] in words:
                seen[ids[0]] += 1
    assert got == [i for i, _ in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))]
    assert words[got[0]] in ("the", "tower")


def test_labels_on_one_spot_never_overlap():
    fig = new_figure(4, 4)
    ax = fig.add_subplot(1, 1, 1)
    coords = np.zeros((10, 2)) + 0.5
    ax.scatter(coords[:, 0], coords[:, 1])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    placed = place_labels(fig, ax, coords, [f"word{i}" for i in range(10)])
    assert [n for n, _ in placed] == [0, 1, 2, 3]  # the four corners, then nothing
    assert len([t for t in ax.texts if t.get_visible()]) == 4
