"""The FUSE edge's message layouts against the kernel's own header.

``cachefsd/fuse/protocol.py`` lays out each message as a ``struct`` format,
where a field out of place corrupts what the kernel reads without an error.
This test compiles a C program against ``<linux/fuse.h>`` (the machine's
kernel headers, linux-libc-dev), runs it, and compares each structure's
size and each member's offset with the format's. Members the protocol
renamed since those headers (``backing_id`` was ``padding`` in the open
answer, ``max_stack_depth`` the first ``unused`` word of the INIT answer)
are named as the headers name them: what is checked is where they lie.
(The ioctl numbers of passthrough are the native plane's: its unit tests
compute them by ``_IOW``'s rule, ``native/src/device.rs``.)

Without a compiler or the headers the test fails (a skip would check
nothing): ``scripts/bootstrap.sh test`` installs them.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from cachefsd.fuse import protocol

# C structure -> (its format here, its members in order; a nested
# structure's member names where the format stops).
LAYOUTS: dict[str, tuple[struct.Struct, tuple[str, ...]]] = {
    "fuse_in_header": (
        protocol.IN_HEADER,
        ("len", "opcode", "unique", "nodeid", "uid", "gid", "pid", "total_extlen", "padding"),
    ),
    "fuse_out_header": (protocol.OUT_HEADER, ("len", "error", "unique")),
    "fuse_init_in": (protocol.INIT_IN, ("major", "minor", "max_readahead", "flags", "flags2")),
    "fuse_init_out": (
        protocol.INIT_OUT,
        tuple(
            [
                "major",
                "minor",
                "max_readahead",
                "flags",
                "max_background",
                "congestion_threshold",
                "max_write",
                "time_gran",
                "max_pages",
                "map_alignment",
                "flags2",
                "unused",
            ]
        ),
    ),
    "fuse_attr": (
        protocol.ATTR,
        (
            "ino",
            "size",
            "blocks",
            "atime",
            "mtime",
            "ctime",
            "atimensec",
            "mtimensec",
            "ctimensec",
            "mode",
            "nlink",
            "uid",
            "gid",
            "rdev",
            "blksize",
            "flags",
        ),
    ),
    "fuse_entry_out": (
        protocol.ENTRY_OUT,
        ("nodeid", "generation", "entry_valid", "attr_valid", "entry_valid_nsec", "attr_valid_nsec", "attr"),
    ),
    "fuse_attr_out": (protocol.ATTR_OUT, ("attr_valid", "attr_valid_nsec", "dummy", "attr")),
    "fuse_open_out": (protocol.OPEN_OUT, ("fh", "open_flags", "padding")),
    "fuse_read_in": (
        protocol.READ_IN,
        ("fh", "offset", "size", "read_flags", "lock_owner", "flags", "padding"),
    ),
    "fuse_release_in": (protocol.RELEASE_IN, ("fh", "flags", "release_flags", "lock_owner")),
    "fuse_flush_in": (protocol.FLUSH_IN, ("fh", "unused", "padding", "lock_owner")),
    "fuse_open_in": (protocol.OPEN_IN, ("flags", "open_flags")),
    "fuse_create_in": (protocol.CREATE_IN, ("flags", "mode", "umask", "open_flags")),
    "fuse_mkdir_in": (protocol.MKDIR_IN, ("mode", "umask")),
    "fuse_rename_in": (protocol.RENAME_IN, ("newdir",)),
    "fuse_rename2_in": (protocol.RENAME2_IN, ("newdir", "flags", "padding")),
    "fuse_setattr_in": (
        protocol.SETATTR_IN,
        (
            "valid",
            "padding",
            "fh",
            "size",
            "lock_owner",
            "atime",
            "mtime",
            "ctime",
            "atimensec",
            "mtimensec",
            "ctimensec",
            "mode",
            "unused4",
            "uid",
            "gid",
            "unused5",
        ),
    ),
    "fuse_write_in": (
        protocol.WRITE_IN,
        ("fh", "offset", "size", "write_flags", "lock_owner", "flags", "padding"),
    ),
    "fuse_write_out": (protocol.WRITE_OUT, ("size", "padding")),
    "fuse_kstatfs": (
        protocol.KSTATFS,
        ("blocks", "bfree", "bavail", "files", "ffree", "bsize", "namelen", "frsize", "padding", "spare"),
    ),
    "fuse_notify_inval_entry_out": (protocol.NOTIFY_INVAL_ENTRY_OUT, ("parent", "namelen", "flags")),
}
# Structures read as a prefix, or followed by another (a nested fuse_attr,
# a name): their C size is not the format's.
PREFIXES = {"fuse_init_in", "fuse_entry_out", "fuse_attr_out"}

PROGRAM = """#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <linux/fuse.h>
int main(void) {
%s
    return 0;
}
"""


def offsets(layout: struct.Struct, members: tuple[str, ...]) -> dict[str, int]:
    """Where each member starts by the format: the size of the format before it."""
    codes = [code for code in layout.format.lstrip("<") if code.isalpha() and code != "x"]
    return {member: struct.calcsize("<" + "".join(codes[:count])) for count, member in enumerate(members)}


def c_answers(tmp_path: Path) -> dict[tuple[str, str], int]:
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.fail("no C compiler: scripts/bootstrap.sh test installs one")
    lines = []
    for name, (_, members) in LAYOUTS.items():
        lines.append(f'    printf("size {name} %zu\\n", sizeof(struct {name}));')
        lines.extend(
            f'    printf("offset {name}.{member} %zu\\n", offsetof(struct {name}, {member}));'
            for member in members
        )
    source = tmp_path / "layout.c"
    source.write_text(PROGRAM % "\n".join(lines))
    binary = tmp_path / "layout"
    subprocess.run([compiler, "-o", str(binary), str(source)], check=True, timeout=60)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=10).stdout
    answers = {}
    for line in output.splitlines():
        kind, name, value = line.split()
        answers[(kind, name)] = int(value)
    return answers


def test_every_message_lies_where_the_kernel_header_puts_it(tmp_path: Path) -> None:
    answers = c_answers(tmp_path)
    for name, (layout, members) in LAYOUTS.items():
        for member, offset in offsets(layout, members).items():
            assert offset == answers[("offset", f"{name}.{member}")], f"{name}.{member}"
        if name not in PREFIXES:
            assert layout.size == answers[("size", name)], name
    # What follows a prefix: a fuse_attr, 8-aligned names.
    assert protocol.ENTRY_OUT.size + protocol.ATTR.size == answers[("size", "fuse_entry_out")]
    assert protocol.ATTR_OUT.size + protocol.ATTR.size == answers[("size", "fuse_attr_out")]
