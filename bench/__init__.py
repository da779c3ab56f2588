"""Benchmark and test infrastructure, not user tools (those are in scripts/):

  netns.py            network namespaces with a shaped loopback (root; ip, tc)
  vcluster.py         a virtual cluster: one namespace, link and sshd per host (the multi-host tests)
  procs.py            a job's processes on this machine and their ps-lite roles (the tests, scripts/chaos.py)
  bench_network.py    throughput on bandwidth-limited links, per-host or loopback (-> results/bench_network/)
  bench_step.py       one worker's step time, imperative vs hybridized (-> results/bench_step/)
  bench_host_step.py  a sparse SSD-SGD worker's host work per step
  bench_server.py     the server's CPU time per round (-> results/bench_server/)
  wire_bytes.py       bytes on the wire of the compressed push path, from the kernel's counters
  probe_2bit.py       MXNet's own 2-bit compression on dist_sync, without ssdsgd

Each runs as a file (`python bench/bench_network.py ...`) or as a module from the checkout's root
(`python -m bench.bench_network ...`); see scripts/__init__.py for how the two folders import each other.
"""
