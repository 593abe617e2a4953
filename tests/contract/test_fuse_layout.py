"""The FUSE edge's C structures against the system's headers.

``cachefsd/fuse`` declares libfuse's and glibc's structures by hand in
ctypes, where a field out of place or of the wrong width corrupts memory
without an error. This test writes a C program from those declarations,
compiles it with the system ``cc`` against ``<fuse3/fuse_lowlevel.h>`` (at
the ``FUSE_USE_VERSION`` the edge binds, ``lowlevel.MINIMUM_VERSION``),
``<sys/stat.h>`` and ``<sys/statvfs.h>``, runs it and compares its answers
with ctypes'.

Every ``ctypes.Structure`` and ``ctypes.Union`` a module of
``cachefsd.fuse`` defines is covered, with every field of its ``_fields_``:
a new structure or field needs no edit here. Each structure's docstring
must name its C type first, in double backquotes (``struct stat``, or
``union name``); a field the Python side names differently (a reserved
word of glibc's, ``struct stat``'s ``st_atim.tv_nsec``) is mapped in
``C_MEMBERS``.

Compared: each structure's size and alignment; each field's offset and
size, and whether a number is signed. A bitfield has no address in C, so
its offset and size cannot be asked: the test sets all of its bits in a
zeroed structure, in C by assigning the field its complement and in ctypes
through the field's descriptor, and compares the two structures' bytes,
which fixes the word that holds it, its position and its width.

Without a compiler or libfuse3's headers the test fails (a skip would check
nothing): ``scripts/bootstrap.sh test`` installs them.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import cachefsd.fuse
from cachefsd.fuse import lowlevel

CType = type[ctypes.Structure] | type[ctypes.Union]

# (C type, Python field) -> the C member that field declares, for each ABI
# ``lowlevel.Stat`` knows (x86_64 has ``__pad0``, aarch64 ``__pad1`` and ``__pad2``).
C_MEMBERS = {
    ("struct stat", "_pad0"): "__pad0",
    ("struct stat", "_pad1"): "__pad1",
    ("struct stat", "_pad2"): "__pad2",
    ("struct stat", "_reserved"): "__glibc_reserved",
    ("struct stat", "st_atime_nsec"): "st_atim.tv_nsec",
    ("struct stat", "st_mtime_nsec"): "st_mtim.tv_nsec",
    ("struct stat", "st_ctime_nsec"): "st_ctim.tv_nsec",
    ("struct statvfs", "_spare"): "__f_spare",
    ("struct fuse_file_info", "_padding"): "padding",
    ("struct fuse_file_info", "_padding2"): "padding2",
    ("struct fuse_conn_info", "_reserved"): "reserved",
}
# ctypes' codes of its integer and floating-point types, the fields with a
# sign: lower case for the signed ones (floats are).
NUMBERS = frozenset("bBhHiIlLqQfdg")
HEADERS = ("stddef.h", "stdio.h", "string.h", "sys/stat.h", "sys/statvfs.h", "fuse3/fuse_lowlevel.h")
# Prints the bytes of a structure in hex, as ``bytes.hex`` does.
HEX = """static void hex(const void *data, size_t size) {
    for (size_t i = 0; i < size; i++) printf("%02x", ((const unsigned char *)data)[i]);
}"""
INSTALL = "scripts/bootstrap.sh test installs a C compiler, pkg-config and libfuse3-dev"


def declared() -> dict[str, CType]:
    """Every structure and union the modules of ``cachefsd.fuse`` define, by
    the C type their docstring names."""
    found: dict[str, CType] = {}
    for info in pkgutil.iter_modules(cachefsd.fuse.__path__, "cachefsd.fuse."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if not (isinstance(value, type) and issubclass(value, ctypes.Structure | ctypes.Union)):
                continue
            if value.__module__ != module.__name__:
                continue
            named = re.search(r"``((?:struct|union) \w+)``", value.__doc__ or "")
            assert named, f"{value.__qualname__}'s docstring must name its C type as ``struct name``"
            assert named[1] not in found, f"{named[1]} is declared twice"
            found[named[1]] = value
    return found


def _number(expression: str) -> str:
    return f'printf("%lld", (long long)({expression}));'


def checks(c_type: str, struct: CType) -> Iterator[tuple[str, str, str]]:
    """(key, the C statement that prints C's answer, ctypes' answer) for one
    structure and each of its fields."""
    name = struct.__name__
    yield f"{name} size", _number(f"sizeof({c_type})"), str(ctypes.sizeof(struct))
    yield f"{name} alignment", _number(f"_Alignof({c_type})"), str(ctypes.alignment(struct))
    for field in struct._fields_:
        python, kind = field[0], field[1]
        member = C_MEMBERS.get((c_type, python), python)
        key = f"{name}.{python}"
        if len(field) == 3:
            ones = struct()
            setattr(ones, python, (1 << field[2]) - 1)
            statement = (
                f"{{ {c_type} v; memset(&v, 0, sizeof v); v.{member} = ~v.{member}; hex(&v, sizeof v); }}"
            )
            yield f"{key} bits", statement, bytes(ones).hex()
            continue
        lvalue = f"(({c_type} *)0)->{member}"
        offset = getattr(struct, python).offset
        yield f"{key} offset", _number(f"offsetof({c_type}, {member})"), str(offset)
        yield f"{key} size", _number(f"sizeof({lvalue})"), str(ctypes.sizeof(kind))
        code = getattr(kind, "_type_", None)
        if isinstance(code, str) and code in NUMBERS:
            yield f"{key} signed", _number(f"(__typeof__({lvalue}))-1 < 0"), str(int(code.islower()))


def compiler_flags() -> list[str]:
    """``pkg-config --cflags fuse3``; fails the test if a tool or libfuse3's
    headers are missing."""
    for tool in ("cc", "pkg-config"):
        if shutil.which(tool) is None:
            pytest.fail(f"no {tool} to check the FUSE structures with: {INSTALL}")
    result = subprocess.run(
        ["pkg-config", "--cflags", "fuse3"], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"libfuse3's headers are missing ({result.stderr.strip()}): {INSTALL}")
    return result.stdout.split()


def c_answers(statements: dict[str, str], workdir: Path) -> dict[str, str]:
    """Compiles and runs a program of ``statements`` (by key); its answers by key."""
    includes = "".join(f"#include <{header}>\n" for header in HEADERS)
    body = "\n".join(
        f"    printf(\"{key} \"); {statement} putchar('\\n');" for key, statement in statements.items()
    )
    source = workdir / "layout.c"
    source.write_text(
        f"#define FUSE_USE_VERSION {lowlevel.MINIMUM_VERSION}\n{includes}\n{HEX}\n\n"
        f"int main(void) {{\n{body}\n    return 0;\n}}\n"
    )
    program = workdir / "layout"
    built = subprocess.run(
        ["cc", *compiler_flags(), "-o", str(program), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert built.returncode == 0, (
        f"{source} does not compile (a member missing from C_MEMBERS?):\n{built.stderr}"
    )
    ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=30, check=True)
    return dict(line.rpartition(" ")[::2] for line in ran.stdout.splitlines())


def test_every_fuse_structure_matches_the_c_headers(tmp_path: Path) -> None:
    structures = declared()
    # The ones the edge cannot run without: proof that discovery found the binding.
    assert {lowlevel.Stat, lowlevel.FileInfo, lowlevel.ConnInfo, lowlevel.Operations} <= set(
        structures.values()
    )
    expected: dict[str, str] = {}
    statements: dict[str, str] = {}
    for c_type, struct in structures.items():
        for key, statement, answer in checks(c_type, struct):
            expected[key], statements[key] = answer, statement
    answers = c_answers(statements, tmp_path)
    wrong = [
        f"{key}: ctypes {answer}, C {answers.get(key)}"
        for key, answer in expected.items()
        if answers.get(key) != answer
    ]
    assert not wrong, "\n".join(["the ctypes declarations disagree with the C headers:", *wrong])
