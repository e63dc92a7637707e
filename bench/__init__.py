"""Benchmarks of ``opd_stream`` against a reference-style baseline client (see README.md)."""
