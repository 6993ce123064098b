"""asv benchmarks of kvcache: kvref and kvfast side by side (``asv run`` in ``asv_bench/``)."""
