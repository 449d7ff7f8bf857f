"""The README's command lines: every `hybridagg SUBCOMMAND ...` it shows parses.

A flag renamed or removed in the code would otherwise leave the user's guide
showing a command that fails at its first word.
"""

import re
import shlex
from pathlib import Path

import pytest

from hybridagg.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            # the command itself, after any launcher in front of it
            m = re.search(
                r"(?:^|\s)hybridagg (profile|simulate|plan|train|convert)\s.*", line
            )
            if m and not any(s in line for s in ("$(", "...", "[")):  # not placeholders
                found.append(m.group(0).strip())
    return found


COMMANDS = _commands()


def test_the_readme_shows_the_planning_commands():
    subcommands = {shlex.split(c)[1] for c in COMMANDS}
    assert {"profile", "simulate", "plan", "train"} <= subcommands


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_parses(command):
    words = shlex.split(command)[1:]
    try:
        build_parser().parse_args(words)
    except SystemExit as exc:  # argparse's way of refusing a flag
        pytest.fail(f"the README's {command!r} does not parse (exit {exc.code})")
