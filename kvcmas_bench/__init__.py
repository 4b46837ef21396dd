"""kvcmas-bench: benchmark cross-agent KV-cache sharing methods for multi-agent LLM systems."""

__version__ = "0.1.0"
