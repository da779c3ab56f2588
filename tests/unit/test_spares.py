"""Spare hosts (the host file's `spare`) and what ssdsgd-run's restart does with a host that does not answer
(ssdsgd/launch/spares.py, probe.py): units, without a cluster. tests/test_cluster.py cuts hosts off for real."""
import signal
import socket
from types import SimpleNamespace

import pytest
from support.jobs import ROOT, ssh_roles

from ssdsgd.launch import spares
from ssdsgd.launch.hosts import Host, read_hostfile, read_hosts
from ssdsgd.launch.probe import probe_hosts
from ssdsgd.launch.spares import HostPool, roles_by_host, swap
from ssdsgd.launch.usage import UsageError

H1, H2, H3 = Host('h1'), Host('h2'), Host('h3')
S4, S5 = Host('h4', spare=True), Host('h5', 2222, spare=True, interface='eth1', python='/opt/py/bin/python')


def test_a_spare_is_a_word_on_its_host_line(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('h1\nh2 slots=2\n# spares: no role until a restart needs one\nh4 spare\n'
                        'h5:2222 interface=eth1 spare python=/opt/py/bin/python   # any order\n')
    assert read_hostfile(str(hostfile)) == [H1, Host('h2', slots=2), S4, S5]


@pytest.mark.parametrize('text, message', [
    ('h1\nh4 spare slots=2\n', r"bad spare in hostfile .*'h4 spare slots=2' \(a spare takes the slots of the host "
                               r"it replaces; drop slots=\)"),
    ('h4 spare\nh5 spare\n', 'lists only spare hosts: the roles need at least one host without `spare`'),
    ('h1\nh2\nh1 spare\n', 'lists h1 both with roles and as a spare'),
    ('h1\nh4 spare=yes\n', r"bad option 'spare=yes' in hostfile .* \(known: slots=N, interface=IF, python=PATH, "
                           r"gpus=IDS or gpus=N, spare\)"),
    ('h1\nh4 Spare\n', "bad option 'Spare'"),
])
def test_a_host_file_that_misuses_spare_is_refused_naming_the_line(tmp_path, text, message):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_hostfile(str(hostfile))


def test_the_same_host_on_another_port_may_be_a_spare(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('h1\nh1:2222 spare\n')
    assert read_hosts(str(hostfile)) == [H1, Host('h1', 2222, spare=True)]


def test_spares_get_no_role_at_the_start():
    """Listed before, between or after the others: the placement is the one without them."""
    for hosts in ([H1, S4, H2, H3], [S4, H1, H2, H3, S5], [H1, H2, H3, S4]):
        planned = ssh_roles(['true'], hosts, 2, 1, {}, '/')
        assert [(name, argv[-2]) for name, argv, _ in planned] == [
            ('server 0', 'h1'), ('worker 0', 'h2'), ('worker 1', 'h3')]


def test_a_spare_takes_the_place_and_slots_of_the_lost_host_and_every_other_role_stays():
    hosts = [H1, Host('h2', slots=2), H3, S4, S5]
    assert roles_by_host(hosts, 4, 1) == {'h1': ['server 0', 'worker 3'], 'h2': ['worker 0', 'worker 1'],
                                          'h3': ['worker 2']}
    after = swap(hosts, Host('h2', slots=2), S5)
    assert after == [H1, Host('h5', 2222, slots=2, interface='eth1', python='/opt/py/bin/python'), H3, S4]
    assert roles_by_host(after, 4, 1) == {'h1': ['server 0', 'worker 3'], 'h5': ['worker 0', 'worker 1'],
                                          'h3': ['worker 2']}
    # A host on two lines is replaced on both.
    assert swap([H1, H2, H1, S4], H1, S4) == [Host('h4'), H2, Host('h4')]


class Probe:
    """A stand-in for probe.probe_hosts: `down` hosts do not answer; `back_after` a host's probe count from
    which it answers again. Records each call's host names."""

    def __init__(self, down=(), back_after=None):
        self.down, self.back_after, self.calls = set(down), back_after or {}, []

    def __call__(self, hosts):
        self.calls.append([h.name for h in hosts])

        def answers(name):
            probes = sum(call.count(name) for call in self.calls)
            return name not in self.down or probes >= self.back_after.get(name, float('inf'))
        return {h: 'there is no route to the host' for h in hosts if not answers(h.name)}


class Clock:
    """time.monotonic and stoppable.wait_unless_stopped as one fake: a wait moves the clock."""

    def __init__(self):
        self.now, self.waits = 0.0, []

    def __call__(self):
        return self.now

    def wait(self, seconds):
        self.waits.append(seconds)
        self.now += seconds
        return None


def _pool(probe, hosts=(H1, H2, H3, S4), host_wait=300.0, clock=None):
    clock = clock or Clock()
    return HostPool(list(hosts), 2, 1, host_wait, probe, wait=clock.wait, clock=clock), clock


def test_every_host_answers_the_hosts_stay(capsys):
    probe = Probe()
    pool, _ = _pool(probe)
    assert pool.before_restart(1) is None
    assert pool.hosts == [H1, H2, H3, S4]
    assert probe.calls == [['h1', 'h2', 'h3']]          # the hosts holding roles, not the spare
    assert capsys.readouterr().err == ''


@pytest.mark.parametrize('lost, role', [('h2', 'worker 0'), ('h1', 'server 0')])
def test_a_lost_host_is_left_out_and_a_spare_takes_its_roles(capsys, lost, role):
    probe = Probe(down={lost})
    pool, _ = _pool(probe)
    assert pool.before_restart(1) is None
    assert roles_by_host(pool.hosts, 2, 1) == {**{h: r for h, r in roles_by_host([H1, H2, H3], 2, 1).items()
                                                  if h != lost}, 'h4': [role]}
    assert not any(h.spare for h in pool.hosts) and pool.left_out == [Host(lost)]
    assert probe.calls == [['h1', 'h2', 'h3'], ['h4']]     # the spare is probed before it gets the roles
    assert capsys.readouterr().err == (f'run: {lost} ({role}) does not answer before restart 1: there is no route '
                                       f'to the host\n'
                                       f'run: spare h4 takes over {role} from {lost}; {lost} is left out of this run\n')
    # The next restart probes the spare in its new place, and the lost host no more.
    assert pool.before_restart(2) is None
    assert sorted(probe.calls[-1]) == sorted({'h1', 'h2', 'h3', 'h4'} - {lost})


def test_a_spare_that_does_not_answer_is_passed_over(capsys):
    probe = Probe(down={'h3', 'h5'})
    pool, _ = _pool(probe, hosts=[H1, H2, H3, S5, S4])
    assert pool.before_restart(1) is None
    assert pool.hosts == [H1, H2, Host('h4')]
    err = capsys.readouterr().err
    assert 'run: spare h5 does not answer either (there is no route to the host); it is left out of this run\n' in err
    assert err.endswith('run: spare h4 takes over worker 1 from h3; h3 is left out of this run\n')


def test_two_lost_hosts_and_one_spare_wait_for_the_second(capsys):
    probe = Probe(down={'h1', 'h3'}, back_after={'h3': 3})
    pool, clock = _pool(probe)
    assert pool.before_restart(1) is None
    assert roles_by_host(pool.hosts, 2, 1) == {'h4': ['server 0'], 'h2': ['worker 0'], 'h3': ['worker 1']}
    err = capsys.readouterr().err
    assert ('run: no spare left for h3: waiting up to 300 s for it (cluster.host_wait), probing every 5 s\n'
            'run: h3 answers again after 10 s\n') in err, err
    assert clock.waits == [5.0, 5.0]


def test_no_spare_and_the_host_stays_away_gives_up_after_host_wait(capsys):
    probe = Probe(down={'h2'})
    pool, clock = _pool(probe, hosts=[H1, H2, H3], host_wait=12)
    assert pool.before_restart(1) == 1
    assert clock.waits == [5.0, 5.0, 2.0] and clock.now == 12      # probed every 5 s, the last wait cut to fit
    assert probe.calls == [['h1', 'h2', 'h3'], ['h2'], ['h2'], ['h2']]
    assert capsys.readouterr().err.splitlines()[-2:] == [
        'run: no spare left for h2: waiting up to 12 s for it (cluster.host_wait), probing every 5 s',
        'run: h2 did not answer within 12 s (cluster.host_wait); not restarted']


def test_host_wait_0_gives_up_at_once(capsys):
    pool, clock = _pool(Probe(down={'h2'}), hosts=[H1, H2, H3], host_wait=0)
    assert pool.before_restart(1) == 1 and clock.waits == []
    assert capsys.readouterr().err.splitlines()[-1] == ('run: no spare left for h2, and cluster.host_wait is 0; '
                                                        'not restarted')


@pytest.mark.parametrize('stop, code, said', [
    (KeyboardInterrupt, 130, 'run: stopped while waiting for h2; not restarted'),
    (signal.SIGTERM, 128 + signal.SIGTERM, 'run: received SIGTERM while waiting for h2; not restarted'),
])
def test_a_stop_while_waiting_for_a_host_is_a_stop(capsys, stop, code, said):
    def wait(seconds):
        if stop is KeyboardInterrupt:
            raise KeyboardInterrupt
        return stop
    pool = HostPool([H1, H2, H3], 2, 1, 300.0, Probe(down={'h2'}), wait=wait)
    assert pool.before_restart(1) == code
    assert capsys.readouterr().err.splitlines()[-1] == said


@pytest.mark.parametrize('during', ['first probe', 'probe while waiting'])
def test_sigterm_during_a_probe_is_a_stop(capsys, during):
    """A probe takes seconds (up to 15): SIGTERM then is caught too, not the end of ssdsgd-run without a word."""
    import os
    calls = []

    def probe(hosts):
        calls.append(hosts)
        if len(calls) == (1 if during == 'first probe' else 2):
            os.kill(os.getpid(), signal.SIGTERM)
        return {h: 'no route' for h in hosts if h.name == 'h2'}
    clock = Clock()
    before = signal.getsignal(signal.SIGTERM)
    pool = HostPool([H1, H2, H3, S4] if during == 'first probe' else [H1, H2, H3], 2, 1, 300.0, probe,
                    wait=clock.wait, clock=clock)
    assert pool.before_restart(1) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before          # put back
    assert len(calls) == (1 if during == 'first probe' else 2)  # neither the spare nor h2 again was probed
    assert capsys.readouterr().err.splitlines()[-1] == (
        'run: received SIGTERM before restart 1; not restarted' if during == 'first probe'
        else 'run: received SIGTERM while waiting for h2; not restarted')


def test_ctrl_c_during_a_probe_is_a_stop(capsys):
    def probe(hosts):
        raise KeyboardInterrupt
    assert HostPool([H1, H2], 1, 1, 300.0, probe).before_restart(2) == 130
    assert capsys.readouterr().err == 'run: stopped before restart 2; not restarted\n'


def test_the_shipped_host_file_example_has_a_spare():
    import os
    example = os.path.join(ROOT, 'configs', 'hosts.example')
    hosts = read_hostfile(example)
    assert [h.name for h in hosts if h.spare] == ['node5'] and len(hosts) == 5


def test_the_wait_for_a_host_is_cut_short_by_sigterm():
    """The real wait: SIGTERM during it ends it at once with the signal (ssdsgd-run's stop)."""
    import os
    import threading
    import time

    from ssdsgd.launch.stoppable import wait_unless_stopped
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    assert wait_unless_stopped(10) == signal.SIGTERM
    assert time.monotonic() - t0 < 3


def _cfg(tmp_path, text, **cluster):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text(text)
    keys = dict(launcher='ssh', hostfile=str(hostfile), max_restarts=2, restart_backoff=0.0, workers=2, servers=1,
                host_wait=0.0, ssh_user=None, ssh_identity=None, ssh_config=None, ssh_options=[])
    return SimpleNamespace(cluster=SimpleNamespace(**{**keys, **cluster}), checkpoint=SimpleNamespace(dir='/ck'))


def _restart_loop(monkeypatch, codes, down):
    """ssdsgd-run's restart loop with the job and the probes stood in for: launch i exits codes[i]; down(n) is
    the host names that do not answer once n launches ran. Returns the launches' (resume, roles by host)."""
    import ssdsgd.checkpoint
    import ssdsgd.folders
    from ssdsgd.launch import run
    launches = []

    def launch(cfg, args, resume, run_dir, hosts=None):
        launches.append((resume, roles_by_host(hosts, 2, 1)))
        return codes[len(launches) - 1]
    monkeypatch.setattr(run, '_launch', launch)
    monkeypatch.setattr(ssdsgd.folders, 'finished_message', lambda run_dir, cfg: None)
    monkeypatch.setattr(ssdsgd.checkpoint, 'latest', lambda root: root + '/epoch-1')
    monkeypatch.setattr(ssdsgd.checkpoint, 'resume_point', lambda cfg: (cfg.checkpoint.dir + '/epoch-1', None))
    monkeypatch.setattr('ssdsgd.checkpoint_dir.remove_leftovers', lambda root, say: None)
    monkeypatch.setattr(spares, 'probe_hosts',
                        lambda hosts, options: {h: 'no route' for h in hosts if h.name in down(len(launches))})
    return launches, lambda cfg: run._run_with_restarts(cfg, SimpleNamespace(resume=False), '/runs/r')


def test_restarts_launch_on_the_spare_and_say_so(tmp_path, monkeypatch, capsys):
    """Worker 0's host stops answering after the first launch; the restart places worker 0 on the spare, every
    other role where it was."""
    launches, restarts = _restart_loop(monkeypatch, [1, 0], lambda n: {'h2'} if n else set())
    assert restarts(_cfg(tmp_path, 'h1\nh2\nh3\nh4 spare\n')) == 0
    assert launches == [(False, {'h1': ['server 0'], 'h2': ['worker 0'], 'h3': ['worker 1']}),
                        (True, {'h1': ['server 0'], 'h4': ['worker 0'], 'h3': ['worker 1']})]
    assert capsys.readouterr().err.splitlines() == [
        'run: h2 (worker 0) does not answer before restart 1: no route',
        'run: spare h4 takes over worker 0 from h2; h2 is left out of this run',
        'run: restart 1 of 2 in 0 s: the job failed (exit 1); resuming from /ck/epoch-1']


@pytest.mark.parametrize('max_restarts', [0, 2])
def test_a_host_down_at_the_start_gives_its_roles_to_a_spare_whatever_max_restarts(tmp_path, monkeypatch, capsys,
                                                                                  max_restarts):
    launches, restarts = _restart_loop(monkeypatch, [0], lambda n: {'h1'})
    assert restarts(_cfg(tmp_path, 'h1\nh2\nh3\nh4 spare\n', max_restarts=max_restarts)) == 0
    assert launches == [(False, {'h4': ['server 0'], 'h2': ['worker 0'], 'h3': ['worker 1']})]
    assert capsys.readouterr().err.splitlines() == [
        'run: h1 (server 0) does not answer at the start: no route',
        'run: spare h4 takes over server 0 from h1; h1 is left out of this run']


def test_at_the_start_without_a_spare_left_the_job_starts_as_it_is(tmp_path, monkeypatch, capsys):
    """No waiting before the first launch: the launcher names the host it cannot reach, as without spares."""
    launches, restarts = _restart_loop(monkeypatch, [1], lambda n: {'h1', 'h4'})
    assert restarts(_cfg(tmp_path, 'h1\nh2\nh4 spare\n', max_restarts=0)) == 1
    assert launches == [(False, {'h1': ['server 0', 'worker 1'], 'h2': ['worker 0']})]
    assert capsys.readouterr().err.splitlines() == [
        'run: h1 (server 0, worker 1) does not answer at the start: no route',
        'run: spare h4 does not answer either (no route); it is left out of this run',
        'run: no spare left for h1; the job starts on the hosts as they are']


def test_without_spares_nothing_is_probed_at_the_start(tmp_path, monkeypatch, capsys):
    probed = []
    launches, restarts = _restart_loop(monkeypatch, [0], lambda n: probed.append(n) or set())
    assert restarts(_cfg(tmp_path, 'h1\nh2\nh3\n')) == 0
    assert probed == [] and capsys.readouterr().err == ''


def test_no_pool_for_local_jobs_or_without_restarts_and_spares(tmp_path):
    assert HostPool.of(_cfg(tmp_path, 'h1\n', launcher='local')) is None
    assert HostPool.of(_cfg(tmp_path, 'h1\n', max_restarts=0)) is None
    assert HostPool.of(_cfg(tmp_path, 'h1\n')).hosts == [H1]
    assert HostPool.of(_cfg(tmp_path, 'h1\nh4 spare\n', max_restarts=0)).hosts == [H1, S4]


@pytest.mark.timeout(60)
def test_a_probe_says_what_ssh_said_and_is_bounded():
    """Real ssh on this machine: a closed port refuses at once; a host that answers is not listed."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]           # bound, not listening: refused
        found = probe_hosts([Host('127.0.0.1', port)], ['-o', 'UserKnownHostsFile=/dev/null', '-o', 'LogLevel=ERROR'])
    assert found == {Host('127.0.0.1', port): 'the host refused the ssh connection (is sshd listening on that port?)'}
