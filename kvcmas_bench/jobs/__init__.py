"""Jobs: what a CLI command does from validated options to files on disk (run, serve-sweep,
coverage, ...). Each job reads and writes :class:`~kvcmas_bench.results.RequestRecord` rows."""
