"""Worker -> server commands: JSON data signed with an HMAC of the per-job secret.

The launcher generates the secret for each job and hands it to every role in SSDSGD_JOB_SECRET.
A command is `SSDSGD1:<hex hmac-sha256>:<json>`; the server verifies the MAC before parsing the
JSON and never unpickles anything, so a process that merely reaches a server port cannot make it
run code (MXNet's stock server unpickles every command body it gets).

The signed JSON also names its sender (a random id per process) and a sequence number that grows with
each command the sender signs. A server accepts a sender's commands only in increasing order, so a command
captured on the (unauthenticated) data plane and sent again is refused, not run twice (a SAVE or a LOAD
replayed later would overwrite a checkpoint or roll the servers back).
"""
import hashlib
import hmac
import itertools
import json
import os
import secrets

from ssdsgd.env import NUM_SERVER_ENV, SECRET_ENV

PREFIX = "SSDSGD1:"
# The commands (the "op" of a message) and their fields; ssdsgd.ps.server handles each.
STOCK_OPTIMIZER = "stock_optimizer"    # lr, momentum, wd, rescale_grad, schedule: MXNet's SGD for the stock path
ROUND_PLAN = "round_plan"              # the buffers and global hyper-parameters of the round service
SAVE = "save"                          # dir: write the servers' state into this checkpoint folder
LOAD = "load"                          # dir: read it back
HELLO = "hello"                        # rank, nonce: a worker's roll call (ssdsgd.ps.membership)


SENDER, SEQUENCE = "sender", "seq"           # the fields sign() adds and verify() checks and removes
_SENDER_ID = secrets.token_hex(8)            # this process's, for the servers' replay check
_sequence = itertools.count(1)


class CommandError(ValueError):
    pass


def _secret_bytes(secret):
    if not secret:
        raise CommandError("no job secret (SSDSGD_JOB_SECRET is unset); start jobs with launch/launch.py")
    return secret.encode()


def sign(msg, secret=None):
    secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
    body = json.dumps(dict(msg, **{SENDER: _SENDER_ID, SEQUENCE: next(_sequence)}), separators=(",", ":"),
                      sort_keys=True)
    mac = hmac.new(_secret_bytes(secret), body.encode(), hashlib.sha256).hexdigest()
    return f"{PREFIX}{mac}:{body}"


def verify(raw, secret, seen=None):
    """Return the command dict (without its sender and sequence number), or raise CommandError without
    interpreting the payload. seen: {sender: the last sequence number accepted}, a server's, updated here:
    a command whose number is not above its sender's last is a replay, refused."""
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
    sender, number = msg.pop(SENDER, None), msg.pop(SEQUENCE, None)
    if not isinstance(sender, str) or not isinstance(number, int):
        raise CommandError("command has no sender and sequence number")
    if seen is not None:
        if number <= seen.get(sender, 0):
            raise CommandError(f"replayed command (number {number} of sender {sender} came before; the last "
                               f"taken was {seen[sender]})")
        seen[sender] = number
    return msg


def send(kv, op, **fields):
    """Run command `op` with `fields` on every server; returns once all of them have handled it."""
    kv._send_command_to_servers(0, sign(dict(fields, op=op)))


def num_servers(kv):
    """MXNet's Python KVStore has no num_servers; ps-lite takes it from the environment."""
    return int(os.environ.get(NUM_SERVER_ENV, "1"))
