"""Fixtures shared by tests and benchmarks: a tiny chat model built from a config (never downloaded) and
a fake OpenAI-compatible vLLM server. Training never imports these."""
