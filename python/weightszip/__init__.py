"""weightszip: bit-exact compression of LLM KV caches, weights and checkpoints.

    >>> import numpy as np, weightszip
    >>> kv = np.random.default_rng(0).standard_normal((256, 192)).astype(np.float16)
    >>> blob = weightszip.compress(kv)
    >>> bool((weightszip.decompress(blob) == kv).all())
    True
"""

from weightszip._core import FORMAT_VERSION
from weightszip._tensors import compress, decompress, info, load_file, save_file, verify
from weightszip import errors
from weightszip.errors import *  # noqa: F403 - the exception classes, listed in errors.__all__
from weightszip.files import compress_file, decompress_file, file_info, verify_file

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "compress",
    "decompress",
    "info",
    "verify",
    "save_file",
    "load_file",
    "compress_file",
    "decompress_file",
    "file_info",
    "verify_file",
    "errors",
    *errors.__all__,
]
