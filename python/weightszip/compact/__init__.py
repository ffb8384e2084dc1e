"""Compact KV formats q4, q3.5 and q3: calibrated, rotated, non-uniform 2-5 bit codes.

``codec`` is the reference codec (the bytes of a page, bit for bit what the GPU kernels write and
read), ``calibrate`` derives a model's tables from text, ``formats`` plugs them into the
evaluation harness (``weightszip eval kl --format q3 --calibration M.wzcal``).
"""

from weightszip.compact.calibrate import Calibration, CalibrationError
from weightszip.compact.codec import CompactCodecError, HeadTables

__all__ = ["Calibration", "CalibrationError", "CompactCodecError", "HeadTables"]
