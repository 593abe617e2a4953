"""The FUSE edge: ``protocol`` lays out the kernel's messages, ``device``
mounts and registers backing files, ``passthrough`` decides which opens the
kernel serves itself, and ``session`` answers a mount's requests with a
``fs.FileSystem``. No libfuse: the protocol is spoken on /dev/fuse."""
