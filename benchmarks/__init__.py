"""Benchmarks; a package so unit tests can import the simulators' pure cores."""
