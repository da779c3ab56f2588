"""Tests for ssdsgd.config (schema validation, --set overrides, CLI exit codes) and ssdsgd.ps.commands."""
import os
import subprocess
import sys

import pytest

from unit.test_config import config_error

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SSGD = os.path.join(REPO, "configs", "demo_digits_ssgd.yaml")


# ---------------------------------------------------------------- shipped configs and defaults


# ---------------------------------------------------------------- unknown keys


# ---------------------------------------------------------------- types


# ---------------------------------------------------------------- ranges


# ---------------------------------------------------------------- overrides


# ---------------------------------------------------------------- cross-field checks


# ---------------------------------------------------------------- CLI

def run_cli(module, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", ["ssdsgd", "ssdsgd.train"])
def test_cli_bad_override_exits_2(module):
    res = run_cli(module, "--config", "configs/demo_digits_ssgd.yaml", "--set", "train.epochs=oops")
    assert res.returncode == 2, res.stderr
    assert "train.epochs" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("module", ["ssdsgd", "ssdsgd.train"])
def test_cli_missing_config_exits_2(module):
    res = run_cli(module, "--config", "configs/does_not_exist.yaml")
    assert res.returncode == 2, res.stderr
    assert "configs/does_not_exist.yaml" in res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------- commands


# ---------------------------------------------------------------- data subsets, IDX datasets, allocation


# ---------------------------------------------------------------- a config reader with limits

def _alias_bomb(levels=9):
    """~1 KB of YAML whose milestones expand to 10^levels values: each anchor lists the previous one ten times."""
    items = ["&a0 [1,1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]"
                                                 for i in range(1, levels)]
    return f"train:\n  lr_schedule:\n    type: step\n    milestones: [{', '.join(items)}]\n"


def _one_short_line(res):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and len(lines[0]) < 400, (res.returncode, res.stderr[-2000:])
    return lines[0]


def test_an_alias_bomb_is_one_short_line_in_under_a_second(tmp_path):
    import time
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert len(path.read_text()) < 1100
    t0 = time.time()
    msg = config_error(str(path))
    assert time.time() - t0 < 1
    assert msg.startswith(f"{path}: train.lr_schedule.milestones: ") and "aliases" in msg and len(msg) < 400, msg
    line = _one_short_line(run_cli("ssdsgd", "--config", str(path), "--dry-run"))
    assert "train.lr_schedule.milestones" in line


@pytest.mark.parametrize("where", ["file", "--set"])
def test_deep_nesting_is_one_line_exit_2(tmp_path, where):
    deep = "[" * 100000 + "]" * 100000
    if where == "file":
        path = tmp_path / "deep.yaml"
        path.write_text(f"train:\n  lr_schedule:\n    milestones: {deep}\n")
        res = run_cli("ssdsgd", "--config", str(path), "--dry-run")
    else:
        deep = "[" * 50000 + "]" * 50000            # an argument holds at most 128 KiB
        res = run_cli("ssdsgd", "--config", SSGD, "--dry-run", "--set", f"train.lr_schedule.milestones={deep}")
    line = _one_short_line(res)
    assert "train.lr_schedule.milestones: " in line and "nested more than" in line, line
