"""User tools: what a user of ssdsgd runs -- the demo (`make demo`), the paper comparison (reproduce.py and
the reproduce_*.sh wrappers), accuracy and time-to-accuracy tables over seeds, plots, the side-by-side
table of finished runs (compare.py), the chaos run, and docs/config.md from the schema (gen_config_doc.py).
results_io.py is their shared home for results folders: job commands, CSV and table files, manifests.

The benchmarks and probes are the `bench` package beside this one; the network namespaces, the virtual
cluster and the job-process lookup the tests, benchmarks and tools share are the `testbed` package. The
imports run one way: bench/ uses results_io.py (and gpu_check.py's timer), a tool never imports bench/, and
testbed/ imports neither (tests/unit/test_code_shape.py checks it).

Each tool runs as a file (`python scripts/accuracy.py ...`, from the checkout's root as the README shows).
Python then puts only this folder on sys.path, so each tool first adds the checkout's root, and imports
its siblings as `scripts.x`, the test bed as `testbed.x`, and ssdsgd from the same checkout. The
tests import them the same way (pytest.ini puts the root on the path).
"""
