"""Paths, directories and the metadata cache (see tree.py)."""
