"""The chunk store: the on-disk block format and the directory of blocks."""
