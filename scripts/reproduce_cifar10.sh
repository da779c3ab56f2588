#!/usr/bin/env bash
# cifar10 runs of the paper comparison; see scripts/reproduce.sh for arguments and outputs.
exec "$(dirname "$0")/reproduce.sh" cifar10 "$@"
