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
    from ssdsgd.config import ROOTED_DATASETS, load_config
    data = load_config(config).data
    missing = data.dataset in ROOTED_DATASETS and not os.path.isdir(data.root)   # CIFAR-10, ImageNet: not shipped
    assert code == (2 if missing else 0), out[-2000:]
    assert ("\n# error: a run would stop here: data.root: " in out) == missing, out[-2000:]
    assert out.startswith(f"# effective config of {config}")
    assert "\n# planned processes\n" in out
    assert os.listdir(tmp_path) == []                   # no run folder, no checkpoint folder


def test_dry_run_shows_the_plan_and_every_override(tmp_path):
    proc = run("--config", "configs/demo_digits_ssd.yaml", "--dry-run", "--set", "train.epochs=3", "seed=7",
               f"log.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout
    assert "\nseed: 7\n" in proc.stdout and "  epochs: 3\n" in proc.stdout
    assert "\n# note: " not in proc.stdout
    assert "SSDSGD_RUN_DIR='<run folder>'" in proc.stdout           # a placeholder, not a path under the cwd
    for role in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert f"\n{role} on localhost: " in proc.stdout


def test_dry_run_notes_a_setting_the_rest_of_the_config_leaves_idle(tmp_path):
    proc = run("--config", "configs/demo_digits_ssgd.yaml", "--dry-run", "--set", "compression.density=0.05",
               f"log.dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout
    assert "\n# note: compression.density = 0.05 has no effect: compression.type is none; only the sparsifiers " \
           "(" in proc.stdout


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


def test_a_section_given_twice_is_named(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  epochs: 2\nalgorithm:\n  type: ssd\ntrain:\n  lr: 0.1\n")
    proc = run("--config", str(path), "--dry-run")
    assert proc.returncode == 2
    assert proc.stdout.strip() == f"config error: {path}: train: given twice in the same section (lines 1 and 5)"


def test_a_mistyped_override_lists_the_keys_of_its_section():
    proc = run("--config", "configs/demo_digits_ssd.yaml", "--dry-run", "--set", "train.epoch=3")
    assert proc.returncode == 2
    assert proc.stdout.startswith("config error: train.epoch: unknown key (known here: batch_size, devices, epochs,")
    assert len(proc.stdout.strip().splitlines()) == 1


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


def test_dry_run_prints_the_plan_then_a_missing_data_root_and_exits_2(tmp_path):
    proc = run("--config", "configs/cifar10_resnet20_ssgd.yaml", "--dry-run", "--set", f"data.root={tmp_path}/no",
               f"log.dir={tmp_path}/runs")
    assert proc.returncode == 2, proc.stdout
    assert "\nworker 0 on localhost: " in proc.stdout
    assert proc.stdout.endswith(f"\n# error: a run would stop here: data.root: {tmp_path}/no does not exist (put "
                                f"the cifar10 files in that folder; nothing is downloaded)\n")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("hosts, interface, error", [
    ("node1 slot=2\n", "lo", "cluster.hostfile: bad option 'slot=2' in hostfile {hostfile} (known: slots=N, "
                             "interface=IF, python=PATH, gpus=IDS or gpus=N, spare)"),
    ("node1\n", "nosuchif0", "cluster.interface: network interface 'nosuchif0' does not exist or has no IPv4 "
                             "address"),
    ("node1\n", "", "cluster.interface: required when cluster.launcher is ssh (the network interface the hosts "
                    "reach this machine on)"),
    ("localhost slots=1\n192.0.2.7 slots=1\n", "lo", "cluster.interface: lo is a loopback interface (127.0.0.1), "
                                                     "which host 192.0.2.7 cannot reach the scheduler on: name the "
                                                     "interface the hosts reach this machine on"),
    ("localhost slots=2\n", "lo|Bogus=1", "cluster.ssh_options / cluster.ssh_config: ssh refuses them: "
                                          "command-line: line 0: Bad configuration option: bogus"),
], ids=["hostfile-option", "unknown-interface", "no-interface", "loopback-interface", "bad-ssh-option"])
def test_a_refused_host_file_or_interface_leaves_no_run_folder(tmp_path, hosts, interface, error):
    """Before: the run folder was made (and `latest` moved to it) before the launcher read the host file and
    the interface, so a refused job left an empty folder that hid the last good run."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    home = tmp_path / "runs" / "x"
    (home / "20260101-000000").mkdir(parents=True)      # an earlier run, as folders.py leaves it
    os.symlink("20260101-000000", home / "latest")
    interface, _, option = interface.partition("|")
    proc = run("--config", "configs/demo_digits_ssgd.yaml", "--set", f"log.dir={tmp_path / 'runs'}", "name=x",
               "cluster.launcher=ssh", f"cluster.hostfile={hostfile}", f"cluster.interface={interface}",
               *([f"cluster.ssh_options=[{option}]"] if option else []))
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout == f"error: {error.format(hostfile=hostfile)}\n"
    assert sorted(os.listdir(home)) == ["20260101-000000", "latest"]
    assert os.readlink(home / "latest") == "20260101-000000"


def test_a_host_whose_name_does_not_resolve_is_named_before_the_run_folder_is_made(tmp_path):
    """Before: the run folder was made and `latest` moved to it, then ssh failed with `Could not resolve
    hostname` and the launcher said the connection was lost or refused."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nnosuchhost-ssdsgd.invalid slots=2\n")
    proc = run("--config", "configs/demo_digits_ssgd.yaml", "--set", f"log.dir={tmp_path / 'runs'}", "name=x",
               "cluster.launcher=ssh", f"cluster.hostfile={hostfile}", "cluster.interface=lo")
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.startswith(f"error: cluster.hostfile: {hostfile} lists host nosuchhost-ssdsgd.invalid, whose "
                                  f"name does not resolve here: "), proc.stdout
    assert proc.stdout.endswith("; correct the name, or add it to /etc/hosts, DNS or the ssh configuration\n")
    assert len(proc.stdout.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


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


def test_a_folder_given_as_the_config_file_is_named_as_a_folder(tmp_path):
    from ssdsgd.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=f"^--config: {tmp_path} is a folder, not a file$"):
        load_config(str(tmp_path))
    loop = _bad_path(tmp_path, "link loop")
    with pytest.raises(ConfigError, match=f"^--config: {loop} is a symbolic link loop$"):
        load_config(loop)
    proc = run("--config", str(tmp_path), "--dry-run")
    assert proc.returncode == 2 and proc.stdout == f"config error: --config: {tmp_path} is a folder, not a file\n"


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


def test_dry_run_of_a_log_dir_that_is_a_file_exits_2(tmp_path):
    path = _bad_path(tmp_path, "file")
    proc = run("--config", "configs/demo_digits_ssgd.yaml", "--dry-run", "--set", f"log.dir={path}")
    assert proc.returncode == 2
    assert proc.stdout.endswith(f"# error: a run would stop here: log.dir: cannot create {path}/demo_digits_ssgd: "
                                f"{path} is a file, not a folder\n"), proc.stdout[-1000:]


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
