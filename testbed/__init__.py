"""The test bed the tests, the benchmarks and the tools share (imports only the standard library and itself):

  netns.py     network namespaces with a shaped loopback (root; ip, tc): bench/, scripts/time_to_accuracy.py
  vcluster.py  a virtual cluster: one namespace, link and sshd per host (the multi-host tests, bench/,
               scripts/chaos.py --cluster)
  procs.py     a job's processes on this machine and their ps-lite roles (the tests, scripts/chaos.py)

It is a package of its own, beside tests/, because the tools import it too: tests import bench/, scripts/
and testbed/; bench/ imports scripts/ and testbed/; scripts/ imports testbed/; testbed/ imports none of
them (tests/unit/test_code_shape.py checks it).
"""
