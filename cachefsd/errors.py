"""The error tree, and the one table that maps it to errno.

Errors are translated twice and only twice: backend codes into this tree at
the store edge (keeping the cause as ``__cause__``), and this tree into an
errno at the FUSE edge (``errno_for``). Everything in between raises and
catches these types only.
"""

from __future__ import annotations

import errno


class CachefsdError(Exception):
    """Base of every error cachefsd raises on purpose."""


class ConfigError(CachefsdError):
    """The configuration is invalid; the message names the field."""


class StoreError(CachefsdError):
    """The cold store failed. Retryable unless a subclass says otherwise."""

    retryable = True


class ObjectNotFound(StoreError):
    """The key (or the bucket) does not exist."""

    retryable = False


class AccessDenied(StoreError):
    """The credentials were refused or lack permission."""

    retryable = False


class ObjectChanged(StoreError):
    """The object no longer has the version (etag) the read was pinned to."""

    retryable = False


class DeadlineExceeded(StoreError):
    """A request did not succeed within its total deadline."""

    retryable = False


class UploadCorrupted(StoreError):
    """The bytes a store holds after an upload are not the file's: its
    etag is not the one the file's bytes give. Retryable: the next upload
    replaces them."""


class SourceChanged(StoreError):
    """The file being uploaded changed (size, mtime or inode) while it was
    read: the upload was abandoned. Retryable once the file stops changing."""


class SourceUnreadable(StoreError):
    """The file to upload cannot be opened or read: nothing was uploaded."""

    retryable = False


class DaemonStopping(StoreError):
    """The daemon is exiting: no request reaches the store any more."""

    retryable = False


class NotADirectory(CachefsdError):
    pass


class IsADirectory(CachefsdError):
    pass


class BadFileHandle(CachefsdError):
    pass


class UnknownInode(CachefsdError):
    """The kernel named an inode it holds no reference to."""


class NotPermitted(CachefsdError):
    """What a bucket cannot do, or a writable mount does not: changing part
    of an uploaded object in place, links, modes, owners."""


class ReadOnly(CachefsdError):
    """A write to a mount that is not writable."""


class NoSpace(CachefsdError):
    """The hot tier cannot hold more staged bytes."""


class NotEmpty(CachefsdError):
    pass


class AlreadyExists(CachefsdError):
    pass


class BadName(CachefsdError):
    """A name the bucket cannot hold as a key."""


class NameTooLong(CachefsdError):
    pass


class Busy(CachefsdError):
    """An object opened for reading through the kernel (passthrough) cannot
    be replaced until those opens close."""


class CrossDevice(CachefsdError):
    """A rename the mount cannot do in place (a directory with uploaded
    objects in it): ``mv`` copies instead."""


_ERRNO_BY_TYPE: tuple[tuple[type[CachefsdError], int], ...] = (
    (ObjectNotFound, errno.ENOENT),
    (AccessDenied, errno.EACCES),
    (ObjectChanged, errno.EIO),
    (DeadlineExceeded, errno.EIO),
    (StoreError, errno.EIO),
    (NotADirectory, errno.ENOTDIR),
    (IsADirectory, errno.EISDIR),
    (BadFileHandle, errno.EBADF),
    (UnknownInode, errno.ESTALE),
    (NotPermitted, errno.EPERM),
    (ReadOnly, errno.EROFS),
    (NoSpace, errno.ENOSPC),
    (NotEmpty, errno.ENOTEMPTY),
    (AlreadyExists, errno.EEXIST),
    (BadName, errno.EINVAL),
    (NameTooLong, errno.ENAMETOOLONG),
    (CrossDevice, errno.EXDEV),
    (Busy, errno.ETXTBSY),
)


class StageCancelled(CachefsdError):
    """The daemon is stopping; the stage was abandoned part way."""


def errno_for(error: CachefsdError) -> int:
    """The errno a FUSE operation returns for ``error``; EIO for anything unlisted."""
    for error_type, code in _ERRNO_BY_TYPE:
        if isinstance(error, error_type):
            return code
    return errno.EIO


class ControlError(CachefsdError):
    """The daemon could not be reached, or refused a request (the message
    says which, and why)."""


class BadRequest(CachefsdError):
    """A request the server answers with 400; handlers raise it for
    arguments they cannot accept (an unknown tier, a missing path). In
    this process (an offline stage) it is a plain one-line error."""
