"""The ssdsgd-run command line as a user meets it: --help, --dry-run on every shipped config, several
overrides after one --set, and config mistakes (a key given twice, a mistyped --set) named in one line."""
import glob
import os
import subprocess
import sys

import pytest
from support.jobs import ROOT

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ssdsgd", *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)


@pytest.mark.parametrize("config", CONFIGS, ids=[os.path.relpath(c, ROOT) for c in CONFIGS])
def test_dry_run_of_every_shipped_config_starts_nothing(tmp_path, capsys, config):
    from ssdsgd.launch.run import main  # in-process: one mxnet import for all configs
    code = main(["--config", config, "--dry-run", "--set", f"log.dir={tmp_path / 'runs'}",
                 f"checkpoint.dir={tmp_path}/ck"])
    out = capsys.readouterr().out
    from ssdsgd.config import ROOTED_DATASETS, load_config
    data = load_config(config).data
    missing = data.dataset in ROOTED_DATASETS and not os.path.isdir(data.root)   # CIFAR-10, ImageNet: not shipped
    assert code == (2 if missing else 0), out[-2000:]
    assert ("\n# error: a run would stop here: data.root: " in out) == missing, out[-2000:]
    assert out.startswith(f"# effective config of {config}")
    assert "\n# planned processes\n" in out
    assert os.listdir(tmp_path) == []                   # no run folder, no checkpoint folder


def test_dry_run_reads_the_data_as_the_run_would(tmp_path, capsys):
    """A data.root without a complete CIFAR-10 copy: the run stops before starting any process, and so
    does --dry-run, with the same line."""
    from ssdsgd.launch.run import main
    (tmp_path / "empty").mkdir()
    code = main(["--config", "configs/cifar10_resnet20_ssd_topk.yaml", "--dry-run", "--set",
                 f"data.root={tmp_path / 'empty'}", "cluster.launcher=local", "cluster.hostfile=null",
                 "cluster.interface=null", f"log.dir={tmp_path / 'runs'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    out = capsys.readouterr().out
    assert code == 2
    assert "\n# error: a run would stop here: cifar10: no complete CIFAR-10 copy found in " in out, out[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_dry_run_reports_what_the_launcher_would_refuse_and_exits_2(tmp_path, capsys):
    """Before: a dry run printed what would stop the run as a warning and exited 0, so a script could not
    check a config with it."""
    from ssdsgd.launch.run import main
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 cores=2\n")
    code = main(["--config", os.path.join(ROOT, "configs", "demo_digits_ssd.yaml"), "--dry-run", "--set",
                 "cluster.launcher=ssh", f"cluster.hostfile={hostfile}", "cluster.interface=lo",
                 f"log.dir={tmp_path}/runs"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert out.splitlines()[-2:] == ["# planned processes", f"# error: a run would stop here: cluster.hostfile: bad "
                                     f"option 'cores=2' in hostfile {hostfile} (known: slots=N, interface=IF, "
                                     f"python=PATH, gpus=IDS or gpus=N, spare)"]
    assert "launch:" not in err
    assert os.listdir(tmp_path) == ["hosts"]


# ---- paths that cannot be used: named for what they are, the same by --dry-run and by the run ---------

def _bad_path(tmp_path, kind):
    """A path of `kind` under tmp_path: a folder, a file, a dangling link, a link loop, a name too long."""
    path = tmp_path / kind.replace(" ", "_")
    if kind == "folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "link loop":
        path.symlink_to(path)
    else:
        path = tmp_path / ("n" * 300)
    return str(path)


@pytest.mark.parametrize("kind, said", [("folder", "is a folder, not a file"), ("link loop", "is a symbolic link loop"),
                                        ("dangling link", "is a symbolic link to ")])
def test_a_host_file_that_is_not_a_file_is_named_for_what_it_is(tmp_path, kind, said):
    from ssdsgd.config import load_config
    from ssdsgd.launch.run import preflight
    path = _bad_path(tmp_path, kind)
    cfg = load_config(os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml"),
                      ["cluster.launcher=ssh", f"cluster.hostfile={path}", "cluster.interface=lo"])
    assert preflight(cfg).startswith(f"cluster.hostfile: {path} {said}")


@pytest.mark.parametrize("key", ["log.dir", "checkpoint.dir"])
@pytest.mark.parametrize("kind, said", [
    ("file", "is a file, not a folder"), ("dangling link", "is a symbolic link to "),
    ("link loop", "is a symbolic link loop"), ("long name", "is a name of 300 bytes")])
def test_dry_run_refuses_the_folders_the_run_cannot_make_as_the_run_does(tmp_path, key, kind, said):
    """--dry-run said nothing where the run stopped at folder creation (exit 0 against exit 2), and a
    checkpoint.dir that is a link loop was 'File exists': both now say what the path is, in the same line."""
    from ssdsgd.config import load_config
    from ssdsgd.folders import FolderError, prepare, start_problem
    path = _bad_path(tmp_path, kind)
    sets = [f"{key}={path}"] + ([f"log.dir={tmp_path}/runs"] if key == "checkpoint.dir" else [])
    cfg = load_config(os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml"), sets)
    with pytest.raises(FolderError) as info:
        prepare(cfg, False, False, "run")
    msg = str(info.value)
    assert msg.startswith(f"{key}: ") and said in msg, msg
    assert start_problem(cfg, False, False) == msg
    assert not os.path.exists(tmp_path / "runs")                  # nothing left behind


@pytest.mark.parametrize("sets, said", [
    (["checkpoint.every_epochs=1"], "no checkpoint was written yet (checkpoint.every_epochs: 1, in {ck}), so there "
                                    "is nothing to restart from"),
    ([], "cluster.max_restarts restarts from a checkpoint, and checkpoint.every_epochs is not set"),
])
def test_a_failure_before_the_first_checkpoint_says_why_it_is_not_restarted(tmp_path, capsys, monkeypatch, sets, said):
    """Both keys set: it said 'cluster.max_restarts needs checkpoint.dir and checkpoint.every_epochs'."""
    from types import SimpleNamespace

    from ssdsgd.config import load_config
    from ssdsgd.launch import run as front
    ck = tmp_path / "ck"
    ck.mkdir()
    cfg = load_config(os.path.join(ROOT, "configs", "demo_digits_ssgd.yaml"),
                      ["cluster.max_restarts=2", f"checkpoint.dir={ck}", *sets])
    monkeypatch.setattr(front, "_launch", lambda *a, **k: front.RESTARTABLE)
    code = front._run_with_restarts(cfg, SimpleNamespace(resume=False), str(tmp_path))
    err = capsys.readouterr().err
    assert code == front.RESTARTABLE
    assert err == f"run: the job failed before its first complete checkpoint; not restarted: {said.format(ck=ck)}\n"
