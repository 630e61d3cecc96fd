"""What the configuration suites share (test_config*.py): the examples' folder
and how a refusal is checked, naming file, line and field. Each suite's YAML
stays in its own file, whole, where its line numbers can be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpclb.config import ConfigError, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "appliance" / "examples"


def line_of(text: str, needle: str) -> int:
    """1-based line of the first occurrence of ``needle``."""
    return text[: text.index(needle)].count("\n") + 1


def refused(text: str) -> str:
    """The error parse_config raises for text (as file t.yaml); fails if it loads."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, "t.yaml")
    return str(info.value)


def assert_refused(base: str, old: str, new: str, path: str, words: str, at: str, *,
                   single: bool = True) -> None:
    """base, its first ``old`` made ``new``, is refused by a line that names
    ``path`` and says ``words``, on the line of ``at`` (the value, or the
    setting a cross-field problem is about). ``single``: exactly one line of
    the message names path; otherwise the first of them is checked."""
    assert old in base, old
    text = base.replace(old, new, 1)
    message = refused(text)
    lines = [m for m in message.splitlines() if f": {path}: " in m]
    assert len(lines) == 1 if single else lines, message
    assert words in lines[0], lines[0]
    assert lines[0].startswith(f"t.yaml:{line_of(text, at)}:"), (lines[0], at)
