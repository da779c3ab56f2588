"""Which GPUs each worker gets: workers that share a host get disjoint ones, handed to each worker as its own
CUDA_VISIBLE_DEVICES (inside which its replicas are gpu(0) ... gpu(D-1), ssdsgd/worker/devices.py).

A host's GPU ids come from its host file line (`gpus=0,1,2,3`, or `gpus=4` for ids 0-3), else from the
job's list (ssdsgd-launch --gpus, the config's cluster.gpus), else 0, 1, 2, ... without a bound (the
worker then finds out whether they exist). The servers and the scheduler see no GPU: an MXNet process
that sees one stages its transfers through pinned memory and opens a CUDA context on GPU 0 for it.
"""
from ssdsgd.launch.usage import UsageError

VISIBLE_ENV = 'CUDA_VISIBLE_DEVICES'


def parse_ids(text, what):
    """'0,1,2,3' -> [0, 1, 2, 3]; a single number N -> [0 .. N-1] (a count) where counts are allowed."""
    items = text.split(',')
    if not all(item.isdigit() for item in items):
        raise UsageError(f'{what}: expected GPU ids such as 0,1,2,3 or a count, got {text!r}')
    ids = [int(item) for item in items]
    if len(items) == 1:
        if ids[0] < 1:
            raise UsageError(f'{what}: a count of GPUs must be at least 1, got {text!r}')
        return list(range(ids[0]))
    if len(set(ids)) != len(ids):
        raise UsageError(f'{what}: GPU ids must be distinct, got {text!r}')
    return ids


def assign(worker_hosts, per_worker, default_ids=None):
    """GPU ids of each worker (in rank order): worker_hosts: (host name, the host's ids or None) per
    worker. Each host's workers take `per_worker` ids in turn; a host whose ids run out is refused by name."""
    taken, lists = {}, []
    for name, ids in worker_hosts:
        ids = ids if ids is not None else default_ids
        start = taken.get(name, 0)
        if ids is None:
            lists.append(list(range(start, start + per_worker)))
        elif start + per_worker > len(ids):
            workers = sum(1 for host, _ in worker_hosts if host == name)
            raise UsageError(f'host {name}: {workers} workers x {per_worker} GPUs each do not fit its '
                             f'{len(ids)} GPUs ({",".join(map(str, ids))})')
        else:
            lists.append(ids[start:start + per_worker])
        taken[name] = start + per_worker
    return lists


def device_env(role, task_id, gpu_lists):
    """The role's CUDA_VISIBLE_DEVICES ({} when the job asks for no GPU)."""
    if gpu_lists is None:
        return {}
    return {VISIBLE_ENV: ','.join(map(str, gpu_lists[task_id])) if role == 'worker' else ''}
