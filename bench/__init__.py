"""Benchmarks and probes, not user tools (those are in scripts/; the namespaces and the virtual cluster they run
on are in testbed/):

  bench_network.py    throughput on bandwidth-limited links, per-host or loopback (-> results/bench_network/)
  bench_step.py       one worker's step time, imperative vs hybridized (-> results/bench_step/)
  bench_host_step.py  a sparse SSD-SGD worker's host work per step
  bench_server.py     the server's CPU time per round (-> results/bench_server/)
  scaling_model.py    a cost model of step time, checked against bench_network's runs (-> results/scaling_model/)
  wire_bytes.py       bytes on the wire of the compressed push path, from the kernel's counters
  probe_2bit.py       MXNet's own 2-bit compression on dist_sync, without ssdsgd

Each runs as a file (`python bench/bench_network.py ...`) or as a module from the checkout's root
(`python -m bench.bench_network ...`); see scripts/__init__.py for how the folders import each other.
"""
