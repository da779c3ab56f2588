"""ssdsgd/launch/remote.py, the wrapper of an ssh job's role on its host: the role never outlives it."""
import os
import signal
import subprocess
import sys
import time

import pytest
from support.jobs import processes_with

from ssdsgd.launch import remote


@pytest.mark.timeout(60)
def test_the_role_dies_with_its_sigkilled_wrapper(tmp_path):
    """Before: a SIGKILLed wrapper (no handler runs) left the role training on unsupervised, and the job
    that then finished was reported lost. Now the kernel ends the role with it (PR_SET_PDEATHSIG)."""
    marker = str(tmp_path)
    env = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", SSDSGD_HOST_INTERFACE="lo")
    wrapper = subprocess.Popen([sys.executable, remote.__file__, sys.executable, "-c",
                                "import time; time.sleep(60)", marker],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    pgid = None
    try:
        words = wrapper.stdout.readline().split()
        assert words[:2] == ["@ssdsgd", "pgid"], words
        pgid = int(words[2])
        assert len(processes_with(marker)) == 2          # the wrapper and the role
        t0 = time.time()
        os.kill(wrapper.pid, signal.SIGKILL)
        wrapper.wait()
        while processes_with(marker) and time.time() - t0 < 5:
            time.sleep(0.05)
        print(f"role gone {time.time() - t0:.2f} s after its wrapper was SIGKILLed")
        assert processes_with(marker) == []
    finally:
        if pgid is not None and processes_with(marker):
            os.killpg(pgid, signal.SIGKILL)
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
