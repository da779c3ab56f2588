"""The plan of a job: which process runs where, with which argv and environment, before anything starts.

Every role runs the same command and branches on DMLC_ROLE (as with MXNet's tools/launch.py). Local jobs
run every role here; ssh jobs run the scheduler here and each server and worker on its host (hosts.py)
under remote.py.
"""
import errno
import os
import secrets
import shlex
import socket
import sys
from typing import NamedTuple, Optional

from ssdsgd.env import (
    HEARTBEAT_ENV,
    HOST_INTERFACE_ENV,
    JOB_DIR_ENV,
    LIVENESS_ENV,
    ROLE_ENV,
    ROLE_NAME_ENV,
    SECRET_ENV,
    TASK_ID_ENV,
)
from ssdsgd.launch import gpus, remote
from ssdsgd.launch.command_line import role_argv
from ssdsgd.launch.hosts import placement, read_hosts
from ssdsgd.launch.ssh import role_script, ssh_base
from ssdsgd.launch.usage import UsageError, check_job

HOOKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pyhooks')  # sitecustomize for roles


class RoleSpec(NamedTuple):
    name: str              # role name shown in output, e.g. 'worker 1'
    host: str              # where the command runs: 'localhost' or the ssh host
    argv: list             # what the launcher executes on this machine
    env: dict              # variables the launcher sets (added to os.environ locally, exported via stdin for ssh)
    stdin: Optional[str]   # script fed to `ssh ... bash -s`; None for local processes
    ssh: Optional[list]    # ssh argv up to and including the host, for cleanup; None for local processes


def interface_ip(name):
    """IPv4 address of a network interface on this machine."""
    address = remote.interface_ip(name)
    if address is None:
        raise UsageError(f'network interface {name!r} does not exist or has no IPv4 address')
    return address


# MXNet's tracker (dmlc_tracker) takes a loopback answer as "no address" and asks the kernel which source
# address it would use towards this one; connecting a UDP socket sends nothing.
OUTSIDE = '10.255.255.255'


def mxnet_interface():
    """(interface, address, how) of this machine as MXNet 1.9.1's launcher finds the scheduler's address when
    told nothing: what its fully qualified name resolves to (its host name's, if that fails); a loopback answer
    gives way to the source address of the route to OUTSIDE. The interface is the one holding that address
    (the scheduler's DMLC_INTERFACE). UsageError if there is none: a scheduler on an address no host reaches
    would only show up as a job that never starts."""
    name = socket.getfqdn()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        name = socket.gethostname()
        try:
            address = socket.gethostbyname(name)
        except OSError as e:
            raise UsageError(f'no --interface given, and this machine\'s name {name} does not resolve '
                             f'({e.strerror or e}): give --interface') from None
    how = f'{name} resolves to {address}'
    if address.startswith('127.'):
        how += ' (loopback)'
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((OUTSIDE, 1))
            except OSError as e:
                raise UsageError(f'no --interface given, and {how} and no route leads out of this machine '
                                 f'({e.strerror or e}): give --interface') from None
            address = s.getsockname()[0]
        how += ': the route out'
    for _, interface in socket.if_nameindex():
        if remote.interface_ip(interface) == address:
            return interface, address, how
    raise UsageError(f'no --interface given, and no network interface here holds {address}, the address {how}: '
                     f'give --interface')


def scheduler_address(launcher, interface):
    """The address the scheduler listens on, on this machine: loopback for a local job, the address on
    `interface` (the network the hosts reach this machine on) for an ssh one."""
    return '127.0.0.1' if launcher == 'local' else interface_ip(interface)


def pick_port(host, port):
    """Check that `port` is free on `host`, or pick a free one when port is None."""
    with socket.socket() as s:
        # Same option ZeroMQ uses, so a TIME_WAIT leftover is not reported as "in use".
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port or 0))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f'port {port} is already in use') from None
            raise UsageError(f'cannot bind {host}:{port}: {e.strerror}') from None
        return s.getsockname()[1]


def roles(num_workers, num_servers):
    """(DMLC_ROLE, task id, role name) in start order: scheduler, servers, workers."""
    return ([('scheduler', 0, 'scheduler')]
            + [('server', i, f'server {i}') for i in range(num_servers)]
            + [('worker', i, f'worker {i}') for i in range(num_workers)])


def role_env(job_env, role, task_id, name, job_dir=None, env_by_role=None, gpu_lists=None):
    """A role's variables; gpu_lists: each worker's GPUs (gpus.py), None when the job asks for none."""
    env = {**job_env, **(env_by_role or {}).get(role, {}),
           ROLE_ENV: role, TASK_ID_ENV: str(task_id), ROLE_NAME_ENV: name, **gpus.device_env(role, task_id, gpu_lists)}
    if role == 'worker' and job_dir:
        env[HEARTBEAT_ENV] = os.path.join(job_dir, f'worker{task_id}.hb')  # the launcher watches its mtime
    elif job_dir:
        env[LIVENESS_ENV] = os.path.join(job_dir, f'{role}{task_id}.alive')
    return env


def _ssh_specs(command, hosts, num_workers, num_servers, env, cwd, ssh_options=(), job_dir=None, env_by_role=None,
               server_timeout=None, gpu_lists=None):
    specs = []
    remote_roles = roles(num_workers, num_servers)[1:]
    # Servers and workers share one placement, so servers do not pile up with worker 0.
    for (role, task_id, name), host in zip(remote_roles, placement(hosts, len(remote_roles))):
        this_env = role_env(env, role, task_id, name, job_dir, env_by_role, gpu_lists)
        if host.interface:
            this_env[HOST_INTERFACE_ENV] = host.interface
        if job_dir:
            this_env[JOB_DIR_ENV] = job_dir   # remote.py ends the role once the launcher removed it
        python = host.python or sys.executable
        script = role_script(this_env, python, cwd, role_argv(command, python, cwd))
        base = ssh_base(host, ssh_options, server_timeout)
        specs.append(RoleSpec(name, host.name, base + ['bash -s'], this_env, script, base))
    return specs


def _job_env(env, launcher, root_uri, port, interface, num_workers, num_servers):
    """The variables every role gets: ps-lite's DMLC_*, the hook's PYTHONPATH, the secret, the user's."""
    python_path = [HOOKS_DIR, env.get('PYTHONPATH', os.environ.get('PYTHONPATH'))]
    job_env = {
        **env,
        'DMLC_PS_ROOT_URI': root_uri,
        'DMLC_PS_ROOT_PORT': str(pick_port(root_uri, port)),
        'DMLC_NUM_WORKER': str(num_workers),
        'DMLC_NUM_SERVER': str(num_servers),
        'DMLC_INTERFACE': interface,
        # pyhooks/sitecustomize.py: an uncaught exception ends a role at once. The package itself needs no
        # PYTHONPATH (it is installed); the hook does (see that file for why).
        'PYTHONPATH': os.pathsep.join(filter(None, python_path)),
        SECRET_ENV: secrets.token_hex(32),
    }
    if 'OMP_NUM_THREADS' not in env and 'OMP_NUM_THREADS' not in os.environ:
        # Several roles per machine would each start one thread per core and fight over them.
        print('launch: OMP_NUM_THREADS is not set; using 1 per process (set it to choose)', file=sys.stderr)
        job_env['OMP_NUM_THREADS'] = '1'
    elif launcher == 'ssh' and 'OMP_NUM_THREADS' not in env:
        job_env['OMP_NUM_THREADS'] = os.environ['OMP_NUM_THREADS']  # as MXNet's ssh launcher forwards it
    return job_env


def plan(command, num_workers, num_servers, launcher, hostfile, env, port, interface,
         timeout, stall_timeout, job_dir, ssh_options=(), env_by_role=None, server_timeout=None,
         gpus_per_worker=0, gpu_ids=None):
    """Validate the job and return (specs in start order, secret). env_by_role: {role: {K: V}}.
    gpus_per_worker: GPUs each worker gets (0: the job uses none); gpu_ids: each host's GPU ids where its
    host file line gives none (gpus.py)."""
    check_job(command, num_workers, num_servers, port, timeout, stall_timeout, server_timeout,
              [*env, *(k for r in (env_by_role or {}).values() for k in r)])
    if launcher == 'local':
        interface = interface or 'lo'
        root_uri = scheduler_address(launcher, interface)
    elif launcher == 'ssh':
        if not hostfile:
            raise UsageError('--launcher ssh needs -H HOSTFILE')
        hosts = list(hostfile) if isinstance(hostfile, list) else read_hosts(hostfile)   # a list: spares.py's
        if not interface:
            interface, address, how = mxnet_interface()
            print(f"launch: no --interface given: using {interface} ({address}), as MXNet's launcher finds it "
                  f"({how})", file=sys.stderr)
        root_uri = scheduler_address(launcher, interface)
    else:
        raise UsageError(f'unknown launcher {launcher!r}')
    job_env = _job_env(env, launcher, root_uri, port, interface, num_workers, num_servers)
    cwd = os.getcwd()
    # Local processes: ps-lite binds this address; a bare `python` is the launching interpreter.
    local_env = {**job_env, 'DMLC_NODE_HOST': root_uri,
                 'PATH': os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')])}
    if launcher == 'local':
        local_env['DMLC_JOB_CLUSTER'] = 'local'   # as MXNet's local launcher sets it (its ssh launcher does not)
    argv = role_argv(command, sys.executable, cwd)
    local = roles(num_workers, num_servers) if launcher == 'local' else roles(0, 0)  # ssh: the scheduler here
    worker_hosts = ([(h.name, h.gpus) for h in placement(hosts, num_servers + num_workers)[num_servers:]]
                    if launcher == 'ssh' else [('localhost', None)] * num_workers)
    gpu_lists = gpus.assign(worker_hosts, gpus_per_worker, gpu_ids) if gpus_per_worker else None
    specs = [RoleSpec(name, 'localhost', argv, role_env(local_env, role, task_id, name, job_dir, env_by_role,
                                                        gpu_lists), None, None)
             for role, task_id, name in local]
    if launcher == 'ssh':
        specs += _ssh_specs(command, hosts, num_workers, num_servers, job_env, cwd, ssh_options, job_dir,
                            env_by_role, server_timeout, gpu_lists)
    return specs, job_env[SECRET_ENV]


def print_plan(specs, secret):
    for s in specs:
        env = ' '.join(f'{k}={shlex.quote(v)}' for k, v in s.env.items())
        print(f'{s.name} on {s.host}: {shlex.join(s.argv)}\n    env: {env}'.replace(secret, '<redacted>'))
