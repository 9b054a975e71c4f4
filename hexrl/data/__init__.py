"""Problems and their sources: JSONL and synthetic datasets, code benchmarks, tokenizers, and the
held-out greedy evaluation. Import from the submodule you need."""
