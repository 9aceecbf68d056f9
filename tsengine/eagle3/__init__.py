"""EAGLE-3 draft head: the module, its config and its on-disk format (shared by train/ and the engine)."""
