#!/usr/bin/env bash
# Installs the real LMCache (from PyPI) into a separate folder, without letting pip touch the main
# environment's torch / transformers / numpy: LMCache's wheel declares CUDA-only requirements
# (cupy-cuda13x, cuda-python) that a CPU machine neither has nor needs for its serde and
# connector classes and for starting its multi-process server. The tests find the folder through WEIGHTSZIP_LMCACHE_SITE:
#   bash scripts/lmcache_site.sh /tmp/lmcache-site && WEIGHTSZIP_LMCACHE_SITE=/tmp/lmcache-site pytest tests/test_lmcache.py
set -euo pipefail
dest=${1:?usage: scripts/lmcache_site.sh DEST}
python -m pip install -q --no-deps --target "$dest" \
    lmcache==0.5.6 numba==0.68.1 llvmlite==0.50.0 prometheus_client==0.26.0 py-cpuinfo==9.0.0 \
    aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 \
    aiosignal==1.4.0 frozenlist==1.8.0 cachetools==8.0.2 aiofile==3.12.3 caio==0.12.10 \
    msgspec==0.23.0 pyzmq==27.3.0 aiofiles==25.1.0 blake3==1.0.11 opentelemetry-api==1.45.2 \
    opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 httpx==0.28.1
