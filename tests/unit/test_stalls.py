"""A stalled job names the worker that stalled it, and says what a waiting worker waited for."""



def test_a_stall_on_hosts_points_at_the_network():
    """Every ssh role still running and none stopped: the message says to check the links (a link that
    drops large packets stalls a job just so), naming the silent worker's host."""
    from ssdsgd.launch.watch import stalled_culprit

    class Worker:
        def __init__(self, host, idle):
            self.ssh, self.host, self.idle = True, host, idle
            self.popen = type("P", (), {"returncode": None})()

        def idle_seconds(self):
            return self.idle
    quiet = Worker("h3", 40.0)
    culprit, why = stalled_culprit([Worker("h2", 31.0), quiet])
    assert culprit is quiet
    assert "check the network between the hosts" in why and "ping -M do -s 1472 h3" in why
