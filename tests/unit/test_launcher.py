"""Tests for ssdsgd.launch.launcher with a toy job (plain Python children, no mxnet)."""
import os
import signal
import time

import pytest
from support.jobs import ssh_roles

from ssdsgd.launch.hosts import Host, read_hostfile, read_hosts
from ssdsgd.launch.usage import UsageError


def test_read_hostfile(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# cluster\nalpha\n\n  beta:2222  # second\nuser@gamma slots=4\n'
                        'delta interface=eth1 python=/opt/venv/bin/python\n')
    assert read_hostfile(str(hostfile)) == [
        Host('alpha'), Host('beta', 2222), Host('user@gamma', slots=4),
        Host('delta', interface='eth1', python='/opt/venv/bin/python')]
    for bad, message in (('alpha slots=0', 'bad slots'), ('alpha cores=2', "bad option 'cores=2'"),
                         ('alpha:x', 'bad host'), ('slots=2', 'bad host'),
                         ('alpha python=python3', "bad python in hostfile .*'alpha python=python3' "
                                                  r"\(an absolute path")):
        hostfile.write_text(bad + '\n')
        with pytest.raises(UsageError, match=message):
            read_hostfile(str(hostfile))


def test_mpi_slots_placement():
    """`slots=N`: a host takes N processes in a row before the next host gets one, as MPI fills hosts."""
    hosts = [Host('a', slots=2), Host('b')]
    planned = ssh_roles(['true'], hosts, 3, 1, {}, '/')
    assert [(name, argv[-2]) for name, argv, _ in planned] == [
        ('server 0', 'a'), ('worker 0', 'a'), ('worker 1', 'b'), ('worker 2', 'a')]


def test_host_list_as_horovodrun_and_mpirun_take_it(tmp_path, monkeypatch):
    """-H h1:2,h2:2 is host:slots, comma-separated; a file of that name, or a single bare name, is a host file."""
    monkeypatch.chdir(tmp_path)
    assert read_hosts('h1:2,h2') == [Host('h1', slots=2), Host('h2')]
    assert read_hosts('h1:3') == [Host('h1', slots=3)]
    with pytest.raises(UsageError, match='cannot read hostfile hosts'):
        read_hosts('hosts')                              # a missing host file stays one
    (tmp_path / 'a,b').write_text('c slots=2\n')
    assert read_hosts('a,b') == [Host('c', slots=2)]
    with pytest.raises(UsageError, match='h1:0 has no slots'):
        read_hosts('h1:0,h2')
    planned = ssh_roles(['true'], read_hosts('a:2,b'), 2, 1, {}, '/')
    assert [(name, argv[-2]) for name, argv, _ in planned] == [('server 0', 'a'), ('worker 0', 'a'), ('worker 1', 'b')]


def test_ssh_options_from_settings():
    from ssdsgd.launch.ssh import ssh_options
    assert ssh_options('me', '/k', '/cfg', ['A=1', 'B=2']) == ['-F', '/cfg', '-i', '/k', '-l', 'me', '-o', 'A=1',
                                                              '-o', 'B=2']
    assert ssh_options() == []


def test_scheduler_loads_the_library_mxnet_itself_loads(monkeypatch, tmp_path):
    """ssdsgd/ps/scheduler.py finds libmxnet.so without importing mxnet, by MXNet's own lookup (which
    honours MXNET_LIBRARY_PATH)."""
    import mxnet.libinfo

    from ssdsgd.ps.scheduler import mxnet_library_path
    assert mxnet_library_path() == mxnet.libinfo.find_lib_path()[0]
    other = tmp_path / "libmxnet.so"
    other.write_bytes(b"")
    monkeypatch.setenv("MXNET_LIBRARY_PATH", str(other))
    assert mxnet_library_path() == str(other)


@pytest.mark.timeout(60)
def test_a_killed_wrapper_is_named(tmp_path):
    """The role script reports how remote.py itself ended: a wrapper SIGKILLed from outside (its role dies
    with it) is named as such, not as a lost connection; bash's own "Killed" line stays out of the output.
    Run here through `bash -s` as ssh would run it on the host (the virtual-cluster test does it over ssh)."""
    from ssdsgd.launch.children import Child
    from ssdsgd.launch.plan import RoleSpec
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'SSDSGD_JOB_SECRET': 'x'}
    [(name, _, script)] = ssh_roles(['sleep', '60'], [Host('alpha')], 1, 1, env, str(tmp_path))[1:]
    child = Child(RoleSpec(name, 'alpha', ['bash', '-s'], {'DMLC_ROLE': 'worker'}, script, ['ssh', 'alpha']))
    try:
        deadline = time.monotonic() + 20
        while child.pgid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(f'/proc/{child.pgid}/stat') as f:          # the role leads its group; its parent is remote.py
            wrapper = int(f.read().rsplit(')', 1)[1].split()[1])
        os.kill(wrapper, signal.SIGKILL)
        assert child.popen.wait(timeout=20) == 128 + signal.SIGKILL
        assert child.exit_code() == 128 + signal.SIGKILL
        assert child.describe_exit() == ('lost its supervisor on alpha: the wrapper that runs it there (remote.py) '
                                         'killed by SIGKILL before the role ended, and the role was killed with it')
        assert not any('Killed' in line for line in child.tail), list(child.tail)
        deadline = time.monotonic() + 5
        while os.path.exists(f'/proc/{child.pgid}') and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f'/proc/{child.pgid}')   # the role died with its wrapper
    finally:
        for pgid in (child.pgid, child.popen.pid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass


def test_interface_not_found_is_refused_naming_the_option(monkeypatch):
    """An address no interface here holds (a stale /etc/hosts line), or no route out: one line, exit 2,
    saying to give --interface (MXNet's tracker would go on with an address no host can reach)."""
    from ssdsgd.launch import plan
    monkeypatch.setattr(plan.socket, 'getfqdn', lambda: 'myhost.example')
    monkeypatch.setattr(plan.socket, 'gethostbyname', lambda name: '203.0.113.77')
    with pytest.raises(UsageError, match=r'^no --interface given, and no network interface here holds 203\.0\.113'
                                         r'\.77, the address myhost\.example resolves to .*: give --interface'):
        plan.mxnet_interface()
    monkeypatch.setattr(plan.socket, 'gethostbyname', lambda name: '127.0.0.1')

    class NoRoute:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, address):
            raise OSError(101, 'Network is unreachable')
    monkeypatch.setattr(plan.socket, 'socket', NoRoute)
    with pytest.raises(UsageError, match=r'^no --interface given, and myhost\.example resolves to 127\.0\.0\.1 '
                                         r'\(loopback\) and no route leads out of this machine \(Network is '
                                         r'unreachable\): give --interface'):
        plan.mxnet_interface()


def test_the_front_end_knows_gluoncvs_model_names_without_importing_gluoncv():
    import sys

    from ssdsgd.worker.model_names import ModelError, check_model_name, zoo_names
    before = set(sys.modules)
    names = zoo_names()
    assert not [m for m in set(sys.modules) - before if m.startswith(("gluoncv", "mxnet"))]   # read, not imported
    from gluoncv.model_zoo import get_model_list
    assert names == set(get_model_list()) and "cifar_resnet20_v1" in names
    check_model_name("resnet50_v1")
    with pytest.raises(ModelError, match="model.name: unknown model 'resnet51_v1'"):
        check_model_name("resnet51_v1")
