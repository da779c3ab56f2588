"""Tests for ssdsgd.launch.launcher with a toy job (plain Python children, no mxnet)."""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from support.jobs import end_group, processes_with, ssh_roles

from ssdsgd.launch import job_dir
from ssdsgd.launch.hosts import Host
from ssdsgd.launch.launcher import run_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _recorded_pids(toy_dir):
    pids = {}
    for path in glob.glob(os.path.join(toy_dir, 'pid.*')):
        with open(path) as f:
            pids[os.path.basename(path)[4:]] = int(f.read())
    return pids


@pytest.fixture
def toy_dir(tmp_path):
    """Directory for the toy's files; kills leftover toy processes if a test fails half-way."""
    d = tmp_path / 'toy'
    d.mkdir()
    yield str(d)
    for pid in _recorded_pids(str(d)).values():
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                if b'toy' in f.read():  # guard against a recycled PID
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
LAUNCH = os.path.join(REPO, 'launch', 'launch.py')

# Every role runs this, like a real ps-lite job: scheduler and servers stay up until all workers
# are done, workers do the work. TOY_MODE makes workers misbehave; in those modes worker 0 also
# starts a grandchild, to check that cleanup reaches whole process groups.
TOY = r'''
import glob, json, os, signal, subprocess, sys, time
role, task = os.environ['DMLC_ROLE'], os.environ['DMLC_TASK_ID']
out, mode = os.environ['TOY_DIR'], os.environ.get('TOY_MODE', 'ok')
n_workers, n_servers = int(os.environ['DMLC_NUM_WORKER']), int(os.environ['DMLC_NUM_SERVER'])
me = role + task
with open(os.path.join(out, 'env.' + me + '.json'), 'w') as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(('DMLC_', 'SSDSGD_', 'OMP_', 'TOY_'))}, f)
with open(os.path.join(out, 'tmp.' + me), 'w') as f:  # renamed, so a reader never sees an empty pid file
    f.write(str(os.getpid()))
os.replace(os.path.join(out, 'tmp.' + me), os.path.join(out, 'pid.' + me))
print(me + ' started', flush=True)

if role != 'worker':
    if mode == 'stop-' + me:  # a stopped server or scheduler: alive, but gives no sign of life
        while len(glob.glob(os.path.join(out, 'pid.*'))) < 1 + n_servers + n_workers:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGSTOP)
    while not all(os.path.exists(os.path.join(out, 'done.%d' % i)) for i in range(n_workers)):
        time.sleep(0.05)
    sys.exit(0)

hb = os.environ['SSDSGD_HEARTBEAT_FILE']
def step(i):
    with open(hb, 'a'):
        os.utime(hb)
    print('step %d' % i, flush=True)
    time.sleep(0.1)

if mode == 'ok':
    for i in range(3):
        step(i)
    open(os.path.join(out, 'done.' + task), 'w').close()
    sys.exit(0)

if task == '0':
    if os.environ.get('TOY_IGNORE_TERM'):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # toy grandchild'])
    with open(os.path.join(out, 'tmp.grandchild'), 'w') as f:
        f.write(str(grandchild.pid))
    os.replace(os.path.join(out, 'tmp.grandchild'), os.path.join(out, 'pid.grandchild'))
# Misbehave only once every process of the job is up, so the tests see all of them.
while len(glob.glob(os.path.join(out, 'pid.*'))) < 1 + n_servers + n_workers + 1:
    time.sleep(0.05)
if mode == 'fail' and task == '1':
    for i in range(1, 41):
        print('worker 1 line %d' % i, flush=True)
    print('worker 1 is about to fail', flush=True)
    sys.exit(3)
if mode == 'sigkill' and task == '0':
    os.kill(os.getpid(), signal.SIGKILL)
if mode == 'stall-later':
    for i in range(15):
        step(i)
time.sleep(600)  # hang: fail, sigkill, hang and stall modes
'''
TOY_CMD = [sys.executable, '-c', TOY]


def _is_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] == 'Z'  # a zombie waiting for its reaper
    except FileNotFoundError:
        return True


def _assert_all_gone(toy_dir, expected):
    pids = _recorded_pids(toy_dir)
    assert sorted(pids) == sorted(expected)
    deadline = time.monotonic() + 5  # orphaned grandchildren are reaped by init asynchronously
    while not all(_is_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {name: pid for name, pid in pids.items() if not _is_gone(pid)} == {}


ALL_ROLES = ['scheduler0', 'server0', 'server1', 'worker0', 'worker1']


@pytest.mark.timeout(30)
def test_success_and_environment(toy_dir, capsys, monkeypatch):
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    assert run_job(TOY_CMD, 2, 2, env={'TOY_DIR': toy_dir}) == 0
    out, err = capsys.readouterr()

    envs = {}
    for name in ALL_ROLES:
        with open(os.path.join(toy_dir, f'env.{name}.json')) as f:
            envs[name] = json.load(f)
    port = envs['scheduler0']['DMLC_PS_ROOT_PORT']
    assert 1 <= int(port) <= 65535
    secret = envs['scheduler0']['SSDSGD_JOB_SECRET']
    assert re.fullmatch(r'[0-9a-f]{64}', secret)
    for name, env in envs.items():
        role, task = name[:-1], name[-1]
        assert env['DMLC_ROLE'] == role
        assert env['DMLC_TASK_ID'] == task
        assert env['SSDSGD_ROLE_NAME'] == (role if role == 'scheduler' else f'{role} {task}')
        assert env['DMLC_PS_ROOT_URI'] == '127.0.0.1'
        assert env['DMLC_PS_ROOT_PORT'] == port
        assert env['DMLC_NUM_WORKER'] == '2'
        assert env['DMLC_NUM_SERVER'] == '2'
        assert env['DMLC_NODE_HOST'] == '127.0.0.1'
        assert env['DMLC_INTERFACE'] == 'lo'
        assert env['DMLC_JOB_CLUSTER'] == 'local'
        assert env['OMP_NUM_THREADS'] == '1'
        assert env['TOY_DIR'] == toy_dir
        assert env['SSDSGD_JOB_SECRET'] == secret
        if role == 'worker':
            assert os.path.basename(env['SSDSGD_HEARTBEAT_FILE']) == f'worker{task}.hb'
        else:
            assert 'SSDSGD_HEARTBEAT_FILE' not in env
        # Servers and the scheduler: the hook took the liveness file out of the environment (their
        # children do not speak for them), and touches it.
        assert 'SSDSGD_LIVENESS_FILE' not in env and 'SSDSGD_REMOTE_WRAPPER' not in env
    heartbeat_dir = os.path.dirname(envs['worker0']['SSDSGD_HEARTBEAT_FILE'])
    assert not os.path.exists(heartbeat_dir)

    assert '[scheduler] scheduler0 started\n' in out
    assert '[worker 1] step 2\n' in out
    assert secret not in out + err
    _assert_all_gone(toy_dir, ALL_ROLES)


@pytest.mark.timeout(30)
def test_user_omp_num_threads_is_kept(toy_dir):
    assert run_job(TOY_CMD, 1, 1, env={'TOY_DIR': toy_dir, 'OMP_NUM_THREADS': '4'}) == 0
    with open(os.path.join(toy_dir, 'env.worker0.json')) as f:
        assert json.load(f)['OMP_NUM_THREADS'] == '4'


@pytest.mark.timeout(30)
def test_failing_worker_stops_everything(toy_dir, capsys):
    start = time.monotonic()
    assert run_job(TOY_CMD, 2, 2, env={'TOY_DIR': toy_dir, 'TOY_MODE': 'fail'}) == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert 'launch: worker 1 exited with code 3' in err
    # design.md: "prints its last 30 lines": 29 numbered lines and the last one, no earlier line.
    said = err.splitlines()
    tail = said[said.index('launch: last output of worker 1:') + 1:][:30]
    assert tail == ['  worker 1 line %d' % i for i in range(12, 41)] + ['  worker 1 is about to fail'], err
    assert '  worker 1 line 11' not in said
    _assert_all_gone(toy_dir, ALL_ROLES + ['grandchild'])


@pytest.mark.timeout(30)
def test_worker_killed_by_signal(toy_dir, capsys):
    assert run_job(TOY_CMD, 2, 1, env={'TOY_DIR': toy_dir, 'TOY_MODE': 'sigkill'}) == 1
    assert 'launch: worker 0 killed by SIGKILL' in capsys.readouterr().err
    _assert_all_gone(toy_dir, ['scheduler0', 'server0', 'worker0', 'worker1', 'grandchild'])


@pytest.mark.timeout(30)
def test_timeout_kills_even_processes_ignoring_sigterm(toy_dir, capsys):
    start = time.monotonic()
    env = {'TOY_DIR': toy_dir, 'TOY_MODE': 'hang', 'TOY_IGNORE_TERM': '1'}
    assert run_job(TOY_CMD, 2, 2, env=env, timeout=3) == 124
    # design.md: SIGKILL 3 s after SIGTERM: 3 s timeout + 3 s SIGTERM grace (worker 0 ignores SIGTERM) + slack
    assert 5.5 < time.monotonic() - start < 9
    assert 'launch: timeout after 3 s' in capsys.readouterr().err
    _assert_all_gone(toy_dir, ALL_ROLES + ['grandchild'])


@pytest.mark.timeout(30)
@pytest.mark.parametrize('mode, min_seconds', [('stall', 2), ('stall-later', 3)])
def test_stalled_worker(toy_dir, capsys, mode, min_seconds):
    """'stall' never touches the heartbeat; 'stall-later' touches it for ~1.5 s, then stops."""
    start = time.monotonic()
    assert run_job(TOY_CMD, 2, 1, env={'TOY_DIR': toy_dir, 'TOY_MODE': mode}, stall_timeout=2) == 1
    assert min_seconds <= time.monotonic() - start < 15
    assert re.search(r'launch: worker [01] made no progress for 2 s', capsys.readouterr().err)
    _assert_all_gone(toy_dir, ['scheduler0', 'server0', 'worker0', 'worker1', 'grandchild'])


@pytest.mark.timeout(30)
@pytest.mark.parametrize('victim, name', [('server0', 'server 0'), ('scheduler0', 'scheduler')])
def test_stopped_server_or_scheduler_is_named(toy_dir, capsys, victim, name):
    """SIGSTOP: the process never exits and the workers would only stall; its liveness file goes quiet.
    Cleanup must end the stopped process too (SIGTERM is held until SIGCONT; SIGKILL is not)."""
    start = time.monotonic()
    assert run_job(TOY_CMD, 2, 1, env={'TOY_DIR': toy_dir, 'TOY_MODE': 'stop-' + victim},
                   server_timeout=3, stall_timeout=30) == 1
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert f'launch: {name} on localhost gave no sign of life for 3 s (server timeout): its process is ' \
           'stopped (SIGSTOP or SIGTSTP)' in err, err
    assert 'made no progress' not in err
    assert elapsed < 13    # 3 s + start-up + at most 3 s of SIGTERM grace
    _assert_all_gone(toy_dir, ['scheduler0', 'server0', 'worker0', 'worker1', 'grandchild'])


def test_server_timeout_must_be_shorter_than_the_stall_timeout(capsys):
    assert run_job(TOY_CMD, 1, 1, server_timeout=30, stall_timeout=30) == 2
    assert '--server-timeout (30 s) must be shorter than --stall-timeout (30 s)' in capsys.readouterr().err
    assert run_job(TOY_CMD, 1, 1, server_timeout=0) == 2
    assert run_job(TOY_CMD, 1, 1, server_timeout=2) == 2
    assert '--server-timeout must be at least 3 s' in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_to_launcher_cli(toy_dir, tmp_path, signum):
    """SIGHUP (the terminal closed) stops the job as SIGTERM does: a message, 128 + signum, every
    process ended and the launcher's job folder removed."""
    cmd = [sys.executable, LAUNCH, '-n', '2', '-s', '1', '--env', f'TOY_DIR={toy_dir}',
           '--env', 'TOY_MODE=hang', '--'] + TOY_CMD
    tmp = tmp_path / 'tmp'
    tmp.mkdir()
    # Run from an unrelated directory: launch.py finds the installed package.
    launcher = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        deadline = time.monotonic() + 15
        while len(_recorded_pids(toy_dir)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_recorded_pids(toy_dir)) == 5
        assert [n.startswith('ssdsgd-launch-') for n in os.listdir(tmp)] == [True]
        launcher.send_signal(signum)
        assert launcher.wait(timeout=10) == 128 + signum
        assert f'received {signal.Signals(signum).name}, stopping the job'.encode() in launcher.stderr.read()
        _assert_all_gone(toy_dir, ['scheduler0', 'server0', 'worker0', 'worker1', 'grandchild'])
        assert os.listdir(tmp) == []
    finally:
        end_group(launcher)
        launcher.stderr.close()


@pytest.mark.timeout(30)
def test_children_die_with_sigkilled_launcher(toy_dir, tmp_path):
    """Also: the job folder a SIGKILLed launcher could not remove goes at the next launcher's start."""
    launcher = subprocess.Popen([sys.executable, LAUNCH, '-n', '2', '-s', '1', '--env', f'TOY_DIR={toy_dir}',
                                 '--env', 'TOY_MODE=hang'] + TOY_CMD, stdout=subprocess.DEVNULL,
                                env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 15
        while len(_recorded_pids(toy_dir)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_recorded_pids(toy_dir)) == 5
    finally:
        launcher.kill()
        launcher.wait()
    # PR_SET_PDEATHSIG covers the launcher's direct children only; the toy fixture kills the
    # grandchild, whose parent (worker 0) died and cannot clean it up.
    pids = _recorded_pids(toy_dir)
    del pids['grandchild']
    deadline = time.monotonic() + 5
    while not all(_is_gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {name: pid for name, pid in pids.items() if not _is_gone(pid)} == {}
    left = [str(tmp_path / n) for n in os.listdir(tmp_path) if n.startswith('ssdsgd-launch-')]
    assert len(left) == 1
    # The next launcher's start removes it (and its own job folder at its end).
    nxt = subprocess.run([sys.executable, LAUNCH, '-n', '1', '-s', '1', 'true'],
                         env=dict(os.environ, TMPDIR=str(tmp_path)), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=30)
    assert nxt.returncode == 0, nxt.stdout
    assert not os.path.exists(left[0])
    assert [n for n in os.listdir(tmp_path) if n.startswith('ssdsgd-launch-')] == []


def test_stale_job_dirs_only_of_gone_launchers_on_this_host(tmp_path):
    gone = subprocess.Popen(['true'])
    gone.wait()
    owners = {'gone': f'{socket.gethostname()} {gone.pid} 123', 'alive': f'{socket.gethostname()} {os.getpid()} '
              f'{job_dir.start_time(os.getpid())}', 'other-host': f'elsewhere {gone.pid} 123', 'no-owner': None}
    for name, owner in owners.items():
        (tmp_path / f'ssdsgd-launch-{name}').mkdir()
        if owner:
            (tmp_path / f'ssdsgd-launch-{name}' / job_dir.OWNER_FILE).write_text(owner)
    assert job_dir.remove_stale_job_dirs(str(tmp_path), 'ssdsgd-launch-') == [str(tmp_path / 'ssdsgd-launch-gone')]
    assert sorted(os.listdir(tmp_path)) == ['ssdsgd-launch-alive', 'ssdsgd-launch-no-owner',
                                            'ssdsgd-launch-other-host']


@pytest.mark.timeout(30)
def test_port_in_use(capsys):
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run_job(['true'], 1, 1, port=port) == 2
    assert f'port {port} is already in use' in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_bad_counts():
    result = subprocess.run([sys.executable, LAUNCH, '-n', '0', '-s', '1', 'true'], capture_output=True, text=True)
    assert result.returncode == 2
    assert 'need at least 1 worker and 1 server' in result.stderr
    assert run_job(['true'], 1, 0) == 2


@pytest.mark.timeout(30)
def test_ssh_options_with_the_local_launcher_are_refused(tmp_path):
    """`--launcher local` with -H or ssh options ran every role on this machine and exited 0; refused in one line
    naming the options, the way out and exit 2, nothing started (MXNet's launcher refuses it too). Without -H
    the launcher is local, as in MXNet's (whose ssh needs -H), so ssh options alone are refused as well."""
    (tmp_path / 'hosts').write_text('node1\n')
    result = subprocess.run([sys.executable, LAUNCH, '-n', '1', '-s', '1', '--launcher', 'local', '-H', 'hosts',
                             '--interface', 'eth0', '--ssh-user', 'bob', '--dry-run', 'python', 'x.py'],
                            capture_output=True, text=True, cwd=tmp_path, timeout=20)
    assert (result.returncode, result.stdout) == (2, '')
    assert result.stderr == ("launch: -H, --interface, --ssh-user: only for the ssh launcher, but the launcher is "
                             "local, which runs every role on this machine: use --launcher ssh (the default with "
                             "-H), or drop them\n")
    result = subprocess.run([sys.executable, LAUNCH, '-n', '1', '--interface', 'eth0', '--ssh-option', 'A=b', 'true'],
                            capture_output=True, text=True, cwd=tmp_path, timeout=20)
    assert result.returncode == 2
    assert result.stderr == ("launch: --interface, --ssh-option: only for the ssh launcher, but the launcher is "
                             "local (the default without -H), which runs every role on this machine: add -H HOSTFILE "
                             "to run over ssh, or drop them\n")
    assert os.listdir(tmp_path) == ['hosts']


@pytest.mark.timeout(30)
@pytest.mark.parametrize('launcher, why', [('mpi', 'not supported; ssdsgd runs local and ssh (mpirun starts and owns '
                                                   'the processes, so this launcher could not watch, time out or end '
                                                   'them)'),
                                           ('yarn', 'not supported; ssdsgd runs local and ssh (YARN starts'),
                                           ('nosuch', 'unknown; use local or ssh')])
def test_a_launcher_we_do_not_run_is_named_with_why(launcher, why):
    """Before: argparse's `invalid choice: 'mpi'` under a usage block, with nothing on why."""
    result = subprocess.run([sys.executable, LAUNCH, '-n', '1', '--launcher', launcher, 'true'], capture_output=True,
                            text=True, timeout=20)
    assert result.returncode == 2
    assert result.stderr.startswith(f'launch: --launcher {launcher}: {why}')
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.timeout(90)
@pytest.mark.parametrize('counts, error', [
    (['-n', '2', '-s', '2'], 'cluster.servers is 1, but the launcher started 2 servers (-s 2; -s defaults to -n): '
                             'add --set cluster.servers=2 to the command, or launch with -s 1'),
    (['-n', '3'], 'cluster.workers is 2 and cluster.servers is 1, but the launcher started 3 workers (-n 3) and 3 '
                  'servers (-s 3; -s defaults to -n): add --set cluster.workers=3 cluster.servers=3 to the command, '
                  'or launch with -n 2 -s 1'),
    (['-n', '1', '-s', '1'], 'cluster.workers is 2, but the launcher started 1 worker (-n 1): add --set '
                             'cluster.workers=1 to the command, or launch with -n 2'),
], ids=['servers', 'both', 'workers'])
def test_a_job_of_another_size_than_its_config_is_refused_before_anything_is_written(tmp_path, counts, error):
    """Before: -n 4 with cluster.workers 8 ended each worker with a RuntimeError traceback, and -s 2 with
    cluster.servers 1 trained on 2 servers while the run folder's config.yaml said 1. Every role now stops
    at start with one line naming the keys, the launcher's numbers and both ways out; the job ends at once,
    no run folder is made and no process is left."""
    runs = tmp_path / 'runs'
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, LAUNCH, *counts, '--timeout', '60', 'python', '-m', 'ssdsgd.train',
                           '--config', os.path.join(REPO, 'configs', 'demo_digits_ssd_topk.yaml'),
                           '--set', f'log.dir={runs}'], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=80, start_new_session=True)
    seconds = time.monotonic() - t0
    try:
        assert proc.returncode == 1, proc.stdout
        failed = re.search(r'^launch: (\S+(?: \d)?) exited with code 2$', proc.stdout, re.M)
        assert failed, proc.stdout
        assert f'[{failed[1]}] {failed[1]}: error: {error}\n' in proc.stdout
        assert 'Traceback' not in proc.stdout
        assert not runs.exists()
        assert seconds < 30, proc.stdout
    finally:
        left = processes_with(str(runs))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert left == []


def _run_remote_script(script, timeout=20):
    """What the remote `bash -s` does with a planned script, run locally; returns (output lines, marks).

    stdin stays open until the role has reported its end: remote.py ends the role when stdin closes."""
    proc = subprocess.Popen(['bash', '-s'], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        proc.stdin.write(script)
        proc.stdin.flush()
        lines, marks = [], {}
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            if line.startswith('@ssdsgd '):
                key, *value = line.split()[1:]
                marks[key] = value
                if key == 'exit':
                    break
            else:
                lines.append(line.rstrip('\n'))
            assert time.monotonic() < deadline
        proc.stdin.close()
        code = int(marks['exit'][0])
        assert proc.wait(timeout=timeout) == (code if code >= 0 else 128 - code)  # like a shell's $?
        return lines, marks
    finally:
        end_group(proc)


@pytest.mark.timeout(60)
def test_planned_ssh_roles_run_on_their_hosts(tmp_path):
    secret = 'ab' * 32
    cwd = tmp_path / "work dir with 'quotes'"
    cwd.mkdir()
    tricky = 'it\'s "quoted" $HOME `id` ; echo pwned'
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': '9091', 'DMLC_NUM_WORKER': '3',
           'DMLC_NUM_SERVER': '2', 'SSDSGD_JOB_SECRET': secret, 'TRICKY': tricky}
    dump = ('import json, os; print(json.dumps({"cwd": os.getcwd(), "pgid": os.getpgid(0), '
            '**{k: v for k, v in os.environ.items() if k.startswith(("DMLC_", "SSDSGD_", "TRICKY"))}}))')
    hosts = [Host('alpha'), Host('beta', 2222, interface='lo')]
    planned = ssh_roles(['python', '-c', dump], hosts, 3, 2, env, str(cwd), ['-F', 'my config'])

    assert [(name, argv[-2]) for name, argv, _ in planned] == [
        ('server 0', 'alpha'), ('server 1', 'beta'), ('worker 0', 'alpha'), ('worker 1', 'beta'),
        ('worker 2', 'alpha')]
    base = ['ssh', '-F', 'my config', '-o', 'StrictHostKeyChecking=no', '-o', 'BatchMode=yes']
    for name, argv, script in planned:
        assert argv == base + (['-p', '2222', 'beta'] if argv[-2] == 'beta' else ['alpha']) + ['bash -s']
        assert secret not in ' '.join(argv)
        lines, marks = _run_remote_script(script)
        seen = json.loads(lines[-1])
        role, task = name.split()
        # The role runs in its own process group, whose id remote.py reported.
        assert seen.pop('pgid') == int(marks['pgid'][0])
        assert marks['exit'] == ['0']
        # Without an interface in the host file, the one routing to the scheduler (here lo).
        assert seen == {**env, 'cwd': str(cwd), 'DMLC_ROLE': role, 'DMLC_TASK_ID': task, 'SSDSGD_ROLE_NAME': name,
                        'DMLC_INTERFACE': 'lo', 'DMLC_NODE_HOST': '127.0.0.1'}
        assert marks['pgid'][2:] == ['lo', '127.0.0.1']


@pytest.mark.timeout(60)
def test_remote_wrapper_reports_signal_and_interpreter(tmp_path):
    """A role killed by a signal is reported as such (not ssh's 255), and `python` is the launching one."""
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'SSDSGD_JOB_SECRET': 'x'}
    code = 'import os, signal, sys; print(sys.executable, flush=True); os.kill(os.getpid(), signal.SIGKILL)'
    [(_, _, script)] = ssh_roles(['python', '-c', code], [Host('alpha')], 1, 1, env, str(tmp_path))[1:]
    lines, marks = _run_remote_script(script)
    assert lines == [sys.executable]
    assert marks['exit'] == ['-9']


def test_hostfile_interface_missing_on_host(tmp_path):
    env = {'DMLC_PS_ROOT_URI': '127.0.0.1', 'SSDSGD_JOB_SECRET': 'x'}
    [(_, _, script)] = ssh_roles(['true'], [Host('alpha', interface='nosuchif0')], 1, 1, env,
                                          str(tmp_path))[1:]
    proc = subprocess.run(['bash', '-s'], input=script, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 2
    assert "interface 'nosuchif0' (host file) does not exist" in proc.stdout


def test_ssh_usage_errors(tmp_path, capsys):
    missing = str(tmp_path / 'no-such-hostfile')
    assert run_job(['true'], 1, 1, launcher='ssh', hostfile=missing, interface='lo') == 2
    assert missing in capsys.readouterr().err
    empty = tmp_path / 'empty'
    empty.write_text('# nobody\n\n')
    assert run_job(['true'], 1, 1, launcher='ssh', hostfile=str(empty), interface='lo') == 2
    assert str(empty) in capsys.readouterr().err
    empty.write_text('alpha\n')
    assert run_job(['true'], 1, 1, launcher='ssh', hostfile=str(empty), interface='nosuchif0') == 2
    assert 'nosuchif0' in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_ssh_dry_run(tmp_path):
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('alpha\nbeta:2222\n')
    result = subprocess.run([sys.executable, LAUNCH, '-n', '2', '-s', '1', '--launcher', 'ssh', '-H', str(hostfile),
                             '--interface', 'lo', '--dry-run', '--', 'python', '-m', 'ssdsgd.train'],
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f'scheduler on localhost: {sys.executable} -m ssdsgd.train' in out  # `python`: the launching one
    assert "server 0 on alpha: ssh -o StrictHostKeyChecking=no -o BatchMode=yes alpha 'bash -s'" in out
    assert 'worker 0 on beta:' in out and 'worker 1 on alpha:' in out
    assert 'DMLC_PS_ROOT_URI=127.0.0.1' in out
    assert out.count('SSDSGD_JOB_SECRET=<redacted>') == 4
    assert not re.search(r'[0-9a-f]{64}', out)


@pytest.mark.timeout(30)
def test_a_host_file_without_launcher_runs_over_ssh_as_in_mxnet(tmp_path):
    """MXNet's launch.py takes ssh when -H is given without --launcher (its default). Before: refused, exit 2.
    Now the plan runs the servers and workers over ssh on the listed hosts."""
    (tmp_path / 'hosts').write_text('node1\nnode2\n')
    result = subprocess.run([sys.executable, LAUNCH, '-n', '1', '-s', '1', '-H', 'hosts', '--interface', 'lo',
                             '--dry-run', 'python', 'x.py'], capture_output=True, text=True, cwd=tmp_path, timeout=20)
    assert result.returncode == 0, result.stderr
    assert "server 0 on node1: ssh -o StrictHostKeyChecking=no -o BatchMode=yes node1 'bash -s'" in result.stdout
    assert 'worker 0 on node2: ssh ' in result.stdout
    assert os.listdir(tmp_path) == ['hosts']


def _route_interface_here():
    """(interface, address) of this machine's route to 10.255.255.255, as `ip route get` says, or None."""
    out = subprocess.run(['ip', '-4', '-o', 'route', 'get', '10.255.255.255'], capture_output=True, text=True).stdout
    found = re.search(r' dev (\S+) .*src (\S+)', out)
    return (found[1], found[2]) if found else None


def test_interface_found_as_mxnets_tracker_finds_it(monkeypatch):
    """No --interface: this machine's address as MXNet 1.9.1's tracker takes it (its fully qualified name
    resolved; its host name when that fails; a loopback answer replaced by the source address of the route
    to 10.255.255.255), and the interface holding that address."""
    from ssdsgd.launch import plan
    route = _route_interface_here()
    if route is None:
        pytest.skip('no route to 10.255.255.255 here')
    monkeypatch.setattr(plan.socket, 'getfqdn', lambda: 'myhost.example')
    looked_up = []

    def loopback(name):
        looked_up.append(name)
        return '127.0.1.1'
    monkeypatch.setattr(plan.socket, 'gethostbyname', loopback)
    assert plan.mxnet_interface() == (*route, 'myhost.example resolves to 127.0.1.1 (loopback): the route out')
    assert looked_up == ['myhost.example']

    def unresolvable(name):   # the qualified name fails: the host name, as MXNet's tracker falls back
        looked_up.append(name)
        if name == 'myhost.example':
            raise socket.gaierror(-2, 'Name or service not known')
        return route[1]
    monkeypatch.setattr(plan.socket, 'gethostname', lambda: 'myhost')
    monkeypatch.setattr(plan.socket, 'gethostbyname', unresolvable)
    assert plan.mxnet_interface() == (*route, f'myhost resolves to {route[1]}')
    assert looked_up[-2:] == ['myhost.example', 'myhost']


@pytest.mark.timeout(30)
def test_ssh_without_interface_says_which_it_chose(tmp_path):
    """Before: `--launcher ssh needs --interface`, exit 2. Now one line names the interface and address."""
    route = _route_interface_here()
    if route is None:
        pytest.skip('no route to 10.255.255.255 here')
    (tmp_path / 'hosts').write_text('node1\n')
    result = subprocess.run([sys.executable, LAUNCH, '-n', '1', '-s', '1', '--launcher', 'ssh', '-H', 'hosts',
                             '--dry-run', 'python', 'x.py'], capture_output=True, text=True, cwd=tmp_path, timeout=20)
    assert result.returncode == 0, result.stderr
    chose = [line for line in result.stderr.splitlines() if 'interface' in line]
    assert len(chose) == 1 and chose[0].startswith(f'launch: no --interface given: using {route[0]} ({route[1]}), '
                                                   "as MXNet's launcher finds it"), result.stderr
    assert f'DMLC_PS_ROOT_URI={route[1]}' in result.stdout and f'DMLC_INTERFACE={route[0]}' in result.stdout
