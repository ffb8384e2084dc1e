#!/usr/bin/env bash
# Installs the real SGLang (from PyPI) into a separate folder, without letting pip touch the main
# environment's torch / transformers: only what importing its HiCache storage classes needs on a
# CPU machine. The tests find the folder through WEIGHTSZIP_SGLANG_SITE.
set -euo pipefail
dest=${1:?usage: scripts/sglang_site.sh DEST}
python -m pip install -q --no-deps --target "$dest" \
    sglang==0.5.23 pybase64==1.5.1 starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0 aiohttp==3.14.5 \
    multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 \
    frozenlist==1.8.0
