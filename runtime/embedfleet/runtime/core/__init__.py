"""Request-independent machinery: tokenizer pool, batching policy, batch manager."""
