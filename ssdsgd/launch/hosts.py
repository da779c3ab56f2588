"""Where the roles of an ssh job run: host files, host lists, and the placement of roles on hosts."""
import os
import re
from typing import NamedTuple, Optional

from ssdsgd.launch.gpus import parse_ids
from ssdsgd.launch.usage import UsageError

HOST_OPTIONS = ('slots', 'interface', 'python', 'gpus')
SPARE = 'spare'    # a bare word on a host file line: the host gets no role until a restart needs it (spares.py)


class Host(NamedTuple):
    """One host file line: `host[:sshport] [slots=N] [interface=IF] [python=PATH] [gpus=IDS|N] [spare]`."""
    name: str
    port: Optional[int] = None     # None: ssh's default (or the ssh config file's)
    slots: int = 1
    interface: Optional[str] = None
    python: Optional[str] = None
    gpus: Optional[list] = None    # the host's GPU ids for the workers (gpus.py); None: the job's default
    spare: bool = False            # listed as a spare: no role at the start


HOST_LIST = re.compile(r'[A-Za-z0-9_.-]+(:\d+)?(,[A-Za-z0-9_.-]+(:\d+)?)*')


def is_host_list(spec):
    """`h1:2,h2:2` or `h1,h2` (not a file of that name): a bare single name stays a host file's name, so a
    missing file is reported as such."""
    return not os.path.isfile(spec) and bool(HOST_LIST.fullmatch(spec)) and (',' in spec or ':' in spec)


def read_hosts(spec):
    """-H: a host file, or a list as horovodrun and mpirun take it (is_host_list): host:slots,
    comma-separated."""
    if not is_host_list(spec):
        return read_hostfile(spec)
    hosts = []
    for item in spec.split(','):
        name, _, slots = item.partition(':')
        if slots and int(slots) < 1:
            raise UsageError(f'-H {spec}: {item} has no slots (host:N takes N >= 1)')
        hosts.append(Host(name, slots=int(slots) if slots else 1))
    return hosts


def read_hostfile(path):
    """Return [Host] from a host file; '#' starts a comment. `slots=N` is the MPI-style count of
    processes the host takes before the next host gets one (default 1); `spare` marks a host that gets no
    role at the start and takes a lost host's roles at a restart (spares.py)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f'cannot read hostfile {path}: {e.strerror}') from None
    hosts = [_host_line(line, path) for line in (raw.split('#', 1)[0].strip() for raw in text.splitlines()) if line]
    if not hosts:
        raise UsageError(f'hostfile {path} lists no hosts')
    if all(h.spare for h in hosts):
        raise UsageError(f'hostfile {path} lists only spare hosts: the roles need at least one host without `spare`')
    used = {(h.name, h.port) for h in hosts if not h.spare}
    both = next((h for h in hosts if h.spare and (h.name, h.port) in used), None)
    if both:
        raise UsageError(f'hostfile {path} lists {both.name} both with roles and as a spare (a spare stands in for '
                         f'another host)')
    return hosts


def _host_line(line, path):
    first, *options = line.split()
    name, sep, port = first.partition(':')
    if not name or (sep and not port.isdigit()) or '=' in first:
        raise UsageError(f'bad host in hostfile {path}: {line!r} (expected host or host:sshport first)')
    fields = {}
    for opt in options:
        key, eq, value = opt.partition('=')
        if opt == SPARE:
            fields[SPARE] = True
            continue
        if not eq or key not in HOST_OPTIONS or not value:
            raise UsageError(f'bad option {opt!r} in hostfile {path} (known: slots=N, interface=IF, python=PATH, '
                             f'gpus=IDS or gpus=N, spare)')
        fields[key] = value
    if fields.get(SPARE) and 'slots' in fields:
        # A spare takes over a lost host's roles, as many as that host had: its own count would mean nothing.
        raise UsageError(f'bad spare in hostfile {path}: {line!r} (a spare takes the slots of the host it replaces; '
                         f'drop slots=)')
    if 'slots' in fields:
        if not fields['slots'].isdigit() or int(fields['slots']) < 1:
            raise UsageError(f'bad slots in hostfile {path}: {line!r} (a positive integer)')
        fields['slots'] = int(fields['slots'])
    if 'gpus' in fields:
        fields['gpus'] = parse_ids(fields['gpus'], f'gpus in hostfile {path}, line {line!r}')
    if 'python' in fields and not os.path.isabs(fields['python']):
        # A bare name would put '' (the working directory) first on the role's PATH (ssh.role_script).
        raise UsageError(f'bad python in hostfile {path}: {line!r} (an absolute path, e.g. /opt/venv/bin/python)')
    return Host(name, int(port) if sep else None, **fields)


def placement(hosts, count):
    """Host of each of `count` processes: round robin over the hosts that are no spares, each taking `slots`
    in a row."""
    cycle = [h for h in hosts if not h.spare for _ in range(h.slots)]
    return [cycle[i % len(cycle)] for i in range(count)]
