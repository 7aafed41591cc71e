#!/usr/bin/env bash
# A user's launcher, as many are: activate the project's venv, then run its trainer. Usage:
# bash train.sh VENV SCRIPT ARGS...
set -euo pipefail
venv=$1
shift
# shellcheck disable=SC1091
source "$venv/bin/activate"
echo "wrapper: $(command -v python)"
python "$@"
