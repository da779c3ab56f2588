"""Runs one role of an ssh job on its host: `python -c <this file's source> COMMAND...`.

The launcher ships this file's source (the remote host may not have the package on its path) and
reads the lines starting with MARK that it prints. What it does on the host:
- picks the host's network interface: SSDSGD_HOST_INTERFACE (the host file's `interface=`), else
  the interface that routes to the scheduler, and sets DMLC_INTERFACE and DMLC_NODE_HOST from it;
- starts COMMAND in its own session (process group id = its PID) and reports that id, so the
  launcher can end the whole group over ssh; COMMAND gets SIGKILL from the kernel if this wrapper dies
  (PR_SET_PDEATHSIG), even when the wrapper itself is SIGKILLed;
- ends the group (SIGTERM, then SIGKILL) when its standard input closes, i.e. when the launcher's
  ssh client is gone (a dead launcher leaves nothing behind), or when it gets SIGTERM/SIGHUP/SIGINT;
- also ends it once the launcher's job folder (SSDSGD_JOB_DIR, on the shared file system) is gone: the
  launcher removes it after its cleanup, so a role on a host the cleanup could not reach (the network
  was cut, and the closing ssh connection never arrived) still ends when the job is over;
- reports how COMMAND ended (exit code, or the signal that killed it) before exiting with it.

Standard library only.
"""
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

MARK = '@ssdsgd '        # ssdsgd.env.MARK: a line `@ssdsgd <key> <value>...` is for the launcher
PGID_MARK = 'pgid'       # `MARK + 'pgid PGID HOST IF ADDRESS'`: the role's process group (read by children.py)
EXIT_MARK = 'exit'       # `MARK + 'exit CODE'`: how the role ended, negative for a signal (children.py)
JOB_DIR_ENV = 'SSDSGD_JOB_DIR'     # ssdsgd.env.JOB_DIR_ENV
JOB_DIR_POLL = 1.0       # seconds between checks that the launcher's job folder still exists
TERM_GRACE = 3.0         # between SIGTERM and SIGKILL
SIOCGIFADDR = 0x8915     # <linux/sockios.h>
PR_SET_PDEATHSIG = 1     # <linux/prctl.h>


def interface_ip(name):
    """IPv4 address of a network interface on this machine, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack('256s', name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(ifreq[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (family, port, addr)


def route_interface(target):
    """(interface, address) this host uses to reach `target`, or (None, None)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))   # UDP connect sends nothing; it only picks the route
        except OSError:
            return None, None
        source = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        if interface_ip(name) == source:
            return name, source
    return None, None


def _end_group(pgid):
    for sig, wait in ((signal.SIGTERM, TERM_GRACE), (signal.SIGKILL, 0)):
        try:
            os.killpg(pgid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pgid, signal.SIGCONT)   # a stopped process gets the SIGTERM now, not at SIGKILL
        except ProcessLookupError:
            return
        deadline = wait
        while deadline > 0:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            threading.Event().wait(0.05)
            deadline -= 0.05


def _die_with_wrapper(wrapper_pid):
    """preexec_fn of the role: the kernel SIGKILLs it when this wrapper dies, even by SIGKILL (no handler
    of ours runs then), so a role never trains on unsupervised (the local launcher does the same)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved before the fork: preexec_fn does little

    def preexec():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != wrapper_pid:   # the wrapper died before prctl took effect
            os._exit(1)
    return preexec


def main(command):
    env = dict(os.environ)
    # The names are ssdsgd.env's (no imports here; tests/unit/test_code_shape.py checks them).
    env.pop('SSDSGD_REMOTE_WRAPPER', None)   # the role itself keeps its liveness file (pyhooks/sitecustomize.py)
    job_dir = env.pop(JOB_DIR_ENV, '')
    iface = env.pop('SSDSGD_HOST_INTERFACE', '')
    if iface:
        address = interface_ip(iface)
        if address is None:
            print(f'error: interface {iface!r} (host file) does not exist on {socket.gethostname()}', flush=True)
            return 2
    else:
        iface, address = route_interface(env['DMLC_PS_ROOT_URI'])
        if iface is None:
            print(f'error: no route from {socket.gethostname()} to the scheduler {env["DMLC_PS_ROOT_URI"]}',
                  flush=True)
            return 2
    env['DMLC_INTERFACE'], env['DMLC_NODE_HOST'] = iface, address
    try:
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=_die_with_wrapper(os.getpid()))
    except OSError as e:   # e.g. the command does not exist on this host: one line, not a traceback
        print(f'error: cannot start {command[0]} on {socket.gethostname()}: {e.strerror}', flush=True)
        return 127
    print(f'{MARK}{PGID_MARK} {child.pid} {socket.gethostname()} {iface} {address}', flush=True)

    def stop(*_):
        _end_group(child.pid)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)

    def watch_stdin():
        # Raw reads (no buffered-reader lock that would stall interpreter shutdown); b'' is EOF:
        # the launcher's ssh client has gone away.
        while os.read(0, 65536):
            pass
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()

    def watch_job_dir():
        while True:
            threading.Event().wait(JOB_DIR_POLL)
            try:
                os.stat(job_dir)
            except FileNotFoundError:
                break       # removed: the launcher is done with the job
            except OSError:
                continue    # a file system hiccup is not the end of the job
        stop()

    if job_dir:
        threading.Thread(target=watch_job_dir, daemon=True).start()
    code = child.wait()
    try:
        print(f'{MARK}{EXIT_MARK} {code}', flush=True)
    except OSError:
        pass  # nobody is listening any more
    return code if code >= 0 else 128 - code


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
