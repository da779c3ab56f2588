#!/usr/bin/env python3
"""Launch an MXNet parameter-server job: python launch/launch.py -n W -s S [options] COMMAND...

Thin wrapper around ssdsgd.launcher.main(); see that module for the options and exit codes.
"""
import os
import sys

# Make `ssdsgd` importable whatever the current directory is.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssdsgd.launcher import main  # noqa: E402  (needs the sys.path entry above)

if __name__ == '__main__':
    main()
