"""Unit-level tests of the launcher's parts (ssdsgd/launch/): each runs in about a second, without a job."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from support.jobs import end_group, ssh_roles

from ssdsgd.launch import ssh


def _group_members(pgid):
    """PIDs of the processes (zombies included) in process group pgid, from /proc."""
    members = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{pid}/stat') as f:
                if f.read().rsplit(')', 1)[1].split()[2] == str(pgid):
                    members.append(int(pid))
        except (OSError, IndexError):
            pass
    return members


def _remote_kill(pgid):
    """Run the cleanup's remote kill as ssh would on the host: the login shell runs `sh -c SCRIPT kill PGID`
    (here bash stands in for ssh and the login shell); sh is dash on Debian."""
    role = SimpleNamespace(ssh=['bash', '-c'], pgid=pgid, host='alpha')
    [(host, group, proc)] = ssh.start_remote_kills([role])
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out.decode()


@pytest.mark.timeout(30)
def test_remote_kill_ends_a_group_that_ignores_sigterm(monkeypatch):
    """Before: `kill -TERM -- -PGID`, which dash refuses ("Illegal number"): nothing was signalled and the
    script still said every group had ended. Now the group gets SIGTERM, then SIGKILL after the grace."""
    monkeypatch.setattr(ssh, 'TERM_GRACE', 0.3)
    role = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, '
                             'signal.SIG_IGN); print(1, flush=True); time.sleep(60)'],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        role.stdout.readline()                                  # SIGTERM is ignored from here on
        threading.Thread(target=role.wait, daemon=True).start()  # reap it, as its parent on a host would
        code, out = _remote_kill(role.pid)
        assert (code, out) == (0, '')
        assert role.wait(timeout=5) == -signal.SIGKILL
        assert _group_members(role.pid) == []
    finally:
        end_group(role)


@pytest.mark.timeout(30)
def test_remote_kill_says_when_a_group_is_still_there(monkeypatch):
    """A group that outlives SIGKILL (here a zombie nobody reaps yet) is reported, with exit 1."""
    monkeypatch.setattr(ssh, 'TERM_GRACE', 0.3)
    zombie = subprocess.Popen(['true'], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f'/proc/{zombie.pid}/stat') as f:
                if f.read().rsplit(')', 1)[1].split()[0] == 'Z':
                    break
            time.sleep(0.02)
        code, out = _remote_kill(zombie.pid)
        assert (code, out.strip()) == (1, f'process groups still alive: {zombie.pid}')
    finally:
        zombie.wait()


def _start_remote_role(command, host, tmp_path):
    """A Child running the role script of `command` on `host` through `bash -s` here, as ssh runs it there."""
    from ssdsgd.launch.children import Child
    from ssdsgd.launch.plan import RoleSpec
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'SSDSGD_JOB_SECRET': 'x'}
    [(name, _, script)] = ssh_roles(command, [host], 1, 1, env, str(tmp_path))[1:]
    return Child(RoleSpec(name, host.name, ['bash', '-s'], {'DMLC_ROLE': 'worker'}, script, ['ssh', host.name]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize('command, host, code, output', [
    (['nosuchcommand-xyz'], {}, 127, "error: cannot start nosuchcommand-xyz on {hostname}: No such file or directory"),
    (['python', '-c', 'pass'], {'python': '/nonexistent/python'}, 127,
     '/nonexistent/python: No such file or directory'),
    (['true'], {'interface': 'nosuchif0'}, 2, "error: interface 'nosuchif0' (host file) does not exist on {hostname}"),
])
def test_a_role_that_cannot_start_on_its_host_is_named_so(tmp_path, command, host, code, output):
    """Before: every start-up failure on a host was reported as a role that "lost its supervisor ... and was
    killed with it", and a missing command gave remote.py's traceback."""
    import socket

    from ssdsgd.launch.hosts import Host
    child = _start_remote_role(command, Host('alpha', **host), tmp_path)
    try:
        assert child.popen.wait(timeout=30) == code
        child.reader.join(timeout=5)
        assert child.describe_exit() == f'could not start on alpha (exited with code {code}; see its output)'
        assert any(output.format(hostname=socket.gethostname()) in line for line in child.tail), list(child.tail)
        assert not any('Traceback' in line for line in child.tail), list(child.tail)
    finally:
        with contextlib.suppress(BrokenPipeError):      # ssh may have ended before it read the script
            child.popen.stdin.close()
        end_group(child.popen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize('host, cause', [
    ('nosuchhost-ssdsgd.invalid', 'ssh could not resolve the host name (check the host file, /etc/hosts, DNS or '
                                  'the ssh configuration)'),
    ('127.0.0.1', 'the host refused the ssh connection (is sshd listening on that port?)'),
])
def test_ssh_that_never_reached_its_host_is_named_with_what_ssh_said(host, cause):
    """Before: `lost: ssh to node1 exited with code 255 before the role reported its end: the connection to
    node1 was lost or refused`, when ssh had said `Could not resolve hostname`. (127.0.0.1 on a port nothing
    listens on: ssh is refused without leaving this machine.)"""
    import socket

    from ssdsgd.launch.children import Child
    from ssdsgd.launch.hosts import Host
    from ssdsgd.launch.plan import RoleSpec
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]            # free once closed: nothing listens there
    base = ssh.ssh_base(Host(host, port), ['-o', 'ConnectTimeout=10'])
    child = Child(RoleSpec('worker 0', host, base + ['bash -s'], {'DMLC_ROLE': 'worker'}, 'true\n', base))
    try:
        assert child.popen.wait(timeout=30) == 255
        child.reader.join(timeout=5)
        assert child.describe_exit() == f'could not start on {host} (ssh exited with code 255): {cause}'
        # ... and the cleanup does not add that it may still be running there.
        assert child.never_reached() == cause
    finally:
        with contextlib.suppress(BrokenPipeError):      # ssh may have ended before it read the script
            child.popen.stdin.close()
        end_group(child.popen)


@pytest.mark.parametrize('races', [2, 10])
def test_job_folder_removal_outlasts_a_role_writing_in_it(tmp_path, monkeypatch, capsys, races):
    """A role the cleanup could not reach touches its heartbeat file again while the job folder is removed
    (rmtree: ENOTEMPTY). Before: a traceback from run_job. Now: tried again, else one line naming it."""
    import errno
    import shutil
    import tempfile

    from ssdsgd.launch import job_dir
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    monkeypatch.setattr(job_dir.time, 'sleep', lambda seconds: None)
    real_rmtree, calls = shutil.rmtree, []

    def racing_rmtree(path, *args, **kwargs):
        calls.append(path)
        if len(calls) > races:
            return real_rmtree(path, *args, **kwargs)
        for name in os.listdir(path):
            os.remove(os.path.join(path, name))
        open(os.path.join(path, 'worker0.hb'), 'w').close()    # the unreached role, again
        if not kwargs.get('ignore_errors'):
            raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
    monkeypatch.setattr(shutil, 'rmtree', racing_rmtree)
    with job_dir.make_job_dir(shared=False) as path:
        assert os.path.dirname(path) == str(tmp_path)
    err = capsys.readouterr().err
    if races < job_dir.REMOVE_ATTEMPTS:
        assert not os.path.exists(path) and err == ''
    else:
        assert os.listdir(path) == ['worker0.hb']
        assert err == (f'launch: cannot remove the job folder {path} (Directory not empty): a role on a host the '
                       f'cleanup could not reach may still write in it; such a role ends once the folder is gone, '
                       f'so remove it\n')


def test_the_job_folder_that_cannot_be_made_is_named(tmp_path, monkeypatch, capsys):
    """Before: a local job's error named the working directory and the ssh launcher, while its folder goes
    in the temporary directory."""
    import tempfile

    from ssdsgd.launch import job_dir
    from ssdsgd.launch.launcher import run_job
    missing = tmp_path / 'missing'
    monkeypatch.setattr(tempfile, 'tempdir', str(missing))
    monkeypatch.chdir(tmp_path)
    assert run_job(['true'], 1, 1) == 2
    assert capsys.readouterr().err == f'launch: cannot create the job folder in {missing}: No such file or directory\n'

    def refused(**kwargs):
        raise PermissionError(13, 'Permission denied')
    monkeypatch.setattr(job_dir.tempfile, 'mkdtemp', refused)
    assert run_job(['true'], 1, 1, launcher='ssh', hostfile='alpha,beta', interface='lo') == 2
    assert capsys.readouterr().err == (f'launch: cannot create the job folder in {tmp_path} (the ssh launcher needs '
                                       f'a writable working directory on the file system the hosts share): '
                                       f'Permission denied\n')


@pytest.mark.parametrize('chained, message', [
    (None, ''),
    ('import os; print("chained ran", flush=True)', ''),
    ('import nosuchmodule_xyz', "ModuleNotFoundError: No module named 'nosuchmodule_xyz'"),
    ('raise ImportError("broken inside")', 'ImportError: broken inside'),
])
def test_the_hook_chains_the_sitecustomize_it_hides(tmp_path, chained, message):
    """Before: `except ImportError` also hid an ImportError raised inside the other sitecustomize. Python's
    site reports such an error in one line and goes on, as it would without the hook."""
    from ssdsgd.launch.plan import HOOKS_DIR
    if chained is not None:
        (tmp_path / 'sitecustomize.py').write_text(chained + '\n')
    env = {k: v for k, v in os.environ.items() if k not in ('DMLC_ROLE', 'SSDSGD_LIVENESS_FILE')}
    env['PYTHONPATH'] = os.pathsep.join([HOOKS_DIR, str(tmp_path)])
    proc = subprocess.run([sys.executable, '-c', 'print("main ran")'], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    expected = ['chained ran'] if 'chained ran' in (chained or '') else []
    assert proc.stdout.splitlines() == expected + ['main ran']
    if message:
        assert proc.stderr == f'Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{message}\n'
    else:
        assert proc.stderr == ''


# ssdsgd-run with the job itself stood in for: each launch writes a checkpoint (as a job that got to its epoch 2
# would) and fails like a killed worker. The rest of the front end is the real one.
FAILING_JOB = r'''
import json, os, sys
from ssdsgd.launch import run
import ssdsgd.checkpoint, ssdsgd.folders

def launch(cfg, args, resume, run_dir, dry_run=False):
    ck = os.path.join(cfg.checkpoint.dir, "epoch-0002")
    os.makedirs(ck, exist_ok=True)
    with open(os.path.join(ck, "manifest.json"), "w") as f:
        json.dump({"epochs_done": 2, "step": 20}, f)
    print("launch: worker 1 killed by SIGKILL", file=sys.stderr, flush=True)
    return 1

run._launch = launch
ssdsgd.checkpoint.resume_point = lambda cfg: (ssdsgd.checkpoint.latest(cfg.checkpoint.dir), None)
sys.exit(run.main(sys.argv[1:]))
'''


def _failing_run(tmp_path, *sets):
    """ssdsgd-run (as `python -m ssdsgd`, its other name) of the demo config with the job failing; returns its
    Popen (stderr piped) and the `--set` words it was given."""
    words = ['--set', f'log.dir={tmp_path / "runs"}', f'checkpoint.dir={tmp_path / "ck"}', 'name=demo', *sets]
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'configs',
                          'demo_digits_ssd.yaml')
    proc = subprocess.Popen([sys.executable, '-c', FAILING_JOB, '--config', config, *words], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, config, words


def _continue_line(config, words):
    command = ' '.join([sys.executable, '-m', 'ssdsgd', '--config', config, *words, '--resume'])
    return (f'run: to continue from the newest checkpoint, {words[2].split("=", 1)[1]}/epoch-0002 (epoch 2, '
            f'step 20): {command}')


@pytest.mark.timeout(60)
def test_the_last_line_after_a_failure_names_the_checkpoint_and_the_command_to_continue(tmp_path):
    """Before: the last line was the launcher's cleanup, with no word on how to go on. Now the final line, on
    the terminal and in launcher.log, names the newest checkpoint and the exact command that continues."""
    proc, config, words = _failing_run(tmp_path, 'cluster.max_restarts=0')
    try:
        _, err = proc.communicate(timeout=45)
    finally:
        end_group(proc)
    assert proc.returncode == 1, err
    assert err.splitlines()[-1] == _continue_line(config, words), err
    log = (tmp_path / 'runs' / 'demo' / 'latest' / 'launcher.log').read_text()
    assert log.splitlines()[-1] == _continue_line(config, words)


@pytest.mark.timeout(60)
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_during_the_restart_backoff_is_said_and_logged(tmp_path, signum):
    """Before: SIGTERM or SIGHUP while ssdsgd-run waited to restart killed it (exit -15/-1), with no line on
    the terminal or in launcher.log and its folder locks left to the kernel. Now it says so there and in
    launcher.log, does not restart, names how to continue and exits 128 + signal."""
    proc, config, words = _failing_run(tmp_path, 'cluster.max_restarts=2', 'cluster.restart_backoff=30')
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line.rstrip('\n'))
            if line.startswith('run: restart 1 of 2 in 30 s'):
                break
        assert lines and lines[-1].startswith('run: restart 1 of 2 in 30 s'), lines
        t0 = time.monotonic()
        os.kill(proc.pid, signum)
        _, rest = proc.communicate(timeout=10)
        seconds = time.monotonic() - t0
    finally:
        end_group(proc)
    said = rest.splitlines()
    assert proc.returncode == 128 + signum, lines + said
    assert seconds < 5
    assert said == [f'run: received {signal.Signals(signum).name} before restart 1; not restarted',
                    _continue_line(config, words)]
    log = (tmp_path / 'runs' / 'demo' / 'latest' / 'launcher.log').read_text()
    assert log.splitlines()[-2:] == said


# A toy job for the quiet-time notes: the worker touches its heartbeat (as ssdsgd.train does every step), goes
# quiet for a while, then goes on; the scheduler and the server end at once unless told to stop themselves.
QUIET_JOB = r'''
import os, signal, sys, time
role, toy = os.environ["DMLC_ROLE"], os.environ["TOY_DIR"]
def touch(seconds):
    end = time.time() + seconds
    while time.time() < end:
        with open(os.environ["SSDSGD_HEARTBEAT_FILE"], "a"):
            os.utime(os.environ["SSDSGD_HEARTBEAT_FILE"])
        time.sleep(0.1)
if role == "server" and os.environ.get("TOY_STOP_SERVER"):
    time.sleep(2)
    open(os.path.join(toy, "server.pid"), "w").write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(2)
elif role == "worker":
    touch(3)
    if os.environ.get("TOY_STOP_SERVER"):
        touch(7)
        os.kill(int(open(os.path.join(toy, "server.pid")).read()), signal.SIGCONT)
    else:
        time.sleep(8)
    touch(2)
'''


def _quiet_job(tmp_path, **env):
    from ssdsgd.launch.launcher import run_job
    return run_job([sys.executable, '-c', QUIET_JOB], 1, 1, env={'TOY_DIR': str(tmp_path), **env},
                   timeout=60, stall_timeout=30, server_timeout=20)


@pytest.mark.timeout(60)
def test_a_pause_in_the_workers_progress_is_said_as_it_happens(tmp_path, capsys):
    """Before: a job whose steps stopped for 8 s (a host cut off for a while, say) said nothing until the stall
    timeout, and nothing at all if it went on before. Now one line when no worker has made a step for a few
    seconds (with the time of day), one when they go on, and the job ends as it would (exit 0)."""
    assert _quiet_job(tmp_path) == 0
    err = capsys.readouterr().err
    paused = re.findall(r'^launch: (\d\d:\d\d:\d\d) no worker has made a step for 5 s \(stall timeout 30 s\)$',
                        err, re.M)
    went_on = re.findall(r'^launch: (\d\d:\d\d:\d\d) the workers go on after (\d+) s without a step$', err, re.M)
    assert len(paused) == 1 and len(went_on) == 1, err
    assert 7 <= int(went_on[0][1]) <= 10, err


@pytest.mark.timeout(60)
def test_a_silent_server_is_said_as_it_happens(tmp_path, capsys):
    """Before: a server silent for 7 s (stopped, or its host cut off for a while) went unsaid until the server
    timeout. Now one line once it has given no sign of life for a few seconds, one when it is back."""
    assert _quiet_job(tmp_path, TOY_STOP_SERVER='1') == 0
    err = capsys.readouterr().err
    silent = re.findall(r'^launch: \d\d:\d\d:\d\d server 0 on localhost has given no sign of life for 5 s '
                        r'\(server timeout 20 s\)$', err, re.M)
    back = re.findall(r'^launch: \d\d:\d\d:\d\d server 0 on localhost is alive again after (\d+) s of silence$',
                      err, re.M)
    assert len(silent) == 1 and len(back) == 1, err
    assert 6 <= int(back[0]) <= 10, err
    assert 'no worker has made a step' not in err
