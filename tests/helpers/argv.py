"""Command lines from keywords, for the package's CLIs run as child processes."""

from __future__ import annotations


def flags(**options) -> list[str]:
    """`group_size=4` → `--group-size 4`, `follow=True` → `--follow`; in the order given."""
    argv = []
    for name, value in options.items():
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv
