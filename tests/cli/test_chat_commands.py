"""`lmkit chat`'s slash commands through the real command with piped stdin: /help lists them, an unknown one is
refused with that list and never reaches the model, // sends a line that starts with a slash."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from helpers.hf_folders import build  # noqa: E402
from helpers.processes import process_env  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    folder = build("qwen2", tmp_path_factory.mktemp("chat") / "model")
    (Path(folder) / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def chat(folder, lines: str):
    return subprocess.run([sys.executable, "-m", "lmkit", "chat", "--model", folder, "--max-new-tokens", "3",
                           "--temperature", "0"], input=lines, capture_output=True, text=True, timeout=300,
                          env=process_env())


def test_help_and_unknown_commands_stay_out_of_the_conversation(chat_folder):
    r = chat(chat_folder, "/help\n/foo bar\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "/help" in r.stdout and "/reset" in r.stdout and "/exit" in r.stdout and "//TEXT" in r.stdout
    assert "[unknown command /foo; the commands are /help, /reset, /exit (//foo sends /foo to the model)]" in r.stdout
    assert "assistant> " not in r.stdout  # neither line was sent to the model


def test_a_doubled_slash_sends_the_line(chat_folder):
    r = chat(chat_folder, "//foo\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "unknown command" not in r.stdout
    assert r.stdout.count("assistant> ") == 1  # the model answered the one message
