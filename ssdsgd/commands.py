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

PREFIX = "SSDSGD1:"


class CommandError(ValueError):
    pass


def _secret_bytes(secret):
    if not secret:
        raise CommandError("no job secret (SSDSGD_JOB_SECRET is unset); start jobs with launch/launch.py")
    return secret.encode()


def sign(msg, secret=None):
    secret = os.environ.get("SSDSGD_JOB_SECRET", "") if secret is None else secret
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


def send(kv, msg):
    """Run `msg` on every server; returns once all of them have handled it."""
    kv._send_command_to_servers(0, sign(msg))


def num_servers(kv):
    """MXNet's Python KVStore has no num_servers; ps-lite takes it from the environment."""
    return int(os.environ.get("DMLC_NUM_SERVER", "1"))
