"""`python -m ssdsgd`: the same as `ssdsgd-run` (ssdsgd/launch/run.py)."""
import sys

from ssdsgd.launch.run import main

if __name__ == "__main__":
    sys.exit(main())
