"""Benchmarks of ``opd_stream`` against a reference-style baseline client (see bench/README.md)."""
