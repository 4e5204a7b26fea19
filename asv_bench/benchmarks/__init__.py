"""asv benchmarks for qformats and scalify (see docs/performance.md)."""
