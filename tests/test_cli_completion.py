"""`sedax completion bash|zsh`: the scripts are valid, know every subcommand and complete as a shell would."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import build_parser

SEDAX = str(Path(sys.executable).with_name("sedax"))

# (words on the line, the last being completed) -> what the completion offers, with the shell's own filter.
CASES = [
    (["sedax", "st"], ["status"]),
    (["sedax", "sim", ""], ["-h", "--help", "static", "growth"]),
    (["sedax", "sim", "static", "--lo"], ["--log-dir", "--log-max-bytes", "--log-keep", "--loads"]),
    (["sedax", "sim", "static", "--loads", ""], ["homogeneous", "heterogeneous", "exponential"]),
    (["sedax", "--log-level", "INFO", "sta"], ["status"]),  # a global option's value is skipped
    (["sedax", "status", "--broker", "127.0.0.1:1", "--j"], ["--json"]),
    (["sedax", "cluster", "d"], ["down"]),
    (["sedax", "broker", "--store", ""], ["auto", "disk", "memory"]),
    (["sedax", "status", "--broker", ""], []),  # a free value: left to the shell's file names
    (["sedax", "completion", ""], ["-h", "--help", "bash", "zsh"]),
]


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [name, *_subcommands(sub)]
    return out


def _script(shell: str) -> str:
    res = subprocess.run([SEDAX, "completion", shell], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    return res.stdout


def _driver(script: Path, cases: list[tuple[list[str], list[str]]], compgen_filters: bool) -> str:
    """Shell code that completes each case as the shell's completion system would call the function."""
    lines = [f"source {script}"]
    for words, _ in cases:
        quoted = " ".join(f"'{w}'" for w in words)
        lines.append(f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _sedax_complete")
        # bash filters by the word being completed in compgen; zsh's bashcompinit leaves that to zsh.
        last = words[-1]
        keep = "" if compgen_filters else '[[ "$w" == "$cur"* ]] && '
        lines.append(f'out=; cur=\'{last}\'; for w in "${{COMPREPLY[@]}}"; do {keep}out="$out $w"; done; echo "$out"')
    return "\n".join(lines) + "\n"


def _check(shell: str, tmp_path: Path, compgen_filters: bool) -> None:
    script = tmp_path / f"sedax.{shell}"
    script.write_text(_script(shell))
    syntax = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True, timeout=60, check=False)
    assert syntax.returncode == 0, syntax.stderr
    text = script.read_text()
    missing = [name for name in _subcommands(build_parser()) if f" {name})" not in text]
    assert missing == [] and "completion)" in text
    driver = tmp_path / f"drive.{shell}"
    driver.write_text(_driver(script, CASES, compgen_filters))
    argv = [shell, "-f", str(driver)] if shell == "zsh" else [shell, "--norc", str(driver)]
    env = {"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # no user start-up files
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    got = [line.split() for line in res.stdout.splitlines()]
    assert got == [want for _, want in CASES]


def test_bash_completion(tmp_path: Path) -> None:
    _check("bash", tmp_path, compgen_filters=True)


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed on this machine")
def test_zsh_completion(tmp_path: Path) -> None:
    _check("zsh", tmp_path, compgen_filters=False)
