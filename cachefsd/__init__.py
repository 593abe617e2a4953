"""cachefsd: a read-only FUSE view of a bucket that keeps training data on local disk."""

__version__ = "0.1.0"
