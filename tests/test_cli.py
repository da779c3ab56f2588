"""The ssdsgd-run command line as a user meets it: --help, --dry-run on every shipped config, several
overrides after one --set, and config mistakes (a key given twice, a mistyped --set) named in one line."""
import glob
import os
import subprocess
import sys

import pytest
from jobs import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ssdsgd", *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


def test_help_names_the_command():
    out = run("--help").stdout
    assert out.startswith("usage: ssdsgd-run") and "--dry-run" in out and "--resume" in out


@pytest.mark.parametrize("config", CONFIGS, ids=[os.path.relpath(c, ROOT) for c in CONFIGS])
def test_dry_run_of_every_shipped_config_starts_nothing(tmp_path, capsys, config):
    from ssdsgd.launch.run import main  # in-process: one mxnet import for all configs
    code = main(["--config", config, "--dry-run", "--set", f"log.dir={tmp_path / 'runs'}",
                 f"checkpoint.dir={tmp_path}/ck"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert out.startswith(f"# effective config of {config}")
    assert "# planned processes" in out or "# warning: a run would stop here" in out
    assert os.listdir(tmp_path) == []                   # no run folder, no checkpoint folder


def test_dry_run_shows_the_plan_and_every_override(tmp_path):
    proc = run("--config", "configs/demo_digits_ssd.yaml", "--dry-run", "--set", "train.epochs=3", "seed=7",
               f"log.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout
    assert "\nseed: 7\n" in proc.stdout and "  epochs: 3\n" in proc.stdout
    for role in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert f"\n{role} on localhost: " in proc.stdout


def test_a_section_given_twice_is_named(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  epochs: 2\nalgorithm:\n  type: ssd\ntrain:\n  lr: 0.1\n")
    proc = run("--config", str(path), "--dry-run")
    assert proc.returncode == 2
    assert proc.stdout.strip() == f"config error: {path}: train: given twice in the same section (lines 1 and 5)"


def test_a_mistyped_override_lists_the_keys_of_its_section():
    proc = run("--config", "configs/demo_digits_ssd.yaml", "--dry-run", "--set", "train.epoch=3")
    assert proc.returncode == 2
    assert proc.stdout.startswith("config error: train.epoch: unknown key (known here: batch_size, epochs,")
    assert len(proc.stdout.strip().splitlines()) == 1


def test_dry_run_reports_what_the_launcher_would_refuse_as_a_warning(tmp_path, capsys):
    """Before: the launcher printed `launch: bad host ...` and the dry run exited 2, though its `except
    UsageError` (and docstring) meant a warning."""
    from ssdsgd.launch.run import main
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 cores=2\n")
    code = main(["--config", os.path.join(ROOT, "configs", "demo_digits_ssd.yaml"), "--dry-run", "--set",
                 "cluster.launcher=ssh", f"cluster.hostfile={hostfile}", "cluster.interface=lo",
                 f"log.dir={tmp_path}/runs"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.splitlines()[-2:] == ["# planned processes", f"# warning: a run would stop here: bad option 'cores=2' "
                                     f"in hostfile {hostfile} (known: slots=N, interface=IF, python=PATH)"]
    assert "launch:" not in err
