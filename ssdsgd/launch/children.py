"""A started role: its process, the tail of its output, its heartbeat or liveness file, and for ssh its
remote process group and how the remote side ended; and what to say about it when it fails."""
import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from ssdsgd.env import HEARTBEAT_ENV, LIVENESS_ENV, MARK, RANK_MARK, ROLE_ENV
from ssdsgd.launch.remote import EXIT_MARK, PGID_MARK
from ssdsgd.launch.ssh import WRAPPER_MARK, ssh_failure

TAIL_LINES = 30        # output lines kept per process for failure reports
PR_SET_PDEATHSIG = 1   # <linux/prctl.h>

# Resolved once here: the preexec_fn runs between fork and exec and must do as little as possible.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_print_lock = threading.Lock()
_stdout_lost = False   # our stdout was closed: role output is dropped


def die_with_parent(parent_pid, signum=signal.SIGKILL):
    """A preexec_fn for a child of parent_pid: Linux sends the child signum when its parent dies, even by
    SIGKILL. The launcher's roles get SIGKILL; a script's job gets SIGTERM, so that its launcher stops its
    roles in turn."""
    def preexec():
        # A SIGKILLed launcher takes its children along; not what they started (a `bash -c` line's commands):
        # the signal is not inherited, and no cleanup of ours runs to end their process groups.
        _prctl(PR_SET_PDEATHSIG, int(signum))
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


# A signal that says more than its name: MXNet's RecordIO reader dies of SIGFPE on an image that decodes
# to nothing where it resizes (validation, data.augment false), before Python could name the record.
SIGNAL_HINTS = {signal.SIGFPE: ' (an arithmetic fault in native code; reading ImageNet RecordIO, an image that '
                                'decodes to nothing: MXNet names the .rec file above)'}


def describe_returncode(returncode):
    if returncode >= 0:
        return f'exited with code {returncode}'
    try:
        sig = signal.Signals(-returncode)
        return f'killed by {sig.name}{SIGNAL_HINTS.get(sig, "")}'
    except ValueError:  # e.g. real-time signals have no name
        return f'killed by signal {-returncode}'


def _describe_shell_status(status):
    """A shell's $? (128 + N: killed by signal N) in words."""
    return describe_returncode(128 - status if status > 128 else status)


def group_states(pgid):
    """One-letter states (R, S, D, T, Z, ...) of the local processes of a process group, from /proc."""
    states = set()
    for pid in os.listdir('/proc'):
        if not pid.isdigit():
            continue
        try:
            with open(f'/proc/{pid}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()   # state, ppid, pgrp, ...
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            states.add(fields[0])
    return states


def _show(text):
    """Write a role's line to our stdout; once that is gone (`ssdsgd-run | head`, a closed terminal), drop
    this and every later line: the job goes on, its failures still reach stderr."""
    with _print_lock:  # one write per line, so lines of different roles never interleave
        if _stdout_lost:
            return
        try:
            _write(text)
        except BlockingIOError:        # a non-blocking stdout that is full: this line is lost, not the rest
            pass
        except (OSError, ValueError):  # EPIPE, EIO; ValueError: sys.stdout was closed
            _stdout_gone()


def _write(text):
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:  # a stdout that cannot encode the role's text (PYTHONIOENCODING=ascii)
        encoding = sys.stdout.encoding
        sys.stdout.write(text.encode(encoding, 'replace').decode(encoding))
    sys.stdout.flush()


def stdout_to_devnull():
    """Point fd 1 at /dev/null: once our reader is gone, later writes (and the flush at exit) succeed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)   # fd 1, not sys.stdout.fileno(): sys.stdout may be closed
    os.close(devnull)


def _stdout_gone():
    """Point fd 1 at /dev/null, so that later writes (and the flush at exit) succeed silently; say so once."""
    global _stdout_lost
    if _stdout_lost:
        return
    _stdout_lost = True
    stdout_to_devnull()
    try:
        print('launch: standard output was closed; the job goes on without showing its output', file=sys.stderr,
              flush=True)
    except (OSError, ValueError):
        pass  # stderr went with it (`2>&1 | head`)


class Child:
    """A started process, the tail of its output, its heartbeat file and, for ssh, its remote group."""

    def __init__(self, spec):
        self.name = spec.name
        self.host = spec.host
        self.ssh = spec.ssh
        self.is_worker = spec.env[ROLE_ENV] == 'worker'
        self.heartbeat = spec.env.get(HEARTBEAT_ENV)
        self.liveness = spec.env.get(LIVENESS_ENV)
        self.root = spec.env.get('DMLC_PS_ROOT_URI'), spec.env.get('DMLC_PS_ROOT_PORT')   # the scheduler's address
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.started = time.monotonic()
        self.rank = None
        self.pgid = None           # the remote process group (ssh), from remote.py's report
        self.remote_code = None    # how the remote role ended (negative: signal), from remote.py
        self.wrapper_code = None   # how remote.py itself ended (the shell's $?), from the role's script
        self.popen = subprocess.Popen(
            spec.argv,
            env=None if spec.stdin else {**os.environ, **spec.env},  # ssh itself gets only our environment
            stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: cleanup also reaches grandchildren
            preexec_fn=die_with_parent(os.getpid()))
        if spec.stdin:
            # The pipe stays open: remote.py ends the role when it closes (when this ssh client dies).
            try:
                self.popen.stdin.write(spec.stdin.encode())
                self.popen.stdin.flush()
            except BrokenPipeError:
                pass  # ssh already exited; the supervisor reports its exit code
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def label(self):
        return self.name if self.rank is None else f'{self.name} (rank {self.rank})'

    def _marker(self, line):
        """Take in a MARK line; False if it is not one of ours (it is shown then)."""
        words = line[len(MARK):].split()
        try:
            if words[0] == PGID_MARK and self.ssh:
                self.pgid = int(words[1])
            elif words[0] == EXIT_MARK and self.ssh:
                self.remote_code = int(words[1])
            elif words[0] == WRAPPER_MARK and self.ssh:
                self.wrapper_code = int(words[1])
            elif words[0] == RANK_MARK:
                self.rank = int(words[1])
            else:
                return False
        except (IndexError, ValueError):
            return False
        return True

    def _pump(self):
        # Reads to the end whatever becomes of our stdout: a role whose output pipe fills blocks, and the
        # job would stall with a worker blamed for it.
        with self.popen.stdout as pipe:
            for raw in pipe:
                line = raw.decode(errors='replace').rstrip('\r\n')
                if line.startswith(MARK) and self._marker(line):
                    continue
                self.tail.append(line)
                _show(f'[{self.label()}] {line}\n')

    def exit_code(self):
        """How the role ended: None while running; for ssh the remote role's own code or signal."""
        code = self.popen.poll()
        if code is None or not self.ssh:
            return code
        self.reader.join(timeout=1.0)  # the exit report is the last line remote.py prints
        return self.remote_code if self.remote_code is not None else code

    def never_reached(self):
        """What ssh said when it ended (exit 255) without reaching the host (refused, unresolvable, login
        denied), else None: then nothing of the role runs there."""
        if not self.ssh or self.pgid is not None or self.popen.poll() != 255:
            return None
        return ssh_failure(self.tail)

    def describe_exit(self):
        code = self.exit_code()
        if not self.ssh:
            return describe_returncode(code)
        if self.remote_code is not None:
            return f'{describe_returncode(code)} on {self.host}'
        if self.wrapper_code is not None and self.pgid is None:
            # Never started: the host file's interface or python= is wrong there, or the command is missing.
            return f'could not start on {self.host} ({_describe_shell_status(self.wrapper_code)}; see its output)'
        if self.wrapper_code is not None:
            # remote.py ended before it could report on the role: killed from outside (its handlers
            # report a normal end), and the kernel then killed the role (PR_SET_PDEATHSIG).
            return (f'lost its supervisor on {self.host}: the wrapper that runs it there (remote.py) '
                    f'{_describe_shell_status(self.wrapper_code)} before the role ended, and the role was '
                    f'killed with it')
        cause = self.never_reached()
        if cause:
            return f'could not start on {self.host} (ssh exited with code 255): {cause}'
        why = (f': the connection to {self.host} was lost or refused (an unreachable host ends ssh within the '
               f'server timeout)' if code == 255 else '')
        return f'lost: ssh to {self.host} exited with code {code} before the role reported its end{why}'

    def idle_seconds(self, path=None):
        """Seconds since the worker last touched its heartbeat file (since its start if it never did);
        with `path`, since that file (the liveness file of a server or the scheduler) was touched."""
        try:
            return time.time() - os.stat(path or self.heartbeat).st_mtime
        except FileNotFoundError:
            return time.monotonic() - self.started

    def silence(self, seconds):
        """What to say about a server or the scheduler that gave no sign of life for `seconds`."""
        if self.ssh:
            why = (f'its process is stopped or hung, {self.host} is unreachable, or it lost the shared '
                   f'file system (the liveness file is there)')
        else:
            states = group_states(self.popen.pid)
            why = ('its process is stopped (SIGSTOP or SIGTSTP)' if states & {'T', 't'}
                   else f'its process is hung (state {"".join(sorted(states)) or "unknown"})')
        return (f'on {self.host} gave no sign of life for {seconds:.0f} s (server timeout): {why}; the '
                f'workers cannot go on without it')

    def report(self, what):
        if self.popen.returncode is not None:
            self.reader.join(timeout=1.0)  # let the reader catch the last lines the process printed
        lines = [f'launch: {self.label()} {what}']
        if self.tail:
            lines += [f'launch: last output of {self.label()}:'] + [f'  {line}' for line in self.tail]
        print('\n'.join(lines), file=sys.stderr, flush=True)
