"""One look for every `lmkit ... --help`: descriptions refilled to the terminal, examples kept as written,
each option's default shown, old flag spellings accepted but hidden.

The vocabulary of metavars: N a count, X a real number, F a fraction, K how many results (or tokens) to keep,
T a temperature, P a probability mass, B beams, C FLOPs, SECONDS a duration, DIR a folder, FILE a file, PATH
either, TEXT free text, NAME a name. How many results is `--k` everywhere (as `rag query --k`), compute type
`--precision fp32|bf16`.
"""
from __future__ import annotations

import argparse
import re
import textwrap


class Formatter(argparse.HelpFormatter):
    """Descriptions refilled paragraph by paragraph (an indented paragraph kept as written), the epilog (the
    examples) kept as written, and ' (default X)' after an option whose help does not name its default."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):  # command lines must not be refilled
            return "\n".join(indent + line for line in text.splitlines())
        paragraphs = re.split(r"\n\s*\n", textwrap.dedent(text).strip("\n"))
        out = []
        for para in paragraphs:
            lines = para.splitlines()
            if any(line[:1].isspace() for line in lines):  # a table or a usage block: its line breaks mean something
                out.append("\n".join(indent + line for line in lines))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent))
        return "\n\n".join(out)

    def _format_action_invocation(self, action):
        hidden = getattr(action, "old_spellings", ())
        if not hidden:
            return super()._format_action_invocation(action)
        shown = argparse.Action([s for s in action.option_strings if s not in hidden], action.dest,
                                nargs=action.nargs, metavar=action.metavar, choices=action.choices)
        return super()._format_action_invocation(shown)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS or action.nargs == 0):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default {shown.replace('%', '%%')})" if text else f"default {shown.replace('%', '%%')}"


def examples(*lines: str) -> str:
    """The epilog of a command: `examples:` and one command line (or a `# comment`) per line."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_command(subparsers, name: str, *, help: str, description: str, example_lines: tuple[str, ...] | list[str],
                **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser with the house formatter, its description and its examples."""
    return subparsers.add_parser(name, help=help, description=description, epilog=examples(*example_lines),
                                 formatter_class=Formatter, **kwargs)


def hidden_alias(parser, *flags: str, dest: str, **kwargs) -> None:
    """Accept `flags` (an old spelling) for `dest` without showing them in --help or the usage line."""
    parser.add_argument(*flags, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def old_spellings(action: argparse.Action, *flags: str) -> argparse.Action:
    """Hide `flags`, further option strings of `action` (after the visible one), from --help; they still parse.
    For a required option, where a separate hidden argument would leave the visible one missing."""
    action.old_spellings = flags
    return action
