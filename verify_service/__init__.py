"""The verify service: the target model and its per-session KV caches."""
