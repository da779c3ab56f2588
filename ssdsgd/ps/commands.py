"""Worker -> server commands: JSON data signed with an HMAC of the per-job secret.

The launcher generates the secret for each job and hands it to every role in SSDSGD_JOB_SECRET.
A command is `SSDSGD1:<hex hmac-sha256>:<json>`; the server verifies the MAC before parsing the
JSON and never unpickles anything, so a process that merely reaches a server port cannot make it
run code (MXNet's stock server unpickles every command body it gets).
"""
import hashlib
import hmac
import json
import os

from ssdsgd.env import NUM_SERVER_ENV, SECRET_ENV

PREFIX = "SSDSGD1:"
# The commands (the "op" of a message) and their fields; ssdsgd.ps.server handles each.
STOCK_OPTIMIZER = "stock_optimizer"    # lr, momentum, wd, rescale_grad, schedule: MXNet's SGD for the stock path
ROUND_PLAN = "round_plan"              # the buffers and global hyper-parameters of the round service
SAVE = "save"                          # dir: write the servers' state into this checkpoint folder
LOAD = "load"                          # dir: read it back
HELLO = "hello"                        # rank, nonce: a worker's roll call (ssdsgd.ps.membership)


class CommandError(ValueError):
    pass


def _secret_bytes(secret):
    if not secret:
        raise CommandError("no job secret (SSDSGD_JOB_SECRET is unset); start jobs with launch/launch.py")
    return secret.encode()


def sign(msg, secret=None):
    secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
    body = json.dumps(msg, separators=(",", ":"), sort_keys=True)
    mac = hmac.new(_secret_bytes(secret), body.encode(), hashlib.sha256).hexdigest()
    return f"{PREFIX}{mac}:{body}"


def verify(raw, secret):
    """Return the command dict, or raise CommandError without interpreting the payload."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if not text.startswith(PREFIX):
        raise CommandError("not an ssdsgd command (unsigned; possibly a pickled optimizer)")
    mac, sep, body = text[len(PREFIX):].partition(":")
    if not sep:
        raise CommandError("malformed command")
    want = hmac.new(_secret_bytes(secret), body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac.encode("utf-8", "replace"), want.encode()):
        raise CommandError("bad signature")
    msg = json.loads(body)
    if not isinstance(msg, dict) or "op" not in msg:
        raise CommandError("command has no op")
    return msg


def send(kv, op, **fields):
    """Run command `op` with `fields` on every server; returns once all of them have handled it."""
    kv._send_command_to_servers(0, sign(dict(fields, op=op)))


def num_servers(kv):
    """MXNet's Python KVStore has no num_servers; ps-lite takes it from the environment."""
    return int(os.environ.get(NUM_SERVER_ENV, "1"))
