"""Who connected to the scheduler during start-up: a process that is not one of the job's roles, named when
ps-lite's scheduler aborts because of it.

ps-lite ranks the first W+S nodes that register with the scheduler, whatever their roles. A stranger that
registers before the job's own (anyone who reaches the scheduler's port with the job's DMLC_* settings) can
leave the servers no place: the scheduler then aborts in van.cc (`there is no socket to node 8`, SIGABRT), and
ps-lite says nothing of who registered. ps-lite cannot be told to refuse it (its transport is unauthenticated),
so the launcher names it instead. While the job starts (until a worker's first step) it reads this machine's
TCP table (/proc/net/tcp, or tcp6 for an IPv6 scheduler; the scheduler runs here) every LOOK_SECONDS: the
connections to the scheduler's port, and, when one is new, the process that holds its other end if that is on
this machine too. A connection from a process outside the job's process groups, or from a host that runs none of
the job's roles, is a stranger's.
Standard library only (the launcher imports no mxnet nor numpy).
"""
import os
import socket

ABORT_MARK = 'there is no socket to node'   # ps-lite's scheduler, when a node it ranked has no connection
ESTABLISHED = '01'                          # a socket's state in /proc/net/tcp
PRIVATE_NETWORK = "keep the job's ports on a private network (README: A private network)"
# A stranger's connection stays open until the scheduler aborts, so a look this often still sees it. Each
# look reads a table the kernel builds by walking its whole socket hash, empty buckets too: a cost in
# system time that does not shrink with the number of sockets.
LOOK_SECONDS = 0.5
TABLES = {socket.AF_INET: '/proc/net/tcp', socket.AF_INET6: '/proc/net/tcp6'}


def _address(hex_address):
    """'0100007F:1F90' (/proc/net/tcp) -> ('127.0.0.1', 8080); IPv4 mapped into IPv6 as IPv4."""
    host, port = hex_address.split(':')
    raw = b''.join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    if len(raw) == 16 and raw[:12] == b'\0' * 10 + b'\xff' * 2:
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def tcp_rows(port, tables=tuple(TABLES.values())):
    """((local ip, port), (remote ip, port), inode) of the established TCP sockets of this network
    namespace with `port` at one end. The port is matched on the table's text before any address is parsed:
    on a busy machine the table holds hundreds of sockets."""
    end = f':{port:04X}'
    rows = []
    for table in tables:
        try:
            with open(table) as f:
                lines = list(f)[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == ESTABLISHED and (cols[1].endswith(end) or cols[2].endswith(end)):
                rows.append((_address(cols[1]), _address(cols[2]), cols[9]))
    return rows


def socket_owners(inodes):
    """{socket inode: pid} for the inodes given, from /proc/<pid>/fd (the processes this user may read)."""
    owners = {}
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            for fd in os.listdir(f'/proc/{pid}/fd'):
                link = os.readlink(f'/proc/{pid}/fd/{fd}')
                if link.startswith('socket:[') and link[8:-1] in inodes:
                    owners[link[8:-1]] = int(pid)
        except OSError:
            continue
    return owners


def _tables(ip):
    """The TCP tables that hold connections to a scheduler listening on `ip`: the one of its address family
    (ps-lite listens on the address it is given), both for a host name or no address."""
    for family, table in TABLES.items():
        try:
            socket.inet_pton(family, ip or '')
            return (table,)
        except OSError:
            continue
    return tuple(TABLES.values())


def _group(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return int(f.read().rsplit(')', 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _command(pid):
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            words = f.read().split(b'\0')
    except OSError:
        return '?'
    text = ' '.join(' '.join(w.decode(errors='replace') for w in words if w).split())   # one line
    return text if len(text) <= 60 else text[:57] + '...'


class Roll:
    """The connections seen to the scheduler's `port` on this machine while the job starts."""

    def __init__(self, port, ip=None):
        self.port, self.ip = port, ip
        self.tables = _tables(ip)
        self.next_look = 0.0
        self.local = {}      # peer (ip, port) -> (pid, pgid, command) of a process on this machine, or None
        self.remote = set()  # peer (ip, port) seen only from the scheduler's side: another host

    def look(self, now=None):
        """Read the TCP table, unless the last look was less than LOOK_SECONDS before `now` (monotonic)."""
        if now is not None:
            if now < self.next_look:
                return
            self.next_look = now + LOOK_SECONDS
        rows = tcp_rows(self.port, self.tables)
        ours = {local: inode for local, remote, inode in rows
                if remote[1] == self.port and (self.ip is None or remote[0] == self.ip) and local not in self.local}
        if ours:
            owners = socket_owners(set(ours.values()))
            for peer, inode in ours.items():
                pid = owners.get(inode)
                self.local[peer] = (pid, _group(pid), _command(pid)) if pid else None
        for local, remote, _ in rows:
            if local[1] == self.port and (self.ip is None or local[0] == self.ip) and remote not in self.local:
                self.remote.add(remote)

    def strangers(self, job_groups, job_hosts):
        """What no role of the job accounts for: ['127.0.0.1 (PID 123: python -c ...)', 'host 10.0.0.9']."""
        found = []
        for (ip, port), owner in sorted(self.local.items(), key=lambda item: str(item[0])):
            if owner is not None and owner[1] not in job_groups:
                found.append(f'{ip} (PID {owner[0]}: {owner[2]})')
        for ip in sorted({ip for ip, _ in self.remote} - set(job_hosts)):
            found.append(f'host {ip}')
        return found


def abort_note(child, roll, job_groups, job_hosts, workers, servers):
    """The one line to say when the scheduler `child` failed because a stranger registered (its last output
    has ps-lite's ABORT_MARK, or a stranger was seen), else None."""
    if child.name != 'scheduler':
        return None
    found = roll.strangers(job_groups, job_hosts) if roll is not None else []
    aborted = any(ABORT_MARK in line for line in child.tail)
    if not (found or aborted):
        return None
    where = (f"from {', '.join(found)}" if found else
             'from an address not seen here (it connected and left between two looks, or from a host of the job)')
    return (f"launch: scheduler aborted in ps-lite's start-up: a process that is not one of the job's roles "
            f"connected to the scheduler (port {roll.port if roll else '?'}) {where}, and ps-lite gave it the place "
            f"of one of the job's {workers} workers and {servers} servers; {PRIVATE_NETWORK}")
