"""The inference server: model forward, unified paged pool, continuous-batching engine."""
