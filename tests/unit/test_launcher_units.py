"""Unit-level tests of the launcher's parts (ssdsgd/launch/): each runs in about a second, without a job."""
import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from ssdsgd.launch import ssh


@pytest.mark.parametrize('supervised', [0, 1, 124])
def test_a_cleanup_that_cannot_confirm_the_end_fails_the_job(monkeypatch, supervised):
    """Before: `return code` was evaluated before the cleanup, so its `code = 1` was lost and a job whose
    remote processes could not be confirmed gone still exited 0."""
    from ssdsgd.launch import launcher
    monkeypatch.setattr(launcher, 'supervise', lambda *args: supervised)
    monkeypatch.setattr(launcher, 'cleanup', lambda children: False)
    assert launcher._run([], None, None) == (1 if supervised == 0 else supervised)
    monkeypatch.setattr(launcher, 'cleanup', lambda children: True)
    assert launcher._run([], None, None) == supervised


@pytest.mark.parametrize('supervised', [0, 1])
@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_stop_during_the_cleanup_is_not_a_failure(monkeypatch, capsys, supervised, signum):
    """Before: Ctrl-C or SIGTERM during the cleanup (seconds long) was swallowed and the job exited 1,
    which ssdsgd-run restarts. Now it exits 128 + the signal, as a job stopped earlier does."""
    from ssdsgd.launch import launcher

    def cleanup(children):
        os.kill(os.getpid(), signum)   # the launcher's handler only records it
        return True
    monkeypatch.setattr(launcher, 'supervise', lambda *args: supervised)
    monkeypatch.setattr(launcher, 'cleanup', cleanup)
    before = signal.getsignal(signum)
    assert launcher._run([], None, None) == 128 + signum
    assert f'launch: received {signal.Signals(signum).name} during the cleanup' in capsys.readouterr().err
    assert signal.getsignal(signum) == before   # restored after the cleanup


def test_a_host_name_that_does_not_resolve_is_found_as_ssh_would_look_it_up(tmp_path):
    """The name looked up is the ssh configuration's HostName (`ssh -G`, which connects nowhere): an alias
    resolves through it; a host behind a proxy is not checked (its name is looked up there)."""
    from ssdsgd.launch.hosts import Host
    config = tmp_path / 'ssh_config'
    config.write_text('Host alias1\n  HostName 127.0.0.1\nHost wrong\n  HostName nosuchhost-ssdsgd.invalid\n'
                      'Host behind\n  ProxyJump alias1\n')
    hosts = [Host('localhost'), Host('alias1', 2222), Host('behind')]
    assert ssh.unresolved_host(hosts, ['-F', str(config)]) is None
    found = ssh.unresolved_host(hosts + [Host('wrong')], ['-F', str(config)])
    assert found[:2] == (Host('wrong'), 'nosuchhost-ssdsgd.invalid') and found[2]
    assert ssh.unresolved_host([Host('alias1')])[:2] == (Host('alias1'), 'alias1')   # without the config


def _restarts(monkeypatch, codes, limit, finished):
    """ssdsgd-run's restart loop with the job's exit codes `codes` (one per launch) and a run folder whose
    summary.json is there (`finished`) or not; returns (exit code, launches)."""
    import ssdsgd.checkpoint
    import ssdsgd.folders
    from ssdsgd.launch import run
    launches = []

    def launch(cfg, args, resume, run_dir):
        launches.append(resume)
        return codes[len(launches) - 1]
    monkeypatch.setattr(run, '_launch', launch)
    monkeypatch.setattr(ssdsgd.folders, 'finished_message', lambda run_dir, cfg: 'finished' if finished else None)
    monkeypatch.setattr(ssdsgd.folders, 'remove_leftovers', lambda root, say: None)
    monkeypatch.setattr(ssdsgd.checkpoint, 'latest', lambda root: root + '/epoch-1')
    monkeypatch.setattr(ssdsgd.checkpoint, 'resume_point', lambda cfg: (cfg.checkpoint.dir + '/epoch-1', None))
    cfg = SimpleNamespace(cluster=SimpleNamespace(max_restarts=limit, restart_backoff=0.0, launcher='local'),
                          checkpoint=SimpleNamespace(dir='/ck'))
    return run._run_with_restarts(cfg, SimpleNamespace(resume=False), '/runs/r'), launches


@pytest.mark.parametrize('limit', [0, 2])
@pytest.mark.parametrize('code', [124, 130])
def test_a_stop_or_timeout_after_the_run_finished_keeps_its_code(monkeypatch, capsys, limit, code):
    """Before: with max_restarts > 0, a Ctrl-C (130) or timeout (124) once summary.json existed was reported
    as "a role failed ... after the run finished" and exited 0."""
    assert _restarts(monkeypatch, [code], limit, finished=True) == (code, [False])
    err = capsys.readouterr().err
    assert f'run: the job ended with exit {code} (a timeout or a stop' in err
    assert '/runs/r holds its complete result' in err and 'a role failed' not in err


@pytest.mark.parametrize('limit', [0, 2])
def test_a_failure_after_the_run_finished_is_not_restarted_whatever_max_restarts(monkeypatch, capsys, limit):
    """Before: with max_restarts 0 the same failure exited 1, with max_restarts > 0 it exited 0."""
    assert _restarts(monkeypatch, [1], limit, finished=True) == (0, [False])
    assert 'run: a role failed (exit 1) after the run finished' in capsys.readouterr().err
    assert _restarts(monkeypatch, [1], 0, finished=False) == (1, [False])     # no summary: a failure
    assert _restarts(monkeypatch, [1, 1, 0], 2, finished=False) == (0, [False, True, True])


def test_ctrl_c_while_waiting_to_restart_is_a_stop(monkeypatch, capsys):
    """Before: a KeyboardInterrupt traceback from the back-off sleep."""
    from ssdsgd.launch import stoppable

    def interrupted(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr(stoppable.time, 'sleep', interrupted)
    assert _restarts(monkeypatch, [1, 0], 2, finished=False) == (130, [False])
    assert capsys.readouterr().err.splitlines()[-1] == 'run: stopped before restart 1; not restarted'


def test_a_role_line_stdout_cannot_encode_is_shown_with_replacements(monkeypatch):
    """A line our stdout's encoding cannot take (PYTHONIOENCODING=ascii) killed the reader of that role's
    output, and the role then blocked on its full pipe."""
    import io

    from ssdsgd.launch import children
    out = io.TextIOWrapper(io.BytesIO(), encoding='ascii')
    monkeypatch.setattr(sys, 'stdout', out)
    children._show('[worker 0] h\u00e9llo\n')
    assert out.buffer.getvalue() == b'[worker 0] h?llo\n'
    assert not children._stdout_lost


def test_a_role_killed_by_sigfpe_gets_the_likely_cause():
    from ssdsgd.launch.children import describe_returncode
    assert describe_returncode(-9) == 'killed by SIGKILL'
    assert describe_returncode(-8).startswith('killed by SIGFPE (an arithmetic fault in native code; reading '
                                              'ImageNet RecordIO, an image that decodes to nothing')


@pytest.mark.timeout(30)
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_while_waiting_to_restart_is_a_stop(monkeypatch, capsys, signum):
    """Before: SIGTERM or SIGHUP during the back-off killed ssdsgd-run at once: no message, no launcher.log
    line, the locks not released by it, exit -signal. Now as during the job: a line saying so, exit
    128 + signal, not restarted, the handlers put back."""
    from ssdsgd.launch import run
    threading.Timer(0.5, os.kill, (os.getpid(), signum)).start()
    monkeypatch.setattr(run, 'backoff_seconds', lambda base, stuck: 5.0)
    def mine(*args):   # without handling in the back-off, the signal lands here, not in pytest's end
        pass
    before = signal.signal(signum, mine)
    try:
        t0 = time.monotonic()
        assert _restarts(monkeypatch, [1, 0], 2, finished=False) == (128 + signum, [False])
        assert time.monotonic() - t0 < 3
        assert capsys.readouterr().err.splitlines()[-1] == (f'run: received {signal.Signals(signum).name} before '
                                                             'restart 1; not restarted')
        assert signal.getsignal(signum) is mine   # put back
    finally:
        signal.signal(signum, before)


def test_without_a_checkpoint_the_last_line_says_so_and_how_to_start_again(tmp_path):
    from ssdsgd.launch.run import how_to_continue
    args = SimpleNamespace(command=['ssdsgd-run', '--config', 'c.yaml', '--overwrite', '--set', 'a=1'],
                           argv=['--config', 'c.yaml', '--overwrite', '--set', 'a=1'], config='c.yaml', set=['a=1'])
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=None))
    assert how_to_continue(cfg, args) == ('run: checkpoint.dir is not set, so no checkpoint to continue from; to '
                                          'start again: ssdsgd-run --config c.yaml --set a=1')
    cfg.checkpoint.dir = str(tmp_path)
    assert how_to_continue(cfg, args) == (f'run: no complete checkpoint in {tmp_path} to continue from; to start '
                                          'again: ssdsgd-run --config c.yaml --set a=1')


@pytest.mark.parametrize('server_timeout', [8, 15, 60])
def test_ssh_keepalive_ends_a_lost_connection_within_the_server_timeout(server_timeout):
    """design.md: ssh's keepalive ends the connection to a host off the network within cluster.server_timeout
    (ServerAliveInterval x ServerAliveCountMax misses), not later."""
    from ssdsgd.launch.hosts import Host
    argv = ssh.ssh_base(Host('node1'), server_timeout=server_timeout)
    options = dict(argv[i + 1].split('=', 1) for i, word in enumerate(argv) if word == '-o')
    interval, misses = int(options['ServerAliveInterval']), int(options['ServerAliveCountMax'])
    assert interval * misses <= server_timeout
    assert interval * misses >= server_timeout / 2       # and not so eager that a short outage ends the job


def test_the_tcp_table_gives_the_established_connections_at_the_port(tmp_path):
    from ssdsgd.launch import strangers
    table = tmp_path / 'tcp'
    head = '  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n'
    row = '   0: {} {} {} 00000000:00000000 00:00000000 00000000     0        0 {} 1 0000000000000000 100 0 0 10 0\n'
    table.write_text(head + row.format('0100007F:2328', '00000000:0000', '0A', 11)        # listening on 9000
                     + row.format('0100007F:2328', '0100007F:A410', '01', 12)             # 9000 <- 42000
                     + row.format('0100007F:A410', '0100007F:2328', '01', 13)             # 42000 -> 9000
                     + row.format('0100007F:A411', '0100007F:2329', '01', 14)             # other ports
                     + row.format('0100007F:A412', '0100007F:2328', '06', 15))            # TIME_WAIT
    assert strangers.tcp_rows(9000, [str(table)]) == [
        (('127.0.0.1', 9000), ('127.0.0.1', 42000), '12'),
        (('127.0.0.1', 42000), ('127.0.0.1', 9000), '13')]


def test_a_connection_to_the_scheduler_from_a_host_without_roles_is_a_strangers(monkeypatch):
    """ssh jobs: only the scheduler's end of a remote connection is in this machine's TCP table; a host that
    runs none of the job's roles is named. A connection to the same port elsewhere is not the scheduler's."""
    from ssdsgd.launch import strangers
    rows = [(('10.0.0.1', 9000), ('10.0.0.2', 5000), '2'),     # a role's host
            (('10.0.0.1', 9000), ('10.0.0.9', 5001), '3'),     # nobody's
            (('10.0.0.1', 41000), ('10.0.0.7', 9000), '4')]    # ours, to another machine's port 9000
    monkeypatch.setattr(strangers, 'tcp_rows', lambda port, tables: rows)
    monkeypatch.setattr(strangers, 'socket_owners', lambda inodes: {})
    roll = strangers.Roll(9000, '10.0.0.1')
    roll.look()
    assert roll.strangers(set(), {'10.0.0.2'}) == ['host 10.0.0.9']


def test_the_roll_reads_the_table_of_the_schedulers_address_family_at_its_own_pace(monkeypatch):
    from ssdsgd.launch import strangers
    assert strangers.Roll(9000, '10.0.0.1').tables == ('/proc/net/tcp',)
    assert strangers.Roll(9000, 'fe80::1').tables == ('/proc/net/tcp6',)
    assert strangers.Roll(9000, 'node1').tables == strangers.Roll(9000).tables == ('/proc/net/tcp', '/proc/net/tcp6')
    looks = []
    monkeypatch.setattr(strangers, 'tcp_rows', lambda port, tables: looks.append(tables) or [])
    roll = strangers.Roll(9000, '127.0.0.1')
    for now in (100.0, 100.1, 100.4, 100.5, 100.6, 101.2):
        roll.look(now)
    assert len(looks) == 3                                 # at 100.0, 100.5 and 101.2
    roll.look()                                            # without a time: at once
    assert len(looks) == 4
