"""tsengine: train EAGLE-3 draft heads and serve them with lossless speculative decoding."""

__version__ = "0.1.0"
