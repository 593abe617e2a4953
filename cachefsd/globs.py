"""Path globs (``stage --include``) matched without backtracking.

The rules: ``*`` matches any run of characters but ``/``, ``?`` one
character but ``/``, ``[...]`` one of a class (``[!...]`` or ``[^...]``
none of it, ``a-z`` a range), ``**/`` any number of directories (none
included), and ``**`` elsewhere any run of characters, ``/`` included
(``train/**`` is everything under ``train``, ``dir/**.jpg`` every jpg at
any depth under ``dir``).

Why not a regular expression: Python's ``re`` backtracks, so
``**/**/**/...`` on a deep path or ``*a*a*a*b`` on a long name took seconds
to minutes per path, holding the GIL the whole time, and every FUSE read
of the mount waited. Here the pattern is a small automaton whose set of
live states advances one character at a time: O(pattern x path) whatever
the pattern.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Class:
    """``[...]``: single characters and ``lo-hi`` ranges, or their complement."""

    chars: frozenset[str]
    ranges: tuple[tuple[str, str], ...]
    negated: bool

    def matches(self, char: str) -> bool:
        found = char in self.chars or any(lo <= char <= hi for lo, hi in self.ranges)
        return found is not self.negated


@dataclass(frozen=True, slots=True)
class _Repeat:
    """``*`` (``crosses`` False), ``**`` (True), or ``**/`` (``to_slash``):
    zero or more characters; ``**/`` also consumes its ``/``."""

    crosses: bool
    to_slash: bool = False


# A literal character (never * or ?, which have no escape), "?", a class, or a repeat.
_Token = str | _Class | _Repeat


def _class(body: str) -> _Class:
    negated = body[:1] in ("!", "^")
    body = body[1:] if negated else body
    chars: set[str] = set()
    ranges: list[tuple[str, str]] = []
    i = 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            ranges.append((body[i], body[i + 2]))
            i += 3
        else:
            chars.add(body[i])
            i += 1
    return _Class(frozenset(chars), tuple(ranges), negated)


def _tokens(pattern: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            tokens.append(_Repeat(crosses=True, to_slash=True))
            i += 3
        elif pattern.startswith("**", i):
            tokens.append(_Repeat(crosses=True))
            i += 2
        elif pattern[i] == "*":
            tokens.append(_Repeat(crosses=False))
            i += 1
        elif pattern[i] == "[" and (close := pattern.find("]", i + 2)) != -1:
            tokens.append(_class(pattern[i + 1 : close]))
            i = close + 1
        else:
            tokens.append(pattern[i])  # "?" or a literal
            i += 1
    return tokens


class PathGlob:
    def __init__(self, pattern: str) -> None:
        self._tokens = _tokens(pattern)

    def matches(self, path: str) -> bool:
        """Whether all of ``path`` matches the whole pattern."""
        # A state is a token's index, and for ``**/`` whether it has taken
        # characters already: then it must go on to its ``/`` (it matched
        # nothing, or directories).
        states = self._closure({(0, False)})
        end = (len(self._tokens), False)
        for char in path:
            advanced: set[tuple[int, bool]] = set()
            for index, _inside in states:
                if index == len(self._tokens):
                    continue
                token = self._tokens[index]
                if isinstance(token, _Repeat):
                    if token.to_slash:
                        advanced.add((index, True))
                        if char == "/":
                            advanced.add((index + 1, False))  # the directories end here
                    elif token.crosses or char != "/":
                        advanced.add((index, False))  # one more character of the repeat
                elif isinstance(token, _Class):
                    if token.matches(char):
                        advanced.add((index + 1, False))
                elif token == char or (token == "?" and char != "/"):
                    advanced.add((index + 1, False))
            states = self._closure(advanced)
            if not states:
                return False
        return end in states

    def _closure(self, states: set[tuple[int, bool]]) -> set[tuple[int, bool]]:
        """``states`` plus, past each repeat not inside a ``**/``, the state
        after it: a repeat may match nothing."""
        found = set(states)
        for start, inside in states:
            index = start
            while not inside and index < len(self._tokens) and isinstance(self._tokens[index], _Repeat):
                index += 1
                found.add((index, False))
        return found
