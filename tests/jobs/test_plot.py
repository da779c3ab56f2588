"""scripts/plot.py draws figures a person can read: titles and labels in words and inside the figure,
legends beside or below the data with no run-folder names in them, a target line on the time-to-accuracy
figures, integer epoch ticks; and every committed PNG names the command that redraws it."""
import json
import os
import shlex
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tracked(pattern):
    try:
        return subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")


def test_every_committed_png_names_the_command_that_redraws_it():
    tracked = set(_tracked("*"))
    problems = []
    for png in _tracked("*.png"):
        folder, name = os.path.split(png)
        try:
            with open(os.path.join(ROOT, folder, "manifest.json")) as f:
                command = json.load(f).get("plots", {}).get(name)
        except (OSError, ValueError) as err:
            problems.append(f"{png}: {err}")
            continue
        if not command:
            problems.append(f"{png}: {folder}/manifest.json has no plots entry for it")
            continue
        words = shlex.split(command)
        inputs = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--csv", "--evals")]
        if words[:2] != ["python", "scripts/plot.py"] or not inputs or not set(inputs) <= tracked:
            problems.append(f"{png}: {command!r} does not redraw it from committed files")
    assert problems == []
