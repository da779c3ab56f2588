"""Every node proves it belongs to the job (ssdsgd.ps.membership): a stranger that joins is named at once."""
import time

import numpy as np
import pytest

from ssdsgd.ps import membership


def _wait(what, condition, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            found = condition()
        except OSError:
            found = None      # a process just ended or closed a socket: look again
        if found:
            return found
        time.sleep(0.005)
    pytest.fail(f"timed out waiting for {what}")


LISTEN = ("0A", "0.0.0.0:9000", "0.0.0.0:0")
SELF = [("01", "127.0.0.1:41000", "127.0.0.1:9000"), ("01", "127.0.0.1:9000", "127.0.0.1:41000")]


def test_connected_from_lists_accepted_connections_but_not_our_own():
    sockets = [LISTEN, *SELF, ("01", "10.0.0.5:9000", "10.0.0.1:5000"), ("01", "10.0.0.5:9000", "10.0.0.7:6000"),
               ("01", "10.0.0.5:7000", "10.0.0.9:9100"),           # one we opened ourselves
               ("06", "10.0.0.5:9000", "10.0.0.8:6100")]            # not established
    assert membership.connected_from(sockets) == ["10.0.0.1:5000", "10.0.0.7:6000"]


def test_roll_call_starts_its_clock_when_every_rank_has_connected(monkeypatch):
    """The scheduler and each of the 2 worker ranks connected: the clock starts before any hello; the
    message names the missing rank and the host of the connection no hello lists, not the scheduler's."""
    monkeypatch.setenv("DMLC_NUM_WORKER", "2")
    monkeypatch.setenv("DMLC_PS_ROOT_URI", "10.0.0.1")
    rows = [LISTEN, *SELF, ("01", "10.0.0.5:9000", "10.0.0.1:5000")]
    roll = membership.RollCall("s" * 64, sockets=lambda: list(rows))
    monkeypatch.setattr(membership, "HELLO_TIMEOUT", 3600.0)       # the deadline itself would end the process
    roll.watch()
    time.sleep(0.3)
    assert not roll.started.is_set()                      # only the scheduler so far
    rows += [("01", "10.0.0.5:9000", "10.0.0.2:5100"), ("01", "10.0.0.5:9000", "10.0.0.3:5200")]
    _wait("the clock to start", roll.started.is_set, timeout=10)
    roll.hello({"rank": 1, "nonce": "n", "addresses": ["10.0.0.2:5100", "10.0.0.2:5101"]}, 0)
    msg = roll.missing()
    assert msg.startswith("worker rank 0 has not proven that it belongs to the job"), msg
    assert "(connected to this server from 10.0.0.3)" in msg and "10.0.0.1" not in msg and "10.0.0.2" not in msg
    roll.hello({"rank": 0, "nonce": "m", "addresses": ["10.0.0.3:5200"]}, 0)
    assert roll.complete.is_set()

    class Stored(np.ndarray):                             # the proof key's array, as the updater gets it
        def wait_to_read(self):
            pass
    stored = np.zeros(2 * membership.TAG_PIECES, np.float32).view(Stored)
    roll.answer(stored)
    assert np.array_equal(stored[membership.TAG_PIECES:], membership.tag("s" * 64, 0, 1, "n"))
    assert np.array_equal(stored[:membership.TAG_PIECES], membership.tag("s" * 64, 0, 0, "m"))


def test_tags_depend_on_secret_server_worker_and_nonce():
    base = membership.tag("s" * 64, 0, 1, "n")
    assert base.dtype == np.float32 and base.shape == (membership.TAG_PIECES,)
    assert np.array_equal(base, base.astype(np.uint16).astype(np.float32))     # exact in float32
    for other in (membership.tag("t" * 64, 0, 1, "n"), membership.tag("s" * 64, 1, 1, "n"),
                  membership.tag("s" * 64, 0, 0, "n"), membership.tag("s" * 64, 0, 1, "m")):
        assert not np.array_equal(base, other)


def test_proof_keys_land_on_their_servers():
    from ssdsgd.ps.keys import KEY_HASH
    for servers in (1, 2, 3):
        keys = membership.proof_keys(servers)
        assert [(k * KEY_HASH) % servers for k in keys] == list(range(servers))
        assert min(keys) > (1 << 20) + 3          # above the probe and tally keys
