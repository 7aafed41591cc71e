"""Text that others wrote, made harmless to print on a terminal.

Event messages, node names, health and cordon reasons come from etcd records that any node's
agent can write, and a rank's words (a checkpoint_failed error) travel in them: the CLI prints
them to an operator's terminal (`lazarus run`, `up`, `status`, `nodes`, `events`). A control
character there could clear the screen, retitle the window or rewrite what is shown, and a
CR or LF could start a line that reads like one of ours (docs/security.md). Where rich renders
such text, it goes in as a Text, never as markup: "[red]" in a node name is part of its name.
"""

from __future__ import annotations

import re

# Every C0 control, DEL and every C1 control (Unicode's Cc), tab and newline too: one record
# is one line on the terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with each control character shown as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
