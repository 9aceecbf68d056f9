"""Reference speculative generator and evaluation harness (the oracle the engine is tested against)."""
