#!/bin/bash
# A launcher command given as a script in the working directory (`launch.py -n 1 -s 1 runme.sh`).
exec python "$(dirname "$0")/role_env.py"
