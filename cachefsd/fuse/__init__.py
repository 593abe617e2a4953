"""The FUSE edge: ``lowlevel`` binds libfuse 3's low-level API, ``session``
serves a ``fs.FileSystem`` through it. The only package that loads libfuse."""
