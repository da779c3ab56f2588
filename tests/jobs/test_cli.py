"""The ssdsgd-run command line as a user meets it: --help, --dry-run on every shipped config, several
overrides after one --set, and config mistakes (a key given twice, a mistyped --set) named in one line."""
import os

import pytest
from unit.test_cli import _bad_path, run


def test_help_names_the_command():
    out = run("--help").stdout
    assert out.startswith("usage: ssdsgd-run") and "--dry-run" in out and "--resume" in out


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


def test_a_folder_given_as_the_config_file_is_named_as_a_folder(tmp_path):
    from ssdsgd.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=f"^--config: {tmp_path} is a folder, not a file$"):
        load_config(str(tmp_path))
    loop = _bad_path(tmp_path, "link loop")
    with pytest.raises(ConfigError, match=f"^--config: {loop} is a symbolic link loop$"):
        load_config(loop)
    proc = run("--config", str(tmp_path), "--dry-run")
    assert proc.returncode == 2 and proc.stdout == f"config error: --config: {tmp_path} is a folder, not a file\n"


def test_dry_run_of_a_log_dir_that_is_a_file_exits_2(tmp_path):
    path = _bad_path(tmp_path, "file")
    proc = run("--config", "configs/demo_digits_ssgd.yaml", "--dry-run", "--set", f"log.dir={path}")
    assert proc.returncode == 2
    assert proc.stdout.endswith(f"# error: a run would stop here: log.dir: cannot create {path}/demo_digits_ssgd: "
                                f"{path} is a file, not a folder\n"), proc.stdout[-1000:]
