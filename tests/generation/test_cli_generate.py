"""`lmkit generate` end to end on a model trained here: greedy output equals model.generate, seeds repeat,
and bad arguments are one clear line with exit status 2."""
import subprocess
import sys

import pytest
import torch

import lmkit

pytestmark = pytest.mark.xdist_group("cli_generate")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    cmd = [sys.executable, "-m", "lmkit", "train", "--preset", "tiny", "--max-steps", "4", "--batch-size", "4",
           "--seq-len", "32", "--out", str(out), "--log-every", "2", "--precision", "fp32"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return out


def generate(run_dir, *args):
    cmd = [sys.executable, "-m", "lmkit", "generate", "--model", str(run_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_greedy_cli_equals_library_with_bos(run_dir):
    prompt = "The with statement"
    res = generate(run_dir, "--prompt", prompt, "--max-new-tokens", "12")
    assert res.returncode == 0, res.stderr
    model, tok = lmkit.load_model(run_dir), lmkit.load_tokenizer(run_dir)
    ids = torch.tensor([[model.config.bos_token_id] + tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=12)
    expected = prompt + tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert res.stdout.rstrip("\n") == expected


def test_temperature_zero_is_greedy_beside_top_k(run_dir):
    greedy = generate(run_dir, "--prompt", "def", "--max-new-tokens", "16")
    runs = [generate(run_dir, "--prompt", "def", "--max-new-tokens", "16", "--temperature", "0", "--top-k", "50",
                     "--seed", str(s)) for s in (1, 2)]
    assert greedy.returncode == 0 and all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout == greedy.stdout


def test_prompt_lookup_prints_the_greedy_text(run_dir, capsys, monkeypatch):
    """--prompt-lookup K reaches generate's speculative decoding with K, and the text is greedy's."""
    from lmkit.cli import main
    from lmkit.generation import mixin

    prompt = ["--model", str(run_dir), "--prompt", "def def def def", "--max-new-tokens", "20"]
    assert main(["generate", *prompt]) == 0
    plain = capsys.readouterr().out
    budgets = []
    lookup = mixin.lookup_greedy
    monkeypatch.setattr(mixin, "lookup_greedy", lambda *a, **k: budgets.append(a[5]) or lookup(*a, **k))
    assert main(["generate", *prompt, "--prompt-lookup", "4"]) == 0
    assert capsys.readouterr().out == plain
    assert budgets == [4]


def test_seeded_sampling_repeats_and_differs_across_seeds(run_dir):
    runs = [generate(run_dir, "--prompt", "def", "--max-new-tokens", "16", "--temperature", "1.5", "--seed", str(s))
            for s in (1, 1, 2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    assert runs[0].stdout == runs[1].stdout
    assert runs[0].stdout != runs[2].stdout


def test_prompt_longer_than_context_is_one_clear_line(run_dir):
    res = generate(run_dir, "--prompt", "word " * 400, "--max-new-tokens", "4")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "context" in res.stderr and "Traceback" not in res.stderr


def test_num_return_sequences_prints_the_library_samples_one_after_another(run_dir):
    prompt = "Return the"
    res = generate(run_dir, "--prompt", prompt, "--max-new-tokens", "10", "--top-k", "20", "--seed", "3",
                   "--num-return-sequences", "3")
    assert res.returncode == 0, res.stderr
    model, tok = lmkit.load_model(run_dir), lmkit.load_tokenizer(run_dir)
    ids = torch.tensor([[model.config.bos_token_id] + tok.encode(prompt, add_special_tokens=False)])
    torch.manual_seed(3)
    out = model.generate(ids, max_new_tokens=10, do_sample=True, top_k=20, num_return_sequences=3)
    expected = "".join(f"--- {i + 1} of 3\n{prompt}{tok.decode(row[ids.shape[1]:].tolist(), skip_special_tokens=True)}\n"
                       for i, row in enumerate(out))
    assert res.stdout == expected
    bad = generate(run_dir, "--prompt", prompt, "--num-return-sequences", "2")  # greedy: one sequence only
    assert bad.returncode == 2 and "greedy decoding returns one sequence" in bad.stderr


def test_default_length_fits_a_short_context(run_dir):
    """The run's context is 32 learned positions: without --max-new-tokens the continuation stops there
    (64 new tokens would not fit), instead of failing."""
    res = generate(run_dir, "--prompt", "The")
    assert res.returncode == 0, res.stderr
    model, tok = lmkit.load_model(run_dir), lmkit.load_tokenizer(run_dir)
    ids = torch.tensor([[model.config.bos_token_id] + tok.encode("The", add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=32 - ids.shape[1])
    assert res.stdout.rstrip("\n") == "The" + tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "word " * 400], "context"),
    (["--prompt", "hi", "--max-new-tokens", "100"], "lower max_new_tokens"),
    (["--prompt", "", "--no-bos"], "the prompt is empty"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--top-k", "-1"], "--top-k must be >= 0"),
    (["--prompt", "hi", "--num-beams", "0"], "--num-beams must be >= 1"),
    (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--prompt", "hi", "--prompt-lookup", "0"], "--prompt-lookup must be >= 1"),
    (["--prompt", "hi", "--prompt-lookup", "3", "--temperature", "1"], "greedy"),
])
def test_bad_arguments_are_one_line_and_print_no_prompt(run_dir, args, message, capsys):
    from lmkit.cli import main

    assert main(["generate", "--model", str(run_dir), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the prompt is echoed only once generation has passed its checks
    err = captured.err.strip()
    assert err.startswith("lmkit: error: ") and "\n" not in err and message in err, err


def test_seq2seq_default_length_fits_bart_positions(tmp_path, capsys):
    """A BART folder of 24 learned positions: without --max-new-tokens the decoder stops at the table's end
    (its start token + 23), as model.generate does with that length, instead of failing."""
    from lmkit.cli import main

    transformers = pytest.importorskip("transformers")
    tok = lmkit.train_tokenizer(["translate the numbers into words, one two three"] * 8, kind="bpe", vocab_size=280)
    cfg = transformers.BartConfig(vocab_size=tok.vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                  decoder_ffn_dim=24, max_position_embeddings=24, forced_eos_token_id=None,
                                  eos_token_id=tok.vocab_size - 1)  # an id greedy decoding does not reach
    torch.manual_seed(0)
    transformers.BartForConditionalGeneration(cfg).save_pretrained(tmp_path)
    tok.save(tmp_path / "tokenizer.json")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "one two"]) == 0
    model = lmkit.load_model(tmp_path)
    out = model.generate(torch.tensor([tok.encode("one two")]), max_new_tokens=23)
    assert capsys.readouterr().out == tok.decode(out[0].tolist(), skip_special_tokens=True) + "\n"


def test_a_reader_that_goes_away_stops_generation_quietly(run_dir):
    """`lmkit generate ... | head -c 1`: the closed pipe ends the command without a traceback (exit 141, as a
    shell reports SIGPIPE), not with BrokenPipeError's stack."""
    cmd = [sys.executable, "-m", "lmkit", "generate", "--model", str(run_dir), "--prompt", "The", "--max-new-tokens",
           "30", "--seed", "0", "--temperature", "1.0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away while tokens are still streamed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 141)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_rope_model_defaults_within_its_context_and_warns_once_past_it(tmp_path, capsys):
    """A RoPE model can run past its positions: the default stops at the context's end, an asked length past it
    goes on with one warning naming the numbers."""
    from serving_folders import make_folder

    from lmkit.cli import main

    folder = make_folder(tmp_path / "rope", "llama", n_positions=16)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    ids = tok.encode("hello world", add_special_tokens=True)
    assert main(["generate", "--model", str(folder), "--prompt", "hello world"]) == 0
    captured = capsys.readouterr()
    out = model.generate(torch.tensor([ids]), max_new_tokens=16 - len(ids), do_sample=False)
    expected = "hello world" + tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    # (the terminal streamer holds back a last byte-level piece that is not a whole character yet)
    assert captured.out.rstrip("\n").rstrip("\ufffd") == expected.rstrip("\ufffd")
    assert "warning" not in captured.err
    assert main(["generate", "--model", str(folder), "--prompt", "hello world", "--max-new-tokens", "40"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"lmkit generate: warning: the prompt ({len(ids)} tokens) and --max-new-tokens 40 run "
                     f"{40 - 16 + len(ids)} tokens past the model's 16 positions; it goes on, but it was never trained "
                     f"past them (--max-new-tokens {16 - len(ids)} stays within)"]
