"""Path globs (``stage --include``) matched without backtracking.

A pattern is cut at ``/`` into segments. ``**`` as a whole segment matches
any number of directories (none included; at the end, one or more path
segments: ``train/**`` is everything under ``train``); in any other segment
``*`` matches any run of characters, ``?`` one character, ``[...]`` one of a
class (``[!...]`` none of it, ``a-z`` a range), and other consecutive
asterisks are plain ``*``, as in ``.gitignore``.

Why not a regular expression: Python's ``re`` backtracks, so
``**/**/**/...`` on a deep path or ``*a*a*a*b`` on a long name took seconds
to minutes per path, holding the GIL the whole time, and every FUSE read
of the mount waited. Here each segment is matched by the classic greedy
wildcard scan (O(pattern x name)), and ``**`` by walking the set of
pattern positions reachable so far (O(segments x path depth)).
"""

from __future__ import annotations

from dataclasses import dataclass

_ANY_DIRECTORIES = "**"


@dataclass(frozen=True, slots=True)
class _Class:
    """``[...]``: single characters and ``lo-hi`` ranges, or their complement."""

    chars: frozenset[str]
    ranges: tuple[tuple[str, str], ...]
    negated: bool

    def matches(self, char: str) -> bool:
        found = char in self.chars or any(lo <= char <= hi for lo, hi in self.ranges)
        return found is not self.negated


# "*", "?", a literal character (never * or ?: they have no escape), or a class.
_Token = str | _Class


def _tokens(segment: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(segment):
        char = segment[i]
        if char == "*":
            if not tokens or tokens[-1] != "*":  # ** inside a segment is *
                tokens.append("*")
            i += 1
        elif char == "[" and (close := segment.find("]", i + 2)) != -1:
            body = segment[i + 1 : close]
            negated = body.startswith("!")
            body = body[1:] if negated else body
            chars: set[str] = set()
            ranges: list[tuple[str, str]] = []
            j = 0
            while j < len(body):
                if j + 2 < len(body) and body[j + 1] == "-":
                    ranges.append((body[j], body[j + 2]))
                    j += 3
                else:
                    chars.add(body[j])
                    j += 1
            tokens.append(_Class(frozenset(chars), tuple(ranges), negated))
            i = close + 1
        else:
            tokens.append(char)
            i += 1
    return tokens


def _one(token: _Token, char: str) -> bool:
    if isinstance(token, _Class):
        return token.matches(char)
    return token in ("?", char)


def _segment_matches(tokens: list[_Token], name: str) -> bool:
    """Greedy wildcard matching: on a mismatch, the last ``*`` takes one
    more character and the scan resumes after it."""
    t = n = 0
    star, resume = -1, 0
    while n < len(name):
        if t < len(tokens) and tokens[t] == "*":
            star, resume = t, n
            t += 1
        elif t < len(tokens) and _one(tokens[t], name[n]):
            t += 1
            n += 1
        elif star != -1:
            resume += 1
            t, n = star + 1, resume
        else:
            return False
    return all(token == "*" for token in tokens[t:])


class PathGlob:
    def __init__(self, pattern: str) -> None:
        self._segments: list[list[_Token] | None] = [  # None: ``**``
            None if segment == _ANY_DIRECTORIES else _tokens(segment) for segment in pattern.split("/")
        ]

    def matches(self, path: str) -> bool:
        """Whether ``path`` (``a/b/c.jpg``, no leading slash) matches."""
        end = len(self._segments)
        states = self._skipping_directories({0})
        for part in path.split("/"):
            reached: set[int] = set()
            for position in states:
                if position == end:
                    continue
                tokens = self._segments[position]
                if tokens is None:
                    reached.update((position, position + 1))  # ** takes this one, and maybe more
                elif _segment_matches(tokens, part):
                    reached.add(position + 1)
            states = self._skipping_directories(reached)
            if not states:
                return False
        return end in states

    def _skipping_directories(self, states: set[int]) -> set[int]:
        """``states`` plus, past each ``**`` not at the end, the position
        after it: there it may match no directory at all."""
        found = set(states)
        for start in states:
            position = start
            while position + 1 < len(self._segments) and self._segments[position] is None:
                position += 1
                found.add(position)
        return found
