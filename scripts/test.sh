#!/usr/bin/env bash
# Installs torch_reccl with its test dependencies and runs the test suite.
# As root on Debian/Ubuntu it also installs the two system packages the tests use
# (nftables: blackholes and lossy NICs; libibverbs-dev: the real verbs backend's
# headers); without root, the tests that need a missing one skip with the reason
# and the install line. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing+=(nftables)
[ -e /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing ${missing[*]} (system packages the tests use)"
        export DEBIAN_FRONTEND=noninteractive
        if timeout 600 apt-get update -qq &&
           timeout 600 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
            # A build made before the verbs headers existed lacks the real verbs backend.
            rm -rf build
        else
            echo "could not install ${missing[*]}: the tests that need them will skip"
        fi
    else
        echo "missing ${missing[*]}: the tests that need them will skip" \
             "(install with: sudo apt-get install ${missing[*]}, then rerun)"
    fi
fi

# torch only where there is none: a torch the user already has stays (a GPU build, say).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# setuptools, wheel and ninja build the native parts (--no-build-isolation uses this
# environment's torch, so the extension matches it); ninja builds in parallel.
python -m pip install -q "setuptools>=64" wheel ninja
python -m pip install -q --no-build-isolation -e '.[test]'
python -m pytest -q -p no:cacheprovider tests "$@"
