"""The unified paged pool: KV blocks and adapter rows carved from one arena. Plain bookkeeping, CPU-testable."""
