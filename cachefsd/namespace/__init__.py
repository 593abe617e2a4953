"""Paths (names.py), the metadata cache (tree.py) and its listings saved for the next mount (saved.py)."""
