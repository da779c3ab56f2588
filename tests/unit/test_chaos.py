"""scripts/chaos.py, short: faults into a strict job with cluster.max_restarts; it must end with the
uninterrupted run's weights bit for bit, every step once in the metrics, nothing left. On loopback one
SIGKILL of a random role; on the virtual cluster (--launcher ssh) one SIGKILL and one host's link taken
down until the launcher gives the job up. (The full runs, 10 faults each, are results/chaos and
results/chaos_cluster.)"""



def test_the_launchers_pause_notes_are_not_taken_for_its_report_of_a_failure():
    """chaos.py's `cut` puts the link back once the launcher reports the job failed: a pause note (said after
    5 s without a step) is no such report; taken for one, the link came back after 5 s and the job rode it
    out ("the job finished while waiting for restart")."""
    from scripts.chaos import launcher_reported
    assert not launcher_reported(["[worker 0] step 3", "launch: 10:00:13 no worker has made a step for 5 s "
                                                       "(stall timeout 30 s)\n"])
    assert launcher_reported(["launch: 10:00:13 no worker has made a step for 5 s\n",
                              "launch: server 0 lost: ssh to h1 exited with code 255 before the role reported its "
                              "end\n"])
