"""Spare hosts (the host file's `spare`) and what ssdsgd-run's restart does with a host that does not answer
(ssdsgd/launch/spares.py, probe.py): units, without a cluster. tests/test_cluster.py cuts hosts off for real."""
import subprocess
import sys


from ssdsgd.launch.hosts import Host
from ssdsgd.launch.probe import probe_hosts

H1, H2, H3 = Host('h1'), Host('h2'), Host('h3')
S4, S5 = Host('h4', spare=True), Host('h5', 2222, spare=True, interface='eth1', python='/opt/py/bin/python')


def test_a_probe_that_hangs_is_ended_and_counts_as_no_answer(tmp_path, monkeypatch):
    """ssh that connects and then hangs: ended at the bound, said as no answer (a fake ssh on PATH)."""
    from ssdsgd.launch import probe
    fake = tmp_path / 'ssh'
    fake.write_text(f'#!{sys.executable}\nimport time; time.sleep(60)\n')
    fake.chmod(0o755)
    monkeypatch.setenv('PATH', f'{tmp_path}:' + __import__('os').environ['PATH'])
    monkeypatch.setattr(probe, 'CONNECT_TIMEOUT', 0.5)
    monkeypatch.setattr(probe, 'RUN_GRACE', 0.5)
    assert probe_hosts([H1, H1]) == {H1: 'no answer within 1 s'}
    assert subprocess.run(['pgrep', '-f', str(fake)], capture_output=True).stdout == b''
