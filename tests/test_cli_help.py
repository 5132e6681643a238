"""Every `pdserve` command's ``--help`` reads right for a user: a boolean flag shows both its
forms and its default as on/off, each flag shows one default, and no help names the code's
modules."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from pdserve.cli import make_parser, parse, worker_config_from_args

COMMANDS = [
    "generate",
    "demo",
    "prefill",
    "decode",
    "colocated",
    "router",
    "router-keeper",
    "up",
    "serve",
    "plan",
]
MODULE_PATH = re.compile(r"\b(common|router|services|kvtransfer|loadtest|pdserve)\.[a-z_]+\b")


def entries(text: str) -> list[str]:
    """The help's entries, one per flag, argparse's wrapped lines joined."""
    out: list[str] = []
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            out.append(line.strip())
        elif out and line.startswith("    "):
            out[-1] += " " + line.strip()
    return out


def help_of(command: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *command.split(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def commands() -> dict[str, argparse.ArgumentParser]:
    return make_parser({})._subparsers._group_actions[0].choices  # type: ignore[union-attr]


def test_top_level_help_names_no_modules():
    text = help_of("")
    assert not MODULE_PATH.search(text) and "``" not in text, text


def test_every_flag_reads_right():
    """Every command in one process (a subprocess each would import torch each time)."""
    assert set(commands()) == set(COMMANDS)
    for name, sub in commands().items():
        for entry in entries(sub.format_help()):
            where = f"pdserve {name}: {entry}"
            assert entry.count("default") <= 1, where
            assert not re.search(r"\(default: (True|False)", entry), where
            assert not MODULE_PATH.search(entry), where
            flags = entry.split("  ")[0]
            if "--no-" in flags:  # a switch shows both forms, the positive first
                assert re.match(r"--([a-z-]+), --no-\1\b", flags), where
                assert "(default: on;" in entry or "(default: off;" in entry, where


def test_switches_read_as_they_say():
    text = " ".join(commands()["up"].format_help().split())
    assert (
        "--prefix-caching, --no-prefix-caching keep computed prompt blocks for later prompts "
        "that share them (the prefix cache) (default: on; env PDSERVE_NO_PREFIX_CACHING=1 turns "
        "it off)"
    ) in text
    assert "--restart, --no-restart restart a component that exits" in text
    assert "(default: off; env PDSERVE_RESTART)" in text
    assert "torch threads per worker (default: the cores split between the workers; env" in text
    for argv, env, on in (
        (["decode"], {}, True),
        (["decode", "--no-verify-checksums"], {}, False),
        (["decode", "--verify-checksums"], {"PDSERVE_NO_VERIFY_CHECKSUMS": "1"}, True),
        (["decode"], {"PDSERVE_NO_VERIFY_CHECKSUMS": "1"}, False),
    ):
        assert worker_config_from_args("decode", parse(argv, env)).verify_checksums is on, argv
