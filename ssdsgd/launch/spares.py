"""Spare hosts and lost hosts across ssdsgd-run's restarts (cluster.max_restarts).

The host file's `spare` lines get no role at the start. Before each restart (and, when the host file lists
spares, before the first launch) every host that holds roles is probed (probe.py: a bounded `ssh HOST true`). A
host that does not answer is left out for the rest of the run: the first spare that answers takes its place in
the host list, with its slots, so that it gets exactly the roles the lost host had, and the job resumes from the
newest checkpoint. With no spare left, the restart waits for the lost host, probing it every PROBE_EVERY
seconds, at most cluster.host_wait seconds, then gives up; the first launch does not wait (the launcher then
names the host it cannot reach, as without spares). Each step is said on stderr, which ssdsgd-run also writes to
the run folder's launcher.log.

The checkpoint ties no state to a host (worker<rank>.npz, server-buffer<b>.npz: by rank and buffer), so a
resume on other hosts continues the run exactly.
"""
import signal
import sys
import time

from ssdsgd.launch.hosts import placement, read_hosts
from ssdsgd.launch.plan import roles
from ssdsgd.launch.probe import probe_hosts
from ssdsgd.launch.ssh import ssh_options
from ssdsgd.launch.stoppable import stops_caught, wait_unless_stopped
from ssdsgd.launch.usage import UsageError

PROBE_EVERY = 5.0   # seconds between two probes of a lost host while a restart waits for it


def say(text):
    print(f'run: {text}', file=sys.stderr, flush=True)


def roles_by_host(hosts, num_workers, num_servers):
    """{host name: [role names]} of the hosts that hold roles, in the order the roles start."""
    remote = roles(num_workers, num_servers)[1:]
    held = {}
    for (_, _, name), host in zip(remote, placement(hosts, len(remote))):
        held.setdefault(host.name, []).append(name)
    return held


def swap(hosts, lost, spare):
    """The host list with `spare` in every place of `lost` (a host's name and port), taking its slots; the
    spare's own line leaves the list. Every other host keeps its place, so every other role its host."""
    def same(a, b):
        return (a.name, a.port) == (b.name, b.port)
    return [spare._replace(slots=h.slots, spare=False) if same(h, lost) else h
            for h in hosts if not (h.spare and same(h, spare))]


class HostPool:
    """The hosts of an ssh job across its restarts: `hosts` (host file order, spares marked) is what each
    launch places its roles on. probe: probe.probe_hosts or a stand-in ({host: why} of those not answering);
    wait: stoppable.wait_unless_stopped or a stand-in."""

    def __init__(self, hosts, num_workers, num_servers, host_wait, probe, wait=wait_unless_stopped,
                 clock=time.monotonic):
        self.hosts, self.num_workers, self.num_servers = list(hosts), num_workers, num_servers
        self.host_wait, self.probe, self.wait, self.clock = host_wait, probe, wait, clock
        self.left_out = []   # hosts left out so far, never used again in this run

    @classmethod
    def of(cls, cfg):
        """The pool of an ssh job that may restart or lists spares, else None (a host file that cannot be read
        now: None, and the launch says why)."""
        cl = cfg.cluster
        if cl.launcher != 'ssh':
            return None
        try:
            hosts = read_hosts(cl.hostfile)
        except UsageError:
            return None
        if not cl.max_restarts and not any(h.spare for h in hosts):
            return None
        options = ssh_options(cl.ssh_user, cl.ssh_identity, cl.ssh_config, cl.ssh_options)
        return cls(hosts, cl.workers, cl.servers, cl.host_wait, lambda hosts: probe_hosts(hosts, options))

    def holding_roles(self):
        held = roles_by_host(self.hosts, self.num_workers, self.num_servers)
        return [h for h in dict.fromkeys(h for h in self.hosts if not h.spare) if h.name in held], held

    def before_start(self):
        """With spares left: probe the hosts that hold roles before the first launch and give the roles of one
        that does not answer to a spare, without waiting. None, or the exit code of a stop."""
        return self._guarded('at the start', 'started', False) if any(h.spare for h in self.hosts) else None

    def before_restart(self, restart):
        """Probe the hosts that hold roles; give each one that does not answer's roles to a spare, or wait
        for it. None when the restart may go ahead, else the exit code (a stop: 128 + signal, 130 for Ctrl-C;
        a host that stays lost: 1)."""
        return self._guarded(f'before restart {restart}', 'restarted', True)

    def _guarded(self, when, not_what, wait):
        """_place with SIGTERM and SIGHUP caught throughout (a probe takes seconds), Ctrl-C a stop too."""
        try:
            with stops_caught() as received:
                return self._place(when, not_what, wait, received)
        except KeyboardInterrupt:
            say(f'stopped {when}; not {not_what}')
            return 130

    def _place(self, when, not_what, wait, received):
        busy, held = self.holding_roles()
        lost = self.probe(busy)
        for host in busy:
            if host in lost:
                say(f'{host.name} ({", ".join(held[host.name])}) does not answer {when}: {lost[host]}')
        waiting = []
        for host in [h for h in busy if h in lost]:
            if received:
                break
            if not self._replace(host, held[host.name]):
                waiting.append(host)
        if received:
            say(f'received {signal.Signals(received[0]).name} {when}; not {not_what}')
            return 128 + received[0]
        if waiting and not wait:
            say(f'no spare left for {", ".join(h.name for h in waiting)}; the job starts on the hosts as they are')
            return None
        return self._wait_for(waiting, received) if waiting else None

    def _replace(self, host, names):
        """Give `host`'s roles to the first spare that answers; False if none is left."""
        while True:
            spares = [h for h in self.hosts if h.spare]
            if not spares:
                return False
            spare = spares[0]
            why = self.probe([spare]).get(spare)
            self.hosts = swap(self.hosts, host, spare) if why is None else [h for h in self.hosts if h != spare]
            if why is None:
                self.left_out.append(host)
                say(f'spare {spare.name} takes over {", ".join(names)} from {host.name}; {host.name} is left out of '
                    f'this run')
                return True
            say(f'spare {spare.name} does not answer either ({why}); it is left out of this run')

    def _wait_for(self, waiting, received):
        """Probe the `waiting` hosts every PROBE_EVERY s until all answer (None), cluster.host_wait runs out (1)
        or a stop (130, 128 + signal; `received`: the signals caught around it)."""
        names = ", ".join(h.name for h in waiting)
        if not self.host_wait:
            say(f'no spare left for {names}, and cluster.host_wait is 0; not restarted')
            return 1
        them = 'it' if len(waiting) == 1 else 'them'
        say(f'no spare left for {names}: waiting up to {self.host_wait:g} s for {them} (cluster.host_wait), '
            f'probing every {PROBE_EVERY:g} s')   # SIGTERM and SIGHUP are caught already (_guarded)
        start = self.clock()
        while waiting:
            if self.clock() - start >= self.host_wait:
                say(f'{names} did not answer within {self.host_wait:g} s (cluster.host_wait); not restarted')
                return 1
            try:   # a signal in the wait ends it (its own handlers); one in a probe is in `received`
                signum = self.wait(min(PROBE_EVERY, self.host_wait - (self.clock() - start)))
                if signum is None:
                    lost = self.probe(waiting)
                    signum = received[0] if received else None
            except KeyboardInterrupt:
                say(f'stopped while waiting for {names}; not restarted')
                return 130
            if signum is not None:
                say(f'received {signal.Signals(signum).name} while waiting for {names}; not restarted')
                return 128 + signum
            for host in [h for h in waiting if h not in lost]:
                say(f'{host.name} answers again after {self.clock() - start:.0f} s')
            waiting = [h for h in waiting if h in lost]
            names = ", ".join(h.name for h in waiting)
        return None
