#!/usr/bin/env python3
"""Launch an MXNet parameter-server job: python launch/launch.py -n W -s S [options] COMMAND...

Thin wrapper around ssdsgd.launch.launcher.main() (installed as `ssdsgd-launch` too); see that module for the
options and exit codes. Needs the ssdsgd package installed in this interpreter (`make setup`).
"""
import sys

try:
    from ssdsgd.launch.launcher import main
except ModuleNotFoundError as e:
    if e.name != 'ssdsgd':
        raise
    sys.exit(f'launch.py: the ssdsgd package is not installed for {sys.executable}; run `make setup` '
             '(or `pip install -c constraints.txt -e .`) in the repository')

if __name__ == '__main__':
    main()
