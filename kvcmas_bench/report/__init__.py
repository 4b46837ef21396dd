"""Reports over run, suite and sweep directories: tables (:mod:`.tables`), figures (:mod:`.plots`)
and their Markdown/HTML rendering (:mod:`.render`); the ``report`` job is :mod:`kvcmas_bench.jobs.report`."""
