#!/usr/bin/env bash
# The newest-torch lane: the newest torch release on the registry, against the newest torch
# the project tests (constraints/torch-X.Y.txt). When the registry's is newer, it goes into a
# venv of its own (.venvs/torch-newest), above pyproject's cap, and the suite runs there;
# its result is printed and is this script's exit status. When it is not newer, the script
# says so and succeeds. Run alone: .ci/newest_torch.sh (from anywhere in the checkout).
# Once the suite passes on a new torch X.Y, supporting it is: constraints/torch-X.Y.txt, a
# suite line in .ci/run, and the cap, in one line each of pyproject.toml (torch<X.Y+1) and
# rrfp/_torch_compat.py (SUPPORTED).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

# NEWEST_TORCH_TESTED=X.Y compares against an older tested torch instead (to show the lane
# running where the registry has nothing newer than what the project tests).
tested=${NEWEST_TORCH_TESTED:-$(ls constraints/torch-*.txt | sed 's/.*torch-\(.*\)\.txt/\1/' | sort -V | tail -1)}
# A machine-wide pip constraint may cap torch: the registry's own list is wanted here.
newest=$(PIP_CONSTRAINT=/dev/null "$python" -m pip index versions torch 2>/dev/null \
         | sed -n 's/^torch (\(.*\))$/\1/p')
if [ -z "$newest" ]; then
    echo "== newest torch: the registry could not be read (pip index versions torch); tested up to $tested"
    exit 0
fi
newest_minor=$(echo "$newest" | cut -d. -f1,2)
if [ "$(printf '%s\n%s\n' "$tested" "$newest_minor" | sort -V | tail -1)" = "$tested" ]; then
    echo "== newest torch on the registry is $newest, already tested (constraints/torch-$tested.txt)"
    exit 0
fi

echo "== newest torch on the registry is $newest, newer than the tested $tested: its suite"
venv=.venvs/torch-newest
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --no-cache-dir -c "constraints/torch-$tested.txt" -e ".[test,titan]"
# Above pyproject's cap (pip notes the conflict): what a user who upgrades torch gets.
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q --no-cache-dir "torch==$newest"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 \
    -m "not install and not torch_suite and not job and not four_ranks and not simulator" || status=$?
if [ "$status" = 0 ]; then
    echo "== torch $newest: the suite passes; to support it, add constraints/torch-$newest_minor.txt and raise the cap (see the top of .ci/newest_torch.sh)"
else
    echo "== torch $newest: the suite fails (exit $status): rrfp does not support it yet"
fi
exit "$status"
