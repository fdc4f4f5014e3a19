"""`lmkit chat` driven through a pseudo-terminal: streamed replies, /reset, /exit, Ctrl-C stopping a reply but not
the session, and the oldest exchanges dropped (with a notice) when the context fills; ChatSession in process."""
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import lmkit  # noqa: E402
from lmkit.chat_session import CHAT_SAMPLING, ChatSession, end_ids, stop_ids  # noqa: E402
from lmkit.errors import GenerationError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<|turn|>{{ m.role }}\n{{ m.content }}<|done|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}")


def _folder(path: Path, positions: int, eos: bool = False) -> Path:
    """A tiny random LLaMA with a chat template; without eos and with tokens the template never ends on, a greedy
    reply runs to --max-new-tokens."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello there, how are you? fine thanks and you " * 5],
                           trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                               show_progress=False))
    extra = {"eos_token": "<|done|>"} if eos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, extra_special_tokens=["<|turn|>", "<|done|>"], **extra)
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
                                 tie_word_embeddings=False)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Sink:
    """A streamer that records each put's ids, then "end"."""

    def __init__(self, record: list):
        self.record = record

    def put(self, ids):
        self.record.append(ids.reshape(-1).tolist())

    def end(self):
        self.record.append("end")


class Terminal:
    """`lmkit ARGS` on a pseudo-terminal: the child is a session leader, so ^C reaches it as SIGINT."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            os.execve(sys.executable, [sys.executable, "-m", "lmkit", *map(str, args)], env)
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 120) -> str:
        end = time.monotonic() + timeout
        while not re.search(pattern, self.seen):
            left = end - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], min(left, 1))[0]:
                try:
                    chunk = os.read(self.fd, 4096).decode("utf-8", "replace")
                except OSError:
                    chunk = ""
                assert chunk or re.search(pattern, self.seen), f"ended before {pattern!r}: {self.seen[-2000:]!r}"
                self.seen += chunk
        found = self.seen
        self.seen = self.seen[re.search(pattern, self.seen).end():]
        return found

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def kill(self) -> None:
        """End the child if it is still running (a failed test must not leave it behind)."""
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def close(self, timeout: float = 30) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    os.read(self.fd, 4096)
                except OSError:
                    pass
        self.kill()
        raise AssertionError("lmkit chat did not exit")


def test_ctrl_c_stops_the_reply_and_the_session_goes_on(tmp_path):
    folder = _folder(tmp_path / "long", 16384)  # a reply long enough to outlast the Ctrl-C on any machine
    term = Terminal("chat", "--model", folder, "--temperature", "0", "--max-new-tokens", "16000")
    try:
        term.expect(r"you> ")
        term.send("hello there\n")
        term.expect(r"assistant> \S")  # streaming has begun
        term.send("\x03")
        term.expect(r"\[reply stopped\]")
        term.expect(r"you> ")
        term.send("/reset\n")
        term.expect(r"\[conversation cleared\]")
        term.expect(r"you> ")
        term.send("/exit\n")
        assert term.close() == 0
    finally:
        if not term.seen.endswith("EXITED"):
            term.kill()


def test_oldest_exchanges_are_dropped_with_a_notice(tmp_path):
    folder = _folder(tmp_path / "short", 64)
    term = Terminal("chat", "--model", folder, "--system", "be brief", "--temperature", "0", "--max-new-tokens", "12")
    try:
        term.expect(r"you> ")
        term.send("hello there\n")
        first = term.expect(r"you> ")
        assert "dropped" not in first and re.search(r"assistant> .+", first)
        term.send("how are you\n")
        term.expect(r"\[dropped the oldest exchange to fit the context\]")
        term.expect(r"you> ")
        term.send("\x04")  # Ctrl-D at the prompt ends the session
        assert term.close() == 0
    finally:
        term.kill()


def test_session_keeps_history_stops_at_end_of_turn_and_refuses_what_cannot_fit(tmp_path):
    folder = _folder(tmp_path / "eos", 48, eos=True)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    assert stop_ids(tok) == [tok.token_to_id("<|done|>")]
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features)
    with torch.no_grad():  # a head whose bias makes <|done|> the most likely token: every reply ends at once
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.token_to_id("<|done|>")] = 100.0
    model.lm_head = head
    session = ChatSession(model, tok, system="be brief", max_new_tokens=8, temperature=0)
    streamed = []
    assert session.send("hi", Sink(streamed)) == ""  # ended on <|done|> at once, which the reply does not show
    assert len(streamed) == 3 and streamed[1] == [tok.token_to_id("<|done|>")]
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"] and streamed[-1] == "end"
    with pytest.raises(GenerationError, match=r"the message takes \d+ of the model's 48 positions and the reply 8 more"):
        session.send("hello there, how are you? " * 10)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    session.reset()
    assert session.messages == [{"role": "system", "content": "be brief"}]


def test_defaults_fit_a_short_context_and_the_folder_sets_the_sampling(tmp_path):
    folder = _folder(tmp_path / "short", 48, eos=True)
    term = Terminal("chat", "--model", folder)  # default flags on a short context: it starts, within the context
    try:
        banner = term.expect(r"you> ")
        assert "48 positions, replies up to 24 tokens, temperature 1" in banner
        term.send("/exit\n")
        assert term.close() == 0
    finally:
        term.kill()
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    assert end_ids(model, tok)[-1] == tok.token_to_id("<|done|>") and model.config.eos_token_id in end_ids(model, tok)
    with pytest.raises(GenerationError, match=r"--max-new-tokens 48 leaves no room .* the model has 48 positions; "
                                              r"use at most 47 \(the default, 24,"):
        ChatSession(model, tok, max_new_tokens=48)
    model.generation_defaults = {**model.generation_defaults, **CHAT_SAMPLING}  # as `finetune --task sft` writes
    session = ChatSession(model, tok)
    assert (session.temperature, session.top_p, session.max_new_tokens) == (0.7, 0.9, 24)
    assert ChatSession(model, tok, temperature=1.2).temperature == 1.2  # a flag still wins
    model.generation_defaults = {"do_sample": False, "temperature": 0.7}  # greedy, as transformers reads the file
    assert ChatSession(model, tok).temperature == 0


def test_replies_decode_through_the_engine_as_generate_does(tmp_path):
    """Three greedy turns: each reply streams one token a put and equals generate's on the rendered conversation;
    later turns reuse the conversation's keys and values from the engine's prefix cache."""
    folder = _folder(tmp_path / "turns", 512, eos=True)
    model, tok = lmkit.load_model(folder), lmkit.load_tokenizer(folder)
    session = ChatSession(model, tok, system="be brief", max_new_tokens=20, temperature=0)
    for text in ["hello there, how are you?", "fine thanks and you", "hello"]:
        prompt = tok.apply_chat_template(session.messages + [{"role": "user", "content": text}],
                                         add_generation_prompt=True, return_dict=False)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=20, eos_token_id=session.stops,
                                  pad_token_id=session.stops[0])[0, len(prompt):].tolist()
        streamed = []
        reply = session.send(text, Sink(streamed))
        assert streamed[0] == prompt and streamed[-1] == "end"
        assert streamed[1:-1] == [[t] for t in expected]
        assert reply == tok.decode([t for t in expected if t not in session.stops], skip_special_tokens=True)
    assert session.engine.prefix.hits > 0
