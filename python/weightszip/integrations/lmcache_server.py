"""Run LMCache's multi-process cache server with the ``weightszip`` serde registered:

    python -m weightszip.integrations.lmcache_server [LMCache server arguments]

takes exactly the arguments of ``python -m lmcache.v1.multiprocess.server``; an L2 adapter can
then say ``"serde": {"type": "weightszip"}``. docs/STORE.md gives a whole command that starts it::

    python -m weightszip.integrations.lmcache_server --host 127.0.0.1 --port 5555 \\
        --l1-size-gb 8 --eviction-policy LRU --disable-observability \\
        --l2-adapter '{"type": "fs", "base_path": "/data/kv", "serde": {"type": "weightszip"}}'
"""

import runpy

from weightszip.integrations.lmcache import register

if __name__ == "__main__":
    register()
    runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__", alter_sys=True)
