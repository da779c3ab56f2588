"""The launcher's argument checks: bad usage is refused before anything starts (exit 2, one line)."""
import re

LIVENESS_INTERVAL = 1.0  # seconds; pyhooks/sitecustomize.py's LIVENESS_INTERVAL (a test keeps them equal)
# ssdsgd.schema's (a test keeps them equal; importing it would bring numpy into the launcher)
MIN_SERVER_TIMEOUT = 3 * LIVENESS_INTERVAL
ENV_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')


class UsageError(Exception):
    """Bad arguments or environment: nothing is started and the exit code is 2."""


def check_job(command, num_workers, num_servers, port, timeout, stall_timeout, server_timeout, env_names):
    """Raise UsageError for the first thing wrong with a job's arguments."""
    if not command:
        raise UsageError('no command given')
    if num_workers < 1 or num_servers < 1:
        raise UsageError(f'need at least 1 worker and 1 server (got -n {num_workers} -s {num_servers})')
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f'port {port} is out of range')
    for label, value in (('--timeout', timeout), ('--stall-timeout', stall_timeout),
                         ('--server-timeout', server_timeout)):
        if value is not None and value <= 0:
            raise UsageError(f'{label} must be > 0')
    if server_timeout is not None and server_timeout < MIN_SERVER_TIMEOUT:
        raise UsageError(f'--server-timeout must be at least {MIN_SERVER_TIMEOUT:g} s (a liveness file is touched '
                         f'every {LIVENESS_INTERVAL:g} s)')
    if server_timeout is not None and stall_timeout is not None and server_timeout >= stall_timeout:
        raise UsageError(f'--server-timeout ({server_timeout:g} s) must be shorter than --stall-timeout '
                         f'({stall_timeout:g} s): a stopped server stalls every worker')
    for key in env_names:
        if not ENV_NAME.fullmatch(key):
            raise UsageError(f'bad environment variable name {key!r}')
