"""Every `lmkit ... --help`: each option described (with its default), named in one metavar vocabulary, and each
command with examples that are themselves valid command lines; the flags DESIGN.md promises stay the visible ones
and the old spellings still parse."""
import argparse
import shlex

import pytest

from lmkit.cli import build_parser
from lmkit.cli.helptext import Formatter


def commands(parser=None, path=()):
    """(path, parser) for lmkit itself and every subcommand below it."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


ALL = list(commands())
IDS = [" ".join(path) or "lmkit" for path, _ in ALL]


def visible_options(parser):
    return [a for a in parser._actions if a.help is not argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))]


def example_lines(parser) -> list[str]:
    return [line.strip() for line in (parser.epilog or "").splitlines()[1:] if line.strip().startswith("lmkit ")]


def test_the_walk_reaches_every_command():
    names = {" ".join(path) for path, _ in ALL}
    assert {"train", "rag index", "rag query", "plot positions", "scaling sweep", "data clean"} <= names
    assert len(names) > 30


@pytest.mark.parametrize("path, parser", ALL, ids=IDS)
def test_every_option_is_described_with_its_default(path, parser):
    assert parser.formatter_class is Formatter, f"{IDS[ALL.index((path, parser))]}: build it with helptext.add_command"
    assert (parser.description or "").strip(), "no description"
    formatter = parser._get_formatter()
    # options of which one must be chosen (--model | --vectors) have no default to tell
    grouped = {id(a) for g in parser._mutually_exclusive_groups for a in g._group_actions}
    for action in visible_options(parser):
        name = "/".join(action.option_strings) or action.dest
        help_text = formatter._get_help_string(action)
        assert help_text and help_text.strip(), f"{name} has no description"
        if action.option_strings and action.nargs != 0 and not action.required and id(action) not in grouped:
            # a switch is off unless given; an option with a value says what it is when left out
            assert "default" in help_text, f"{name}'s help does not say what happens without it"
        if action.nargs != 0 and not action.choices:
            # argparse's own metavar is the dest in capitals (LR, SEED, LORA_ALPHA): one vocabulary instead
            assert action.metavar is not None, f"{name} has no metavar of the house vocabulary (N, X, K, DIR ...)"


@pytest.mark.parametrize("path, parser", ALL, ids=IDS)
def test_every_command_has_examples_that_parse(path, parser):
    lines = example_lines(parser)
    assert lines, "no example in the epilog"
    for line in lines:
        argv = shlex.split(line.split(" # ")[0])[1:]
        assert argv[:len(path)] == list(path), f"the example {line!r} is not of this command"
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"the example {line!r} does not parse (exit {exc.code})")


def test_help_prints_the_examples_as_written(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rag", "query", "--help"])
    out = capsys.readouterr().out
    assert "\nexamples:\n  lmkit rag query --index " in out
    assert "--k K" in out and "(default 5)" in out


@pytest.mark.parametrize("command, flag", [
    ("train", "--precision"), ("rag index", "--precision"), ("search", "--precision"), ("rag query", "--k"),
    ("search", "--k"), ("embed similar", "--k"), ("lens", "--k"), ("plot embeddings", "--k"),
    ("generate", "--prompt-lookup"), ("generate", "--top-k"), ("harness", "--num-fewshot"),
])
def test_one_visible_spelling_per_idea(command, flag):
    parser = dict(zip(IDS, (p for _, p in ALL)))[command]
    assert flag in parser.format_help()


@pytest.mark.parametrize("argv, dest, value", [
    ("search --model m --query q --top-k 3", "top_k", 3),
    ("search --model m --query q --bf16", "precision", "bf16"),
    ("search --model m --query q", "precision", "fp32"),
    ("embed similar --vectors v w --topn 4", "topn", 4),
    ("lens --model m --prompt p --top 2", "top", 2),
    ("plot embeddings --model m --count 7", "count", 7),
    ("plot attention --model m --text t", "text", "t"),
])
def test_old_spellings_still_parse_and_stay_hidden(argv, dest, value):
    args = build_parser().parse_args(shlex.split(argv))
    assert getattr(args, dest) == value
    old = next((w for w in argv.split() if w in ("--top-k", "--bf16", "--topn", "--top", "--count", "--text")), None)
    if old:
        command = " ".join(w for w in argv.split()[:2] if not w.startswith("-"))
        parser = dict(zip(IDS, (p for _, p in ALL)))[command]
        assert f"{old} " not in parser.format_help() and f"{old}\n" not in parser.format_help()
