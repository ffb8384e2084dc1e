"""Typed errors: every failure of the codec raises a subclass of `WeightszipError`.

    WeightszipError
    ├── BadMagicError            not a weightszip container
    ├── UnsupportedVersionError  a format version this build cannot read
    │   └── UnsupportedFeatureError  a dtype / profile / mode this version does not define
    ├── CorruptDataError         structure or payload is damaged
    │   ├── TruncatedError       the input ends early
    │   └── ChecksumMismatchError
    ├── LimitExceededError       a declared size exceeds a hard limit
    ├── InvalidArgumentError     the call's arguments are not usable
    │   └── BufferTooSmallError
    └── WeightszipIOError        reading or writing a file failed
        └── OutputExistsError    the output exists and was not to be overwritten (overwrite=False)

The compact formats' own errors derive from it too (and from ValueError, as they always have):
`weightszip.compact.codec.CompactCodecError` (inputs the compact codec cannot encode or decode)
and `weightszip.compact.calibrate.CalibrationError` (a calibration file that is not one, or does
not fit the model). `weightszip.hf.UnsupportedCacheOperationError` (an operation the transformers
cache does not support, such as beam search) is an `InvalidArgumentError` and a
NotImplementedError.
"""

from weightszip._core import (
    BadMagicError,
    BufferTooSmallError,
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    OutputExistsError,
    TruncatedError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
    WeightszipError,
    WeightszipIOError,
)

__all__ = [
    "WeightszipError",
    "BadMagicError",
    "UnsupportedVersionError",
    "UnsupportedFeatureError",
    "CorruptDataError",
    "TruncatedError",
    "ChecksumMismatchError",
    "LimitExceededError",
    "InvalidArgumentError",
    "BufferTooSmallError",
    "WeightszipIOError",
    "OutputExistsError",
]
